"""dma-buf export of every kind of CUDA allocation, byte-exact, and what is refused.

Bytes are read back through the dma-buf's own CPU mapping where the driver offers
one (CU_DEVICE_ATTRIBUTE_DMA_BUF_MMAP_SUPPORTED), else through a copy of the
exported range; the fd's size and exporter are checked either way.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from p2phub.errors import UsageError
from p2phub.sources import dmabuf_exporter

MiB = 1 << 20
TOP = Path(__file__).resolve().parents[2]


def _mmap_supported(be) -> bool:
    try:
        return bool(be.device_attribute("CU_DEVICE_ATTRIBUTE_DMA_BUF_MMAP_SUPPORTED"))
    except (AttributeError, OSError):
        return False


def _read_back(be, cu, fd: int, ptr: int, n: int) -> bytes:
    """The range's bytes: through the dma-buf's CPU mapping if possible, else a copy."""
    assert os.lseek(fd, 0, os.SEEK_END) == n
    assert dmabuf_exporter(fd) is not None
    if _mmap_supported(be):
        m = mmap.mmap(fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
        try:
            return bytes(m[:n])
        finally:
            m.close()
    out = bytearray(n)
    import ctypes
    (err,) = cu.cuMemcpyDtoH(ctypes.addressof(ctypes.c_char.from_buffer(out)), ptr, n)
    assert int(err) == 0
    return bytes(out)


def _pattern(n: int, seed: int) -> bytes:
    import random
    return random.Random(seed).randbytes(n)


def test_cumemalloc_export_is_byte_exact_and_sync_memops_set(be, cu) -> None:
    import ctypes
    n = 4 * MiB
    err, ptr = cu.cuMemAlloc(n)
    assert int(err) == 0
    ptr = int(ptr)
    data = _pattern(n, 1)
    buf = ctypes.create_string_buffer(data, n)
    try:
        assert int(cu.cuMemcpyHtoD(ptr, buf, n)[0]) == 0
        rng = be.resolve((ptr, n))
        try:
            assert rng.keepalive[-1]["alloc_kind"] == "cuMemAlloc"
            assert rng.keepalive[-1]["mapping"] in ("pcie", "default")
            err, sync = cu.cuPointerGetAttribute(
                cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, ptr)
            assert int(err) == 0 and int(sync) == 1
            assert _read_back(be, cu, rng.dmabuf_fd, ptr, n) == data
        finally:
            rng.close()
    finally:
        cu.cuMemFree(ptr)


def test_caching_allocator_tensor_export_is_byte_exact(be, cu, torch) -> None:
    n = 8 * MiB
    src = torch.frombuffer(bytearray(_pattern(n, 2)), dtype=torch.uint8)
    t = src.cuda()
    torch.cuda.synchronize()
    rng = be.resolve(t)
    try:
        assert rng.ptr == t.data_ptr() and rng.length == n
        assert rng.alloc_base <= rng.ptr < rng.alloc_base + rng.alloc_size
        assert _read_back(be, cu, rng.dmabuf_fd, rng.ptr, n) == bytes(src.numpy())
    finally:
        rng.close()


def test_expandable_segments_tensor_export_is_byte_exact(be) -> None:
    """torch's expandable segments map 20 MiB VMM chunks back to back: a 64 MiB tensor
    spans several cuMemCreate handles and exports as one dma-buf. Runs in a child
    process because the allocator setting must precede CUDA's initialisation."""
    script = textwrap.dedent("""
        import json, mmap, os, sys, ctypes
        import torch
        import p2phub_cuda
        from p2phub_cuda.backend import cu
        be = p2phub_cuda.backend()
        n = 64 << 20
        torch.cuda.init()
        pad = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # not at a chunk start
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        rng = be.resolve(t)
        kind = rng.keepalive[-1]["alloc_kind"]
        fdsize = os.lseek(rng.dmabuf_fd, 0, os.SEEK_END)
        out = bytearray(n)
        try:
            ok_mmap = bool(be.device_attribute("CU_DEVICE_ATTRIBUTE_DMA_BUF_MMAP_SUPPORTED"))
        except Exception:
            ok_mmap = False
        if ok_mmap:
            m = mmap.mmap(rng.dmabuf_fd, n, mmap.MAP_SHARED, mmap.PROT_READ)
            out[:] = m[:n]
            m.close()
        else:
            err, = cu.cuMemcpyDtoH(ctypes.addressof(ctypes.c_char.from_buffer(out)), rng.ptr, n)
        same = bytes(out) == bytes(t.cpu().numpy())
        print(json.dumps({"kind": kind, "fdsize": fdsize, "same": same, "mmap": ok_mmap,
                          "base": rng.alloc_base, "size": rng.alloc_size, "ptr": rng.ptr,
                          "mapping": rng.keepalive[-1].get("mapping")}))
        rng.close()
    """)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
               PYTHONPATH=os.pathsep.join([str(TOP), str(TOP / "backends" / "cuda"),
                                           os.environ.get("PYTHONPATH", "")]))
    pytest.importorskip("torch")
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    print(out)
    assert out["kind"] == "vmm"
    assert out["fdsize"] == 64 * MiB
    assert out["same"]
    assert out["base"] <= out["ptr"] and out["ptr"] + 64 * MiB <= out["base"] + out["size"]


