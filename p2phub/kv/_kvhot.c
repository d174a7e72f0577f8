// SPDX-License-Identifier: GPL-2.0-only OR MIT
/* KV transfer hot path (see _kvhot.h). Called through cffi, which releases the GIL. */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "_kvhot.h"

#define KV_IOV_BATCH 1024

long kv_plan(const int32_t *lids, const int32_t *rids, size_t n,
             uint64_t laddr, uint64_t lblocks, uint32_t rseg, uint64_t rbase, uint64_t rblocks,
             uint64_t bbytes, struct kv_iov *liov, struct kv_wire *wire, size_t cap, size_t *bad)
{
	size_t out = 0, i;
	int64_t pl = -2, pr = -2;

	for (i = 0; i < n; i++) {
		int64_t l = lids[i], r = rids[i];

		if (l < 0 || (uint64_t)l >= lblocks || r < 0 || (uint64_t)r >= rblocks) {
			*bad = i;
			return -ERANGE;
		}
		if (out && l == pl + 1 && r == pr + 1) {
			liov[out - 1].len += bbytes;
			wire[out - 1].len += bbytes;
		} else {
			if (out == cap)
				return -ENOSPC;
			liov[out].addr = laddr + (uint64_t)l * bbytes;
			liov[out].len = bbytes;
			wire[out].seg = rseg;
			wire[out].flags = 0;
			wire[out].off = rbase + (uint64_t)r * bbytes;
			wire[out].len = bbytes;
			out++;
		}
		pl = l;
		pr = r;
	}
	return (long)out;
}

long kv_plan_descs(const int32_t *lidx, const int32_t *ridx, size_t n,
                   const struct kv_iov *ltab, size_t nl, const struct kv_wire *rtab, size_t nr,
                   struct kv_iov *liov, struct kv_wire *wire, size_t cap, size_t *bad,
                   uint64_t *total)
{
	size_t out = 0, i;

	*total = 0;
	for (i = 0; i < n; i++) {
		int32_t l = lidx[i], r = ridx[i];
		const struct kv_iov *L;
		const struct kv_wire *R;

		if (l < 0 || (size_t)l >= nl || r < 0 || (size_t)r >= nr) {
			*bad = i;
			return -ERANGE;
		}
		L = &ltab[l];
		R = &rtab[r];
		if (L->len != R->len) {
			*bad = i;
			return -EINVAL;
		}
		*total += L->len;
		if (out && liov[out - 1].addr + liov[out - 1].len == L->addr &&
		    wire[out - 1].seg == R->seg && wire[out - 1].off + wire[out - 1].len == R->off) {
			liov[out - 1].len += L->len;
			wire[out - 1].len += R->len;
			continue;
		}
		if (out == cap)
			return -ENOSPC;
		liov[out] = *L;
		wire[out] = *R;
		wire[out].flags = 0;
		out++;
	}
	return (long)out;
}

static int wait_fd(int fd, short events, int timeout_ms)
{
	struct pollfd p = { .fd = fd, .events = events };
	int rc;

	do {
		rc = poll(&p, 1, timeout_ms);
	} while (rc < 0 && errno == EINTR);
	if (rc < 0)
		return -errno;
	if (rc == 0)
		return -ETIMEDOUT;
	if ((p.revents & (POLLERR | POLLNVAL)) && !(p.revents & events))
		return -ECONNRESET;
	return 0;
}

/* The k-th piece of the message: hdr, the run table, then the payload ranges. */
struct msg {
	const void *hdr;
	size_t hdrlen;
	const void *wire;
	size_t wirelen;
	const struct kv_iov *iov;
	size_t niov;
};

static size_t msg_pieces(const struct msg *m) { return 2 + m->niov; }

