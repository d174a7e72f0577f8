/* p2phub staged I/O engine (see _sio.h). One thread drives one engine: it keeps up to
 * `depth` reads (writes) in flight through io_uring, each in its own staging slot, and moves
 * the bytes between the slots and memory: memcpy for host memory, and for CUDA memory one
 * batched driver call per reaped round (cuMemcpyBatchAsync where the driver has it, else
 * one cuMemcpy*Async per contiguous run), an event recorded after each round. A slot is
 * reused once the event of the copy that used it has completed, so reads of the next pieces
 * run while the GPU copies the last ones. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "_sio.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <linux/aio_abi.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define NEVENTS 64
/* O_DIRECT reads through the staging slots of twice this and up go in pieces of this size
 * (sio_set_split), and O_DIRECT reads through the slots keep at most SIO_INFLIGHT_DEFAULT
 * bytes in flight (sio_set_inflight): a large read then reaches the disk as many small
 * requests, few enough that its queue does not fill with megabytes. On the GPU machines'
 * virtio disks this ran 16 MiB reads 1.23-1.29x as fast as the former default (2 MiB pieces,
 * up to 256 MiB in flight), 4 MiB ones 1.20-1.21x, 256 KiB-1 MiB ones 0.93-1.23x; 16 or 32
 * MiB in flight, or 256 KiB pieces, gained less (docs/benchmarks.md). */
#define SIO_SPLIT_DEFAULT (128ULL << 10)
#define SIO_INFLIGHT_DEFAULT (8ULL << 20)
/* A run whose entries average this much or more reads (writes) in pieces this large: the
 * staging memory is carved into fewer, larger slots for it (carve_slots), never into fewer
 * than GANG_MIN_SLOTS. On the H200's virtio disk 16 MiB O_DIRECT reads in 2 MiB pieces ran
 * 1.12x 1 MiB ones with the same bytes in flight (docs/benchmarks.md). */
#define GANG_BYTES (2ULL << 20)
#define GANG_MIN_SLOTS 32
/* a host load waits for 1/REAP_SHARE of the reads in flight at a time */
#define REAP_SHARE 8
#define MAX_COPY_BATCH 512
/* a read in place into registered memory goes in pieces of at most this */
#define IN_PLACE_MAX (64ULL << 20)
/* Reads in place of at most this go through the ring's table of registered memory (no
 * pinning per read); larger ones as plain reads. Into 4 KiB-page memory on a virtio disk,
 * 16 MiB reads ran 4-5% slower from the table than as plain reads, and 256 KiB-1 MiB ones
 * 1-2% slower; 4-64 KiB ones were as fast or faster (docs/benchmarks.md). */
#define FIXED_IN_PLACE_MAX (128ULL << 10)
/* the kernel takes registered buffers of at most 1 GiB each */
#define FIXED_MAX (1ULL << 30)
/* entries of the ring's buffer table for the caller's memory (sio_register_mem), each a
 * range of at most FIXED_MAX bytes */
#define MEM_ENTRIES 32

/* ------------------------------------------------------------------ CUDA driver */

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void *CUstream;
typedef void *CUevent;
struct cu_location { int type; int id; };
struct cu_copy_attrs {
    int src_access_order;            /* CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1 */
    struct cu_location src_hint, dst_hint;
    unsigned int flags;
};

static struct {
    int state;  /* -1 not opened, 0 opened, 1 failed */
    CUresult (*h2d)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*d2h)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*ev_create)(CUevent *, unsigned int);
    CUresult (*ev_destroy)(CUevent);
    CUresult (*ev_record)(CUevent, CUstream);
    CUresult (*ev_query)(CUevent);
    CUresult (*ev_sync)(CUevent);
    CUresult (*stream_sync)(CUstream);
    CUresult (*get_error_name)(CUresult, const char **);
    CUresult (*ctx_get)(void **);
    CUresult (*ctx_set)(void *);
    /* CUDA 13: no failIdx; CUDA 12.8: failIdx before the stream */
    CUresult (*batch13)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, struct cu_copy_attrs *,
                        size_t *, size_t, CUstream);
    CUresult (*batch128)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, struct cu_copy_attrs *,
                         size_t *, size_t, size_t *, CUstream);
} cu = { .state = -1 };

#define CUDA_ERROR_NOT_READY 600

static void say(char *err, int errlen, const char *fmt, ...)
{
    va_list ap;

    if (!err || errlen <= 0)
        return;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static const char *cu_name(CUresult r)
{
    const char *s = NULL;

    if (cu.get_error_name && cu.get_error_name(r, &s) == 0 && s)
        return s;
    return "CUDA error";
}

static int cu_open(char *err, int errlen)
{
    void *h;

    if (cu.state == 0)
        return 0;
    if (cu.state == 1) {
        say(err, errlen, "the CUDA driver (libcuda.so.1) could not be opened");
        return -1;
    }
    h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!h) {
        cu.state = 1;
        say(err, errlen, "dlopen libcuda.so.1: %s", dlerror());
        return -1;
    }
#define SYM(field, name) (*(void **)&cu.field = dlsym(h, name))
    SYM(h2d, "cuMemcpyHtoDAsync_v2");
    SYM(d2h, "cuMemcpyDtoHAsync_v2");
    SYM(ev_create, "cuEventCreate");
    SYM(ev_destroy, "cuEventDestroy_v2");
    SYM(ev_record, "cuEventRecord");
    SYM(ev_query, "cuEventQuery");
    SYM(ev_sync, "cuEventSynchronize");
    SYM(stream_sync, "cuStreamSynchronize");
    SYM(get_error_name, "cuGetErrorName");
    SYM(ctx_get, "cuCtxGetCurrent");
    SYM(ctx_set, "cuCtxSetCurrent");
    if (!SYM(batch13, "cuMemcpyBatchAsync_v2"))
        SYM(batch128, "cuMemcpyBatchAsync");
#undef SYM
    if (!cu.h2d || !cu.d2h || !cu.ev_create || !cu.ev_destroy || !cu.ev_record ||
        !cu.ev_query || !cu.ev_sync || !cu.stream_sync || !cu.ctx_get || !cu.ctx_set) {
        cu.state = 1;
        say(err, errlen, "libcuda.so.1 lacks the copy and event calls p2phub needs");
        return -1;
    }
    if (getenv("P2PHUB_NO_BATCH_COPY"))
        cu.batch13 = NULL, cu.batch128 = NULL;
    cu.state = 0;
    return 0;
}

int sio_cuda_batch_api(void)
{
    if (cu.state != 0)
        return -1;
    return cu.batch13 || cu.batch128;
}

/* ------------------------------------------------------------------ io_uring */

struct ring {
    int fd;
    unsigned entries;
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_sqe *sqes;
    struct io_uring_cqe *cqes;
    void *sq_map, *cq_map;
    size_t sq_len, cq_len, sqe_len;
    unsigned pending;  /* SQEs written, not yet handed to the kernel */
    int single;        /* only the creating thread may use it (SINGLE_ISSUER) */
    pid_t owner;       /* that thread */
};

static int ring_setup(struct ring *r, unsigned entries, int single, char *err, int errlen)
{
    /* single (one thread submits and reaps): completions wait until that thread asks for
     * them, and a wait for k completions wakes it once, not once per completion
     * (DEFER_TASKRUN, 6.1+); else they are posted when the thread next enters the kernel
     * rather than by interrupting it (COOP_TASKRUN, 5.19+). Older kernels refuse the flags:
     * each is dropped in turn. */
    static const unsigned flags[] = {
        IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN, IORING_SETUP_COOP_TASKRUN, 0,
    };
    struct io_uring_params p;
    void *sq, *cq;
    unsigned k;

    memset(r, 0, sizeof(*r));
    r->fd = -1;
    for (k = single ? 0 : 1; k < sizeof(flags) / sizeof(flags[0]) && r->fd < 0; k++) {
        memset(&p, 0, sizeof(p));
        p.flags = IORING_SETUP_CQSIZE | flags[k];
        p.cq_entries = entries * 2;
        r->fd = (int)syscall(__NR_io_uring_setup, entries, &p);
        if (r->fd < 0 && errno != EINVAL)
            break;
        r->single = r->fd >= 0 && k == 0;
    }
    if (r->fd < 0) {
        int e = errno;
        say(err, errlen, "io_uring_setup(%u): %s", entries, strerror(e));
        return -e;
    }
    r->entries = p.sq_entries;
    r->sq_len = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    r->cq_len = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        if (r->cq_len > r->sq_len)
            r->sq_len = r->cq_len;
        r->cq_len = r->sq_len;
    }
    sq = mmap(NULL, r->sq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
              IORING_OFF_SQ_RING);
    if (sq == MAP_FAILED)
        goto fail;
    r->sq_map = sq;
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
        cq = sq;
    } else {
        cq = mmap(NULL, r->cq_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                  IORING_OFF_CQ_RING);
        if (cq == MAP_FAILED)
            goto fail;
    }
    r->cq_map = cq;
    r->sqe_len = p.sq_entries * sizeof(struct io_uring_sqe);
    r->sqes = mmap(NULL, r->sqe_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, r->fd,
                   IORING_OFF_SQES);
    if (r->sqes == MAP_FAILED) {
        r->sqes = NULL;
        goto fail;
    }
    r->sq_head = (unsigned *)((char *)sq + p.sq_off.head);
    r->sq_tail = (unsigned *)((char *)sq + p.sq_off.tail);
    r->sq_mask = (unsigned *)((char *)sq + p.sq_off.ring_mask);
    r->sq_array = (unsigned *)((char *)sq + p.sq_off.array);
    r->cq_head = (unsigned *)((char *)cq + p.cq_off.head);
    r->cq_tail = (unsigned *)((char *)cq + p.cq_off.tail);
    r->cq_mask = (unsigned *)((char *)cq + p.cq_off.ring_mask);
    r->cqes = (struct io_uring_cqe *)((char *)cq + p.cq_off.cqes);
    r->owner = (pid_t)syscall(__NR_gettid);
    return 0;
