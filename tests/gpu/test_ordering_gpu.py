"""Fences and GPU streams on a real GPU: a fence gates kernels on torch and CuPy streams
(cuStreamWaitValue32 on a pinned host word), GPU work declared with gpu_access holds back
later host-side accesses, and the data is checked on the GPU.

While a stream waits on a fence, nothing here touches the legacy default stream or
synchronizes the whole device: both would wait for the held stream (a deadlock the
test would create, not p2phub). Producers run on streams of their own.

Every kernel is run once before it is enqueued behind a fence: with CUDA's lazy module
loading (the default), the first launch of a kernel loads its module, and that load
waits for the context's streams, the held one included, so it would never return."""

from __future__ import annotations

import threading
import time

import pytest

from p2phub.errors import UsageError
from p2phub.ordering import AccessKind, FenceError, HostFence, Ordering

N = 1 << 20  # int32 elements


def _blocked(query, seconds: float = 0.2) -> bool:
    """True when the stream stays busy (held by the fence) for `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if query():
            return False
        time.sleep(0.01)
    return True


def test_fence_gates_a_torch_kernel_until_the_host_completes_it(torch, ops) -> None:
    s = torch.cuda.Stream()
    src = torch.zeros(N, dtype=torch.int32, device="cuda")
    dst = torch.full((N,), -1, dtype=torch.int32, device="cuda")
    host = (torch.arange(N, dtype=torch.int32) * 3 + 7).pin_memory()
    with torch.cuda.stream(s):
        dst.copy_(src * 2)                  # load the kernels (lazy loading), see above
    torch.cuda.synchronize()
    dst.fill_(-1)
    torch.cuda.synchronize()

    f = HostFence("ssd read into src (stand-in)")
    f.on_stream(s)
    with torch.cuda.stream(s):
        dst.copy_(src * 2)                  # the consumer, enqueued behind the fence
    assert _blocked(s.query), "the consumer ran before the fence completed"

    # The producer fills src (a stream of its own, standing in for the SSD's DMA), then
    # the host completes the fence.
    p = torch.cuda.Stream()
    with torch.cuda.stream(p):
        src.copy_(host, non_blocking=True)
    p.synchronize()
    f.set()
    s.synchronize()
    torch.cuda.synchronize()
    want = (torch.arange(N, dtype=torch.int32, device="cuda") * 3 + 7) * 2
    assert torch.equal(dst, want)           # compared on the GPU


def test_fence_gates_a_cupy_kernel(cp, ops) -> None:
    s = cp.cuda.Stream(non_blocking=True)
    src = cp.zeros(N, dtype=cp.int32)
    dst = cp.full(N, -1, dtype=cp.int32)
    with s:
        dst[...] = src + 1                      # load the kernel first
        src[...] = 41
        dst[...] = -1
    cp.cuda.Device().synchronize()
    src[...] = 0
    cp.cuda.Device().synchronize()
    f = HostFence("rdma write into src (stand-in)")
    f.on_stream(s)
    with s:
        dst[...] = src + 1
    assert _blocked(lambda: s.done), "the CuPy kernel ran before the fence completed"
    p = cp.cuda.Stream(non_blocking=True)
    with p:
        src[...] = 41                           # the producer, on a stream of its own
    p.synchronize()
    threading.Timer(0.05, f.set).start()        # completed from another thread
    s.synchronize()
    cp.cuda.Device().synchronize()
    assert bool(cp.all(dst == 42))


def test_gpu_access_holds_back_a_later_host_side_consumer(torch, ops, cp) -> None:
    """A GPU write declared with gpu_access: a later NVMe-write-style acquire waits for the
    kernel's end (a host word the stream writes), then sees the kernel's bytes."""
    nbytes = N * 4
    t = torch.zeros(N, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    o = Ordering("gpu buffer", nbytes)
    s = torch.cuda.Stream()
    with o.gpu_access(0, nbytes, AccessKind.GPU_WRITE, s) as g:
        with torch.cuda.stream(s):
            torch.cuda._sleep(200_000_000)     # a long kernel first (~0.1 s)
            t.fill_(42)
    assert not g.done()
    acc = o.acquire(0, nbytes, AccessKind.NVME_WRITE, "ssd write (stand-in)", timeout=30)
    assert g.done() and acc.deps and acc.deps[0].kind is AccessKind.GPU_WRITE
    # Read back on a fresh non-blocking stream: nothing but the fence ordered it.
    rs = cp.cuda.Stream(non_blocking=True)
    with rs:
        view = cp.asarray(t)
        ok = bool(cp.all(view == 42))
    assert ok
    acc.cancel()


def test_gpu_write_then_gpu_read_on_two_streams(torch, ops) -> None:
    """GPU after GPU: the reading stream waits on the word the writing stream stores."""
    nbytes = N * 4
    buf = torch.zeros(N, dtype=torch.int32, device="cuda")
    out = torch.zeros(N, dtype=torch.int32, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s2):
        out.copy_(buf)                        # load the kernels first
    buf.fill_(0)
    torch.cuda.synchronize()
    o = Ordering("gpu buffer", nbytes)
    with o.gpu_access(0, nbytes, AccessKind.GPU_WRITE, s1):
        with torch.cuda.stream(s1):
            torch.cuda._sleep(100_000_000)
            buf.fill_(7)
    with o.gpu_access(0, nbytes, AccessKind.GPU_READ, s2) as rd:
        with torch.cuda.stream(s2):
            out.copy_(buf)
    rd.wait(30)
    s2.synchronize()
    assert torch.equal(out, torch.full_like(out, 7))
    deadline = time.monotonic() + 10
    while o.live() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert o.live() == []


def test_nvme_style_producer_then_gpu_read_through_the_tracker(torch, ops) -> None:
    """An access declared by a host path (here a HostFence standing for an NVMe CQE) and a
    GPU read of the same bytes: the stream waits on the access's fence, not the CPU."""
    nbytes = N * 4
    buf = torch.zeros(N, dtype=torch.int32, device="cuda")
    out = torch.full((N,), -1, dtype=torch.int32, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        out[:1024].copy_(buf[:1024])          # load the kernels first
        buf.fill_(5)
        buf.fill_(0)
        out.fill_(-1)
    torch.cuda.synchronize()
    o = Ordering("gpu buffer", nbytes)
    rd = o.acquire(0, nbytes, AccessKind.NVME_READ, "ssd read")
    cqe = HostFence("cqe")
    rd.bind(cqe)
    with o.gpu_access(0, 4096, AccessKind.GPU_READ, s) as g:
        with torch.cuda.stream(s):
            out[:1024].copy_(buf[:1024])
    assert g.access.deps == [rd]
    assert _blocked(s.query)
    p = torch.cuda.Stream()
    with torch.cuda.stream(p):
        buf.fill_(5)
    p.synchronize()
    cqe.set()
    g.wait(30)
    torch.cuda.synchronize()
    assert torch.equal(out[:1024], torch.full((1024,), 5, dtype=torch.int32, device="cuda"))


def test_a_failed_fence_releases_the_stream_and_reports(torch, ops) -> None:
    s = torch.cuda.Stream()
    x = torch.zeros(16, device="cuda")
    with torch.cuda.stream(s):
        x.add_(1)                             # load the kernel first
    torch.cuda.synchronize()
    f = HostFence("nvme read")
    f.on_stream(s)
    with torch.cuda.stream(s):
        x.add_(1)
    f.fail("controller reset: command aborted")
    s.synchronize()  # not stuck
    with pytest.raises(FenceError, match="aborted"):
        f.wait(0)
    with pytest.raises(FenceError, match="aborted"):
        f.on_stream(s)


def test_stream_handles(torch, cp, ops) -> None:
    from p2phub_cuda.backend import cu

    ts, cs = torch.cuda.Stream(), cp.cuda.Stream()
    assert ops.stream_handle(ts) == ts.cuda_stream
    assert ops.stream_handle(cs) == cs.ptr
    assert ops.stream_handle(123) == 123
    assert ops.stream_handle(cu.CUstream(ts.cuda_stream)) == ts.cuda_stream
    assert ops.claims_stream(ts) and ops.claims_stream(cs) and not ops.claims_stream("s")
    with pytest.raises(UsageError):
        ops.stream_handle(-1)
    f = HostFence()
    f.on_stream(ts.cuda_stream)   # a raw handle works too
    f.set()
    ts.synchronize()


def test_rdma_write_flush(ops) -> None:
    order, opts = ops.rdma_write_ordering(0)
    assert order in (0, 100, 200)
    ops.flush_rdma_writes(0)      # callable wherever the driver offers it
    expect = order < 100 and bool(opts & 1)
    assert ops.rdma_flush_required(0) is expect or ops.force_flush
    o = Ordering("gpu", 4096)
    o.gpu_device = (ops, 0)
    o.make_visible()
