"""The NVMe ioctls of p2phub.ko, raw: every documented errno, and what closing releases."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from pathlib import Path
from typing import Iterator

import pytest

from p2phub import uapi
from p2phub.device import Device

from regutil import errno_of as _errno_of, nvme_open_arg as _open_arg

pytestmark = pytest.mark.lab

DEBUGFS = Path("/sys/kernel/debug/p2phub/nvme")


@pytest.fixture(scope="module")
def bdf(owned_bdf: str) -> str:
    """This module's tests own the controller: bound to p2phub for the module (conftest)."""
    return owned_bdf


@pytest.fixture
def handle(bdf: str, dev: Device) -> Iterator[int]:
    fd = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, _open_arg(bdf), True)
    yield fd
    os.close(fd)
    assert int((DEBUGFS / "live_handles").read_text()) == 0
    assert int((DEBUGFS / "live_dma_buffers").read_text()) == 0


def test_open_errors(bdf: str, dev: Device, lab: dict[str, str]) -> None:
    assert _errno_of(dev.fd, uapi.NVME_OPEN, _open_arg(bdf, flags=1)) == errno.EINVAL
    a = _open_arg(bdf)
    a.reserved[0] = 1
    assert _errno_of(dev.fd, uapi.NVME_OPEN, a) == errno.EINVAL
    a = _open_arg(bdf, out_bar0_size=1)
    assert _errno_of(dev.fd, uapi.NVME_OPEN, a) == errno.EINVAL
    a = _open_arg(bdf)
    a.argsz = 16
    assert _errno_of(dev.fd, uapi.NVME_OPEN, a) == errno.EINVAL
    # The kernel-driven twin is not ours; a slot with no device is nobody's.
    assert _errno_of(dev.fd, uapi.NVME_OPEN, _open_arg(lab["nvme_baseline"])) == errno.ENXIO
    assert _errno_of(dev.fd, uapi.NVME_OPEN, _open_arg("0000:7f:1f.7")) == errno.ENODEV


def test_one_owner(bdf: str, dev: Device, handle: int) -> None:
    assert _errno_of(dev.fd, uapi.NVME_OPEN, _open_arg(bdf)) == errno.EBUSY


def test_dma_alloc_free_mmap(handle: int) -> None:
    for size in (0, 100, uapi.NVME_DMA_MAX_BUF + 4096):
        assert _errno_of(handle, uapi.NVME_DMA_ALLOC, uapi.NvmeDmaAlloc.new(size=size)) == errno.EINVAL
    assert _errno_of(handle, uapi.NVME_DMA_ALLOC, uapi.NvmeDmaAlloc.new(size=4096, flags=2)) == errno.EINVAL
    a = uapi.NvmeDmaAlloc.new(size=8192)
    assert _errno_of(handle, uapi.NVME_DMA_ALLOC, a) == 0
    assert a.out_dma_addr % 4096 == 0 and a.out_mmap_offset == (a.out_id + 1) << uapi.NVME_MMAP_DMA_SHIFT
    assert int((DEBUGFS / "live_dma_buffers").read_text()) == 1
    with pytest.raises(OSError) as e:  # larger than the buffer
        mmap.mmap(handle, 3 * 4096, mmap.MAP_SHARED, offset=a.out_mmap_offset)
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:  # private
        mmap.mmap(handle, 4096, mmap.MAP_PRIVATE, offset=a.out_mmap_offset)
    assert e.value.errno == errno.EINVAL
    with pytest.raises(OSError) as e:  # no such buffer
        mmap.mmap(handle, 4096, mmap.MAP_SHARED, offset=(a.out_id + 9) << uapi.NVME_MMAP_DMA_SHIFT)
    assert e.value.errno == errno.EINVAL
    m = mmap.mmap(handle, 8192, mmap.MAP_SHARED, offset=a.out_mmap_offset)
    m[:5] = b"hello"
    # Mapped: refused; unmapped: freed.
    assert _errno_of(handle, uapi.NVME_DMA_FREE, uapi.NvmeDmaFree.new(id=a.out_id)) == errno.EBUSY
    m.close()
    assert _errno_of(handle, uapi.NVME_DMA_FREE, uapi.NvmeDmaFree.new(id=a.out_id)) == 0
    assert _errno_of(handle, uapi.NVME_DMA_FREE, uapi.NvmeDmaFree.new(id=a.out_id)) == errno.ENOENT
    assert int((DEBUGFS / "live_dma_buffers").read_text()) == 0