fail:
    {
        int e = errno;
        say(err, errlen, "io_uring mmap: %s", strerror(e));
        if (r->sqes)
            munmap(r->sqes, r->sqe_len);
        if (r->cq_map && r->cq_map != r->sq_map)
            munmap(r->cq_map, r->cq_len);
        if (r->sq_map)
            munmap(r->sq_map, r->sq_len);
        close(r->fd);
        return -e;
    }
}

static void ring_close(struct ring *r)
{
    if (r->fd < 0)
        return;
    munmap(r->sqes, r->sqe_len);
    if (r->cq_map != r->sq_map)
        munmap(r->cq_map, r->cq_len);
    munmap(r->sq_map, r->sq_len);
    close(r->fd);
}

static void ring_push(struct ring *r, int op, int fd, void *addr, unsigned len,
                      unsigned long long off, unsigned long long data, int buf_index)
{
    unsigned tail = *r->sq_tail;
    unsigned idx = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = &r->sqes[idx];

    memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = (unsigned char)op;
    sqe->fd = fd;
    sqe->addr = (unsigned long long)(uintptr_t)addr;
    sqe->len = len;
    sqe->off = off;
    sqe->user_data = data;
    if (buf_index >= 0)
        sqe->buf_index = (unsigned short)buf_index;
    r->sq_array[idx] = idx;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    r->pending++;
}

/* Hand pending SQEs to the kernel and wait for at least `wait` completions. */
static int ring_enter(struct ring *r, unsigned wait)
{
    for (;;) {
        long ret = syscall(__NR_io_uring_enter, r->fd, r->pending, wait,
                           IORING_ENTER_GETEVENTS, NULL, 0);
        if (ret >= 0) {
            r->pending -= (unsigned)ret < r->pending ? (unsigned)ret : r->pending;
            return 0;
        }
        if (errno != EINTR)
            return -errno;
    }
}

static int ring_peek(struct ring *r, unsigned long long *data, int *res)
{
    unsigned head = *r->cq_head;
    struct io_uring_cqe *c;

    if (head == __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE))
        return 0;
    c = &r->cqes[head & *r->cq_mask];
    *data = c->user_data;
    *res = c->res;
    __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
    return 1;
}

/* ------------------------------------------------------------------ Linux AIO
 *
 * Where io_uring is blocked (io_uring_setup refused: containers under Docker's default seccomp
 * profile, kernel.io_uring_disabled), the engine submits through Linux AIO instead: the same
 * O_DIRECT reads and writes, without registered buffers. One iocb per slot (a slot has at most
 * one I/O in flight); reaped events wait in `ev` until taken. */

struct aio_q {
    aio_context_t ctx;
    struct iocb *cbs;           /* one per slot */
    struct iocb **pend;         /* built, not yet submitted */
    unsigned npend;
    struct io_event *ev;        /* reaped, not yet taken */
    unsigned nev, evpos, cap;
};

static int aio_q_setup(struct aio_q *a, unsigned depth, unsigned nslots, char *err, int errlen)
{
    memset(a, 0, sizeof(*a));
    a->cap = depth;
    a->cbs = calloc(nslots, sizeof(*a->cbs));
    a->pend = calloc(nslots, sizeof(*a->pend));
    a->ev = calloc(depth, sizeof(*a->ev));
    if (!a->cbs || !a->pend || !a->ev) {
        free(a->cbs), free(a->pend), free(a->ev);
        say(err, errlen, "out of memory");
        return -ENOMEM;
    }
    if (syscall(__NR_io_setup, depth, &a->ctx) < 0) {
        int e = errno;
        say(err, errlen, "io_setup(%u): %s", depth, strerror(e));
        free(a->cbs), free(a->pend), free(a->ev);
        return -e;
    }
    return 0;
}

static void aio_q_close(struct aio_q *a)
{
    syscall(__NR_io_destroy, a->ctx);
    free(a->cbs), free(a->pend), free(a->ev);
}

static void aio_q_push(struct aio_q *a, int write, int fd, void *addr, unsigned len,
                       unsigned long long off, unsigned slot)
{
    struct iocb *cb = &a->cbs[slot];

    memset(cb, 0, sizeof(*cb));
    cb->aio_lio_opcode = write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    cb->aio_fildes = (unsigned)fd;
    cb->aio_buf = (unsigned long long)(uintptr_t)addr;
    cb->aio_nbytes = len;
    cb->aio_offset = (long long)off;
    cb->aio_data = slot;
    a->pend[a->npend++] = cb;
}

/* Submit what is pending; with `wait`, reap at least one completion (every one ready). An
 * iocb the kernel refuses completes at once with its error, as io_uring's would. */
static int aio_q_enter(struct aio_q *a, unsigned wait)
{
    unsigned done = 0;

    while (done < a->npend) {
        long ret = syscall(__NR_io_submit, a->ctx, (long)(a->npend - done), a->pend + done);

        if (ret > 0) {
            done += (unsigned)ret;
            continue;
        }
        if (ret < 0 && errno == EINTR)
            continue;
        if (ret < 0 && errno == EAGAIN)
            break;          /* the context is full: submit the rest after reaping */
        if (a->nev - a->evpos == 0)
            a->nev = a->evpos = 0;
        if (a->nev >= a->cap)
            break;
        a->ev[a->nev].data = a->pend[done]->aio_data;
        a->ev[a->nev].res = ret < 0 ? -errno : -EIO;
        a->nev++;
        done++;
    }
    memmove(a->pend, a->pend + done, (a->npend - done) * sizeof(*a->pend));
    a->npend -= done;
    if (!wait || a->nev > a->evpos)
        return 0;
    for (;;) {
        long ret = syscall(__NR_io_getevents, a->ctx, (long)wait, (long)a->cap, a->ev, NULL);

        if (ret >= 0) {
            a->nev = (unsigned)ret;
            a->evpos = 0;
            return 0;
        }
        if (errno != EINTR)
            return -errno;
    }
}

static int aio_q_peek(struct aio_q *a, unsigned long long *data, int *res)
{
    if (a->evpos >= a->nev)
        return 0;
    *data = a->ev[a->evpos].data;
    *res = (int)a->ev[a->evpos].res;
    a->evpos++;
    return 1;
}

/* 1 when io_uring must not be used: P2PHUB_IO_URING=0 (as where it is blocked). */
static int uring_refused(void)
{
    const char *v = getenv("P2PHUB_IO_URING");

    return v && (!strcmp(v, "0") || !strcmp(v, "off") || !strcmp(v, "no"));
}

/* Why io_uring_setup failed, with kernel.io_uring_disabled where it is set. */
static void uring_reason(char *buf, int len, int e)
{
    char v[8] = "";
    FILE *f = fopen("/proc/sys/kernel/io_uring_disabled", "r");

    if (f) {
        if (!fgets(v, sizeof(v), f))
            v[0] = 0;
        fclose(f);
        v[strcspn(v, "\n")] = 0;
    }
    if (v[0] && strcmp(v, "0"))
        snprintf(buf, len, "io_uring_setup: %s (kernel.io_uring_disabled=%s)", strerror(e), v);
    else
        snprintf(buf, len, "io_uring_setup: %s", strerror(e));
}

/* ------------------------------------------------------------------ the engine */

struct slot {
    unsigned long long entry;   /* the entry this slot serves */
    unsigned long long pos;     /* file offset of the I/O (aligned for O_DIRECT) */
    unsigned long long done;    /* bytes of the I/O done so far */
    unsigned long long need;    /* bytes the I/O must reach (read: skip + useful) */
    unsigned long long io_len;  /* bytes of the I/O (aligned up for O_DIRECT) */
    unsigned long long skip;    /* bytes at the slot's start before the useful ones */
    unsigned long long useful;  /* useful bytes */
    unsigned long long mem;     /* memory address of the useful bytes */
    unsigned long long seq;     /* the copy round whose event frees the slot */
    int to_mem;                 /* a read straight into host memory: no staging, no copy */
    unsigned long long flying;  /* bytes of the read in flight counted in inflight_bytes */
    int bounded;                /* an O_DIRECT read through the slot: counted there */
};