def _vmm_map(cu, chunks: int, reserve_chunks: int):
    """Reserve reserve_chunks granules of VA and map `chunks` physical granules at its start."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    err, gran = cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
    assert int(err) == 0
    gran = int(gran)
    err, va = cu.cuMemAddressReserve(gran * reserve_chunks, 0, 0, 0)
    assert int(err) == 0
    va = int(va)
    handles = []
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    for i in range(chunks):
        err, h = cu.cuMemCreate(gran, prop, 0)
        assert int(err) == 0
        assert int(cu.cuMemMap(va + i * gran, gran, 0, h, 0)[0]) == 0
        handles.append(h)
    assert int(cu.cuMemSetAccess(va, gran * chunks, [access], 1)[0]) == 0
    return va, gran, handles


def _vmm_free(cu, va: int, gran: int, handles: list, reserve_chunks: int) -> None:
    for i, h in enumerate(handles):
        cu.cuMemUnmap(va + i * gran, gran)
        cu.cuMemRelease(h)
    cu.cuMemAddressFree(va, gran * reserve_chunks)


def test_vmm_range_across_mapped_chunks_exports_and_a_hole_is_refused(be, cu) -> None:
    va, gran, handles = _vmm_map(cu, 2, 3)
    try:
        rng = be.resolve((va, 2 * gran))
        try:
            assert rng.keepalive[-1]["alloc_kind"] == "vmm"
            assert (rng.alloc_base, rng.alloc_size) == (va, 2 * gran)
            assert os.lseek(rng.dmabuf_fd, 0, os.SEEK_END) == 2 * gran
        finally:
            rng.close()
        with pytest.raises(UsageError, match="spans two allocations|unmapped"):
            be.resolve((va + gran, 2 * gran))
    finally:
        _vmm_free(cu, va, gran, handles, 3)


def test_adjacent_cumemalloc_allocations_are_two(be, cu) -> None:
    """A range from one cuMemAlloc into the next is refused even where they touch."""
    err, a = cu.cuMemAlloc(2 * MiB)
    err2, b = cu.cuMemAlloc(2 * MiB)
    assert int(err) == 0 and int(err2) == 0
    try:
        lo = min(int(a), int(b))
        with pytest.raises(UsageError, match="spans two allocations"):
            be.resolve((lo + MiB, 2 * MiB))
    finally:
        cu.cuMemFree(a)
        cu.cuMemFree(b)


def test_plain_host_pointer_is_refused(be) -> None:
    import ctypes
    buf = ctypes.create_string_buffer(MiB)
    with pytest.raises(UsageError, match="not CUDA memory"):
        be.resolve((ctypes.addressof(buf), MiB))


def test_stream_handles(torch) -> None:
    from p2phub_cuda import stream_handle
    from p2phub_cuda.backend import cu
    s = torch.cuda.Stream()
    assert stream_handle(s) == s.cuda_stream
    assert stream_handle(None) == 0 and stream_handle(1234) == 1234
    err, cs = cu.cuStreamCreate(0)
    assert stream_handle(cs) == int(cs)
    cu.cuStreamDestroy(cs)
    cupy = pytest.importorskip("cupy")
    cps = cupy.cuda.Stream(non_blocking=True)
    assert stream_handle(cps) == cps.ptr
    with pytest.raises(UsageError):
        stream_handle("stream")
