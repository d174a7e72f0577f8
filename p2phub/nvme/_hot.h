/* SPDX-License-Identifier: GPL-2.0-only OR MIT */
/*
 * The per-command hot path of the p2phub NVMe engine: encode submission
 * entries, ring doorbells, reap completions. Everything else (bring-up,
 * admin commands, splitting, timeouts, recovery) is Python.
 *
 * This header is parsed by cffi as well as compiled: plain declarations, no
 * function-like macros, fixed-width types only.
 *
 * Thread rule: one thread at a time per struct p2h_qp (the Python QueuePair
 * holds a lock around every call). Different queue pairs are independent.
 */

/* Completion handed back to Python. */
struct p2h_cpl {
	uint64_t tag;		/* the submitter's cookie */
	uint32_t dw0;
	uint32_t dw1;
	uint32_t lat_ns;	/* submit -> reap, wall clock, saturated */
	uint16_t cid;
	uint16_t status;	/* CQE DW3[31:17]: SC | SCT << 8 | CRD | M << 13 | DNR << 14 */
};

/* One read/write/flush/write-zeroes request, already split to fit MDTS. */
struct p2h_io {
	uint8_t opc;
	uint8_t _pad0[3];
	uint32_t nsid;
	uint64_t slba;
	uint32_t nlb;		/* blocks, 1-based; 0 for flush */
	uint32_t cdw12_flags;	/* ORed into CDW12 (FUA, ...) */
	uint32_t cdw13;
	uint32_t nbytes;	/* data bytes; 0 for no data */
	uint64_t buf_off;	/* byte offset of the data in the page list */
	const uint64_t *pages;	/* 4 KiB-granular DMA addresses of the buffer */
	uint64_t npages;
	uint64_t tag;
};

/* Per-command tracker, indexed by the low 12 bits of the command id. */
struct p2h_trk {
	uint64_t t_submit_ns;
	uint64_t tag;
	uint16_t cid;		/* gen << 12 | index, while busy */
	uint8_t busy;
	uint8_t opc;
	uint32_t _pad;
};

struct p2h_qp {
	/* Hot: touched on every command. */
	uint8_t *sq;			/* depth * 64 bytes, DMA-coherent */
	uint8_t *cq;			/* depth * 16 bytes, DMA-coherent */
	uint32_t *sq_db;		/* BAR0; written through a volatile access */
	uint32_t *cq_db;		/* BAR0; written through a volatile access */
	uint32_t depth;
	uint32_t sq_tail;
	uint32_t sq_head;		/* from the latest CQE's SQHD */
	uint32_t cq_head;
	uint32_t phase;
	uint32_t nfree;
	uint32_t ntrk;
	uint32_t prp_stride;		/* bytes of PRP list per tracker */
	uint16_t *free_stk;
	struct p2h_trk *trk;
	uint8_t *prp_cpu;
	uint64_t prp_dma;
	/* Below this line: not on the normal I/O path. */
	uint64_t stale_cqes;		/* CQEs naming no outstanding command */
	uint64_t submitted;
	uint64_t completed;
	uint64_t doorbells;
	uint32_t hold_doorbell;		/* fault injection: never ring the SQ doorbell */
	uint16_t qid;
	uint16_t _pad;
};

struct p2h_qp *p2h_qp_create(uint16_t qid, uint32_t depth, uint32_t ntrk,
			     void *sq, void *cq, void *sq_db, void *cq_db,
			     void *prp_cpu, uint64_t prp_dma, uint32_t prp_stride);
void p2h_qp_destroy(struct p2h_qp *q);
/* Forget every command and return the rings to their just-created state. */
void p2h_qp_reset(struct p2h_qp *q);

/*
 * Copy raw 64-byte commands (16 dwords each) into the SQ; the command id is
 * allocated here and written into CDW0. One doorbell for the batch.
 * Return: commands queued (maybe fewer than n: no free tracker or SQ slot).
 */
int p2h_submit_raw(struct p2h_qp *q, const uint32_t *cmds, const uint64_t *tags,
		   int n, uint16_t *cids_out);

/*
 * Encode and queue I/O commands, PRPs built from each request's page list.
 * One doorbell for the batch.
 * Return: commands queued (>= 0), or -22 (EINVAL) when the first request
 * that did not fit is malformed (range outside its page list, PRP list
 * longer than a tracker's slot); *bad_index names it.
 */
int p2h_submit_io(struct p2h_qp *q, const struct p2h_io *ios, int n,
		  uint16_t *cids_out, int *bad_index);

/* Reap up to max completions; one CQ doorbell for the batch. */
int p2h_reap(struct p2h_qp *q, struct p2h_cpl *out, int max);

/* Outstanding commands submitted before now - age_ns (age_ns 0: all). */
int p2h_outstanding(struct p2h_qp *q, uint64_t age_ns, uint16_t *cids,
		    uint64_t *tags, uint64_t *ages_ns, int max);

/* Release one tracker by cid without a completion (after reset). */
int p2h_forget(struct p2h_qp *q, uint16_t cid);

uint64_t p2h_now_ns(void);

/*
 * Keep up to qd of the n requests in flight until every one completes or
 * nothing completes for timeout_ns. Request i gets tag i; its status goes to
 * status_out[i] and its latency to lat_out[i] (either may be NULL).
 * Return: requests completed; the rest are still outstanding.
 */
int p2h_run(struct p2h_qp *q, const struct p2h_io *ios, int n, int qd,
	    uint64_t timeout_ns, uint16_t *status_out, uint32_t *lat_out);

/*
 * Benchmark loop: n reads of tmpl->nlb blocks at uniformly random aligned
 * LBAs below span_blocks, qd in flight, each into its own nbytes slot of
 * the buffer modulo nslots. Return: requests completed; errors counted in
 * *errors.
 */
int p2h_bench_rand(struct p2h_qp *q, const struct p2h_io *tmpl,
		   uint64_t span_blocks, uint32_t nslots, uint64_t seed,
		   int n, int qd, uint64_t timeout_ns, uint32_t *lat_out,
		   uint64_t *errors);
