/* The KV transfer hot path: plan runs of pages, send them as one vectored
 * message, receive them straight into the pool. Every call takes a stall
 * timeout: no progress for timeout_ms milliseconds returns -ETIMEDOUT.
 * Results are >= 0 on success and -errno on failure; an orderly close by the
 * peer is -ENOTCONN. */

struct kv_iov { uint64_t addr; uint64_t len; };

/* One run as it travels: destination segment, offset and length. 24 bytes. */
struct kv_wire { uint32_t seg; uint32_t flags; uint64_t off; uint64_t len; };

/* Merge n (local page, remote page) pairs of one (layer, K/V) into runs: pairs whose
 * local and remote ids both go up by one extend the run before them. Appends at most
 * cap runs to liov / wire; returns how many, -ERANGE (*bad = index of the first pair
 * out of range) or -ENOSPC. */
long kv_plan(const int32_t *lids, const int32_t *rids, size_t n,
             uint64_t laddr, uint64_t lblocks, uint32_t rseg, uint64_t rbase, uint64_t rblocks,
             uint64_t bbytes, struct kv_iov *liov, struct kv_wire *wire, size_t cap, size_t *bad);

/* The same over prepared descriptor tables (NIXL's prepped lists): pair i moves
 * ltab[lidx[i]] to rtab[ridx[i]] (lengths must agree: -EINVAL, *bad = i); runs that are
 * contiguous on both sides (same remote segment) merge. */
long kv_plan_descs(const int32_t *lidx, const int32_t *ridx, size_t n,
                   const struct kv_iov *ltab, size_t nl, const struct kv_wire *rtab, size_t nr,
                   struct kv_iov *liov, struct kv_wire *wire, size_t cap, size_t *bad,
                   uint64_t *total);

/* Send hdr, then the nwire runs, then the niov payload ranges, as one stream of bytes
 * (sendmsg with up to IOV_MAX vectors per call) on non-blocking socket fd. */
long kv_send(int fd, const void *hdr, size_t hdrlen, const struct kv_wire *wire, size_t nwire,
             const struct kv_iov *iov, size_t niov, int timeout_ms);

/* Read exactly len bytes into buf. */
long kv_recv_exact(int fd, void *buf, size_t len, int timeout_ms);

/* Check the nwire runs against the nsegs segments (every run inside one, lengths adding up
 * to total): -EINVAL (*bad = the first bad run) without reading anything; else read the
 * payload straight into the segments with readv. */
long kv_recv_runs(int fd, const struct kv_iov *segs, uint32_t nsegs, const struct kv_wire *wire,
                  size_t nwire, uint64_t total, int timeout_ms, size_t *bad);

/* Check the nwire runs against the nsegs segments, as kv_recv_runs does, and turn them
 * into addresses (the source ranges of a READ served from this side). */
long kv_runs_to_iov(const struct kv_iov *segs, uint32_t nsegs, const struct kv_wire *wire,
                    size_t nwire, struct kv_iov *iov, size_t *bad, uint64_t *total);

/* Read exactly the niov ranges, in order (the payload of a READ's answer). */
long kv_recv_iov(int fd, const struct kv_iov *iov, size_t niov, int timeout_ms);

/* Read and drop n bytes (the payload of a rejected message). */
long kv_discard(int fd, uint64_t n, int timeout_ms);

/* CUDA staging: driver entry points that Python resolved once (from libcuda), as
 * addresses, and the context made current in the calling thread before each copy.
 *   ctx_set_current  CUresult cuCtxSetCurrent(CUcontext)
 *   dtoh_async       CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t, CUstream)
 *   htod_async       CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t, CUstream)
 *   stream_sync      CUresult cuStreamSynchronize(CUstream) */
struct kv_cuda {
	uint64_t ctx_set_current;
	uint64_t dtoh_async;
	uint64_t htod_async;
	uint64_t stream_sync;
	uint64_t ctx;
};

/* Queue on `stream` one copy per run between the device ranges `runs` and the host
 * staging buffer `stage`, packed in order: device -> stage (to_device 0) or stage ->
 * device (to_device 1). Nothing waits for the copies (kv_cuda_sync does). Returns the
 * bytes queued, or -EIO with *cuerr = the CUresult of the call that failed. */
long kv_cuda_copy(const struct kv_cuda *cu, int to_device, const struct kv_iov *runs,
                  size_t nruns, void *stage, uint64_t stream, int *cuerr);

/* Wait for everything queued on `stream`: 0, or -EIO with *cuerr set. */
long kv_cuda_sync(const struct kv_cuda *cu, uint64_t stream, int *cuerr);

/* Send one DATA message from device runs: hdr and the run table, then the payload, staged
 * in chunks of `chunk` bytes through the two halves of `stage` (2 * chunk bytes), chunk c
 * copied on streams[c % 2]: the copies of chunk c + 1 run while chunk c is sent. Returns
 * the payload bytes; -EIO with *cuerr set and *sent = 0 when a copy failed before anything
 * was sent, *sent = 1 when it failed mid-message (the stream is then out of step: drop the
 * connection); other -errno as kv_send. */
long kv_cuda_send(const struct kv_cuda *cu, int fd, const void *hdr, size_t hdrlen,
                  const struct kv_wire *wire, size_t nwire, const struct kv_iov *runs,
                  size_t nruns, void *stage, uint64_t chunk, const uint64_t *streams,
                  int timeout_ms, int *cuerr, int *sent);

/* Receive a payload of `total` bytes into device runs (checked by the caller), chunk by
 * chunk through the two halves of `stage`, each chunk's copies queued on streams[c % 2]
 * while the next chunk is read; both streams are synchronized before it returns. A failed
 * copy does not stop the reading (the stream stays in step): -EIO with *cuerr set once the
 * whole payload was read; socket errors as kv_recv_exact. */
long kv_cuda_recv(const struct kv_cuda *cu, int fd, const struct kv_iov *runs, size_t nruns,
                  uint64_t total, void *stage, uint64_t chunk, const uint64_t *streams,
                  int timeout_ms, int *cuerr);
