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
 *  - the gate: just before each SQ doorbell write, the status page of the
 *    controller fd must say state 0 and the generation of every
 *    registration the batch touches must be the one it was mapped with;
 *    else nothing of the batch is rung (p2h_gate). Plain loads only.
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
 * Barriers, per architecture (what the kernel's dma_wmb()/wmb() and
 * dma_rmb() are for these orders):
 *
 * p2h_wmb() orders the SQE stores (write-back DMA-coherent memory) before
 * the doorbell store (uncached MMIO), and CQE reads before the CQ head
 * doorbell store. x86 keeps store order between the two, but the compiler
 * must not sink the entry stores past the doorbell: a full fence (mfence).
 * arm64: "dsb st", as the kernel's wmb() before a relaxed MMIO write (an
 * inner-shareable dmb, what a C11 fence gives, does not order against the
 * device). Without it a controller was seen to fetch a still-zero entry.
 *
 * p2h_rmb() orders reading a CQE's phase tag before reading the rest of the
 * entry (the device wrote them). x86: loads are not reordered with loads, a
 * compiler barrier suffices. arm64: "dmb oshld", the kernel's dma_rmb().
 */
#if defined(__aarch64__)
static inline void p2h_wmb(void)
{
	__asm__ __volatile__("dsb st" ::: "memory");
}

