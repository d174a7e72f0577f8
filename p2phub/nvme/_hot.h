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

/*
 * The controller fd's status page (mmap P2PHUB_NVME_MMAP_STATUS), as the
 * kernel writes it: struct p2phub_nvme_status of kmod/uapi/p2phub.h (the
 * unit tests compare the two layouts). Read with plain volatile loads.
 */
struct p2h_status {
	uint32_t abi;
	uint32_t state;		/* P2PHUB_NVME_ST_*: nonzero stops every doorbell */
	uint64_t events;
	uint64_t reg_gen[256];	/* per MAP_REG slot; 0: unused or revoked */
};

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
	uint32_t slot;		/* status page slot of the registration; 0xffffffff: none */
	uint32_t _pad1;
	uint64_t gen;		/* generation MAP_REG returned for that slot */
};

/*
 * A batch of requests driven by the pump (p2h_pump): explicit requests
 * (ios); or same-sized ones from a template (ios NULL, tmpl set), request i
 * at LBA lbas[i] and buffer offset offs[i] when lbas is set (the batch API:
 * each command is encoded as it is submitted, no per-request struct), else
 * generated at uniformly random aligned LBAs below span_blocks and buffer
 * offset (i % nslots) * tmpl->nbytes (the benchmark). Completions are
 * recorded here, not handed back one by one.
 */
struct p2h_batch {
	const struct p2h_io *ios;	/* n requests (their tags are ignored) */
	const struct p2h_io *tmpl;	/* generator template, when ios is NULL */
	uint16_t *status;		/* per request, or NULL: CQE status at completion */
	uint32_t *lat_ns;		/* per request, or NULL */
	uint64_t span_blocks;		/* generator */
	uint64_t rng;			/* generator state (nonzero) */
	uint32_t nslots;		/* generator */
	uint32_t n;			/* requests */
	uint32_t qd;			/* at most this many of them in flight */
	uint32_t next;			/* requests submitted */
	uint32_t done;			/* requests completed */
	uint32_t errors;		/* completed with a nonzero status */
	int32_t refused;		/* 0, or why submission stopped at `next`: -EINVAL
					 * malformed, -ESTALE a registration's generation
					 * changed, -EIO the status page's state is not 0,
					 * -ENODEV the queue pair is dead */
	uint32_t bad;			/* with refused: the request it stopped at */
	uint32_t id;			/* slot in the queue pair's batch table */
	uint32_t attached;
	/*
	 * Requests made of several commands (p2h_fill_ops), or NULL: op_of[i]
	 * is the request of command i, op_left[k] the commands of request k
	 * not yet completed; when it reaches 0, k is appended to op_done
	 * (nops_done entries so far), in completion order.
	 */
	const uint32_t *op_of;
	uint32_t *op_left;
	uint32_t *op_done;
	uint32_t nops_done;
	uint32_t _pad2;
	const uint64_t *lbas;		/* with tmpl: per request, its LBA */
	const uint64_t *offs;		/* with tmpl and lbas: its buffer offset */
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
	const struct p2h_status *st;	/* the gate; NULL: none (unit tests of the rings) */
	uint32_t dead;			/* set: no MMIO at all (BAR0 is going away) */
	uint32_t nbatch;		/* batches attached */
	struct p2h_batch *batch[64];	/* attached batches, by id */
	uint64_t refused;		/* submissions the gate refused */
	uint16_t *cids;			/* ntrk entries: scratch for batch submission */
};

