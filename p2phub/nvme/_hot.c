// SPDX-License-Identifier: GPL-2.0-only OR MIT
/*
 * The NVMe engine's hot path; see _hot.h for the contract.
 *
 * Ring rules (NVMe base spec 2.0, 3.3.1):
 *  - submission: write the 64-byte entry, make it globally visible, then
 *    write the new tail to the SQ doorbell. Once per batch.
 *  - completion: an entry is new when its phase tag equals the phase we
 *    expect; read the tag first, then (after a read barrier) the rest; the
 *    phase flips each time the head wraps. SQ head comes from each CQE.
 *    The CQ head doorbell is written once per batch.
 *  - command ids are not SQ slots: cid = generation << 12 | tracker index,
 *    so a completion for a command that is no longer outstanding (late,
 *    duplicated, or from before a reset) is recognised and dropped.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "_hot.h"

#define P2H_PAGE	4096u
#define P2H_SQE		64u
#define P2H_CQE		16u
#define P2H_CID_IDX	0x0fffu
#define P2H_CID_GEN_SHIFT 12
#define P2H_MAX_TRK	4095u	/* cid 0xffff is never issued */

#define OPC_FLUSH	0x00
#define OPC_WRITE	0x01
#define OPC_READ	0x02
#define OPC_WRITE_ZEROES 0x08

/*
 * Orders the SQE stores (write-back DMA-coherent memory) before the doorbell
 * store (uncached MMIO). x86 keeps store order between the two, but the
 * compiler must not sink the entry stores past the doorbell; a full fence
 * also covers weaker architectures. Without it a controller was seen to
 * fetch a still-zero entry (shared/LAB.md).
 */
static inline void p2h_wmb(void)
{
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
}

/* Orders reading a CQE's phase tag before reading the rest of the entry. */
static inline void p2h_rmb(void)
{
	__atomic_thread_fence(__ATOMIC_ACQUIRE);
}

uint64_t p2h_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

struct p2h_qp *p2h_qp_create(uint16_t qid, uint32_t depth, uint32_t ntrk,
			     void *sq, void *cq, void *sq_db, void *cq_db,
			     void *prp_cpu, uint64_t prp_dma, uint32_t prp_stride)
{
	struct p2h_qp *q;

	if (depth < 2 || ntrk == 0 || ntrk > depth - 1 || ntrk > P2H_MAX_TRK)
		return NULL;
	q = calloc(1, sizeof(*q));
	if (!q)
		return NULL;
	q->trk = calloc(ntrk, sizeof(*q->trk));
	q->free_stk = calloc(ntrk, sizeof(*q->free_stk));
	if (!q->trk || !q->free_stk) {
		free(q->trk);
		free(q->free_stk);
		free(q);
		return NULL;
	}
	q->qid = qid;
	q->depth = depth;
	q->ntrk = ntrk;
	q->sq = sq;
	q->cq = cq;
	q->sq_db = sq_db;
	q->cq_db = cq_db;
	q->prp_cpu = prp_cpu;
	q->prp_dma = prp_dma;
	q->prp_stride = prp_stride;
	p2h_qp_reset(q);
	return q;
}

void p2h_qp_destroy(struct p2h_qp *q)
{
	if (!q)
		return;
	free(q->trk);
	free(q->free_stk);
	free(q);
}

void p2h_qp_reset(struct p2h_qp *q)
{
	uint32_t i;

	q->sq_tail = 0;
	q->sq_head = 0;
	q->cq_head = 0;
	q->phase = 1;
	memset(q->cq, 0, (size_t)q->depth * P2H_CQE);
	memset(q->sq, 0, (size_t)q->depth * P2H_SQE);
	/* Keep generations across resets: a stale CQE must not match. */
	for (i = 0; i < q->ntrk; i++) {
		q->trk[i].busy = 0;
		q->free_stk[i] = (uint16_t)(q->ntrk - 1 - i);
	}
	q->nfree = q->ntrk;
}

static inline uint32_t p2h_sq_free_slots(const struct p2h_qp *q)
{
	uint32_t used = (q->sq_tail + q->depth - q->sq_head) % q->depth;

	return q->depth - 1 - used;
}