/* A range of the caller's memory in the ring's buffer table. The table changes only on the
 * thread that drives the ring (a ring of one thread refuses io_uring_register from any other),
 * at the start of a batch: a range asked for is installed then, one given up is removed then
 * (or at once where the caller is that thread). Lookups see only MEM_LIVE ranges, so a range
 * given up is never read into again, even before the kernel let go of its pages.
 *
 * mem_lock guards e->mem and the ring's setup against sio_register_mem/sio_unregister_mem on
 * other threads (the caller's, while the engine thread runs a batch); the engine thread's
 * lookups read a range's state without it (atomic loads). */
enum { MEM_FREE, MEM_WANTED, MEM_LIVE, MEM_DEAD, MEM_REFUSED };

struct mem_range {
    unsigned long long addr, len;
    int state;
};

static void mem_state(struct mem_range *m, int state)
{
    __atomic_store_n(&m->state, state, __ATOMIC_RELEASE);
}

struct sio_engine {
    struct ring ring;
    struct aio_q aio;
    int use_aio;                /* 1: Linux AIO submits (io_uring blocked) */
    char path_reason[160];      /* why this submission path */
    unsigned long long split;   /* reads of 2 x split bytes and up go in pieces of split */
    unsigned long long split_entries;   /* this batch: entries cut into split pieces */
    unsigned long long inflight_max;    /* bytes of O_DIRECT reads through slots in flight at
                                           most (0: only `depth` bounds them) */
    unsigned long long inflight_bytes;  /* bytes of such reads in flight now */
    unsigned options;           /* SIO_OPT_* */
    int fixed;                  /* the staging memory is registered with the ring */
    int no_in_place;            /* this batch: a read in place faulted, stage the rest */
    unsigned fixed_slots;       /* slots per registered buffer (each at most FIXED_MAX) */
    int table;                  /* the ring has a sparse buffer table: the staging buffers
                                   first (nstage of them), then MEM_ENTRIES for memory */
    unsigned nstage;
    struct mem_range mem[MEM_ENTRIES];
    unsigned mem_hint;          /* the entry the last lookup found */
    int mem_errno;              /* why the kernel last refused a range (0: never) */
    pthread_mutex_t mem_lock;
    unsigned depth;
    /* the staging memory: base_nslots slots of base_slot_bytes as opened, carved for the run
     * in progress into nslots slots of slot_bytes, gang base slots each (carve_slots); the
     * per-slot arrays are base_nslots long */
    unsigned long long base_slot_bytes, slot_bytes;
    unsigned base_nslots, nslots, gang;
    char *stage;
    CUstream stream;
    void *ctx;                  /* the CUDA context current when it was opened */
    /* more entries for the batch being run, asked when its entries are all started: returns
     * the new entry count (the arrays are the caller's, long enough); NULL: none */
    unsigned long long (*feed)(void *arg, unsigned long long n);
    void *feed_arg;
    CUevent events[NEVENTS];
    int nevents;
    struct slot *slots;
    unsigned *free_list;
    unsigned nfree;
    unsigned *held;             /* slots waiting for a copy round's event, FIFO */
    unsigned held_head, held_count;
    unsigned long long next_seq, done_seq;  /* copy rounds recorded / known complete */
    /* one copy round being built */
    CUdeviceptr *c_dst, *c_src;
    size_t *c_size;
    unsigned *c_slots;
    unsigned c_n, c_nslots;
};

static unsigned ring_ready(struct ring *r)
{
    return __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE) - *r->cq_head;
}

/* The engine's submission queue: io_uring, or Linux AIO where io_uring is blocked. With
 * SIO_OPT_POLL a wait polls for completions instead of sleeping (no wake-up to wait for on a
 * host whose CPUs are all busy; costs this thread's CPU while the disk works). */
static int q_enter(struct sio_engine *e, unsigned wait)
{
    if (!wait || !(e->options & SIO_OPT_POLL))
        return e->use_aio ? aio_q_enter(&e->aio, wait) : ring_enter(&e->ring, wait);
    if (e->use_aio) {
        struct timespec zero = { 0, 0 };
        int r = aio_q_enter(&e->aio, 0);

        if (r || e->aio.nev > e->aio.evpos)
            return r;
        for (;;) {
            long ret = syscall(__NR_io_getevents, e->aio.ctx, 0L, (long)e->aio.cap, e->aio.ev,
                               &zero);
            if (ret > 0) {
                e->aio.nev = (unsigned)ret;
                e->aio.evpos = 0;
                return 0;
            }
            if (ret < 0 && errno != EINTR)
                return -errno;
        }
    }
    for (;;) {
        /* hand over what is pending and run the completions' task work, never sleeping */
        long ret = syscall(__NR_io_uring_enter, e->ring.fd, e->ring.pending, 0,
                           IORING_ENTER_GETEVENTS, NULL, 0);
        if (ret < 0 && errno != EINTR)
            return -errno;
        if (ret > 0)
            e->ring.pending -= (unsigned)ret < e->ring.pending ? (unsigned)ret : e->ring.pending;
        if (ring_ready(&e->ring))
            return 0;
    }
}

/* The next completion: *data its slot, whose read bytes leave the in-flight count. */
static int q_peek(struct sio_engine *e, unsigned long long *data, int *res)
{
    int got = e->use_aio ? aio_q_peek(&e->aio, data, res) : ring_peek(&e->ring, data, res);

    if (got) {
        struct slot *p = &e->slots[*data];

        e->inflight_bytes -= p->flying;
        p->flying = 0;
    }
    return got;
}

/* Room for another read through a slot under the engine's byte bound. */
static int fly_room(const struct sio_engine *e)
{
    return !e->inflight_max || e->inflight_bytes < e->inflight_max;
}

static const char *q_call(struct sio_engine *e)
{
    return e->use_aio ? "io_submit/io_getevents" : "io_uring_enter";
}

static unsigned q_pending(struct sio_engine *e)
{
    return e->use_aio ? e->aio.npend : e->ring.pending;
}

/* Replace `n` entries of the ring's buffer table from `first` (an iov_base of NULL empties
 * one). 0, or -errno. */
static int table_update(struct sio_engine *e, unsigned first, struct iovec *iov, unsigned n)
{
#ifdef IORING_RSRC_REGISTER_SPARSE
    struct io_uring_rsrc_update2 up;

    memset(&up, 0, sizeof(up));
    up.offset = first;
    up.data = (unsigned long long)(uintptr_t)iov;
    up.nr = n;
    if (syscall(__NR_io_uring_register, e->ring.fd, IORING_REGISTER_BUFFERS_UPDATE, &up,
                sizeof(up)) < 0)
        return -errno;
    return 0;
#else
    (void)e, (void)first, (void)iov, (void)n;
    return -EOPNOTSUPP;
#endif
}

/* A sparse buffer table of `n` entries (5.19+). 0, or -errno. */
static int table_setup(struct sio_engine *e, unsigned n)
{
#ifdef IORING_RSRC_REGISTER_SPARSE
    struct io_uring_rsrc_register rr;

    memset(&rr, 0, sizeof(rr));
    rr.nr = n;
    rr.flags = IORING_RSRC_REGISTER_SPARSE;
    if (syscall(__NR_io_uring_register, e->ring.fd, IORING_REGISTER_BUFFERS2, &rr,
                sizeof(rr)) < 0)
        return -errno;
    return 0;
#else
    (void)e, (void)n;
    return -EOPNOTSUPP;
#endif
}

/* Register the staging memory with the ring as fixed buffers (no page pinning per I/O):
 * one buffer per FIXED_MAX bytes of whole slots, in a sparse table with room for the caller's
 * memory (sio_register_mem) after them. Where the kernel has no sparse tables, the staging
 * buffers alone; where it refuses (memlock limit, memory it cannot pin for long), the engine
 * reads into the slots as plain memory. A new ring (sio_run on another thread) installs the
 * caller's ranges again at its first batch. */
static void register_stage(struct sio_engine *e)
{
    unsigned per = (unsigned)(FIXED_MAX / e->base_slot_bytes), n = 0, i;
    struct iovec *iov = NULL;

    e->table = 0;
    e->nstage = 0;
    for (i = 0; i < MEM_ENTRIES; i++) {
        if (e->mem[i].state == MEM_LIVE || e->mem[i].state == MEM_REFUSED)
            mem_state(&e->mem[i], MEM_WANTED);
        else if (e->mem[i].state == MEM_DEAD)
            mem_state(&e->mem[i], MEM_FREE);
    }
    if (e->options & SIO_OPT_NO_FIXED)
        return;     /* nothing registered: the caller's memory neither */
    if (per) {
        n = (e->base_nslots + per - 1) / per;
        iov = calloc(n, sizeof(*iov));
        if (!iov)
            return;
        for (i = 0; i < n; i++) {
            unsigned first = i * per;
            unsigned cnt = e->base_nslots - first < per ? e->base_nslots - first : per;
            iov[i].iov_base = e->stage + (unsigned long long)first * e->base_slot_bytes;
            iov[i].iov_len = (size_t)(cnt * e->base_slot_bytes);
        }
    }
    if (table_setup(e, n + MEM_ENTRIES) == 0) {
        e->table = 1;
        e->nstage = n;
        if (n && table_update(e, 0, iov, n) == 0) {
            e->fixed = 1;
            e->fixed_slots = per / e->gang;
        }
    } else if (n &&
               syscall(__NR_io_uring_register, e->ring.fd, IORING_REGISTER_BUFFERS, iov, n) == 0) {
        e->fixed = 1;
        e->fixed_slots = per / e->gang;
    }
    free(iov);
}

