"""The kernel's side of "no device DMA outlives its memory", raw ioctls on a real controller.

A controller holds the registrations it may DMA to (NVME_MAP_REG): UNREGISTER is refused while it
does, closing /dev/p2phub leaves the pin until the controller fd is closed (after the kernel has
disabled the controller), and a revocation turns the controller's bus mastering off and says so in
the status page before the memory goes. Also: who may own a controller (IOMMU confinement or a
tainting opt-out), BAR0 without the MSI-X table, the DMA_PAGES/UNREGISTER race, argsz and byte caps.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import pytest

import p2phub_fakegpu as fg
import regutil
import uffd
from p2phub import uapi
from p2phub.device import Device
from p2phub.hostmem import Udmabuf, VgemBuffer
from p2phub.nvme import bind

from regutil import bus_master as _bus_master, errno_of as _errno_of, nvme_open_arg as _open_arg

pytestmark = pytest.mark.lab

MiB = 1 << 20
PARAMS = Path("/sys/module/p2phub/parameters")


def host_buf(size: int) -> Udmabuf | VgemBuffer:
    """Host memory as a dma-buf: udmabuf where the kernel has it (6.12), else vgem (6.1)."""
    return Udmabuf(size) if Path("/dev/udmabuf").exists() else VgemBuffer(size)


def _register(dev: Device, dmabuf_fd: int, length: int) -> int:
    arg = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF, fd=dmabuf_fd, length=length)
    dev.ioctl(uapi.REGISTER, arg, "REGISTER")
    return arg.out_handle


def _unregister(dev: Device, handle: int) -> int:
    return _errno_of(dev.fd, uapi.UNREGISTER, uapi.Unregister.new(handle=handle))


def _map_reg(ctrl: int, handle: int, count: int = 0) -> tuple[int, uapi.NvmeMapReg, list[int]]:
    addrs = (ctypes.c_uint64 * max(count, 1))()
    arg = uapi.NvmeMapReg.new(handle=handle, count=count, addrs=ctypes.addressof(addrs) if count else 0)
    err = _errno_of(ctrl, uapi.NVME_MAP_REG, arg)
    return err, arg, list(addrs[:count])


@pytest.fixture(scope="module")
def bdf(owned_bdf: str) -> str:
    """This module's tests own the controller: bound to p2phub for the module (conftest)."""
    return owned_bdf


@pytest.fixture
def ctrl(bdf: str, dev: Device) -> Iterator[int]:
    bind.bind(bdf)   # an unbind test hands the controller back to nvme; take it again
    fd = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, _open_arg(bdf), True)
    yield fd
    os.close(fd)


class _Status:
    """The controller fd's read-only status page."""

    def __init__(self, ctrl: int) -> None:
        self.map = mmap.mmap(ctrl, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ,
                             offset=uapi.NVME_MMAP_STATUS)

    @property
    def page(self) -> uapi.NvmeStatus:
        return uapi.NvmeStatus.from_buffer_copy(self.map[:ctypes.sizeof(uapi.NvmeStatus)])

    def close(self) -> None:
        self.map.close()


def test_map_reg_holds_the_registration(dev: Device, ctrl: int) -> None:
    with host_buf(1 * MiB) as buf:
        handle = _register(dev, buf.fd, 1 * MiB)
        err, arg, addrs = _map_reg(ctrl, handle, count=256)
        assert err == 0 and arg.count == 256 and arg.out_total == 256
        assert all(addrs) and arg.out_generation
        st = _Status(ctrl)
        assert st.page.abi == uapi.NVME_STATUS_ABI and st.page.state == 0
        assert st.page.reg_gen[arg.out_slot] == arg.out_generation
        # Held by the controller: the memory cannot be let go under it.
        assert _unregister(dev, handle) == errno.EBUSY
        # Mapping again only copies addresses; same slot, same addresses.
        err, again, addrs2 = _map_reg(ctrl, handle, count=256)
        assert err == 0 and again.out_slot == arg.out_slot and addrs2 == addrs
        assert _errno_of(ctrl, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=handle)) == 0
        assert st.page.reg_gen[arg.out_slot] == 0
        assert _errno_of(ctrl, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=handle)) == errno.ENOENT
        assert _unregister(dev, handle) == 0
        st.close()
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