/* Take a tracker; returns its new cid. Caller checked nfree. */
static inline uint16_t p2h_trk_get(struct p2h_qp *q, uint64_t tag, uint8_t opc,
				   uint64_t now)
{
	uint16_t idx = q->free_stk[--q->nfree];
	struct p2h_trk *t = &q->trk[idx];
	uint16_t gen = (uint16_t)(((t->cid >> P2H_CID_GEN_SHIFT) + 1) & 0xf);

	t->cid = (uint16_t)(gen << P2H_CID_GEN_SHIFT | idx);
	t->busy = 1;
	t->opc = opc;
	t->tag = tag;
	t->t_submit_ns = now;
	return t->cid;
}

static inline void p2h_trk_put(struct p2h_qp *q, uint16_t idx)
{
	q->trk[idx].busy = 0;
	q->free_stk[q->nfree++] = idx;
}

static inline void p2h_sq_ring(struct p2h_qp *q)
{
	if (q->hold_doorbell)
		return;
	p2h_wmb();
	*(volatile uint32_t *)q->sq_db = q->sq_tail;
	q->doorbells++;
}

static inline void p2h_sq_push(struct p2h_qp *q, const uint32_t *cmd)
{
	memcpy(q->sq + (size_t)q->sq_tail * P2H_SQE, cmd, P2H_SQE);
	if (++q->sq_tail == q->depth)
		q->sq_tail = 0;
}

int p2h_submit_raw(struct p2h_qp *q, const uint32_t *cmds, const uint64_t *tags,
		   int n, uint16_t *cids_out)
{
	uint64_t now = p2h_now_ns();
	uint32_t cmd[16];
	int i;

	for (i = 0; i < n; i++) {
		if (!q->nfree || !p2h_sq_free_slots(q))
			break;
		memcpy(cmd, cmds + 16 * i, sizeof(cmd));
		cids_out[i] = p2h_trk_get(q, tags[i], (uint8_t)cmd[0], now);
		cmd[0] = (cmd[0] & 0xffffu) | ((uint32_t)cids_out[i] << 16);
		p2h_sq_push(q, cmd);
	}
	if (i) {
		q->submitted += (uint64_t)i;
		p2h_sq_ring(q);
	}
	return i;
}

/*
 * Build the data pointer of one request into cmd[6..9]. The first PRP may
 * start anywhere (dword aligned); every later one is a whole 4 KiB page.
 */
static inline int p2h_build_prp(struct p2h_qp *q, const struct p2h_io *io,
				uint16_t trk_idx, uint32_t *cmd)
{
	uint64_t first_page, last_page, prp1, prp2 = 0, *list;
	uint32_t in_page, n_more, i;

	if (!io->nbytes)
		goto out;
	if (io->buf_off & 3)
		return -EINVAL;
	first_page = io->buf_off / P2H_PAGE;
	in_page = (uint32_t)(io->buf_off % P2H_PAGE);
	last_page = (io->buf_off + io->nbytes - 1) / P2H_PAGE;
	if (last_page >= io->npages || last_page < first_page)
		return -EINVAL;
	prp1 = io->pages[first_page] + in_page;
	n_more = (uint32_t)(last_page - first_page);
	if (n_more == 1) {
		prp2 = io->pages[first_page + 1];
	} else if (n_more > 1) {
		if ((uint64_t)n_more * 8 > q->prp_stride)
			return -EINVAL;
		list = (uint64_t *)(q->prp_cpu + (size_t)trk_idx * q->prp_stride);
		for (i = 0; i < n_more; i++)
			list[i] = io->pages[first_page + 1 + i];
		prp2 = q->prp_dma + (uint64_t)trk_idx * q->prp_stride;
	}
	cmd[6] = (uint32_t)prp1;
	cmd[7] = (uint32_t)(prp1 >> 32);
	(void)in_page;
out:
	cmd[8] = (uint32_t)prp2;
	cmd[9] = (uint32_t)(prp2 >> 32);
	return 0;
}