/* Bring the ring's table in line with e->mem: remove the ranges given up, install the ranges
 * asked for (a range the kernel refuses, such as memory it cannot pin for long, is read into
 * as plain memory). Only on the thread that drives the ring, mem_lock held. */
static void mem_sync(struct sio_engine *e)
{
    unsigned i;

    if (!e->table)
        return;
    for (i = 0; i < MEM_ENTRIES; i++) {
        struct mem_range *m = &e->mem[i];
        struct iovec iov = { NULL, 0 };
        int r;

        if (m->state == MEM_DEAD) {
            table_update(e, e->nstage + i, &iov, 1);
            mem_state(m, MEM_FREE);
        } else if (m->state == MEM_WANTED) {
            iov.iov_base = (void *)(uintptr_t)m->addr;
            iov.iov_len = (size_t)m->len;
            r = table_update(e, e->nstage + i, &iov, 1);
            mem_state(m, r ? MEM_REFUSED : MEM_LIVE);
            if (r)
                e->mem_errno = -r;
        }
    }
}

/* The table entry of a live range that holds [addr, addr + len), or -1. */
static int mem_lookup(struct sio_engine *e, unsigned long long addr, unsigned long long len)
{
    unsigned k;

    for (k = 0; k < MEM_ENTRIES; k++) {
        unsigned i = (e->mem_hint + k) % MEM_ENTRIES;
        struct mem_range *m = &e->mem[i];

        if (__atomic_load_n(&m->state, __ATOMIC_ACQUIRE) == MEM_LIVE && addr >= m->addr &&
            addr + len <= m->addr + m->len) {
            e->mem_hint = i;
            return (int)(e->nstage + i);
        }
    }
    return -1;
}

static int ring_owner(struct sio_engine *e)
{
    return !e->ring.single || e->ring.owner == (pid_t)syscall(__NR_gettid);
}

/* sio_register_mem's work, mem_lock held. */
static int register_mem(struct sio_engine *e, unsigned long long a, unsigned long long len)
{
    unsigned long long pos;
    unsigned i, need = 0, have = 0;

    if (!len || a + len < a)
        return -EINVAL;
    if (e->use_aio || !e->table)
        return -EOPNOTSUPP;
    for (pos = a; pos < a + len; pos += FIXED_MAX)
        need++;
    for (i = 0; i < MEM_ENTRIES; i++)
        have += e->mem[i].state == MEM_FREE;
    /* already asked for: how it stands */
    for (i = 0; i < MEM_ENTRIES; i++) {
        struct mem_range *m = &e->mem[i];

        if (m->addr != a)
            continue;
        if (m->state == MEM_LIVE)
            return 0;
        if (m->state == MEM_WANTED)
            return (int)need;
        if (m->state == MEM_REFUSED)
            return -e->mem_errno;
    }
    if (need > have)
        return -ENOSPC;
    for (pos = a, i = 0; pos < a + len; i++) {
        struct mem_range *m = &e->mem[i];

        if (m->state != MEM_FREE)
            continue;
        m->addr = pos;
        m->len = a + len - pos < FIXED_MAX ? a + len - pos : FIXED_MAX;
        mem_state(m, MEM_WANTED);
        pos += m->len;
    }
    if (!ring_owner(e))
        return (int)need;
    mem_sync(e);
    for (i = 0; i < MEM_ENTRIES; i++) {
        struct mem_range *m = &e->mem[i];

        if (m->state == MEM_REFUSED && m->addr >= a && m->addr + m->len <= a + len)
            return -e->mem_errno;
    }
    return 0;
}

int sio_register_mem(struct sio_engine *e, void *addr, unsigned long long len)
{
    int rc;

    pthread_mutex_lock(&e->mem_lock);
    rc = register_mem(e, (unsigned long long)(uintptr_t)addr, len);
    pthread_mutex_unlock(&e->mem_lock);
    return rc;
}

int sio_unregister_mem(struct sio_engine *e, void *addr, unsigned long long len)
{
    unsigned long long a = (unsigned long long)(uintptr_t)addr;
    unsigned i;
    int n = 0;

    pthread_mutex_lock(&e->mem_lock);
    for (i = 0; i < MEM_ENTRIES; i++) {
        struct mem_range *m = &e->mem[i];

        if (m->state == MEM_FREE || m->addr < a || m->addr + m->len > a + len)
            continue;
        mem_state(m, m->state == MEM_LIVE ? MEM_DEAD : MEM_FREE);
        n++;
    }
    if (n && !e->use_aio && ring_owner(e))
        mem_sync(e);
    pthread_mutex_unlock(&e->mem_lock);
    return n;
}

int sio_mem_table(struct sio_engine *e, unsigned *live, unsigned *pending, int *refused_errno)
{
    unsigned i;

    int table;

    pthread_mutex_lock(&e->mem_lock);
    *live = *pending = 0;
    for (i = 0; i < MEM_ENTRIES; i++) {
        *live += e->mem[i].state == MEM_LIVE || e->mem[i].state == MEM_DEAD;
        *pending += e->mem[i].state == MEM_WANTED || e->mem[i].state == MEM_DEAD;
    }
    *refused_errno = e->mem_errno;
    table = e->table && !e->use_aio;
    pthread_mutex_unlock(&e->mem_lock);
    return table;
}