def test_map_reg_errors(dev: Device, ctrl: int) -> None:
    assert _map_reg(ctrl, 0)[0] == errno.ENOENT
    assert _map_reg(ctrl, 4242)[0] == errno.ENOENT
    with host_buf(64 * 1024) as buf:
        handle = _register(dev, buf.fd, 64 * 1024)
        bad = uapi.NvmeMapReg.new(handle=handle, flags=1)
        assert _errno_of(ctrl, uapi.NVME_MAP_REG, bad) == errno.EINVAL
        bad = uapi.NvmeMapReg.new(handle=handle)
        bad.reserved[0] = 1
        assert _errno_of(ctrl, uapi.NVME_MAP_REG, bad) == errno.EINVAL
        bad = uapi.NvmeMapReg.new(handle=handle, out_slot=3)
        assert _errno_of(ctrl, uapi.NVME_MAP_REG, bad) == errno.EINVAL
        bad = uapi.NvmeMapReg.new(handle=handle, page_size=1000)
        assert _errno_of(ctrl, uapi.NVME_MAP_REG, bad) == errno.EINVAL
        bad = uapi.NvmeMapReg.new(handle=handle, count=uapi.DMA_PAGES_MAX + 1, addrs=8)
        assert _errno_of(ctrl, uapi.NVME_MAP_REG, bad) == errno.E2BIG
        bad = uapi.NvmeMapReg.new(handle=handle, count=1, first=16, addrs=8)
        assert _errno_of(ctrl, uapi.NVME_MAP_REG, bad) == errno.ERANGE
        bad = uapi.NvmeMapReg.new(handle=handle, count=1, addrs=8)   # unmapped user page
        assert _errno_of(ctrl, uapi.NVME_MAP_REG, bad) == errno.EFAULT
        assert _errno_of(ctrl, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=handle)) == 0
        assert _unregister(dev, handle) == 0
    assert _errno_of(ctrl, uapi.NVME_RESUME, uapi.NvmeResume.new(flags=1)) == errno.EINVAL
    assert _errno_of(ctrl, uapi.NVME_REQ_SET, uapi.NvmeReqSet.new(eventfd=0)) == errno.EBADF
    assert _errno_of(ctrl, uapi.NVME_REQ_SET, uapi.NvmeReqSet.new(eventfd=-5)) == errno.EBADF


def test_closing_dev_p2phub_waits_for_the_controller(bdf: str) -> None:
    """The pin outlives /dev/p2phub's release while a controller that may DMA to it is open."""
    buf = host_buf(1 * MiB)
    dev = Device()
    ctrl = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, _open_arg(bdf), True)
    handle = _register(dev, buf.fd, 1 * MiB)
    assert _map_reg(ctrl, handle, count=1)[0] == 0
    dev.close()
    buf.close()
    c = regutil.counters()
    assert c["regs"] == 1 and c["dev_maps"] == 1
    assert _bus_master(bdf)
    os.close(ctrl)
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}
    assert not _bus_master(bdf)


@pytest.fixture(scope="module")
def gpu_module(lab: dict[str, str]) -> Iterator[None]:
    with fg.loaded_module(lab["modules_dir"]):
        yield


def test_revocation_fences_the_controller(bdf: str, dev: Device, ctrl: int, gpu_module: None) -> None:
    """The owner revokes: bus mastering goes off and the status page says so before the unmap."""
    with fg.FakeGpu() as gpu:
        dmabuf = gpu.export_dmabuf(0, 2 * MiB)
        try:
            handle = _register(dev, dmabuf, 2 * MiB)
            err, arg, _ = _map_reg(ctrl, handle, count=1)
            assert err == 0
            st = _Status(ctrl)
            efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            assert _errno_of(ctrl, uapi.NVME_REQ_SET, uapi.NvmeReqSet.new(eventfd=efd)) == 0
            assert _bus_master(bdf)
            gpu.revoke(dmabuf)
            page = st.page
            assert page.state & uapi.NVME_ST_FENCED
            assert page.reg_gen[arg.out_slot] == 0 and page.events >= 1
            assert not _bus_master(bdf)
            assert os.eventfd_read(efd) >= 1
            # Nothing new while fenced; no resume while the revoked memory is still held.
            assert _map_reg(ctrl, handle)[0] == errno.EIO
            assert _errno_of(ctrl, uapi.NVME_RESUME, uapi.NvmeResume.new()) == errno.EBUSY
            assert _errno_of(ctrl, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=handle)) == 0
            assert _errno_of(ctrl, uapi.NVME_RESUME, uapi.NvmeResume.new()) == 0
            assert st.page.state == 0 and _bus_master(bdf)
            assert _unregister(dev, handle) == 0
            os.close(efd)
            st.close()
        finally:
            os.close(dmabuf)
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