static inline int p2h_queue_io(struct p2h_qp *q, const struct p2h_io *io,
			       uint64_t tag, uint64_t now, uint16_t *cid_out)
{
	uint32_t cmd[16];
	uint16_t cid, idx;

	memset(cmd, 0, sizeof(cmd));
	idx = q->free_stk[q->nfree - 1];	/* the tracker p2h_trk_get takes */
	if (p2h_build_prp(q, io, idx, cmd))
		return -EINVAL;
	cid = p2h_trk_get(q, tag, io->opc, now);
	cmd[0] = (uint32_t)io->opc | ((uint32_t)cid << 16);
	cmd[1] = io->nsid;
	if (io->opc != OPC_FLUSH) {
		cmd[10] = (uint32_t)io->slba;
		cmd[11] = (uint32_t)(io->slba >> 32);
		cmd[12] = ((io->nlb - 1) & 0xffffu) | io->cdw12_flags;
		cmd[13] = io->cdw13;
	}
	p2h_sq_push(q, cmd);
	*cid_out = cid;
	return 0;
}

int p2h_submit_io(struct p2h_qp *q, const struct p2h_io *ios, int n,
		  uint16_t *cids_out, int *bad_index)
{
	uint64_t now = p2h_now_ns();
	int i, ret = 0;

	*bad_index = -1;
	for (i = 0; i < n; i++) {
		if (!q->nfree || !p2h_sq_free_slots(q))
			break;
		if (p2h_queue_io(q, &ios[i], ios[i].tag, now, &cids_out[i])) {
			*bad_index = i;
			ret = -EINVAL;
			break;
		}
	}
	if (i) {
		q->submitted += (uint64_t)i;
		p2h_sq_ring(q);
	}
	return i ? i : ret;
}

int p2h_reap(struct p2h_qp *q, struct p2h_cpl *out, int max)
{
	uint64_t now = 0;
	int got = 0, consumed = 0;

	while (got < max) {
		volatile uint8_t *e = q->cq + (size_t)q->cq_head * P2H_CQE;
		uint16_t status = *(volatile uint16_t *)(e + 14);
		uint16_t cid, idx, sqhd;
		struct p2h_trk *t;

		if ((status & 1u) != q->phase)
			break;
		/* The phase tag said the entry is complete: now read the rest. */
		p2h_rmb();
		cid = *(volatile uint16_t *)(e + 12);
		sqhd = *(volatile uint16_t *)(e + 8);
		if (++q->cq_head == q->depth) {
			q->cq_head = 0;
			q->phase ^= 1u;
		}
		consumed++;
		if (sqhd < q->depth)
			q->sq_head = sqhd;
		idx = cid & P2H_CID_IDX;
		t = idx < q->ntrk ? &q->trk[idx] : NULL;
		if (!t || !t->busy || t->cid != cid) {
			q->stale_cqes++;
			continue;
		}
		if (!now)
			now = p2h_now_ns();
		out[got].tag = t->tag;
		out[got].dw0 = *(volatile uint32_t *)(e + 0);
		out[got].dw1 = *(volatile uint32_t *)(e + 4);
		out[got].cid = cid;
		out[got].status = status >> 1;
		out[got].lat_ns = now - t->t_submit_ns > 0xffffffffull ?
				  0xffffffffu : (uint32_t)(now - t->t_submit_ns);
		p2h_trk_put(q, idx);
		got++;
	}
	if (consumed) {
		/* Entries are consumed (read) before the controller may reuse them. */
		p2h_wmb();
		*(volatile uint32_t *)q->cq_db = q->cq_head;
		q->completed += (uint64_t)got;
	}
	return got;
}

int p2h_outstanding(struct p2h_qp *q, uint64_t age_ns, uint16_t *cids,
		    uint64_t *tags, uint64_t *ages_ns, int max)
{
	uint64_t now = p2h_now_ns();
	uint32_t i;
	int n = 0;

	for (i = 0; i < q->ntrk && n < max; i++) {
		const struct p2h_trk *t = &q->trk[i];

		if (!t->busy || now - t->t_submit_ns < age_ns)
			continue;
		cids[n] = t->cid;
		tags[n] = t->tag;
		ages_ns[n] = now - t->t_submit_ns;
		n++;
	}
	return n;
}