struct sio_engine *sio_open(unsigned depth, unsigned long long slot_bytes, unsigned nslots,
                            void *stage, unsigned long long stream, unsigned options,
                            char *err, int errlen)
{
    struct sio_engine *e;
    unsigned i;

    if (depth == 0 || depth > 4096 || nslots < 1 || slot_bytes == 0 ||
        slot_bytes % SIO_ALIGN || ((uintptr_t)stage % SIO_ALIGN)) {
        say(err, errlen, "bad engine settings: depth %u, %u slots of %llu bytes at %p", depth,
            nslots, slot_bytes, stage);
        return NULL;
    }
    e = calloc(1, sizeof(*e));
    if (!e) {
        say(err, errlen, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&e->mem_lock, NULL);
    e->options = options;
    e->depth = depth;
    e->slot_bytes = e->base_slot_bytes = slot_bytes;
    e->nslots = e->base_nslots = nslots;
    e->gang = 1;
    e->stage = stage;
    e->stream = (CUstream)(uintptr_t)stream;
    e->slots = calloc(nslots, sizeof(*e->slots));
    e->free_list = calloc(nslots, sizeof(unsigned));
    e->held = calloc(nslots, sizeof(unsigned));
    e->c_dst = calloc(nslots, sizeof(CUdeviceptr));
    e->c_src = calloc(nslots, sizeof(CUdeviceptr));
    e->c_size = calloc(nslots, sizeof(size_t));
    e->c_slots = calloc(nslots, sizeof(unsigned));
    if (!e->slots || !e->free_list || !e->held || !e->c_dst || !e->c_src || !e->c_size ||
        !e->c_slots) {
        say(err, errlen, "out of memory");
        goto fail;
    }
    for (i = 0; i < nslots; i++)
        e->free_list[i] = nslots - 1 - i;
    e->nfree = nslots;
    if (stream) {
        if (cu_open(err, errlen))
            goto fail;
        if (cu.ctx_get(&e->ctx) || !e->ctx) {
            say(err, errlen, "no CUDA context is current");
            goto fail;
        }
        for (i = 0; i < NEVENTS; i++) {
            CUresult r = cu.ev_create(&e->events[i], 2 /* CU_EVENT_DISABLE_TIMING */);
            if (r) {
                say(err, errlen, "cuEventCreate: %s", cu_name(r));
                goto fail;
            }
            e->nevents++;
        }
    }
    e->split = SIO_SPLIT_DEFAULT;
    e->inflight_max = SIO_INFLIGHT_DEFAULT;
    if (uring_refused()) {
        snprintf(e->path_reason, sizeof(e->path_reason),
                 "io_uring not used: P2PHUB_IO_URING is off");
        e->use_aio = 1;
    } else {
        /* one thread drives the ring unless CUDA loads read on a second one */
        int single = !(options & SIO_OPT_POLL) && ((options & SIO_OPT_NO_IO_THREAD) || !stream);
        int rc = ring_setup(&e->ring, depth, single, NULL, 0);

        if (rc) {
            uring_reason(e->path_reason, sizeof(e->path_reason), -rc);
            e->use_aio = 1;
        }
    }
    if (e->use_aio) {
        if (aio_q_setup(&e->aio, depth, nslots, err, errlen))
            goto fail;
    } else {
        register_stage(e);
        snprintf(e->path_reason, sizeof(e->path_reason), "io_uring_setup succeeded%s%s",
                 e->fixed ? ", staging registered" : ", staging not registered",
                 (options & SIO_OPT_NO_FIXED) ? " (fixed buffers off)"
                 : e->table ? ", memory registrable (sparse buffer table)"
                 : ", memory not registrable (no sparse buffer table)");
    }
    return e;
fail:
    for (i = 0; i < (unsigned)e->nevents; i++)
        cu.ev_destroy(e->events[i]);
    free(e->slots), free(e->free_list), free(e->held);
    free(e->c_dst), free(e->c_src), free(e->c_size), free(e->c_slots);
    pthread_mutex_destroy(&e->mem_lock);
    free(e);
    return NULL;
}

void sio_close(struct sio_engine *e)
{
    int i;

    if (!e)
        return;
    if (e->stream)
        cu.stream_sync(e->stream);
    for (i = 0; i < e->nevents; i++)
        cu.ev_destroy(e->events[i]);
    if (e->use_aio)
        aio_q_close(&e->aio);
    else
        ring_close(&e->ring);
    free(e->slots), free(e->free_list), free(e->held);
    free(e->c_dst), free(e->c_src), free(e->c_size), free(e->c_slots);
    pthread_mutex_destroy(&e->mem_lock);
    free(e);
}

static char *slot_buf(struct sio_engine *e, unsigned s)
{
    return e->stage + (unsigned long long)s * e->slot_bytes;
}

/* Issue the copy round being built (CUDA only): one batched call, or one call per run. */
static int flush_copies(struct sio_engine *e, int write, struct sio_stats *st, char *err,
                        int errlen)
{
    CUresult r = 0;
    unsigned i, ev;

    if (!e->c_nslots)
        return 0;
    if (e->next_seq - e->done_seq >= (unsigned long long)e->nevents) {
        /* every event is in use: the oldest round must finish first */
        r = cu.ev_sync(e->events[e->done_seq % e->nevents]);
        if (r) {
            say(err, errlen, "cuEventSynchronize: %s", cu_name(r));
            return -1;
        }
        e->done_seq++;
    }
    if (cu.batch13 || cu.batch128) {
        struct cu_copy_attrs a;
        size_t zero = 0, fail = 0;

        memset(&a, 0, sizeof(a));
        a.src_access_order = 1;
        for (i = 0; i < e->c_n && !r; i += MAX_COPY_BATCH) {
            size_t k = e->c_n - i < MAX_COPY_BATCH ? e->c_n - i : MAX_COPY_BATCH;
            if (cu.batch13)
                r = cu.batch13(e->c_dst + i, e->c_src + i, e->c_size + i, k, &a, &zero, 1,
                               e->stream);
            else
                r = cu.batch128(e->c_dst + i, e->c_src + i, e->c_size + i, k, &a, &zero, 1,
                                &fail, e->stream);
            st->copy_calls++;
        }
        st->batch_api = 1;
        if (r) {
            say(err, errlen, "cuMemcpyBatchAsync of %u copies: %s", e->c_n, cu_name(r));
            return -1;
        }
    } else {
        for (i = 0; i < e->c_n; i++) {
            if (write)
                r = cu.d2h((void *)(uintptr_t)e->c_dst[i], e->c_src[i], e->c_size[i], e->stream);
            else
                r = cu.h2d(e->c_dst[i], (const void *)(uintptr_t)e->c_src[i], e->c_size[i],
                           e->stream);
            st->copy_calls++;
            if (r) {
                say(err, errlen, "cuMemcpy%sAsync(%zu bytes): %s", write ? "DtoH" : "HtoD",
                    e->c_size[i], cu_name(r));
                return -1;
            }
        }
    }
    st->copies += e->c_n;
    ev = (unsigned)(e->next_seq % e->nevents);
    r = cu.ev_record(e->events[ev], e->stream);
    if (r) {
        say(err, errlen, "cuEventRecord: %s", cu_name(r));
        return -1;
    }
    for (i = 0; i < e->c_nslots; i++) {
        unsigned s = e->c_slots[i];
        e->slots[s].seq = e->next_seq;
        e->held[(e->held_head + e->held_count) % e->nslots] = s;
        e->held_count++;
    }
    e->next_seq++;
    e->c_n = 0;
    e->c_nslots = 0;
    return 0;
}

/* Add one copy to the round, merged into the previous one when both sides continue it. */
static void add_copy(struct sio_engine *e, unsigned s, CUdeviceptr dst, CUdeviceptr src,
                     size_t n, struct sio_stats *st)
{
    unsigned k = e->c_n;

    if (k && e->c_dst[k - 1] + e->c_size[k - 1] == dst &&
        e->c_src[k - 1] + e->c_size[k - 1] == src) {
        e->c_size[k - 1] += n;
        st->merged++;
    } else {
        e->c_dst[k] = dst;
        e->c_src[k] = src;
        e->c_size[k] = n;
        e->c_n++;
    }
    e->c_slots[e->c_nslots++] = s;
}

/* The slots that wait to be written (write direction): a ring of nslots. */
struct ready {
    unsigned *slot;
    unsigned head, count;
};

/* Held slots of rounds known complete go back to the free list, or (write) to `ready`. */
static int drop_held(struct sio_engine *e, struct ready *ready)
{
    int released = 0;

    while (e->held_count && e->slots[e->held[e->held_head]].seq < e->done_seq) {
        unsigned s = e->held[e->held_head];
        e->held_head = (e->held_head + 1) % e->nslots;
        e->held_count--;
        if (ready)
            ready->slot[(ready->head + ready->count++) % e->nslots] = s;
        else
            e->free_list[e->nfree++] = s;
        released++;
    }
    return released;
}

/* Completed copy rounds release their slots. block: wait for the oldest round when none
 * has completed. Returns slots released, -1 on a CUDA failure. */
static int release_rounds(struct sio_engine *e, int block, struct ready *ready, char *err,
                          int errlen)
{
    int released = drop_held(e, ready);

    while (e->done_seq < e->next_seq) {
        CUevent ev = e->events[e->done_seq % e->nevents];
        CUresult r = block && !released ? cu.ev_sync(ev) : cu.ev_query(ev);
        if (r == CUDA_ERROR_NOT_READY)
            break;
        if (r) {
            say(err, errlen, "waiting for copies: %s", cu_name(r));
            return -1;
        }
        e->done_seq++;
        released += drop_held(e, ready);
    }
    return released;
}

/* The piece cursor: walks the entries, cutting each into slot-sized pieces (split-sized for
 * large O_DIRECT reads through the slots, one piece for a large read in place). */
struct cursor {
    unsigned long long i;      /* entry */
    unsigned long long done;   /* useful bytes of entry i already given out */
};

/* Next piece into slot s; 0 when the entries are exhausted. */
static int next_piece(struct sio_engine *e, struct cursor *c, int write, unsigned long long n,
                      const unsigned long long *off, const unsigned long long *len,
                      const unsigned long long *mem, const unsigned char *flags,
                      const long long *result, struct slot *p)
{
    unsigned long long start, skip, useful, cap;
    int in_place;

    while (c->i < n && (c->done >= len[c->i] || result[c->i] < 0)) {
        c->i++;
        c->done = 0;
    }
    if (c->i >= n)
        return 0;
    start = off[c->i] + c->done;
    skip = (flags[c->i] & SIO_DIRECT) ? start % SIO_ALIGN : 0;
    useful = len[c->i] - c->done;
    cap = e->slot_bytes - skip;
    /* may land in place: an aligned O_DIRECT read into host memory */
    in_place = !write && !e->no_in_place &&
               (flags[c->i] & (SIO_DIRECT | SIO_CUDA)) == SIO_DIRECT &&
               ((mem[c->i] + c->done) | start) % SIO_ALIGN == 0;
    /* O_DIRECT reads through a slot only: a buffered read's pieces each start their own
     * readahead, and a read in place is cut by the block layer as a plain pread is */
    if (!write && !in_place && e->split && (flags[c->i] & SIO_DIRECT) &&
        len[c->i] >= 2 * e->split && e->split - skip < cap) {
        cap = e->split - skip;
        if (!c->done)
            e->split_entries++;
    }
    if (in_place && useful > cap && e->table) {
        /* A read in place into memory the ring holds registered (pinned, so the read cannot
         * fault back to a slot) uses no slot's bytes: one piece for the rest of the entry,
         * which the block layer cuts into requests as large as the disk takes, as it would
         * a plain pread's. Slot-sized pieces are smaller requests (2 MiB where a virtio disk
         * takes 4 MiB), each with its own cost. */
        unsigned long long big = useful < IN_PLACE_MAX ? useful : IN_PLACE_MAX;

        big -= big % SIO_ALIGN;
        if (big > cap && mem_lookup(e, mem[c->i] + c->done, big) >= 0)
            cap = big;
    }
    if (useful > cap)
        useful = cap;
    p->entry = c->i;
    p->pos = start - skip;
    p->skip = skip;
    p->useful = useful;
    p->need = skip + useful;
    p->io_len = p->need;
    if (flags[c->i] & SIO_DIRECT)
        p->io_len = (p->need + SIO_ALIGN - 1) / SIO_ALIGN * SIO_ALIGN;
    p->done = 0;
    p->mem = mem[c->i] + c->done;
    /* an O_DIRECT read into host memory whose address, offset and length are all aligned
     * lands in place, as a plain O_DIRECT read would */
    p->to_mem = in_place && useful % SIO_ALIGN == 0;
    /* a buffered read's pages come through the page cache and its readahead: not bounded */
    p->bounded = !write && (flags[c->i] & SIO_DIRECT);
    c->done += useful;
    return 1;
}

static void submit_io(struct sio_engine *e, int write, const int *fd, unsigned s,
                      struct sio_stats *st)
{
    struct slot *p = &e->slots[s];
    int op = write ? IORING_OP_WRITE : IORING_OP_READ;
    char *addr = p->to_mem ? (char *)(uintptr_t)p->mem + p->done : slot_buf(e, s) + p->done;
    unsigned len = (unsigned)(p->io_len - p->done);

    st->pieces++;
    p->flying = 0;
    if (p->bounded && !p->to_mem) {
        p->flying = len;
        e->inflight_bytes += len;
        if (e->inflight_bytes > st->max_inflight_bytes)
            st->max_inflight_bytes = e->inflight_bytes;
    }
    if (e->use_aio) {
        aio_q_push(&e->aio, write, fd[p->entry], addr, len, p->pos + p->done, s);
        return;
    }
    if (p->to_mem) {
        int idx = e->table && len <= FIXED_IN_PLACE_MAX ?
                  mem_lookup(e, (unsigned long long)(uintptr_t)addr, len) : -1;

        if (idx >= 0) {
            op = write ? IORING_OP_WRITE_FIXED : IORING_OP_READ_FIXED;
            st->fixed_mem++;
        }
        ring_push(&e->ring, op, fd[p->entry], addr, len, p->pos + p->done, s, idx);
        return;
    }
    if (e->fixed)
        op = write ? IORING_OP_WRITE_FIXED : IORING_OP_READ_FIXED;
    ring_push(&e->ring, op, fd[p->entry], addr, len, p->pos + p->done, s,
              e->fixed ? (int)(s / e->fixed_slots) : -1);
}

/* The kernel could not pin the memory of a read in place (a mapping without struct pages,
 * such as some device or dma-buf mappings): send the piece again through its staging slot,
 * and the rest of the batch that way too. 1 when completion `res` of slot s was that. */
static int restage_faulted(struct sio_engine *e, int write, const int *fd, unsigned s, int res,
                           struct sio_stats *st)
{
    struct slot *p = &e->slots[s];

    if (res != -EFAULT || !p->to_mem || p->io_len > e->slot_bytes)
        return 0;       /* (a piece larger than a slot fails: only registered memory has one) */
    p->to_mem = 0;
    p->done = 0;
    e->no_in_place = 1;
    submit_io(e, write, fd, s, st);
    return 1;
}

/* An entry's result is the bytes its pieces moved, or the first error of any of them: pieces
 * complete out of order, so a piece that lands after another failed must leave the error in
 * place (an entry is done only when every byte of every piece moved). */
static void fail_entry(long long *result, unsigned long long i, int res, int *failed)
{
    if (result[i] >= 0) {
        result[i] = res;
        (*failed)++;
    }
}

/* An O_DIRECT write goes out in whole blocks from its slot: one that does not start and end
 * on a block would write the slot's stale bytes around the range. Refused here whatever the
 * caller checked (entries from..n). */
static void refuse_unaligned_writes(unsigned long long from, unsigned long long n,
                                    const unsigned long long *off, const unsigned long long *len,
                                    const unsigned char *flags, long long *result, int *failed)
{
    unsigned long long i;

    for (i = from; i < n; i++)
        if ((flags[i] & SIO_DIRECT) && (off[i] % SIO_ALIGN || len[i] % SIO_ALIGN))
            fail_entry(result, i, -EINVAL, failed);
}

static void credit_entry(long long *result, unsigned long long i, unsigned long long useful)
{
    if (result[i] >= 0)
        result[i] += (long long)useful;
}

/* ------------------------------------------------------------------ CUDA loads, two threads
 *
 * A load into CUDA memory splits the work: a second thread (io_main) keeps the ring full and
 * reaps it, handing each piece that arrived to the calling thread, which batches the
 * host-to-device copies, records a round's event and, once it completed, gives the slots
 * back. The driver's per-copy cost then runs beside the reads instead of between them.
 *
 * Shared through `m`: the FIFO `ready` (slots read, to copy), the engine's free list (slots
 * the I/O thread may reuse), `io_done`, `stop` and the waiting flags. A slot belongs to one
 * side at a time: the I/O thread from the free list until it queues it in `ready`, the
 * calling thread until it puts it back on the free list. Only the I/O thread touches the
 * ring, `result` and the I/O statistics; only the calling thread calls CUDA. Where no thread
 * can be started, the batch runs on the calling thread alone (sio_run's loop). */

struct load_ctx {
    struct sio_engine *e;
    unsigned long long n;
    const int *fd;
    const unsigned long long *off, *len, *mem;
    const unsigned char *flags;
    long long *result;
    struct sio_stats *st;
    pthread_mutex_t m;
    pthread_cond_t to_copy, to_io;
    unsigned *ready;            /* FIFO of nslots */
    unsigned r_head, r_count;
    int io_done, stop, copy_waits, io_waits;
    int failed;                 /* entries that failed (I/O thread) */
    int io_ret;                 /* -1: the ring failed (message in io_err) */
    char io_err[160];
};

static void *io_main(void *arg)
{
    struct load_ctx *x = arg;
    struct sio_engine *e = x->e;
    struct sio_stats *st = x->st;
    struct cursor cur = { 0, 0 };
    unsigned *lfree, *done;
    unsigned nlf = 0, nd = 0, inflight = 0, i;
    int more = 1, stop = 0;

    lfree = calloc(e->nslots, sizeof(unsigned));
    done = calloc(e->nslots, sizeof(unsigned));
    if (!lfree || !done) {
        snprintf(x->io_err, sizeof(x->io_err), "out of memory");
        x->io_ret = -1;
        goto out;
    }
    for (;;) {
        unsigned long long data;
        int res;

        /* 1. take the slots given back, waiting for one only when nothing is in flight */
        pthread_mutex_lock(&x->m);
        while (more && !inflight && !nlf && !e->nfree && !x->stop) {
            st->slot_waits++;
            x->io_waits = 1;
            pthread_cond_wait(&x->to_io, &x->m);
            x->io_waits = 0;
        }
        for (i = 0; i < e->nfree; i++)
            lfree[nlf++] = e->free_list[i];
        e->nfree = 0;
        stop = x->stop;
        pthread_mutex_unlock(&x->m);
        if (stop)
            break;
        /* 2. fill the queue */
        while (more && nlf && inflight < e->depth && fly_room(e)) {
            unsigned s = lfree[nlf - 1];

            if (!next_piece(e, &cur, 0, x->n, x->off, x->len, x->mem, x->flags, x->result,
                            &e->slots[s])) {
                more = 0;
                break;
            }
            nlf--;
            submit_io(e, 0, x->fd, s, st);
            inflight++;
        }
        if (inflight > st->max_inflight)
            st->max_inflight = inflight;
        if (!inflight && !more)
            break;
        if (!inflight)
            continue;   /* every slot is with the copies: wait for one (step 1) */
        /* 3. hand the reads over and wait for at least one */
        res = q_enter(e, 1);
        if (res) {
            snprintf(x->io_err, sizeof(x->io_err), "%s: %s", q_call(e), strerror(-res));
            x->io_ret = -1;
            break;
        }
        /* 4. reap: host pieces are copied here, CUDA pieces go to the copy side */
        while (q_peek(e, &data, &res)) {
            unsigned s = (unsigned)data;
            struct slot *p = &e->slots[s];

            inflight--;
            if (restage_faulted(e, 0, x->fd, s, res, st)) {
                inflight++;
                continue;
            }
            if (res < 0 || (res == 0 && p->done < p->need)) {
                fail_entry(x->result, p->entry, res < 0 ? res : -EIO, &x->failed);
                lfree[nlf++] = s;
                continue;
            }
            p->done += (unsigned long long)res;
            if (p->done < p->need) {
                submit_io(e, 0, x->fd, s, st);   /* short: the rest */
                inflight++;
                continue;
            }
            credit_entry(x->result, p->entry, p->useful);
            st->bytes += p->useful;
            st->in_place += p->to_mem;
            if (x->flags[p->entry] & SIO_CUDA) {
                done[nd++] = s;
            } else {
                if (!p->to_mem)
                    memcpy((void *)(uintptr_t)p->mem, slot_buf(e, s) + p->skip, p->useful);
                lfree[nlf++] = s;
            }
        }
        if (nd) {
            pthread_mutex_lock(&x->m);
            for (i = 0; i < nd; i++)
                x->ready[(x->r_head + x->r_count++) % e->nslots] = done[i];
            if (x->copy_waits)
                pthread_cond_signal(&x->to_copy);
            pthread_mutex_unlock(&x->m);
            nd = 0;
        }
    }
    /* stopped or failed: no read may land in a slot after the batch returns */
    while (inflight) {
        unsigned long long data;
        int res;

        if (q_enter(e, 1))
            break;
        while (q_peek(e, &data, &res)) {
            inflight--;
            lfree[nlf++] = (unsigned)data;
        }
    }
out:
    pthread_mutex_lock(&x->m);
    for (i = 0; i < nlf; i++)
        e->free_list[e->nfree++] = lfree[i];
    x->io_done = 1;
    pthread_cond_signal(&x->to_copy);
    pthread_mutex_unlock(&x->m);
    free(lfree);
    free(done);
    return NULL;
}

/* Completed copy rounds give their slots back to the I/O thread. block: wait for the oldest
 * round. Returns -1 on a CUDA failure. */
static int give_back(struct sio_engine *e, struct load_ctx *x, int block, char *err,
                     int errlen)
{
    unsigned long long seq = e->done_seq;

    while (seq < e->next_seq) {
        CUevent ev = e->events[seq % e->nevents];
        CUresult r = block && seq == e->done_seq ? cu.ev_sync(ev) : cu.ev_query(ev);

        if (r == CUDA_ERROR_NOT_READY)
            break;
        if (r) {
            say(err, errlen, "waiting for copies: %s", cu_name(r));
            return -1;
        }
        seq++;
    }
    e->done_seq = seq;   /* flush_copies may have moved it too */
    if (!e->held_count || e->slots[e->held[e->held_head]].seq >= e->done_seq)
        return 0;
    pthread_mutex_lock(&x->m);
    drop_held(e, NULL);
    if (x->io_waits)
        pthread_cond_signal(&x->to_io);
    pthread_mutex_unlock(&x->m);
    return 0;
}

static int run_load_threaded(struct sio_engine *e, unsigned long long n, const int *fd,
                             const unsigned long long *off, const unsigned long long *len,
                             const unsigned long long *mem, const unsigned char *flags,
                             long long *result, struct sio_stats *st, char *err, int errlen)
{
    struct load_ctx x;
    pthread_t t;
    int ret = 0, rc;

    memset(&x, 0, sizeof(x));
    x.e = e, x.n = n, x.fd = fd, x.off = off, x.len = len, x.mem = mem, x.flags = flags;
    x.result = result, x.st = st;
    x.ready = calloc(e->nslots, sizeof(unsigned));
    if (!x.ready) {
        say(err, errlen, "out of memory");
        return -1;
    }
    pthread_mutex_init(&x.m, NULL);
    pthread_cond_init(&x.to_copy, NULL);
    pthread_cond_init(&x.to_io, NULL);
    rc = pthread_create(&t, NULL, io_main, &x);
    if (rc) {
        ret = -2;   /* nothing started: the caller runs the batch on one thread */
        goto out;
    }
    st->io_thread = 1;
    for (;;) {
        int fin, took = 0;

        pthread_mutex_lock(&x.m);
        while (!x.r_count && !x.io_done && e->next_seq == e->done_seq) {
            x.copy_waits = 1;
            pthread_cond_wait(&x.to_copy, &x.m);
            x.copy_waits = 0;
        }
        while (x.r_count) {
            unsigned s = x.ready[x.r_head];
            struct slot *p = &e->slots[s];

            x.r_head = (x.r_head + 1) % e->nslots;
            x.r_count--;
            took = 1;
            add_copy(e, s, p->mem, (CUdeviceptr)(uintptr_t)(slot_buf(e, s) + p->skip),
                     p->useful, st);
        }
        fin = x.io_done;
        pthread_mutex_unlock(&x.m);
        if (flush_copies(e, 0, st, err, errlen) ||
            give_back(e, &x, !took, err, errlen)) {
            ret = -1;
            break;
        }
        if (fin && e->next_seq == e->done_seq) {
            pthread_mutex_lock(&x.m);
            fin = !x.r_count;
            pthread_mutex_unlock(&x.m);
            if (fin)
                break;
        }
    }
    if (ret < 0) {
        pthread_mutex_lock(&x.m);
        x.stop = 1;
        pthread_cond_signal(&x.to_io);
        pthread_mutex_unlock(&x.m);
    }
    pthread_join(t, NULL);
    drop_held(e, NULL);
    if (x.io_ret < 0) {
        if (ret == 0)
            say(err, errlen, "%s", x.io_err);
        ret = -1;
    }
out:
    pthread_cond_destroy(&x.to_io);
    pthread_cond_destroy(&x.to_copy);
    pthread_mutex_destroy(&x.m);
    free(x.ready);
    return ret == -2 ? -2 : ret < 0 ? -1 : x.failed;
}

/* After an engine failure, or carving the slots anew: nothing is in flight; every slot is
 * free again. */
static void reset_slots(struct sio_engine *e)
{
    unsigned long long i;

    if (e->stream)
        cu.stream_sync(e->stream);
    e->done_seq = e->next_seq;
    e->held_head = e->held_count = 0;
    e->c_n = e->c_nslots = 0;
    e->nfree = e->nslots;
    for (i = 0; i < e->nslots; i++)
        e->free_list[i] = (unsigned)(e->nslots - 1 - i);
}

static int run_batch(struct sio_engine *e, int write, unsigned long long n, const int *fd,
                     const unsigned long long *off, const unsigned long long *len,
                     const unsigned long long *mem, const unsigned char *flags,
                     long long *result, struct sio_stats *st, char *err, int errlen)
{
    struct cursor cur = { 0, 0 };
    unsigned inflight = 0;
    struct ready rd = { NULL, 0, 0 };   /* write: slots whose bytes are in place */
    int failed = 0, more = 1, ret = 0, need_cuda = 0;
    unsigned long long i;

    memset(st, 0, sizeof(*st));
    for (i = 0; i < n; i++) {
        result[i] = 0;
        if (flags[i] & SIO_CUDA)
            need_cuda = 1;
    }
    if (need_cuda && !e->stream) {
        say(err, errlen, "CUDA memory in a batch on an engine without a CUDA stream");
        return -1;
    }
    if (write)
        refuse_unaligned_writes(0, n, off, len, flags, result, &failed);
    st->fixed = e->fixed;
    e->no_in_place = 0;
    if (!write && need_cuda && !(e->options & SIO_OPT_NO_IO_THREAD)) {
        int rc = run_load_threaded(e, n, fd, off, len, mem, flags, result, st, err, errlen);

        if (rc == -1)
            reset_slots(e);
        if (rc != -2)
            return rc;
    }
    if (write) {
        rd.slot = calloc(e->nslots, sizeof(unsigned));
        if (!rd.slot) {
            say(err, errlen, "out of memory");
            return -1;
        }
    }
    for (;;) {
        unsigned long long data;
        int res, progressed = 0;

        /* 1. start new pieces while slots and queue room last */
        while (more && e->nfree && inflight + rd.count < e->depth && fly_room(e)) {
            unsigned s = e->free_list[e->nfree - 1];
            struct slot *p = &e->slots[s];

            if (!next_piece(e, &cur, write, n, off, len, mem, flags, result, p)) {
                unsigned long long fed = e->feed ? e->feed(e->feed_arg, n) : n;

                if (fed > n) {      /* entries queued meanwhile join this batch */
                    if (write)
                        refuse_unaligned_writes(n, fed, off, len, flags, result, &failed);
                    n = fed;
                    continue;
                }
                more = 0;
                break;
            }
            e->nfree--;
            progressed = 1;
            if (!write) {
                submit_io(e, 0, fd, s, st);
                inflight++;
            } else if (flags[p->entry] & SIO_CUDA) {
                add_copy(e, s, (CUdeviceptr)(uintptr_t)(slot_buf(e, s) + p->skip), p->mem,
                         p->useful, st);
            } else {
                memcpy(slot_buf(e, s) + p->skip, (void *)(uintptr_t)p->mem, p->useful);
                rd.slot[(rd.head + rd.count++) % e->nslots] = s;
            }
        }
        if (write && flush_copies(e, 1, st, err, errlen)) {
            ret = -1;
            break;
        }
        /* load: the reads just queued go to the disk first, then the last round's copies
         * are issued while the disk works on them */
        if (!write && e->c_nslots) {
            int r = q_pending(e) ? q_enter(e, 0) : 0;
            if (r || flush_copies(e, 0, st, err, errlen)) {
                if (r)
                    say(err, errlen, "%s: %s", q_call(e), strerror(-r));
                ret = -1;
                break;
            }
        }
        /* write: submit the pieces whose bytes are in their slots */
        while (write && rd.count && inflight < e->depth) {
            submit_io(e, 1, fd, rd.slot[rd.head], st);
            rd.head = (rd.head + 1) % e->nslots;
            rd.count--;
            inflight++;
            progressed = 1;
        }
        if (inflight > st->max_inflight)
            st->max_inflight = inflight;
        if (!inflight && !more && !e->held_count && !rd.count)
            break;
        /* 2. hand the SQEs over; wait for a completion only when nothing else can move */
        {
            /* load: step 1 submitted all it could, and the GPU finishes the copies on its
             * own, so hand over the new reads and wait in the same system call */
            int wait = write ? inflight && !progressed && !e->held_count : inflight > 0;
            unsigned want = 1;
            /* a host load with entries still to start: sleep until an eighth of the queue
             * completed, not after each read (fewer wake-ups on a busy host; the other
             * seven eighths keep the disk busy meanwhile) */
            if (wait && !write && !need_cuda && more && inflight >= 2 * REAP_SHARE)
                want = inflight / REAP_SHARE;
            int r = q_enter(e, wait ? want : 0);
            if (r) {
                say(err, errlen, "%s: %s", q_call(e), strerror(-r));
                ret = -1;
                break;
            }
        }
        /* 3. reap */
        while (q_peek(e, &data, &res)) {
            unsigned s = (unsigned)data;
            struct slot *p = &e->slots[s];

            inflight--;
            if (restage_faulted(e, write, fd, s, res, st)) {
                inflight++;
                continue;
            }
            if (res < 0 || (res == 0 && p->done < p->need)) {
                fail_entry(result, p->entry, res < 0 ? res : -EIO, &failed);
                e->free_list[e->nfree++] = s;
                continue;
            }
            p->done += (unsigned long long)res;
            if (p->done < p->need || (write && p->done < p->io_len)) {
                submit_io(e, write, fd, s, st);   /* short: the rest */
                inflight++;
                continue;
            }
            credit_entry(result, p->entry, p->useful);
            st->bytes += p->useful;
            st->in_place += p->to_mem;
            if (write || !(flags[p->entry] & SIO_CUDA)) {
                if (!write && !p->to_mem)
                    memcpy((void *)(uintptr_t)p->mem, slot_buf(e, s) + p->skip, p->useful);
                e->free_list[e->nfree++] = s;
            } else {
                add_copy(e, s, p->mem, (CUdeviceptr)(uintptr_t)(slot_buf(e, s) + p->skip),
                         p->useful, st);
            }
        }
        /* 4. completed copy rounds give their slots back (write: to the ready list) */
        if (e->held_count) {
            int block = write ? (!inflight && !rd.count)
                              : (!e->nfree && !inflight) || (!more && !inflight);
            if (!write && !e->nfree)
                st->slot_waits++;
            if (release_rounds(e, block, write ? &rd : NULL, err, errlen) < 0) {
                ret = -1;
                break;
            }
        }
    }
    if (ret < 0) {
        /* drain what is in flight so no I/O lands in a slot after we return */
        while (inflight) {
            unsigned long long data;
            int res;
            if (q_enter(e, 1))
                break;
            while (q_peek(e, &data, &res))
                inflight--;
        }
        reset_slots(e);
    }
    free(rd.slot);
    return ret < 0 ? -1 : failed;
}

/* Slots as large as the run's entries want: gang base slots make one slot, gang a power of
 * two with gang x base at most the entries' mean length and GANG_BYTES, at least
 * GANG_MIN_SLOTS slots left, and no slot across two registered buffers. Only while every
 * slot is free (between runs); otherwise the carving stays. */
static void carve_slots(struct sio_engine *e, unsigned long long n, const unsigned long long *len)
{
    unsigned long long sum = 0, want, i;
    unsigned long long per = FIXED_MAX / e->base_slot_bytes;  /* base slots per registered
                                                                 buffer, registered or not */
    unsigned k = 1;

    for (i = 0; i < n; i++)     /* each capped: no overflow, no one entry decides */
        sum += len[i] < GANG_BYTES ? len[i] : GANG_BYTES;
    want = n ? sum / n : 0;
    while (2ULL * k * e->base_slot_bytes <= want && e->base_nslots / (2 * k) >= GANG_MIN_SLOTS &&
           per % (2 * k) == 0)
        k *= 2;
    if (k == e->gang || e->nfree != e->nslots || e->held_count || e->c_nslots)
        return;
    e->gang = k;
    e->slot_bytes = e->base_slot_bytes * k;
    e->nslots = e->base_nslots / k;
    e->fixed_slots = (unsigned)(per / k);
    reset_slots(e);     /* every slot free, in the new carving */
}

int sio_run(struct sio_engine *e, int write, unsigned long long n, const int *fd,
            const unsigned long long *off, const unsigned long long *len,
            const unsigned long long *mem, const unsigned char *flags, long long *result,
            struct sio_stats *st, char *err, int errlen)
{
    int rc;

    e->split_entries = 0;
    e->inflight_bytes = 0;
    pthread_mutex_lock(&e->mem_lock);
    if (!e->use_aio && e->ring.single && e->ring.owner != (pid_t)syscall(__NR_gettid)) {
        /* a ring of one thread, driven now by another: set it up again for this one */
        ring_close(&e->ring);
        e->fixed = 0;
        e->table = 0;
        if (ring_setup(&e->ring, e->depth, 1, NULL, 0)) {
            uring_reason(e->path_reason, sizeof(e->path_reason), errno);
            e->use_aio = 1;
            if (aio_q_setup(&e->aio, e->depth, e->base_nslots, err, errlen)) {
                e->use_aio = 0;
                e->ring.fd = -1;
                pthread_mutex_unlock(&e->mem_lock);
                return -1;
            }
        } else {
            register_stage(e);
        }
    }
    if (!e->use_aio)
        mem_sync(e);
    pthread_mutex_unlock(&e->mem_lock);
    carve_slots(e, n, len);
    rc = run_batch(e, write, n, fd, off, len, mem, flags, result, st, err, errlen);
    st->slot_bytes = e->slot_bytes;
    st->slots = e->nslots;
    st->aio = e->use_aio;
    st->split = e->split;
    st->split_entries = e->split_entries;
    st->inflight_bytes = e->inflight_max;
    return rc;
}

int sio_engine_bind(struct sio_engine *e)
{
    void *cur = NULL;

    if (!e->ctx)
        return 0;
    if (cu.ctx_get(&cur) == 0 && cur == e->ctx)
        return 0;
    return cu.ctx_set(e->ctx) ? -1 : 0;
}

void sio_set_split(struct sio_engine *e, unsigned long long piece_bytes)
{
    e->split = piece_bytes / SIO_ALIGN * SIO_ALIGN;
}

void sio_set_inflight(struct sio_engine *e, unsigned long long bytes)
{
    e->inflight_max = bytes;
}

int sio_submit_path(struct sio_engine *e, char *reason, int reasonlen)
{
    say(reason, reasonlen, "%s", e->path_reason);
    return e->use_aio;
}

void sio_scan(unsigned long long n, const long long *off, const long long *len,
              const long long *moff, struct sio_scan *out)
{
    unsigned long long i;
    long long total = 0;

    out->min_off = out->min_len = out->min_moff = LLONG_MAX;
    out->min_mend = out->min_fend = LLONG_MAX;
    out->max_mend = out->max_fend = LLONG_MIN;
    out->odd = 0;
    for (i = 0; i < n; i++) {
        long long o = off[i], l = len[i], m = moff[i];
        long long mend, fend;

        if (o < out->min_off)
            out->min_off = o;
        if (l < out->min_len)
            out->min_len = l;
        if (m < out->min_moff)
            out->min_moff = m;
        if (__builtin_add_overflow(m, l, &mend))
            mend = -1;
        if (__builtin_add_overflow(o, l, &fend))
            fend = -1;
        if (mend < out->min_mend)
            out->min_mend = mend;
        if (mend > out->max_mend)
            out->max_mend = mend;
        if (fend < out->min_fend)
            out->min_fend = fend;
        if (fend > out->max_fend)
            out->max_fend = fend;
        if ((o | l) % SIO_ALIGN)
            out->odd = 1;
        if (total >= 0 && __builtin_add_overflow(total, l, &total))
            total = -1;
    }
    out->total = total;
}

void sio_targets(unsigned long long n, const long long *moff, unsigned long long base, int fd,
                 unsigned char flags, int *fd_out, unsigned char *flags_out,
                 unsigned long long *mem_out)
{
    unsigned long long i;

    for (i = 0; i < n; i++) {
        fd_out[i] = fd;
        flags_out[i] = flags;
        mem_out[i] = base + (unsigned long long)moff[i];
    }
}

int sio_ceiling(int fd, unsigned long long n, const unsigned long long *off,
                const unsigned long long *len, unsigned depth, void *buf,
                unsigned long long slot_bytes, char *err, int errlen)
{
    struct ring r;
    unsigned *free_slots;
    unsigned nfree, inflight = 0, i;
    unsigned long long next = 0;
    int ret = 0;

    ret = ring_setup(&r, depth, 1, err, errlen);
    if (ret)
        return ret;
    free_slots = calloc(depth, sizeof(unsigned));
    if (!free_slots) {
        ring_close(&r);
        return -ENOMEM;
    }
    for (i = 0; i < depth; i++)
        free_slots[i] = i;
    nfree = depth;
    while (next < n || inflight) {
        unsigned long long data;
        int res;

        while (next < n && nfree) {
            unsigned s = free_slots[--nfree];
            unsigned long long l = len[next] < slot_bytes ? len[next] : slot_bytes;
            ring_push(&r, IORING_OP_READ, fd, (char *)buf + s * slot_bytes, (unsigned)l,
                      off[next], s, -1);
            next++;
            inflight++;
        }
        ret = ring_enter(&r, 1);
        if (ret) {
            say(err, errlen, "io_uring_enter: %s", strerror(-ret));
            break;
        }
        while (ring_peek(&r, &data, &res)) {
            inflight--;
            free_slots[nfree++] = (unsigned)data;
            if (res <= 0 && !ret) {
                ret = res < 0 ? res : -EIO;
                say(err, errlen, "read: %s", strerror(-ret));
            }
        }
        if (ret)
            break;
    }
    while (inflight) {
        unsigned long long data;
        int res;
        if (ring_enter(&r, 1))
            break;
        while (ring_peek(&r, &data, &res))
            inflight--;
    }
    free(free_slots);
    ring_close(&r);
    return ret;
}

#include "_sio_queue.c"
#include "_sio_file.c"