def test_status_page_is_read_only(ctrl: int) -> None:
    with pytest.raises(OSError) as exc:
        mmap.mmap(ctrl, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                  offset=uapi.NVME_MMAP_STATUS)
    assert exc.value.errno in (errno.EINVAL, errno.EACCES, errno.EPERM)
    with pytest.raises(OSError):
        mmap.mmap(ctrl, 2 * mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ, offset=uapi.NVME_MMAP_STATUS)


def test_bar0_mmap_stops_before_msix(bdf: str, dev: Device) -> None:
    arg = _open_arg(bdf)
    fd = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, arg, True)
    try:
        assert 0x2000 <= arg.out_bar0_mmap_size < arg.out_bar0_size
        assert arg.out_bar0_mmap_size % mmap.PAGESIZE == 0
        # The doorbells are there; the MSI-X table is not.
        m = mmap.mmap(fd, arg.out_bar0_mmap_size, mmap.MAP_SHARED, offset=0)
        m.close()
        with pytest.raises(OSError) as exc:
            mmap.mmap(fd, arg.out_bar0_mmap_size + mmap.PAGESIZE, mmap.MAP_SHARED, offset=0)
        assert exc.value.errno == errno.EINVAL
    finally:
        os.close(fd)


def _tainted_user() -> bool:
    return bool(int(Path("/proc/sys/kernel/tainted").read_text()) & (1 << 6))


def test_ownership_needs_iommu_confinement(bdf: str, dev: Device, lab: dict[str, str]) -> None:
    """VFIO's rule: an IOMMU must confine the controller, or the admin opts out and the kernel is tainted."""
    param = PARAMS / "allow_unsafe_noiommu"
    old = param.read_text().strip()
    try:
        param.write_text("N")
        if lab.get("iommu_groups") == "1":
            # The emulated intel-iommu translates, the group is ours, MSIs are remapped.
            os.close(fcntl.ioctl(dev.fd, uapi.NVME_OPEN, _open_arg(bdf), True))
            assert not _tainted_user()
        else:
            assert _errno_of(dev.fd, uapi.NVME_OPEN, _open_arg(bdf)) == errno.EXDEV
            param.write_text("Y")
            os.close(fcntl.ioctl(dev.fd, uapi.NVME_OPEN, _open_arg(bdf), True))
            assert _tainted_user(), "owning an unconfined controller must taint the kernel"
    finally:
        param.write_text(old)


def test_dma_pages_races_unregister(dev: Device, lab: dict[str, str]) -> None:
    """DMA_PAGES copying while another thread unregisters: only documented errnos, no UAF."""
    seen: set[int] = set()
    dom, bus, devfn = bind.split_bdf(lab["nvme_baseline"])
    addrs = (ctypes.c_uint64 * 4096)()
    for _ in range(40):
        with host_buf(16 * MiB) as buf:
            handle = _register(dev, buf.fd, 16 * MiB)
            go = threading.Event()

            def pages() -> None:
                go.wait()
                arg = uapi.DmaPages.new(handle=handle, domain=dom, bus=bus, devfn=devfn,
                                        count=4096, addrs=ctypes.addressof(addrs))
                seen.add(_errno_of(dev.fd, uapi.DMA_PAGES, arg))

            t = threading.Thread(target=pages)
            t.start()
            go.set()
            while True:
                err = _unregister(dev, handle)
                seen.add(err)
                if err != errno.EBUSY:
                    break
            t.join()
    assert seen <= {0, errno.EBUSY, errno.ENOENT, errno.ESTALE}, seen
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