int p2h_forget(struct p2h_qp *q, uint16_t cid)
{
	uint16_t idx = cid & P2H_CID_IDX;

	if (idx >= q->ntrk || !q->trk[idx].busy || q->trk[idx].cid != cid)
		return -ENOENT;
	p2h_trk_put(q, idx);
	return 0;
}

/*
 * True once commands are in flight and nothing has completed for timeout_ns.
 * *idle_since is when the current completion-less stretch began (0: none).
 */
static inline int p2h_stalled(uint64_t *idle_since, int got, int inflight,
			      uint64_t timeout_ns)
{
	uint64_t now;

	if (got) {
		*idle_since = 0;
		return 0;
	}
	if (!inflight)
		return 0;
	now = p2h_now_ns();
	if (!*idle_since) {
		*idle_since = now;
		return 0;
	}
	return now - *idle_since > timeout_ns;
}

int p2h_run(struct p2h_qp *q, const struct p2h_io *ios, int n, int qd,
	    uint64_t timeout_ns, uint16_t *status_out, uint32_t *lat_out)
{
	struct p2h_cpl cpl[64];
	uint64_t idle_since = 0;
	int next = 0, done = 0, inflight = 0, i, bad;
	uint16_t cids[64];

	while (done < n) {
		int room = qd - inflight, batch = n - next, got;

		if (batch > room)
			batch = room;
		if (batch > 64)
			batch = 64;
		if (batch > 0) {
			struct p2h_io local[64];

			for (i = 0; i < batch; i++) {
				local[i] = ios[next + i];
				local[i].tag = (uint64_t)(next + i);
			}
			got = p2h_submit_io(q, local, batch, cids, &bad);
			if (got < 0)
				return done;	/* malformed request: caller validated */
			next += got;
			inflight += got;
		}
		got = p2h_reap(q, cpl, 64);
		for (i = 0; i < got; i++) {
			uint64_t k = cpl[i].tag;

			if (status_out)
				status_out[k] = cpl[i].status;
			if (lat_out)
				lat_out[k] = cpl[i].lat_ns;
		}
		done += got;
		inflight -= got;
		if (p2h_stalled(&idle_since, got, inflight, timeout_ns))
			return done;
	}
	return done;
}

static inline uint64_t p2h_xorshift(uint64_t *s)
{
	uint64_t x = *s;

	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	*s = x;
	return x;
}

int p2h_bench_rand(struct p2h_qp *q, const struct p2h_io *tmpl,
		   uint64_t span_blocks, uint32_t nslots, uint64_t seed,
		   int n, int qd, uint64_t timeout_ns, uint32_t *lat_out,
		   uint64_t *errors)
{
	struct p2h_cpl cpl[64];
	uint64_t rng = seed ? seed : 0x9e3779b97f4a7c15ull, idle_since = 0;
	uint64_t units = span_blocks / tmpl->nlb;
	int next = 0, done = 0, inflight = 0, i, bad;
	uint16_t cids[64];

	*errors = 0;
	if (!units || !nslots)
		return -EINVAL;
	while (done < n) {
		int room = qd - inflight, batch = n - next, got;

		if (batch > room)
			batch = room;
		if (batch > 64)
			batch = 64;
		if (batch > 0) {
			struct p2h_io local[64];

			for (i = 0; i < batch; i++) {
				local[i] = *tmpl;
				local[i].slba = (p2h_xorshift(&rng) % units) * tmpl->nlb;
				local[i].buf_off = (uint64_t)((uint32_t)(next + i) % nslots) *
						   tmpl->nbytes;
				local[i].tag = (uint64_t)(next + i);
			}
			got = p2h_submit_io(q, local, batch, cids, &bad);
			if (got < 0)
				return got;
			next += got;
			inflight += got;
		}
		got = p2h_reap(q, cpl, 64);
		for (i = 0; i < got; i++) {
			if (lat_out)
				lat_out[cpl[i].tag] = cpl[i].lat_ns;
			if (cpl[i].status)
				(*errors)++;
		}
		done += got;
		inflight -= got;
		if (p2h_stalled(&idle_since, got, inflight, timeout_ns))
			return done;
	}
	return done;
}