static void msg_piece(const struct msg *m, size_t k, char **base, size_t *len)
{
	if (k == 0) {
		*base = (char *)m->hdr;
		*len = m->hdrlen;
	} else if (k == 1) {
		*base = (char *)m->wire;
		*len = m->wirelen;
	} else {
		*base = (char *)(uintptr_t)m->iov[k - 2].addr;
		*len = m->iov[k - 2].len;
	}
}

long kv_send(int fd, const void *hdr, size_t hdrlen, const struct kv_wire *wire, size_t nwire,
             const struct kv_iov *iov, size_t niov, int timeout_ms)
{
	struct msg m = { hdr, hdrlen, wire, nwire * sizeof(*wire), iov, niov };
	struct iovec vec[KV_IOV_BATCH];
	size_t k = 0, skip = 0, total = 0, pieces = msg_pieces(&m);

	while (k < pieces) {
		struct msghdr mh = { 0 };
		size_t nv = 0, j = k, first_skip = skip;
		ssize_t sent;

		for (; j < pieces && nv < KV_IOV_BATCH; j++) {
			char *b;
			size_t l;

			msg_piece(&m, j, &b, &l);
			if (j == k) {
				b += first_skip;
				l -= first_skip;
			}
			if (!l)
				continue;
			vec[nv].iov_base = b;
			vec[nv].iov_len = l;
			nv++;
		}
		if (!nv)
			break;
		mh.msg_iov = vec;
		mh.msg_iovlen = nv;
		sent = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (sent < 0) {
			int rc;

			if (errno == EINTR)
				continue;
			if (errno != EAGAIN && errno != EWOULDBLOCK)
				return -errno;
			rc = wait_fd(fd, POLLOUT, timeout_ms);
			if (rc)
				return rc;
			continue;
		}
		total += (size_t)sent;
		/* Advance (k, skip) by sent bytes. */
		while (sent > 0 && k < pieces) {
			char *b;
			size_t l;

			msg_piece(&m, k, &b, &l);
			if ((size_t)sent >= l - skip) {
				sent -= (ssize_t)(l - skip);
				k++;
				skip = 0;
			} else {
				skip += (size_t)sent;
				sent = 0;
			}
		}
		/* Skip empty pieces. */
		while (k < pieces) {
			char *b;
			size_t l;

			msg_piece(&m, k, &b, &l);
			if (l > skip)
				break;
			k++;
			skip = 0;
		}
	}
	return (long)(total > LONG_MAX ? LONG_MAX : total);
}

long kv_recv_exact(int fd, void *buf, size_t len, int timeout_ms)
{
	size_t got = 0;

	while (got < len) {
		ssize_t r = recv(fd, (char *)buf + got, len - got, MSG_DONTWAIT);

		if (r > 0) {
			got += (size_t)r;
			continue;
		}
		if (r == 0)
			return -ENOTCONN;
		if (errno == EINTR)
			continue;
		if (errno != EAGAIN && errno != EWOULDBLOCK)
			return -errno;
		r = wait_fd(fd, POLLIN, timeout_ms);
		if (r)
			return (long)r;
	}
	return (long)got;
}