def test_map_reg_races_unregister(dev: Device, ctrl: int) -> None:
    """The controller's first NVME_MAP_REG of a registration (which makes its map) while another
    thread unregisters it: MAP_REG either holds it (UNREGISTER then EBUSY, until UNMAP_REG) or
    finds it gone (ENOENT, ESTALE); never another errno, never a read of a freed map (KASAN on the
    debug kernel)."""
    seen: set[int] = set()
    for _ in range(40):
        with host_buf(4 * MiB) as buf:
            handle = _register(dev, buf.fd, 4 * MiB)
            go = threading.Event()
            mapped: list[int] = []

            def map_reg() -> None:
                go.wait()
                err, _arg, _addrs = _map_reg(ctrl, handle, count=16)
                mapped.append(err)

            t = threading.Thread(target=map_reg)
            t.start()
            go.set()
            while True:
                err = _unregister(dev, handle)
                seen.add(err)
                if err != errno.EBUSY:
                    break
                if not t.is_alive() and mapped == [0]:
                    assert _errno_of(ctrl, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=handle)) == 0
            t.join()
            seen.update(mapped)
    assert seen <= {0, errno.EBUSY, errno.ENOENT, errno.ESTALE}, seen
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


def test_dma_pages_blocked_in_its_copy_keeps_the_registration(dev: Device, lab: dict[str, str]) -> None:
    """H1, forced rather than raced: DMA_PAGES is held inside its copy to user space (the
    destination is a userfaultfd page whose fault this test serves late) while UNREGISTER
    runs on the same fd. The registration must stay (EBUSY) until the copy is over, and every
    address handed out must be the registration's own, not bytes of a freed array."""
    why = uffd.available()
    if why:
        pytest.skip(f"needs userfaultfd to hold the copy: {why}")
    dom, bus, devfn = bind.split_bdf(lab["nvme_baseline"])
    n = 16 * MiB // 4096
    with host_buf(16 * MiB) as buf:
        handle = _register(dev, buf.fd, 16 * MiB)
        ref = (ctypes.c_uint64 * n)()
        dev.ioctl(uapi.DMA_PAGES, uapi.DmaPages.new(handle=handle, domain=dom, bus=bus, devfn=devfn,
                                                    count=n, addrs=ctypes.addressof(ref)), "DMA_PAGES")
        result: dict[str, int] = {}
        with uffd.HeldPages(n * 8 // mmap.PAGESIZE) as held:
            def pages() -> None:
                arg = uapi.DmaPages.new(handle=handle, domain=dom, bus=bus, devfn=devfn, count=n,
                                        addrs=held.addr)
                result["errno"] = _errno_of(dev.fd, uapi.DMA_PAGES, arg)

            t = threading.Thread(target=pages)
            t.start()
            assert held.wait_fault(60), "DMA_PAGES never reached its copy to user space"
            unreg = _unregister(dev, handle)          # while the copy is held
            held.release()
            t.join(60)
            assert not t.is_alive(), "DMA_PAGES did not return after its page was served"
            got = list((ctypes.c_uint64 * n).from_address(held.addr))
        foreign = sum(1 for a, b in zip(got, ref) if a != b)
        assert unreg == errno.EBUSY and foreign == 0, (
            f"UNREGISTER during the copy returned {errno.errorcode.get(unreg, unreg)} (want EBUSY); "
            f"DMA_PAGES returned {errno.errorcode.get(result.get('errno', -1), result)} and "
            f"{foreign} of {n} addresses it handed out are not the registration's")
        assert result["errno"] == 0
        assert _unregister(dev, handle) == 0
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


def test_foreign_device_maps_need_cap_sys_admin(dev: Device) -> None:
    """Without CAP_SYS_ADMIN, DMA_PAGES and REGISTER F_DEVICE are refused (EPERM)."""
    code = (
        "import ctypes, errno, fcntl, os\n"
        "from p2phub import uapi\n"
        "from pathlib import Path\n"
        "from p2phub.hostmem import Udmabuf, VgemBuffer\n"
        "fd = os.open('/dev/p2phub', os.O_RDWR)\n"
        "b = Udmabuf(65536) if Path('/dev/udmabuf').exists() else VgemBuffer(65536)\n"
        "a = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF | uapi.REGISTER_F_DEVICE, fd=b.fd, length=65536)\n"
        "try:\n    fcntl.ioctl(fd, uapi.REGISTER, a, True); print('register', 0)\n"
        "except OSError as e:\n    print('register', e.errno)\n"
        "a = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF, fd=b.fd, length=65536)\n"
        "fcntl.ioctl(fd, uapi.REGISTER, a, True)\n"
        "p = uapi.DmaPages.new(handle=a.out_handle)\n"
        "try:\n    fcntl.ioctl(fd, uapi.DMA_PAGES, p, True); print('pages', 0)\n"
        "except OSError as e:\n    print('pages', e.errno)\n"
    )
    out = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin",
                          sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["register", str(errno.EPERM), "pages", str(errno.EPERM)]


def test_argsz_is_capped_at_a_page(dev: Device) -> None:
    buf = ctypes.create_string_buffer(8192)
    hdr = (ctypes.c_uint32 * 2).from_buffer(buf)
    hdr[0] = 4096 + 8
    assert _errno_of(dev.fd, uapi.GET_INFO, buf) == errno.E2BIG
    hdr[0] = 4096
    assert _errno_of(dev.fd, uapi.GET_INFO, buf) == 0


def test_registered_bytes_are_capped(dev: Device) -> None:
    param = PARAMS / "max_reg_gib"
    old = param.read_text().strip()
    try:
        param.write_text("0")
        with host_buf(64 * 1024) as buf:
            arg = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF, fd=buf.fd, length=64 * 1024)
            assert _errno_of(dev.fd, uapi.REGISTER, arg) == errno.ENOSPC
    finally:
        param.write_text(old)
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