/* A buffer the requests of p2h_fill_ops may reference, by index. */
struct p2h_buf {
	const uint64_t *pages;	/* 4 KiB-granular DMA addresses */
	uint64_t npages;
	uint32_t slot;		/* status page slot; 0xffffffff: none */
	uint32_t _pad;
	uint64_t gen;
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
 * Just before the one doorbell write of the batch, the gate: the status
 * page's state must be 0 and reg_gen[slot] must equal each request's gen
 * (plain loads, no system call); otherwise nothing of the batch is rung and
 * its trackers and SQ slots are given back.
 * Return: commands queued (>= 0), or (nothing queued) -22 (EINVAL) when the
 * first request that did not fit is malformed (range outside its page list,
 * PRP list longer than a tracker's slot), -116 (ESTALE) when a request's
 * registration generation is not current, -5 (EIO) when the state is not 0,
 * -19 (ENODEV) when the queue pair is dead; *bad_index names the request
 * (-1 for EIO/ENODEV).
 */
int p2h_submit_io(struct p2h_qp *q, const struct p2h_io *ios, int n,
		  uint16_t *cids_out, int *bad_index);

/*
 * Reap up to max completions; one CQ doorbell for the batch. Completions of
 * attached batches are recorded in their batch and not returned in out.
 */
int p2h_reap(struct p2h_qp *q, struct p2h_cpl *out, int max);

/* Attach a batch to the queue pair (it gets an id); -28 (ENOSPC) when 64 are. */
int p2h_batch_attach(struct p2h_qp *q, struct p2h_batch *b);
/* Detach it; its commands still in flight are then reaped as stale. */
void p2h_batch_detach(struct p2h_qp *q, struct p2h_batch *b);

/*
 * The one submission/reap pump. Repeat: submit from every attached batch
 * (each up to its qd in flight, one doorbell per round), reap; until every
 * attached batch is done or refused, or a completion that belongs to no
 * batch has been returned in out (up to max), or the status page's state is
 * not 0, or nothing completed for idle_ns (0: one round only).
 * Return: entries written to out (completions of single commands), or -5
 * (EIO) when the state is not 0, or -19 (ENODEV) when the queue pair is dead.
 */
int p2h_pump(struct p2h_qp *q, struct p2h_cpl *out, int max, uint64_t idle_ns);

/* Outstanding commands submitted before now - age_ns (age_ns 0: all). */
int p2h_outstanding(struct p2h_qp *q, uint64_t age_ns, uint16_t *cids,
		    uint64_t *tags, uint64_t *ages_ns, int max);

/* Release one tracker by cid without a completion (after reset). */
int p2h_forget(struct p2h_qp *q, uint16_t cid);

uint64_t p2h_now_ns(void);

/*
 * Fill n read/write requests of nbytes each (at most one command each):
 * request i reads/writes nbytes at LBA lbas[i], buffer offset offs[i] of the
 * page list (pages, npages; status page slot and gen). Each is checked: LBA
 * range inside blocks, buffer range inside npages * 4096, offset dword
 * aligned. With ios NULL only checks (a batch with a template and the two
 * arrays is encoded by the pump). Return: 0, with span[0] the lowest offset
 * and span[1] the end of the highest request (the bytes of the buffer the
 * batch touches); or -22 (EINVAL) with *bad the first bad request and *why 1
 * (LBA range) or 2 (buffer range) or 3 (alignment).
 */
int p2h_fill_rw(struct p2h_io *ios, int n, uint8_t opc, uint32_t nsid,
		uint32_t lba_shift, uint32_t nbytes, const uint64_t *lbas,
		const uint64_t *offs, const uint64_t *pages, uint64_t npages,
		uint32_t slot, uint64_t gen, uint64_t blocks, uint64_t *span, int *bad, int *why);

/*
 * Encode n requests of any kind (read, write, flush, write zeroes) and size
 * into commands, each request split so that no command moves more than
 * max_transfer bytes (write zeroes: 65536 blocks). Request i: opcode opc[i],
 * LBA lbas[i], len[i] bytes (write zeroes: blocks times the LBA size; flush:
 * ignored), offset offs[i] into buffer bufs[bufi[i]] (0xffffffff: none).
 * Every request is checked before anything is written: opcode known, length
 * a positive multiple of the LBA size, LBA range inside blocks, a buffer for
 * data, buffer range inside it, offset dword aligned. op_first[i] is the
 * index of request i's first command, op_first[n] the number of commands;
 * when written, op_of[c] (per command) its request and op_left[i] (per
 * request) its number of commands (both may be NULL). With ios NULL only
 * checks and counts. Return: commands (written when ios
 * is not NULL and they fit in max_ios), -28 (ENOSPC) when they do not fit,
 * or -22 (EINVAL) with *bad the first bad request and *why 1 (LBA range),
 * 2 (buffer range), 3 (alignment), 4 (length), 5 (no such buffer) or
 * 6 (opcode).
 */
int p2h_fill_ops(struct p2h_io *ios, uint32_t max_ios, uint32_t n,
		 const uint8_t *opc, const uint64_t *lbas, const uint64_t *len,
		 const uint64_t *offs, const uint32_t *bufi,
		 const struct p2h_buf *bufs, uint32_t nbufs, uint32_t nsid,
		 uint32_t lba_shift, uint64_t blocks, uint32_t max_transfer,
		 uint32_t *op_first, uint32_t *op_of, uint32_t *op_left,
		 int *bad, int *why);

/*
 * Run one batch to completion on a queue pair with nothing else in flight:
 * attach, pump until done, refused or nothing completes for timeout_ns,
 * detach. Return: requests completed.
 */
int p2h_batch_run(struct p2h_qp *q, struct p2h_batch *b, uint64_t timeout_ns);

/*
 * Latencies into histogram buckets in one pass: counts[j] += how many of
 * lat[0..n) are at most bounds[j] (bounds ascending, nb of them; cumulative,
 * as a Prometheus histogram counts), *sum += their total. Return: 0, or -22
 * (EINVAL, nothing counted) for more than 64 bounds.
 */
int p2h_lat_buckets(const uint32_t *lat, uint32_t n, const uint64_t *bounds,
		     uint32_t nb, uint64_t *counts, uint64_t *sum);