long kv_recv_runs(int fd, const struct kv_iov *segs, uint32_t nsegs, const struct kv_wire *wire,
                  size_t nwire, uint64_t total, int timeout_ms, size_t *bad)
{
	struct iovec vec[KV_IOV_BATCH];
	uint64_t sum = 0;
	size_t k = 0, skip = 0, i;

	for (i = 0; i < nwire; i++) {
		const struct kv_wire *w = &wire[i];

		if (w->seg >= nsegs || w->len == 0 || w->off > segs[w->seg].len ||
		    w->len > segs[w->seg].len - w->off || w->flags != 0 ||
		    sum + w->len < sum) {
			*bad = i;
			return -EINVAL;
		}
		sum += w->len;
	}
	if (sum != total) {
		*bad = nwire;
		return -EINVAL;
	}
	while (k < nwire) {
		size_t nv = 0, j;
		ssize_t r;

		for (j = k; j < nwire && nv < KV_IOV_BATCH; j++) {
			vec[nv].iov_base = (char *)(uintptr_t)(segs[wire[j].seg].addr + wire[j].off) +
					   (j == k ? skip : 0);
			vec[nv].iov_len = wire[j].len - (j == k ? skip : 0);
			nv++;
		}
		r = readv(fd, vec, (int)nv);
		if (r == 0)
			return -ENOTCONN;
		if (r < 0) {
			long rc;

			if (errno == EINTR)
				continue;
			if (errno != EAGAIN && errno != EWOULDBLOCK)
				return -errno;
			rc = wait_fd(fd, POLLIN, timeout_ms);
			if (rc)
				return rc;
			continue;
		}
		while (r > 0 && k < nwire) {
			uint64_t left = wire[k].len - skip;

			if ((uint64_t)r >= left) {
				r -= (ssize_t)left;
				k++;
				skip = 0;
			} else {
				skip += (size_t)r;
				r = 0;
			}
		}
	}
	return (long)(total > LONG_MAX ? LONG_MAX : total);
}

long kv_recv_iov(int fd, const struct kv_iov *iov, size_t niov, int timeout_ms)
{
	struct iovec vec[KV_IOV_BATCH];
	size_t k = 0, skip = 0;
	uint64_t got = 0;

	while (k < niov) {
		size_t nv = 0, j;
		ssize_t r;

		for (j = k; j < niov && nv < KV_IOV_BATCH; j++) {
			vec[nv].iov_base = (char *)(uintptr_t)iov[j].addr + (j == k ? skip : 0);
			vec[nv].iov_len = iov[j].len - (j == k ? skip : 0);
			nv++;
		}
		r = readv(fd, vec, (int)nv);
		if (r == 0)
			return -ENOTCONN;
		if (r < 0) {
			long rc;

			if (errno == EINTR)
				continue;
			if (errno != EAGAIN && errno != EWOULDBLOCK)
				return -errno;
			rc = wait_fd(fd, POLLIN, timeout_ms);
			if (rc)
				return rc;
			continue;
		}
		got += (uint64_t)r;
		while (r > 0 && k < niov) {
			uint64_t left = iov[k].len - skip;

			if ((uint64_t)r >= left) {
				r -= (ssize_t)left;
				k++;
				skip = 0;
			} else {
				skip += (size_t)r;
				r = 0;
			}
		}
	}
	return (long)(got > LONG_MAX ? LONG_MAX : got);
}

long kv_runs_to_iov(const struct kv_iov *segs, uint32_t nsegs, const struct kv_wire *wire,
                    size_t nwire, struct kv_iov *iov, size_t *bad, uint64_t *total)
{
	uint64_t sum = 0;
	size_t i;

	for (i = 0; i < nwire; i++) {
		const struct kv_wire *w = &wire[i];

		if (w->seg >= nsegs || w->len == 0 || w->off > segs[w->seg].len ||
		    w->len > segs[w->seg].len - w->off || w->flags != 0 || sum + w->len < sum) {
			*bad = i;
			return -EINVAL;
		}
		iov[i].addr = segs[w->seg].addr + w->off;
		iov[i].len = w->len;
		sum += w->len;
	}
	*total = sum;
	return (long)nwire;
}

long kv_discard(int fd, uint64_t n, int timeout_ms)
{
	char scratch[65536];

	while (n) {
		size_t want = n < sizeof(scratch) ? (size_t)n : sizeof(scratch);
		long r = kv_recv_exact(fd, scratch, want, timeout_ms);

		if (r < 0)
			return r;
		n -= want;
	}
	return 0;
}

/* ---- CUDA staging (see _kvhot.h): the driver is called through the addresses Python
 * resolved; CUresult is an int, CUdeviceptr a 64-bit integer, CUstream and CUcontext
 * pointers. */