def test_function_reset_fences_the_owner(bdf: str, dev: Device, ctrl: int) -> None:
    """An FLR under the owner's feet: bus mastering off, ERROR in the status page, RESUME after."""
    reset = Path(f"/sys/bus/pci/devices/{bdf}/reset")
    if not reset.exists():
        pytest.skip("the controller offers no reset method")
    st = _Status(ctrl)
    assert _bus_master(bdf)
    reset.write_text("1")
    assert st.page.state & uapi.NVME_ST_ERROR
    assert not _bus_master(bdf)
    assert _errno_of(ctrl, uapi.NVME_RESUME, uapi.NvmeResume.new()) == 0
    assert st.page.state == 0 and _bus_master(bdf)
    st.close()


def test_unbind_asks_the_owner_to_let_go(lab: dict[str, str]) -> None:
    """Unbind does not hang on a silent owner: it sets REMOVING and signals the request eventfd."""
    b = lab["nvme_target"]
    bind.bind(b)
    dev = Device()
    ctrl = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, _open_arg(b), True)
    st = _Status(ctrl)
    efd = os.eventfd(0, os.EFD_CLOEXEC)
    assert _errno_of(ctrl, uapi.NVME_REQ_SET, uapi.NvmeReqSet.new(eventfd=efd)) == 0
    done = threading.Event()

    def unbind() -> None:
        Path(f"/sys/bus/pci/devices/{b}/driver/unbind").write_text(b)
        done.set()

    t = threading.Thread(target=unbind)
    t.start()
    try:
        assert os.eventfd_read(efd) >= 1          # the kernel asked
        assert st.page.state & uapi.NVME_ST_REMOVING
        assert not done.is_set()                   # and waits for the owner
        # A new owner is refused at once rather than queued behind the unbind.
        with Device() as other:
            assert _errno_of(other.fd, uapi.NVME_OPEN, _open_arg(b)) in (errno.EBUSY, errno.ENXIO)
    finally:
        st.close()
        os.close(ctrl)
        os.close(efd)
        dev.close()
        t.join(timeout=60)
    assert done.is_set(), "unbind did not finish once the owner closed its fd"
    bind.unbind(b)      # back to the kernel nvme driver (and rebinds the module fixture's next use)


# ------------------------------------------------------- revocation and unmap order (N1)

