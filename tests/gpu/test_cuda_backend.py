"""The CUDA backend on a real GPU: what it accepts, what it refuses, and the dma-buf it exports."""

from __future__ import annotations

import os

import pytest

from p2phub.backend import find_backend
from p2phub.errors import UsageError
from p2phub.sources import dmabuf_exporter

MiB = 1 << 20


def _alloc(cu, nbytes: int) -> int:
    err, ptr = cu.cuMemAlloc(nbytes)
    assert int(err) == 0
    return int(ptr)


def _fd_size(fd: int) -> int:
    return os.lseek(fd, 0, os.SEEK_END)


def test_device_reports_dmabuf_support(be) -> None:
    assert be.dmabuf_supported(0)


def test_torch_tensor_exports_exactly_its_bytes(be, torch) -> None:
    t = torch.zeros(4 * MiB // 4, dtype=torch.float32, device="cuda")
    assert find_backend(t) is be
    rng = be.resolve(t)
    try:
        assert rng.ptr == t.data_ptr() and rng.length == 4 * MiB
        assert rng.alloc_base <= rng.ptr and rng.ptr + rng.length <= rng.alloc_base + rng.alloc_size
        assert _fd_size(rng.dmabuf_fd) == 4 * MiB
        assert dmabuf_exporter(rng.dmabuf_fd) is not None
        assert rng.pci_bus_id.count(":") == 2
        assert rng.keepalive[0] is t
    finally:
        rng.close()
    assert rng.dmabuf_fd == -1


def test_sub_range_of_a_tensor(be, torch) -> None:
    t = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    rng = be.resolve(t, offset=1 * MiB, length=2 * MiB)
    try:
        assert rng.ptr == t.data_ptr() + MiB and _fd_size(rng.dmabuf_fd) == 2 * MiB
    finally:
        rng.close()


def test_cuda_array_interface_and_dlpack(be, torch) -> None:
    t = torch.ones(MiB, dtype=torch.uint8, device="cuda")

    class CAI:
        __cuda_array_interface__ = t.__cuda_array_interface__

    class DL:
        def __dlpack__(self, stream=None):
            return t.__dlpack__()

        def __dlpack_device__(self):
            return t.__dlpack_device__()

    for obj in (CAI(), DL()):
        assert be.claims(obj)
        rng = be.resolve(obj)
        try:
            assert (rng.ptr, rng.length) == (t.data_ptr(), MiB)
        finally:
            rng.close()


def test_raw_pointer_and_size(be, cu) -> None:
    ptr = _alloc(cu, 2 * MiB)
    try:
        rng = be.resolve((ptr, 2 * MiB))
        assert rng.alloc_base == ptr and rng.nvidia_p2p_ok
        rng.close()
    finally:
        cu.cuMemFree(ptr)


def test_freed_pointer_is_refused(be, cu) -> None:
    ptr = _alloc(cu, 2 * MiB)
    cu.cuMemFree(ptr)
    with pytest.raises(UsageError, match="not CUDA memory|freed"):
        be.resolve((ptr, 2 * MiB))


def test_range_past_the_allocation_is_refused(be, cu) -> None:
    ptr = _alloc(cu, 2 * MiB)
    try:
        with pytest.raises(UsageError, match="spans two allocations"):
            be.resolve((ptr, 4 * MiB))
    finally:
        cu.cuMemFree(ptr)


def test_host_memory_is_refused(be, torch) -> None:
    pinned = torch.zeros(MiB, dtype=torch.uint8).pin_memory()
    with pytest.raises(UsageError, match="not device memory|not CUDA memory"):
        be.resolve((pinned.data_ptr(), MiB))
    plain = torch.zeros(MiB, dtype=torch.uint8)
    assert not be.claims(plain)
    with pytest.raises(UsageError, match="not CUDA memory|not device memory"):
        be.resolve((plain.data_ptr(), MiB))


def test_managed_memory_is_refused(be, cu) -> None:
    err, ptr = cu.cuMemAllocManaged(MiB, cu.CUmemAttach_flags.CU_MEM_ATTACH_GLOBAL.value)
    assert int(err) == 0
    try:
        with pytest.raises(UsageError, match="managed"):
            be.resolve((int(ptr), MiB))
    finally:
        cu.cuMemFree(ptr)


def test_misaligned_range_is_refused_for_export(be, cu) -> None:
    ptr = _alloc(cu, 2 * MiB)
    try:
        with pytest.raises(UsageError, match="aligned"):
            be.resolve((ptr + 100, 4096))
        rng = be.resolve((ptr + 100, 4096), export_dmabuf=False)  # valid memory, just not exportable
        assert not rng.nvidia_p2p_ok
    finally:
        cu.cuMemFree(ptr)


def test_bad_ranges(be, torch) -> None:
    t = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    for kw, match in (({"offset": -1}, "negative"), ({"length": 0}, "positive"),
                      ({"offset": MiB - 4096, "length": 8192}, "ends past")):
        with pytest.raises(UsageError, match=match):
            be.resolve(t, **kw)


def test_non_contiguous_tensor_is_refused(be, torch) -> None:
    t = torch.zeros(1024, 1024, dtype=torch.uint8, device="cuda").t()
    with pytest.raises(UsageError, match="contiguous"):
        be.resolve(t)


def test_cache_key_names_the_allocation_not_the_address(be, cu) -> None:
    # the registration cache keys CUDA memory on the allocation's buffer id: a range freed and
    # allocated again (often at the very same address) must not find the old registration
    ptr = _alloc(cu, 2 * MiB)
    key = be.cache_key((ptr, 2 * MiB))
    assert key == be.cache_key((ptr, 2 * MiB))
    assert be.cache_key((ptr, MiB)) != key and be.cache_key((ptr, 2 * MiB), MiB) != key
    cu.cuMemFree(ptr)
    again = _alloc(cu, 2 * MiB)
    try:
        assert be.cache_key((again, 2 * MiB)) != key
    finally:
        cu.cuMemFree(again)
    assert be.cache_key((ptr, 2 * MiB)) is None or ptr == again