typedef int (*kv_ctx_set_fn)(void *ctx);
typedef int (*kv_dtoh_fn)(void *dst, uint64_t src, size_t n, void *stream);
typedef int (*kv_htod_fn)(uint64_t dst, const void *src, size_t n, void *stream);
typedef int (*kv_sync_fn)(void *stream);

static int kv_cuda_enter(const struct kv_cuda *cu, int *cuerr)
{
	int rc = ((kv_ctx_set_fn)(uintptr_t)cu->ctx_set_current)((void *)(uintptr_t)cu->ctx);

	*cuerr = rc;
	return rc ? -EIO : 0;
}

long kv_cuda_copy(const struct kv_cuda *cu, int to_device, const struct kv_iov *runs,
                  size_t nruns, void *stage, uint64_t stream, int *cuerr)
{
	void *s = (void *)(uintptr_t)stream;
	char *p = stage;
	uint64_t done = 0;
	size_t i;

	if (kv_cuda_enter(cu, cuerr))
		return -EIO;
	for (i = 0; i < nruns; i++) {
		int rc;

		if (to_device)
			rc = ((kv_htod_fn)(uintptr_t)cu->htod_async)(runs[i].addr, p + done,
								    (size_t)runs[i].len, s);
		else
			rc = ((kv_dtoh_fn)(uintptr_t)cu->dtoh_async)(p + done, runs[i].addr,
								    (size_t)runs[i].len, s);
		if (rc) {
			*cuerr = rc;
			return -EIO;
		}
		done += runs[i].len;
	}
	return (long)(done > LONG_MAX ? LONG_MAX : done);
}

long kv_cuda_sync(const struct kv_cuda *cu, uint64_t stream, int *cuerr)
{
	int rc;

	if (kv_cuda_enter(cu, cuerr))
		return -EIO;
	rc = ((kv_sync_fn)(uintptr_t)cu->stream_sync)((void *)(uintptr_t)stream);
	*cuerr = rc;
	return rc ? -EIO : 0;
}

/* A cursor over device runs, cutting them into staging chunks. */
struct kv_cursor {
	const struct kv_iov *runs;
	size_t nruns, i;
	uint64_t off;
};

/* Queue the copies of the next n bytes of the runs to / from buf on stream s. */
static int kv_cuda_chunk(const struct kv_cuda *cu, struct kv_cursor *k, int to_device, char *buf,
			 uint64_t n, void *s)
{
	uint64_t done = 0;

	while (done < n && k->i < k->nruns) {
		uint64_t left = k->runs[k->i].len - k->off, take = n - done < left ? n - done : left;
		uint64_t dev = k->runs[k->i].addr + k->off;
		int rc;

		if (to_device)
			rc = ((kv_htod_fn)(uintptr_t)cu->htod_async)(dev, buf + done, (size_t)take, s);
		else
			rc = ((kv_dtoh_fn)(uintptr_t)cu->dtoh_async)(buf + done, dev, (size_t)take, s);
		if (rc)
			return rc;
		done += take;
		k->off += take;
		if (k->off == k->runs[k->i].len) {
			k->i++;
			k->off = 0;
		}
	}
	return 0;
}

static int kv_cuda_wait(const struct kv_cuda *cu, uint64_t stream)
{
	return ((kv_sync_fn)(uintptr_t)cu->stream_sync)((void *)(uintptr_t)stream);
}