def _export(dev: Device, handle: int) -> int:
    return fcntl.ioctl(dev.fd, uapi.EXPORT, uapi.Export.new(handle=handle, flags=uapi.EXPORT_F_CLOEXEC),
                       True)


def test_unmap_reg_drops_the_controller_mapping(bdf: str, dev: Device, ctrl: int, gpu_module: None) -> None:
    """UNMAP_REG takes the controller's mapping away at once (the exporter counts it gone), so no
    address the controller was told stays reachable until UNREGISTER; a revocation then finds
    nothing of p2phub's still mapped when its wait for p2phub's fence returns."""
    with fg.FakeGpu() as gpu:
        dmabuf = gpu.export_dmabuf(4 * MiB, 1 * MiB)
        try:
            base = gpu.query().mappings
            handle = _register(dev, dmabuf, 1 * MiB)
            assert _map_reg(ctrl, handle, count=1)[0] == 0
            assert gpu.query().mappings == base + 1
            assert _errno_of(ctrl, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=handle)) == 0
            info = uapi.RegInfo.new(handle=handle)
            dev.ioctl(uapi.REG_INFO, info, "REG_INFO")
            assert (info.out_nr_devices, gpu.query().mappings) == (0, base), \
                "the controller's mapping outlived UNMAP_REG"
            # Mapped again, then revoked: every mapping is gone before the fence lets the exporter go.
            assert _map_reg(ctrl, handle, count=1)[0] == 0
            assert _errno_of(ctrl, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=handle)) == 0
            assert _map_reg(ctrl, handle, count=1)[0] == 0
            assert gpu.revoke(dmabuf).mappings_left == 0
            assert _errno_of(ctrl, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=handle)) == 0
            assert _errno_of(ctrl, uapi.NVME_RESUME, uapi.NvmeResume.new()) == 0
            assert _unregister(dev, handle) == 0
        finally:
            os.close(dmabuf)
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


def test_resume_waits_for_revoked_mappings(bdf: str, dev: Device, ctrl: int, gpu_module: None,
                                           lab: dict[str, str]) -> None:
    """A revoked registration still mapped for the controller (an importer of its export, on the
    same device, is still busy) keeps RESUME refused (EBUSY) even after UNMAP_REG: bus mastering
    must not come back while an address of the revoked memory is reachable. Once the importer is
    done, the mapping goes before the exporter's wait returns, and RESUME succeeds."""
    with fg.FakeGpu() as gpu, regutil.consumer_loaded(lab["modules_dir"]) as consumer:
        dmabuf = gpu.export_dmabuf(5 * MiB, 1 * MiB)
        exp = -1
        try:
            handle = _register(dev, dmabuf, 1 * MiB)
            exp = _export(dev, handle)
            consumer.command("hold")
            consumer.command(f"dmabuf {exp} {bdf}")
            assert consumer.state()["mapped"] == 1
            assert _map_reg(ctrl, handle, count=1)[0] == 0
            st = _Status(ctrl)
            out: dict[str, object] = {}
            t = threading.Thread(target=lambda: out.update(r=gpu.revoke(dmabuf)))
            t.start()
            try:
                assert regutil.wait_until(lambda: bool(st.page.state & uapi.NVME_ST_FENCED), 30)
                assert regutil.wait_until(lambda: consumer.state()["fence_pending"] == 1, 30)
                assert _errno_of(ctrl, uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=handle)) == 0
                assert t.is_alive()
                assert _errno_of(ctrl, uapi.NVME_RESUME, uapi.NvmeResume.new()) == errno.EBUSY, \
                    "RESUME re-enabled bus mastering while the revoked memory was still mapped"
                assert not _bus_master(bdf)
            finally:
                consumer.command("signal")
                t.join(60)
            assert not t.is_alive() and out["r"].mappings_left == 0
            assert _errno_of(ctrl, uapi.NVME_RESUME, uapi.NvmeResume.new()) == 0
            assert _bus_master(bdf)
            consumer.command("release")
            os.close(exp)
            exp = -1
            st.close()
            assert _unregister(dev, handle) == 0
        finally:
            if exp >= 0:
                os.close(exp)
            os.close(dmabuf)
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}