def test_dma_free_refused_while_controller_enabled(handle: int) -> None:
    bar = mmap.mmap(handle, 0x2000, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
    regs = memoryview(bar).cast("I")
    a = uapi.NvmeDmaAlloc.new(size=4096)
    assert _errno_of(handle, uapi.NVME_DMA_ALLOC, a) == 0
    q = uapi.NvmeDmaAlloc.new(size=4096)
    assert _errno_of(handle, uapi.NVME_DMA_ALLOC, q) == 0
    # Enable with a one-page admin queue pair (no commands).
    regs[0x14 // 4] = 0
    regs[0x24 // 4] = (1 << 16) | 1
    regs[0x28 // 4], regs[0x2C // 4] = q.out_dma_addr & 0xFFFFFFFF, q.out_dma_addr >> 32
    regs[0x30 // 4], regs[0x34 // 4] = a.out_dma_addr & 0xFFFFFFFF, a.out_dma_addr >> 32
    regs[0x14 // 4] = (4 << 20) | (6 << 16) | 1
    for _ in range(10000):
        if regs[0x1C // 4] & 1:
            break
    assert regs[0x1C // 4] & 1, "controller did not become ready"
    assert _errno_of(handle, uapi.NVME_DMA_FREE, uapi.NvmeDmaFree.new(id=a.out_id)) == errno.EBUSY
    regs.release()
    bar.close()
    # Closing the handle (fixture) disables the controller, then frees both buffers.


def test_function_reset_between_owners(bdf: str, dev: Device) -> None:
    """Closing the controller fd resets the PCI function before anyone else gets it (as
    VFIO does), and the next owner finds a working controller."""
    methods = Path(f"/sys/bus/pci/devices/{bdf}/reset_method").read_text().split()
    assert methods, "the lab's NVMe controller offers no reset method"
    before = int((DEBUGFS / "function_resets").read_text())
    aqa_left = (0x1F << 16) | 0x1F
    for owner in range(2):
        fd = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, _open_arg(bdf), True)
        try:
            bar = mmap.mmap(fd, 0x2000, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
            regs = memoryview(bar).cast("I")
            try:
                vs, aqa = regs[2], regs[0x24 // 4]
                if owner == 0:
                    regs[0x24 // 4] = aqa_left            # state this owner leaves behind
            finally:
                regs.release()
                bar.close()
        finally:
            os.close(fd)
        assert vs >= 0x10000, f"owner {owner} read VS {vs:#x}: the registers do not answer"
    resets = int((DEBUGFS / "function_resets").read_text()) - before
    assert resets == 4, f"{resets} function resets for 2 owners, want one at each open and release " \
        f"(reset methods: {methods})"
    print(f"reset methods {methods}; AQA the next owner saw: {aqa:#x} (left: {aqa_left:#x})")


def test_bar_mmap_bounds(handle: int) -> None:
    m = mmap.mmap(handle, 0x2000, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
    vs = memoryview(m).cast("I")[2]
    assert vs >= 0x10000  # NVMe version register: 1.x or later
    with pytest.raises(OSError) as e:
        mmap.mmap(handle, 64 << 20, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
    assert e.value.errno == errno.EINVAL
    m.close()


def test_irq_set_errors(handle: int) -> None:
    assert _errno_of(handle, uapi.NVME_IRQ_SET, uapi.NvmeIrqSet.new(vector=uapi.NVME_MAX_IRQS, eventfd=-1)) \
        == errno.EINVAL
    r, w = os.pipe()
    try:
        assert _errno_of(handle, uapi.NVME_IRQ_SET, uapi.NvmeIrqSet.new(vector=0, eventfd=r)) == errno.EINVAL
    finally:
        os.close(r)
        os.close(w)
    assert _errno_of(handle, uapi.NVME_IRQ_SET, uapi.NvmeIrqSet.new(vector=0, eventfd=-5)) == errno.EBADF
    efd = os.eventfd(0)
    try:
        assert _errno_of(handle, uapi.NVME_IRQ_SET, uapi.NvmeIrqSet.new(vector=0, eventfd=efd)) == 0
        assert _errno_of(handle, uapi.NVME_IRQ_SET, uapi.NvmeIrqSet.new(vector=0, eventfd=efd)) == 0  # replace
        assert _errno_of(handle, uapi.NVME_IRQ_SET, uapi.NvmeIrqSet.new(vector=0, eventfd=-1)) == 0  # detach
        assert _errno_of(handle, uapi.NVME_IRQ_SET, uapi.NvmeIrqSet.new(vector=1, eventfd=efd)) == 0
        # Left attached: closing the handle frees the vector.
    finally:
        os.close(efd)


def test_unknown_ioctl_on_handle(handle: int) -> None:
    with pytest.raises(OSError) as e:
        fcntl.ioctl(handle, uapi.GET_INFO, uapi.Info.new(), True)
    assert e.value.errno == errno.ENOTTY


# --------------------------------------------------------------------------- the controller contract (C1)


def test_open_reports_the_mappable_bar0_and_no_more_maps(bdf: str, dev: Device) -> None:
    arg = _open_arg(bdf)
    fd = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, arg, True)
    try:
        size = arg.out_bar0_mmap_size
        assert 0x2000 <= size <= arg.out_bar0_size and size % mmap.PAGESIZE == 0
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
        m.close()
        with pytest.raises(OSError) as e:
            mmap.mmap(fd, size + mmap.PAGESIZE, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
        assert e.value.errno == errno.EINVAL
    finally:
        os.close(fd)


def test_status_page_is_read_only_and_starts_clean(handle: int) -> None:
    st = mmap.mmap(handle, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ, offset=uapi.NVME_MMAP_STATUS)
    try:
        s = uapi.NvmeStatus.from_buffer_copy(st[:ctypes.sizeof(uapi.NvmeStatus)])
        assert s.abi == uapi.NVME_STATUS_ABI and s.state == 0 and list(s.reg_gen) == [0] * uapi.NVME_MAX_MAPS
    finally:
        st.close()
    with pytest.raises(OSError):
        mmap.mmap(handle, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                  offset=uapi.NVME_MMAP_STATUS)


def test_map_reg_holds_a_registration_until_unmapped(bdf: str, dev: Device, handle: int) -> None:
    from p2phub.hostmem import VgemBuffer

    buf = VgemBuffer(64 << 10)
    try:
        reg = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF, fd=buf.fd, length=64 << 10)
        dev.ioctl(uapi.REGISTER, reg, "REGISTER")
        h = reg.out_handle
        addrs = (ctypes.c_uint64 * 16)()
        a = uapi.NvmeMapReg.new(handle=h, addrs=ctypes.addressof(addrs), count=16, page_size=4096)
        assert _errno_of(handle, uapi.NVME_MAP_REG, a) == 0
        assert a.out_total == 16 and a.out_generation != 0 and a.out_slot < uapi.NVME_MAX_MAPS
        assert all(addrs[i] and addrs[i] % 4096 == 0 for i in range(16))
        st = mmap.mmap(handle, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ, offset=uapi.NVME_MMAP_STATUS)
        s = uapi.NvmeStatus.from_buffer_copy(st[:ctypes.sizeof(uapi.NvmeStatus)])
        assert s.reg_gen[a.out_slot] == a.out_generation
        # Held: UNREGISTER is refused.
        assert _errno_of(dev.fd, uapi.UNREGISTER, uapi.Unregister.new(handle=h)) == errno.EBUSY
        assert _errno_of(handle, uapi.NVME_MAP_REG, uapi.NvmeMapReg.new(handle=h + 1000)) == errno.ENOENT
        assert _errno_of(handle, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=h)) == 0
        assert _errno_of(handle, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=h)) == errno.ENOENT
        s = uapi.NvmeStatus.from_buffer_copy(st[:ctypes.sizeof(uapi.NvmeStatus)])
        assert s.reg_gen[a.out_slot] == 0
        st.close()
        assert _errno_of(dev.fd, uapi.UNREGISTER, uapi.Unregister.new(handle=h)) == 0
    finally:
        buf.close()


def test_req_set(handle: int) -> None:
    efd = os.eventfd(0)
    try:
        assert _errno_of(handle, uapi.NVME_REQ_SET, uapi.NvmeReqSet.new(eventfd=efd)) == 0
        assert _errno_of(handle, uapi.NVME_REQ_SET, uapi.NvmeReqSet.new(eventfd=-1)) == 0
        assert _errno_of(handle, uapi.NVME_REQ_SET, uapi.NvmeReqSet.new(eventfd=efd, flags=1)) == errno.EINVAL
    finally:
        os.close(efd)


def test_open_resets_the_function(bdf: str, dev: Device) -> None:
    """OPEN resets the PCI function before the new owner gets it (as VFIO does at open), under the
    device lock; bus mastering is on once OPEN returns, and the registers answer."""
    before = int((DEBUGFS / "function_resets").read_text())
    fd = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, _open_arg(bdf), True)
    try:
        assert int((DEBUGFS / "function_resets").read_text()) - before == 1, "OPEN did not reset"
        cmd = int.from_bytes(Path(f"/sys/bus/pci/devices/{bdf}/config").read_bytes()[4:6], "little")
        assert cmd & 0x4, "bus mastering is off after OPEN"
        bar = mmap.mmap(fd, 0x2000, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
        try:
            regs = memoryview(bar).cast("I")
            assert regs[2] >= 0x10000 and regs[0x14 // 4] & 1 == 0   # VS answers, CC.EN is 0
            regs.release()
        finally:
            bar.close()
    finally:
        os.close(fd)


# --------------------------------------------------------------------- faults after a partial munmap (S8)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def _addr(m: mmap.mmap) -> int:
    buf = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf


def _drop_first_page(m: mmap.mmap) -> int:
    """munmap the first page of `m` (the VMA's vm_pgoff moves on); the address of what is left."""
    base = _addr(m)
    assert _libc.munmap(base, mmap.PAGESIZE) == 0, os.strerror(ctypes.get_errno())
    return base + mmap.PAGESIZE


def test_dma_buffer_faults_follow_a_partial_munmap(handle: int) -> None:
    """After the front of a DMA-buffer mapping is unmapped, the rest still maps its own pages:
    page 1 of the buffer faults in at page 1's address, not page 0."""
    n = 3
    a = uapi.NvmeDmaAlloc.new(size=n * mmap.PAGESIZE)
    assert _errno_of(handle, uapi.NVME_DMA_ALLOC, a) == 0
    writer = mmap.mmap(handle, n * mmap.PAGESIZE, mmap.MAP_SHARED, offset=a.out_mmap_offset)
    # A second mapping, not touched before the munmap: its pages fault in after it.
    reader = mmap.mmap(handle, n * mmap.PAGESIZE, mmap.MAP_SHARED, offset=a.out_mmap_offset)
    try:
        for i in range(n):
            writer[i * mmap.PAGESIZE:i * mmap.PAGESIZE + 8] = b"page%04d" % i
        rest = _drop_first_page(reader)
        got = [ctypes.string_at(rest + i * mmap.PAGESIZE, 8) for i in range(n - 1)]
        assert got == [b"page%04d" % (i + 1) for i in range(n - 1)], \
            f"after munmap of page 0 the mapping shows {got} (the buffer's pages from 0, not 1)"
    finally:
        reader.close()
        writer.close()


def test_bar0_faults_follow_a_partial_munmap(bdf: str, dev: Device) -> None:
    """The same for BAR0: page 1 (the doorbells) after the register page is unmapped."""
    arg = _open_arg(bdf)
    fd = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, arg, True)
    try:
        size = 2 * mmap.PAGESIZE
        assert arg.out_bar0_mmap_size >= size
        whole = mmap.mmap(fd, size, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
        cut = mmap.mmap(fd, size, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
        try:
            cap = ctypes.c_uint32.from_address(_addr(whole)).value
            page1 = ctypes.c_uint32.from_address(_addr(whole) + mmap.PAGESIZE).value
            assert cap != page1, f"CAP {cap:#x} and BAR0 page 1 {page1:#x} read the same"
            rest = _drop_first_page(cut)
            got = ctypes.c_uint32.from_address(rest).value
            assert got == page1, f"BAR0 page 1 reads {got:#x} after munmap of page 0, want {page1:#x} " \
                f"(CAP is {cap:#x})"
        finally:
            cut.close()
            whole.close()
    finally:
        os.close(fd)