long kv_cuda_send(const struct kv_cuda *cu, int fd, const void *hdr, size_t hdrlen,
                  const struct kv_wire *wire, size_t nwire, const struct kv_iov *runs,
                  size_t nruns, void *stage, uint64_t chunk, const uint64_t *streams,
                  int timeout_ms, int *cuerr, int *sent)
{
	struct kv_cursor k = { runs, nruns, 0, 0 };
	uint64_t total = 0, nchunks, c;
	char *buf = stage;
	size_t i;
	long rc;

	*sent = 0;
	for (i = 0; i < nruns; i++)
		total += runs[i].len;
	if (!chunk)
		return -EINVAL;
	nchunks = (total + chunk - 1) / chunk;
	if (kv_cuda_enter(cu, cuerr))
		return -EIO;
	for (c = 0; c < nchunks && c < 2; c++) {
		uint64_t n = total - c * chunk < chunk ? total - c * chunk : chunk;

		*cuerr = kv_cuda_chunk(cu, &k, 0, buf + (c % 2) * chunk, n,
				       (void *)(uintptr_t)streams[c % 2]);
		if (*cuerr) {
			kv_cuda_wait(cu, streams[0]);
			kv_cuda_wait(cu, streams[1]);
			return -EIO;
		}
	}
	for (c = 0; c < nchunks || c == 0; c++) {
		uint64_t n = nchunks ? (total - c * chunk < chunk ? total - c * chunk : chunk) : 0;
		struct kv_iov piece = { (uint64_t)(uintptr_t)(buf + (c % 2) * chunk), n };

		if (nchunks) {
			*cuerr = kv_cuda_wait(cu, streams[c % 2]);
			if (*cuerr) {
				kv_cuda_wait(cu, streams[(c + 1) % 2]);
				return -EIO;
			}
		}
		rc = c == 0 ? kv_send(fd, hdr, hdrlen, wire, nwire, &piece, n ? 1 : 0, timeout_ms)
			    : kv_send(fd, NULL, 0, NULL, 0, &piece, 1, timeout_ms);
		if (rc < 0) {
			kv_cuda_wait(cu, streams[(c + 1) % 2]);
			return rc;
		}
		*sent = 1;
		/* this half is free again: queue chunk c + 2 into it */
		if (c + 2 < nchunks) {
			uint64_t m = total - (c + 2) * chunk < chunk ? total - (c + 2) * chunk : chunk;

			*cuerr = kv_cuda_chunk(cu, &k, 0, buf + (c % 2) * chunk, m,
					       (void *)(uintptr_t)streams[c % 2]);
			if (*cuerr) {
				kv_cuda_wait(cu, streams[(c + 1) % 2]);
				return -EIO;
			}
		}
	}
	return (long)(total > LONG_MAX ? LONG_MAX : total);
}

long kv_cuda_recv(const struct kv_cuda *cu, int fd, const struct kv_iov *runs, size_t nruns,
                  uint64_t total, void *stage, uint64_t chunk, const uint64_t *streams,
                  int timeout_ms, int *cuerr)
{
	struct kv_cursor k = { runs, nruns, 0, 0 };
	int err = 0, used[2] = { 0, 0 };
	uint64_t got = 0, c = 0;
	char *buf = stage;
	long rc;

	if (!chunk)
		return -EINVAL;
	if (kv_cuda_enter(cu, cuerr))
		err = *cuerr;
	while (got < total) {
		uint64_t n = total - got < chunk ? total - got : chunk;
		int h = (int)(c % 2);

		if (used[h] && !err) {	/* the copies out of this half are done before it refills */
			err = kv_cuda_wait(cu, streams[h]);
			used[h] = 0;
		}
		rc = kv_recv_exact(fd, buf + h * chunk, (size_t)n, timeout_ms);
		if (rc < 0) {
			if (!err) {
				kv_cuda_wait(cu, streams[0]);
				kv_cuda_wait(cu, streams[1]);
			}
			return rc;
		}
		if (!err) {
			err = kv_cuda_chunk(cu, &k, 1, buf + h * chunk, n, (void *)(uintptr_t)streams[h]);
			used[h] = 1;
		}
		got += n;
		c++;
	}
	for (c = 0; c < 2; c++) {
		int r = kv_cuda_wait(cu, streams[c]);

		if (!err)
			err = r;
	}
	*cuerr = err;
	return err ? -EIO : (long)(total > LONG_MAX ? LONG_MAX : total);
}
