/* Added to fake_libcuda.c for a NIXL plugin that runs the staged I/O engine's CUDA path on
 * the host: the context, stream and pinned-memory calls it makes around the copies. One
 * "device" 0, whose memory is host memory; anything else is CUDA_ERROR_INVALID_DEVICE. */
#include <stdlib.h>

typedef int CUresult;
static int fake_ctx_retained;

CUresult cuInit(unsigned flags) { (void)flags; return 0; }
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return ordinal == 0 ? 0 : 101; }
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev)
{
    if (dev != 0)
        return 101;
    fake_ctx_retained++;
    *ctx = &fake_ctx_retained;
    return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; fake_ctx_retained--; return 0; }
CUresult cuStreamCreate(void **stream, unsigned flags) { (void)flags; *stream = malloc(1); return 0; }
CUresult cuStreamDestroy_v2(void *stream) { free(stream); return 0; }
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags)
{
    (void)flags;
    return posix_memalign(p, 4096, n) ? 2 : 0;
}
CUresult cuMemFreeHost(void *p) { free(p); return 0; }