static inline void p2h_rmb(void)
{
	__asm__ __volatile__("dmb oshld" ::: "memory");
}
#elif defined(__x86_64__) || defined(__i386__)
static inline void p2h_wmb(void)
{
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static inline void p2h_rmb(void)
{
	__asm__ __volatile__("" ::: "memory");
}
#else
#error "p2phub NVMe hot path: no device barriers for this architecture"
#endif

#define P2H_NO_SLOT	0xffffffffu
#define P2H_NSLOTS	256u
#define P2H_MAX_BATCH	64u
#define P2H_TAG_BATCH	(1ull << 63)

static inline uint32_t p2h_st_state(const struct p2h_qp *q)
{
	return q->st ? *(const volatile uint32_t *)&q->st->state : 0;
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
	q->cids = calloc(ntrk, sizeof(*q->cids));
	if (!q->trk || !q->free_stk || !q->cids) {
		free(q->trk);
		free(q->free_stk);
		free(q->cids);
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
	free(q->cids);
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
	if (q->hold_doorbell || q->dead)
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

	if (q->dead)
		return -ENODEV;
	if (p2h_st_state(q))
		return -EIO;
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

/*
 * The gate, just before a doorbell write: 0 when the status page's state is
 * 0 and every request's registration generation is current. Plain loads.
 */
static inline int p2h_gate(const struct p2h_qp *q, const struct p2h_io *ios,
			   int n, int *bad)
{
	const volatile uint64_t *gen;
	int i;

	if (!q->st)
		return 0;
	if (p2h_st_state(q))
		return -EIO;
	gen = q->st->reg_gen;
	for (i = 0; i < n; i++) {
		uint32_t slot = ios[i].slot;

		if (slot == P2H_NO_SLOT)
			continue;
		if (slot >= P2H_NSLOTS || gen[slot] != ios[i].gen) {
			*bad = i;
			return -ESTALE;
		}
	}
	return 0;
}

/* Give back what queueing n commands took (nothing was rung). */
static void p2h_unqueue(struct p2h_qp *q, uint32_t old_tail,
			const uint16_t *cids, int n)
{
	int i;

	for (i = n - 1; i >= 0; i--)
		p2h_trk_put(q, cids[i] & P2H_CID_IDX);
	q->sq_tail = old_tail;
}

/* Queue up to n requests; tag of request i: tag_base + i, or ios[i].tag if tag_base is 0. */
static int p2h_submit_tagged(struct p2h_qp *q, const struct p2h_io *ios, int n,
			     uint64_t tag_base, uint16_t *cids_out, int *bad_index)
{
	uint64_t now = p2h_now_ns();
	uint32_t old_tail = q->sq_tail;
	int i, ret = 0, bad = -1;

	*bad_index = -1;
	if (q->dead)
		return -ENODEV;
	for (i = 0; i < n; i++) {
		if (!q->nfree || !p2h_sq_free_slots(q))
			break;
		if (p2h_queue_io(q, &ios[i], tag_base ? tag_base + (uint64_t)i : ios[i].tag,
				 now, &cids_out[i])) {
			*bad_index = i;
			ret = -EINVAL;
			break;
		}
	}
	if (!i)
		return ret;
	ret = p2h_gate(q, ios, i, &bad);
	if (ret) {
		p2h_unqueue(q, old_tail, cids_out, i);
		q->refused++;
		*bad_index = bad;
		return ret;
	}
	q->submitted += (uint64_t)i;
	p2h_sq_ring(q);
	return i;
}

int p2h_submit_io(struct p2h_qp *q, const struct p2h_io *ios, int n,
		  uint16_t *cids_out, int *bad_index)
{
	return p2h_submit_tagged(q, ios, n, 0, cids_out, bad_index);
}

/* Record a batch request's completion in its batch; 0 if the batch is gone. */
static inline int p2h_batch_complete(struct p2h_qp *q, uint64_t tag,
				     uint16_t status, uint32_t lat)
{
	uint32_t id = (uint32_t)(tag >> 32) & (P2H_MAX_BATCH - 1);
	uint32_t k = (uint32_t)tag;
	struct p2h_batch *b = q->batch[id];

	if (!b)
		return 0;
	if (b->status)
		b->status[k] = status;
	if (b->lat_ns)
		b->lat_ns[k] = lat;
	if (status)
		b->errors++;
	b->done++;
	if (b->op_of) {
		uint32_t op = b->op_of[k];

		if (--b->op_left[op] == 0)
			b->op_done[b->nops_done++] = op;
	}
	return 1;
}

int p2h_reap(struct p2h_qp *q, struct p2h_cpl *out, int max)
{
	uint64_t now = 0;
	int got = 0, consumed = 0, ndone = 0;

	if (q->dead)
		return 0;
	while (got < max) {
		volatile uint8_t *e = q->cq + (size_t)q->cq_head * P2H_CQE;
		uint16_t status = *(volatile uint16_t *)(e + 14);
		uint16_t cid, idx, sqhd;
		struct p2h_trk *t;
		uint32_t lat;

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
		lat = now - t->t_submit_ns > 0xffffffffull ?
		      0xffffffffu : (uint32_t)(now - t->t_submit_ns);
		ndone++;
		if (t->tag & P2H_TAG_BATCH) {
			if (!p2h_batch_complete(q, t->tag, status >> 1, lat))
				q->stale_cqes++;
			p2h_trk_put(q, idx);
			continue;
		}
		out[got].tag = t->tag;
		out[got].dw0 = *(volatile uint32_t *)(e + 0);
		out[got].dw1 = *(volatile uint32_t *)(e + 4);
		out[got].cid = cid;
		out[got].status = status >> 1;
		out[got].lat_ns = lat;
		p2h_trk_put(q, idx);
		got++;
	}
	if (consumed) {
		q->completed += (uint64_t)ndone;
		/* Entries are consumed (read) before the controller may reuse them. */
		if (!(p2h_st_state(q) & 2u)) {	/* P2PHUB_NVME_ST_REMOVING: no MMIO */
			p2h_wmb();
			*(volatile uint32_t *)q->cq_db = q->cq_head;
		}
	}
	return got;
}

int p2h_batch_attach(struct p2h_qp *q, struct p2h_batch *b)
{
	uint32_t i;

	for (i = 0; i < P2H_MAX_BATCH; i++) {
		if (!q->batch[i]) {
			q->batch[i] = b;
			b->id = i;
			b->attached = 1;
			q->nbatch++;
			return (int)i;
		}
	}
	return -ENOSPC;
}

void p2h_batch_detach(struct p2h_qp *q, struct p2h_batch *b)
{
	if (!b->attached || b->id >= P2H_MAX_BATCH || q->batch[b->id] != b)
		return;
	q->batch[b->id] = NULL;
	b->attached = 0;
	q->nbatch--;
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

/*
 * Submit what batch b may (up to its qd in flight, as many as there are free
 * trackers and SQ slots); one doorbell. Generated requests go 64 at a time.
 */
static int p2h_batch_submit(struct p2h_qp *q, struct p2h_batch *b)
{
	struct p2h_io local[64];
	const struct p2h_io *src;
	uint16_t *cids = q->cids;
	int k, got, bad, i;
	uint32_t inflight = b->next - b->done;

	if (b->refused || b->next >= b->n || inflight >= b->qd)
		return 0;
	k = (int)(b->n - b->next);
	if ((uint32_t)k > b->qd - inflight)
		k = (int)(b->qd - inflight);
	if ((uint32_t)k > q->ntrk)
		k = (int)q->ntrk;
	if (b->ios) {
		src = b->ios + b->next;
	} else if (b->lbas) {
		if (k > 64)
			k = 64;
		for (i = 0; i < k; i++) {
			local[i] = *b->tmpl;
			local[i].slba = b->lbas[b->next + (uint32_t)i];
			local[i].buf_off = b->offs[b->next + (uint32_t)i];
		}
		src = local;
	} else {
		if (k > 64)
			k = 64;
		uint64_t units = b->span_blocks / b->tmpl->nlb;

		for (i = 0; i < k; i++) {
			local[i] = *b->tmpl;
			local[i].slba = (p2h_xorshift(&b->rng) % units) * b->tmpl->nlb;
			local[i].buf_off = (uint64_t)((b->next + (uint32_t)i) % b->nslots) *
					   b->tmpl->nbytes;
		}
		src = local;
	}
	got = p2h_submit_tagged(q, src, k, P2H_TAG_BATCH | (uint64_t)b->id << 32 | b->next,
				cids, &bad);
	if (got < 0) {
		b->refused = got;
		b->bad = b->next + (uint32_t)(bad > 0 ? bad : 0);
		return got;
	}
	b->next += (uint32_t)got;
	return got;
}

static inline int p2h_batches_busy(const struct p2h_qp *q)
{
	uint32_t i;

	for (i = 0; i < P2H_MAX_BATCH; i++) {
		const struct p2h_batch *b = q->batch[i];

		if (b && b->done < b->next)
			return 1;	/* in flight */
		if (b && !b->refused && b->next < b->n)
			return 1;	/* still to submit */
	}
	return 0;
}

int p2h_pump(struct p2h_qp *q, struct p2h_cpl *out, int max, uint64_t idle_ns)
{
	uint64_t idle_since = 0, before;
	uint32_t i;
	int got;

	for (;;) {
		if (q->dead)
			return -ENODEV;
		if (p2h_st_state(q))
			return -EIO;
		if (q->nbatch) {
			for (i = 0; i < P2H_MAX_BATCH; i++) {
				if (q->batch[i] && p2h_batch_submit(q, q->batch[i]) == -EIO)
					return -EIO;
			}
		}
		before = q->completed;
		got = p2h_reap(q, out, max);
		if (got || !idle_ns || !p2h_batches_busy(q))
			return got;
		if (q->completed != before) {
			idle_since = 0;
			continue;
		}
		if (!idle_since)
			idle_since = p2h_now_ns();
		else if (p2h_now_ns() - idle_since > idle_ns)
			return 0;
	}
}

/* The exact check of request i (0: good, else 1..3 as p2h_fill_rw's why). */
static int p2h_rw_bad(uint64_t lba, uint64_t off, uint64_t nlb, uint32_t nbytes,
		      uint64_t blocks, uint64_t limit)
{
	if (lba >= blocks || nlb > blocks - lba)
		return 1;
	if (off >= limit || nbytes > limit - off)
		return 2;
	if (off & 3)
		return 3;
	return 0;
}

int p2h_fill_rw(struct p2h_io *ios, int n, uint8_t opc, uint32_t nsid,
		uint32_t lba_shift, uint32_t nbytes, const uint64_t *lbas,
		const uint64_t *offs, const uint64_t *pages, uint64_t npages,
		uint32_t slot, uint64_t gen, uint64_t blocks, uint64_t *span,
		int *bad, int *why)
{
	uint64_t nlb = (uint64_t)nbytes >> lba_shift, limit = npages * P2H_PAGE;
	uint64_t lo = UINT64_MAX, top = 0, last = 0, any = 0;
	int i;

	*bad = -1;
	*why = 0;
	/*
	 * One pass of min/max/or (no branch per request): a good batch is known
	 * from its largest LBA and offset, its smallest offset and the OR of its
	 * offsets. Only a bad one is searched for its first bad request.
	 */
	for (i = 0; i < n; i++) {
		last = lbas[i] > last ? lbas[i] : last;
		top = offs[i] > top ? offs[i] : top;
		lo = offs[i] < lo ? offs[i] : lo;
		any |= offs[i];
	}
	if (n > 0 && (p2h_rw_bad(last, top, nlb, nbytes, blocks, limit) || (any & 3))) {
		for (i = 0; i < n; i++) {
			*why = p2h_rw_bad(lbas[i], offs[i], nlb, nbytes, blocks, limit);
			if (*why) {
				*bad = i;
				return -EINVAL;
			}
		}
	}
	for (i = 0; ios && i < n; i++) {
		struct p2h_io *io = &ios[i];

		memset(io, 0, sizeof(*io));
		io->opc = opc;
		io->nsid = nsid;
		io->slba = lbas[i];
		io->nlb = (uint32_t)nlb;
		io->nbytes = nbytes;
		io->buf_off = offs[i];
		io->pages = pages;
		io->npages = npages;
		io->slot = slot;
		io->gen = gen;
	}
	span[0] = lo;		/* the bytes of the buffer the batch touches */
	span[1] = top + nbytes;
	return 0;
}

int p2h_fill_ops(struct p2h_io *ios, uint32_t max_ios, uint32_t n,
		 const uint8_t *opc, const uint64_t *lbas, const uint64_t *len,
		 const uint64_t *offs, const uint32_t *bufi,
		 const struct p2h_buf *bufs, uint32_t nbufs, uint32_t nsid,
		 uint32_t lba_shift, uint64_t blocks, uint32_t max_transfer,
		 uint32_t *op_first, uint32_t *op_of, uint32_t *op_left,
		 int *bad, int *why)
{
	uint64_t lba_mask = ((uint64_t)1 << lba_shift) - 1;
	uint64_t step = (uint64_t)max_transfer & ~lba_mask;
	uint64_t total = 0;
	uint32_t i;

	*bad = -1;
	*why = 0;
	if (!step)
		return -EINVAL;
	/* First pass: check every request and count its commands. */
	for (i = 0; i < n; i++) {
		uint64_t nlb = len[i] >> lba_shift, limit;
		const struct p2h_buf *b;

		op_first[i] = (uint32_t)total;
		if (opc[i] == OPC_FLUSH) {
			total++;
			continue;
		}
		if (opc[i] != OPC_READ && opc[i] != OPC_WRITE && opc[i] != OPC_WRITE_ZEROES) {
			*why = 6;
			goto bad;
		}
		if (!len[i] || (len[i] & lba_mask)) {
			*why = 4;
			goto bad;
		}
		if (lbas[i] >= blocks || nlb > blocks - lbas[i]) {
			*why = 1;
			goto bad;
		}
		if (opc[i] == OPC_WRITE_ZEROES) {
			total += (nlb + 0xffff) >> 16;
			continue;
		}
		if (bufi[i] >= nbufs) {
			*why = 5;
			goto bad;
		}
		b = &bufs[bufi[i]];
		limit = b->npages * P2H_PAGE;
		if (offs[i] >= limit || len[i] > limit - offs[i]) {
			*why = 2;
			goto bad;
		}
		if (offs[i] & 3) {
			*why = 3;
			goto bad;
		}
		total += (len[i] + step - 1) / step;
	}
	if (total > 0xffffffffull)
		return -ENOSPC;
	op_first[n] = (uint32_t)total;
	if (!ios)
		return (int)(total > 0x7fffffff ? 0x7fffffff : total);
	if (total > max_ios)
		return -ENOSPC;
	/* Second pass: encode. */
	for (i = 0; i < n; i++) {
		struct p2h_io *io = &ios[op_first[i]];
		uint64_t done = 0, piece;
		uint32_t c;

		for (c = op_first[i]; op_of && c < op_first[i + 1]; c++)
			op_of[c] = i;
		if (op_left)
			op_left[i] = op_first[i + 1] - op_first[i];

		if (opc[i] == OPC_FLUSH) {
			memset(io, 0, sizeof(*io));
			io->opc = OPC_FLUSH;
			io->nsid = nsid;
			io->slot = P2H_NO_SLOT;
			continue;
		}
		if (opc[i] == OPC_WRITE_ZEROES) {
			uint64_t nlb = len[i] >> lba_shift;

			for (; done < nlb; done += piece, io++) {
				piece = nlb - done > 0x10000 ? 0x10000 : nlb - done;
				memset(io, 0, sizeof(*io));
				io->opc = OPC_WRITE_ZEROES;
				io->nsid = nsid;
				io->slba = lbas[i] + done;
				io->nlb = (uint32_t)piece;
				io->slot = P2H_NO_SLOT;
			}
			continue;
		}
		for (; done < len[i]; done += piece, io++) {
			const struct p2h_buf *b = &bufs[bufi[i]];

			piece = len[i] - done > step ? step : len[i] - done;
			memset(io, 0, sizeof(*io));
			io->opc = opc[i];
			io->nsid = nsid;
			io->slba = lbas[i] + (done >> lba_shift);
			io->nlb = (uint32_t)(piece >> lba_shift);
			io->nbytes = (uint32_t)piece;
			io->buf_off = offs[i] + done;
			io->pages = b->pages;
			io->npages = b->npages;
			io->slot = b->slot;
			io->gen = b->gen;
		}
	}
	return (int)total;
bad:
	*bad = (int)i;
	return -EINVAL;
}

/* How many of lat[0..n) are at most b: one compare per latency, no branch. */
static uint64_t p2h_count_at_most(const uint32_t *lat, uint32_t n, uint32_t b)
{
	uint64_t c = 0;
	uint32_t i;

	for (i = 0; i < n; i++)
		c += lat[i] <= b;
	return c;
}

int p2h_lat_buckets(const uint32_t *lat, uint32_t n, const uint64_t *bounds,
		     uint32_t nb, uint64_t *counts, uint64_t *sum)
{
	uint64_t total = 0, run = 0, floor;
	uint32_t i, j, bits, v, lo = UINT32_MAX, hi = 0, inner = 0;
	uint64_t per[65];
	uint8_t first[33];

	if (nb > 64)
		return -EINVAL;
	for (i = 0; i < n; i++) {
		v = lat[i];
		total += v;
		lo = v < lo ? v : lo;
		hi = v > hi ? v : hi;
	}
	*sum += total;
	if (!n)
		return 0;
	/*
	 * A batch's latencies mostly lie between two or three bounds: below the
	 * smallest latency a bound counts none, at or above the largest it counts
	 * them all, and each bound in between is one counting pass.
	 */
	for (j = 0; j < nb; j++)
		inner += bounds[j] >= lo && bounds[j] < hi;
	if (inner <= 4) {
		for (j = 0; j < nb; j++) {
			if (bounds[j] < lo)
				continue;
			counts[j] += bounds[j] >= hi ? n :
				     p2h_count_at_most(lat, n, (uint32_t)bounds[j]);
		}
		return 0;
	}
	/*
	 * Spread wide: bucket each latency, starting from first[b], the first
	 * bound at or above the smallest value of b bits (bounds are a few per
	 * octave: a step or two from there).
	 */
	for (bits = 0, j = 0; bits <= 32; bits++) {
		floor = bits ? 1ull << (bits - 1) : 0;
		while (j < nb && bounds[j] < floor)
			j++;
		first[bits] = (uint8_t)j;
	}
	memset(per, 0, sizeof(per));
	for (i = 0; i < n; i++) {
		v = lat[i];
		j = first[v ? 32 - __builtin_clz(v) : 0];
		while (j < nb && bounds[j] < v)
			j++;
		per[j]++;	/* per[nb]: above every bound, counted in n only */
	}
	for (j = 0; j < nb; j++) {
		run += per[j];
		counts[j] += run;
	}
	return 0;
}

int p2h_batch_run(struct p2h_qp *q, struct p2h_batch *b, uint64_t timeout_ns)
{
	struct p2h_cpl stray[16];
	int ret;

	if (b->ios == NULL && (!b->tmpl || !b->tmpl->nlb || !b->nslots ||
			       b->span_blocks < b->tmpl->nlb))
		return -EINVAL;
	if (!b->rng)
		b->rng = 0x9e3779b97f4a7c15ull;
	if (!b->qd)
		b->qd = 1;
	ret = p2h_batch_attach(q, b);
	if (ret < 0)
		return ret;
	while (b->done < b->next || (!b->refused && b->next < b->n)) {
		uint32_t before = b->done;

		ret = p2h_pump(q, stray, 16, timeout_ns);
		if (ret < 0 || (ret == 0 && b->done == before && b->done < b->next))
			break;	/* gate closed, dead, or stalled for timeout_ns */
	}
	p2h_batch_detach(q, b);
	return (int)b->done;
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
