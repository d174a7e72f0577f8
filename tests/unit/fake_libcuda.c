/* A stand-in libcuda.so.1 for the staged I/O engine's CUDA path on a host without a GPU:
 * "device" pointers are host pointers, and copies are queued on the stream and carried out
 * only when an event that follows them is synchronized, or queried for the second time, so
 * an engine that reuses a staging slot before its copy completed reads the wrong bytes. */
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
struct copy { void *dst; const void *src; size_t n; };
struct event { size_t upto; int queries; };
struct attrs { int order; int src[2], dst[2]; unsigned flags; };

static struct copy *q;
static size_t qn, qcap, done;
int fake_cuda_batches, fake_cuda_bad_attrs;

static void push(void *dst, const void *src, size_t n)
{
    if (qn == qcap) {
        qcap = qcap ? 2 * qcap : 1024;
        q = realloc(q, qcap * sizeof(*q));
    }
    q[qn++] = (struct copy){ dst, src, n };
}

static void run_to(size_t upto)
{
    for (; done < upto; done++)
        memcpy(q[done].dst, q[done].src, q[done].n);
}

CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *s)
{
    push((void *)dst, src, n);
    return 0;
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, unsigned long long src, size_t n, void *s)
{
    push(dst, (const void *)src, n);
    return 0;
}

CUresult cuMemcpyBatchAsync_v2(unsigned long long *dsts, unsigned long long *srcs, size_t *sizes,
                               size_t count, struct attrs *a, size_t *idx, size_t na, void *s)
{
    size_t i;

    fake_cuda_batches++;
    if (!s || na != 1 || idx[0] != 0 || a->order != 1)
        fake_cuda_bad_attrs++;
    for (i = 0; i < count; i++)
        push((void *)dsts[i], (const void *)srcs[i], sizes[i]);
    return 0;
}

CUresult cuEventCreate(void **ev, unsigned flags)
{
    *ev = calloc(1, sizeof(struct event));
    return 0;
}

CUresult cuEventDestroy_v2(void *ev)
{
    free(ev);
    return 0;
}

CUresult cuEventRecord(void *ev, void *s)
{
    struct event *e = ev;

    e->upto = qn;
    e->queries = 0;
    return 0;
}

CUresult cuEventQuery(void *ev)
{
    struct event *e = ev;

    if (done >= e->upto)
        return 0;
    if (e->queries++ == 0)
        return 600; /* CUDA_ERROR_NOT_READY */
    run_to(e->upto);
    return 0;
}

CUresult cuEventSynchronize(void *ev)
{
    run_to(((struct event *)ev)->upto);
    return 0;
}

CUresult cuStreamSynchronize(void *s)
{
    run_to(qn);
    return 0;
}

CUresult cuGetErrorName(CUresult r, const char **s)
{
    *s = "FAKE_CUDA_ERROR";
    return 0;
}

/* the context made current on this thread; a thread that set none has the default one */
static int fake_ctx;
static __thread void *fake_current;

CUresult cuCtxGetCurrent(void **ctx)
{
    *ctx = fake_current ? fake_current : &fake_ctx;
    return 0;
}

CUresult cuCtxSetCurrent(void *ctx)
{
    fake_current = ctx;
    return 0;
}
