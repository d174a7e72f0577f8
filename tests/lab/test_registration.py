"""p2phub.ko registrations in the lab: page lists per device, export, revocation, leaks.

Runs inside tools/lab's VM with p2phub.ko loaded; the stand-in GPU module is
loaded here when missing.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from p2phub import uapi
from p2phub.errors import P2PHubOSError, RevokedError, UsageError
from p2phub.hostmem import Udmabuf, VgemBuffer
from p2phub.hub import Hub, Provider, RegState

import p2phub_fakegpu as fg
import regutil as ru
import uffd

MiB = 1 << 20
KiB = 1 << 10
TOP = Path(__file__).resolve().parents[2]


@pytest.fixture
def target(lab: dict[str, str]) -> str:
    return lab["nvme_target"]


@pytest.fixture
def iommu(lab: dict[str, str]) -> bool:
    return lab.get("iommu") == "1"


@pytest.fixture(autouse=True)
def no_leaks():
    yield
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


def _aligned_distinct(pages: list[int], size: int) -> None:
    assert all(p and p % size == 0 for p in pages), "DMA addresses not page aligned"
    assert len(set(pages)) == len(pages), "two pages share a DMA address"


# ------------------------------------------------------------------ page lists


def test_module_caps() -> None:
    with Hub() as hub:
        caps = hub.info().caps
    assert uapi.Cap.DMABUF_IMPORT in caps and uapi.Cap.DMABUF_EXPORT in caps
    assert uapi.Cap.NVIDIA_P2P_BUILT in caps


def test_vgem_page_list(target: str, iommu: bool) -> None:
    with Hub() as hub, VgemBuffer(1 * MiB) as buf:
        with hub.register_dmabuf(buf.fd, device=target) as reg:
            assert (reg.provider, reg.page_size, reg.length) == (Provider.DMABUF, 4096, MiB)
            pages = reg.dma_pages(target)
            assert len(pages) == 256
            _aligned_distinct(pages, 4096)
            info = reg.info()
            assert (info.state, info.nr_devices, info.length) == (RegState.LIVE, 1, MiB)
            assert reg.dma_pages(target) == pages      # cached, stable
            with hub.register_dmabuf(buf.fd, offset=64 * KiB, length=128 * KiB) as win:
                wpages = win.dma_pages(target)
                assert len(wpages) == 32
                _aligned_distinct(wpages, 4096)
                if not iommu:   # bus address = physical: the same pages
                    assert wpages == pages[16:48]


def test_udmabuf_page_list_is_iova_under_iommu(lab: dict[str, str], target: str,
                                               iommu: bool) -> None:
    if lab["kernel_release"].startswith("6.1."):
        assert not Path("/dev/udmabuf").exists()
        pytest.skip("Debian 6.1 has no udmabuf (CONFIG_UDMABUF off)")
    with Hub() as hub, Udmabuf(2 * MiB) as buf:
        m = buf.mmap()
        m.write(b"\xa5" * buf.size)                 # make every page resident
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        phys = ru.phys_addrs(addr, buf.size)
        with hub.register_dmabuf(buf.fd, device=target) as reg:
            pages = reg.dma_pages(target)
            assert len(pages) == 512 and reg.page_size == 4096
            _aligned_distinct(pages, 4096)
            if iommu:
                assert pages != phys, "with the IOMMU on, addresses must be IOVAs"
                assert not set(pages) & set(phys) or len(set(pages) & set(phys)) < 8
            else:
                assert pages == phys
        del addr
        m.close()


def test_memory_that_would_bounce_is_refused(lab: dict[str, str], resident_gpu: fg.FakeGpu,
                                            target: str, iommu: bool) -> None:
    """No dma_sync runs around user-space DMA, so a swiotlb-bounced map must be refused.

    With `tools/lab run --cmdline swiotlb=force` (no IOMMU) the exporter maps host pages
    through bounce buffers: the SSD would write to the bounce copy and the pages would
    never see it. The stand-in GPU's BAR is peer memory and never bounces.
    """
    if lab["kernel_release"].startswith("6.1."):
        pytest.skip("Debian 6.1 has no udmabuf (CONFIG_UDMABUF off)")
    forced = "swiotlb=force" in Path("/proc/cmdline").read_text().split()
    with Hub() as hub, Udmabuf(1 * MiB) as buf, hub.register_dmabuf(buf.fd) as reg:
        if forced and not iommu:
            with pytest.raises(P2PHubOSError) as exc:
                reg.dma_pages(target)
            assert exc.value.errno == errno.EOPNOTSUPP and "bounce buffers" in str(exc.value)
            assert "would need dma_sync" in subprocess.run(
                ["dmesg"], capture_output=True, text=True).stdout
        else:
            assert len(reg.dma_pages(target)) == 256
    q = resident_gpu.query()
    fd = resident_gpu.export_dmabuf(0, 1 * MiB)
    try:
        with Hub() as hub, hub.register_dmabuf(fd, device=target) as reg:
            pages = reg.dma_pages(target)
            if not iommu:
                assert pages == [q.bar_addr + i * 4096 for i in range(256)]
    finally:
        os.close(fd)
    assert ru.wait_no_leaks() == dict.fromkeys(ru.LEAK_COUNTERS, 0)


def test_fakegpu_dmabuf_page_list(resident_gpu: fg.FakeGpu, target: str, iommu: bool) -> None:
    q = resident_gpu.query()
    off, length = 1 * MiB, 1 * MiB
    fd = resident_gpu.export_dmabuf(off, length)
    try:
        with Hub() as hub, hub.register_dmabuf(fd, device=target) as reg:
            pages = reg.dma_pages(target)
            assert len(pages) == 256 and reg.page_size == 4096
            _aligned_distinct(pages, 4096)
            bus = [q.bar_addr + off + i * 4096 for i in range(256)]
            assert (pages != bus) if iommu else (pages == bus)
            # One pin from p2phub; without CONFIG_DMABUF_MOVE_NOTIFY the core pins again per map.
            assert resident_gpu.query().pins >= q.pins + 1
    finally:
        os.close(fd)
    assert resident_gpu.query().attachments == 0 and resident_gpu.query().pins == 0


def test_nvidia_p2p_page_list(resident_gpu: fg.FakeGpu, target: str, iommu: bool) -> None:
    q = resident_gpu.query()
    off, length = 4 * MiB, 1 * MiB
    with Hub() as hub, hub.register_nvidia(resident_gpu.va(off), length, device=target) as reg:
        assert (reg.provider, reg.page_size) == (Provider.NVIDIA, 64 * KiB)
        pages = reg.dma_pages(target)
        assert len(pages) == 16
        _aligned_distinct(pages, 64 * KiB)
        bus = [q.bar_addr + off + i * 64 * KiB for i in range(16)]
        assert (pages != bus) if iommu else (pages == bus)
        small = reg.dma_pages(target, page_size=4096)
        assert len(small) == 256
        assert small[::16] == pages and small[1] == pages[0] + 4096
        assert resident_gpu.query().page_tables == q.page_tables + 1
    c = resident_gpu.query()
    assert (c.page_tables, c.dma_mappings) == (0, 0)


# ------------------------------------------------------------------ export


def test_export_vgem_reimport(target: str) -> None:
    """An export registered again is the same memory; an export of that is too (one level deep)."""
    with Hub() as hub, VgemBuffer(256 * KiB) as buf:
        reg = hub.register_dmabuf(buf.fd, device=target)
        pages = reg.dma_pages(target)
        fd = reg.dmabuf_fd
        assert os.lseek(fd, 0, os.SEEK_END) == 256 * KiB
        assert fg.dmabuf_info(fd)["exp_name"] == "p2phub"
        with hub.register_dmabuf(fd, device=target) as again:
            assert again.dma_pages(target) == pages
            info = reg.info()
            assert (info.nr_exports, info.nr_attached) == (1, 1)
            with pytest.raises(P2PHubOSError) as ei:
                reg.close()
            assert ei.value.errno == errno.EBUSY
            # The export of `again` resolves to `reg`'s: `again` has no importer of its own.
            window = hub.register_dmabuf(again.dmabuf_fd, offset=64 * KiB, length=64 * KiB,
                                         device=target)
            assert window.dma_pages(target) == pages[16:32]
            assert reg.info().nr_attached == 2 and again.info().nr_attached == 0
            again.close()
            assert window.dma_pages(target) == pages[16:32]
            window.close()
        reg.close()


def test_export_chain_64_deep(target: str) -> None:
    """Registering the export of the export ... 64 times: the last one's page list is the
    first one's (this used to recurse once per link and overflow the kernel stack)."""
    with Hub() as hub, VgemBuffer(128 * KiB) as buf:
        first = hub.register_dmabuf(buf.fd)
        chain = [first]
        for _ in range(64):
            chain.append(hub.register_dmabuf(chain[-1].dmabuf_fd))
        last = chain[-1]
        assert last.dma_pages(target) == first.dma_pages(target)
        assert first.info().nr_attached == 1     # only the last link is mapped
        for reg in reversed(chain):
            reg.close()


def test_export_of_unregistered_registration_is_refused(target: str) -> None:
    """An export outlives its registration's UNREGISTER, but registering it then gives ENODEV."""
    with Hub() as hub, VgemBuffer(64 * KiB) as buf:
        reg = hub.register_dmabuf(buf.fd)
        fd = reg.export()
        try:
            reg.close()
            assert _errno_of(lambda: hub.register_dmabuf(fd, device=target)) == errno.ENODEV
        finally:
            os.close(fd)


def test_export_nvidia_reimport(resident_gpu: fg.FakeGpu, target: str) -> None:
    with Hub() as hub, hub.register_nvidia(resident_gpu.va(8 * MiB), 512 * KiB) as reg:
        pages4k = reg.dma_pages(target, page_size=4096)
        with hub.register_dmabuf(reg.dmabuf_fd, device=target) as again:
            assert again.provider == Provider.DMABUF
            assert again.dma_pages(target) == pages4k


def test_export_fd_close_drops_the_export(target: str) -> None:
    with Hub() as hub, VgemBuffer(64 * KiB) as buf, hub.register_dmabuf(buf.fd) as reg:
        fd = reg.export()
        os.close(fd)
        assert reg.info().nr_exports == 0 or ru.wait_until(lambda: reg.info().nr_exports == 0)


# -------------------------------------------------------------- revocation


def test_dmabuf_revoke(resident_gpu: fg.FakeGpu, target: str) -> None:
    fd = resident_gpu.export_dmabuf(2 * MiB, 256 * KiB)
    try:
        with Hub() as hub:
            reg = hub.register_dmabuf(fd, device=target)
            gen = reg.info().generation
            exported = reg.dmabuf_fd
            again = hub.register_dmabuf(exported, device=target)
            before = resident_gpu.query().mappings
            resident_gpu.revoke(fd)      # returns once p2phub's revocation fence signalled
            # The export's importer was told before the exporter could move the memory.
            assert again.info().revoked
            # p2phub unmaps after its fence signalled (its mapping stays valid until then).
            assert ru.wait_until(lambda: resident_gpu.query().mappings == before - 1)
            info = reg.info()
            assert info.revoked and info.generation == gen + 1
            with pytest.raises(RevokedError):
                reg.dma_pages(target)
            with pytest.raises(RevokedError):
                reg.export()
            with pytest.raises(RevokedError):
                again.dma_pages(target)
            again.close()
            reg.close()
    finally:
        os.close(fd)
    c = resident_gpu.query()
    assert (c.attachments, c.pins, c.mappings) == (0, 0, 0)


def test_nvidia_free_callback_revokes(resident_gpu: fg.FakeGpu, target: str) -> None:
    c0 = resident_gpu.query()   # per module load: what earlier tests did is theirs
    va = resident_gpu.va(12 * MiB)
    with Hub() as hub:
        reg = hub.register_nvidia(va, 1 * MiB, device=target)
        unmapped = hub.register_nvidia(resident_gpu.va(16 * MiB), 1 * MiB)   # no device yet
        gen = reg.info().generation
        assert resident_gpu.free_va(va, 1 * MiB) == 1
        info = reg.info()
        assert info.revoked and info.generation == gen + 1
        with pytest.raises(RevokedError):
            reg.dma_pages(target)
        assert resident_gpu.free_va(resident_gpu.va(16 * MiB), 1 * MiB) == 1
        with pytest.raises(RevokedError):
            unmapped.dma_pages(target)
        reg.close()
        unmapped.close()
    c = resident_gpu.query()
    assert (c.page_tables, c.dma_mappings, c.callbacks_unacked, c.misuse) == \
        (0, 0, c0.callbacks_unacked, c0.misuse)


# -------------------------------------------------------------------- leaks


def test_1000_cycles_leave_nothing(resident_gpu: fg.FakeGpu, target: str) -> None:
    fds0 = ru.fd_count()
    rev0 = ru.counters()["revocations"]
    gfd = resident_gpu.export_dmabuf(20 * MiB, 64 * KiB)
    try:
        with Hub() as hub, VgemBuffer(64 * KiB) as buf:
            for i in range(1000):
                with hub.register_dmabuf(buf.fd, device=target) as reg:
                    assert len(reg.dma_pages(target)) == 16
                with hub.register_dmabuf(gfd, device=target):
                    pass
                with hub.register_nvidia(resident_gpu.va(24 * MiB), 64 * KiB, device=target):
                    pass
            assert int(fg.dmabuf_info(buf.fd)["count"]) == 1, "a file reference on the vgem buffer leaked"
            assert int(fg.dmabuf_info(gfd)["count"]) == 1
            c = resident_gpu.query()
            assert (c.attachments, c.pins, c.mappings, c.page_tables, c.dma_mappings) == (0,) * 5
    finally:
        os.close(gfd)
    assert ru.fd_count() == fds0
    assert ru.counters()["revocations"] == rev0


CHILD = textwrap.dedent("""
    import os, sys
    sys.path[:0] = [{top!r}, {tests!r}]
    from p2phub.hub import Hub
    from p2phub.hostmem import VgemBuffer
    import p2phub_fakegpu as fg
    target = {target!r}
    resident_gpu = fg.FakeGpu()
    hub = Hub()
    buf = VgemBuffer(1 << 20)
    gfd = resident_gpu.export_dmabuf(32 << 20, 1 << 20)
    keep = [hub.register_dmabuf(buf.fd, device=target),
            hub.register_nvidia(resident_gpu.va(40 << 20), 1 << 20, device=target)]
    keep.append(hub.register_dmabuf(keep[1].dmabuf_fd, device=target))
    keep.append(hub.register_dmabuf(gfd, device=target))
    print("ready", flush=True)
    while True:   # killed somewhere in here, between and inside registrations
        r = hub.register_dmabuf(buf.fd, device=target)
        e = hub.register_dmabuf(r.dmabuf_fd, device=target)
        n = hub.register_nvidia(resident_gpu.va(48 << 20), 256 << 10, device=target)
        n.dma_pages(target, 4096)
        e.close(); r.close(); n.close()
""")


@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0])
def test_killed_process_leaves_nothing(resident_gpu: fg.FakeGpu, target: str, delay: float) -> None:
    code = CHILD.format(top=str(TOP), tests=str(TOP / "tests" / "lab"), target=target)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        assert ru.counters()["regs"] >= 4
        time.sleep(delay)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}
    c = resident_gpu.query()
    assert (c.attachments, c.pins, c.mappings, c.page_tables, c.dma_mappings) == (0,) * 5


# ---------------------------------------------------------------- bad input


def _errno_of(fn) -> int:
    with pytest.raises(P2PHubOSError) as ei:
        fn()
    return ei.value.errno


def _register(hub: Hub, **kw) -> None:
    a = uapi.Register.new(**kw)
    hub.device.ioctl(uapi.REGISTER, a, "P2PHUB_REGISTER")


def test_bad_register_input(target: str) -> None:
    D = uapi.REGISTER_F_DMABUF
    with Hub() as hub, VgemBuffer(64 * KiB) as buf, open("/dev/null") as null:
        fd = buf.fd
        closed = os.dup(fd)
        os.close(closed)
        cases = {
            "not a dma-buf": (dict(flags=D, fd=null.fileno(), length=4096), errno.EINVAL),
            "closed fd": (dict(flags=D, fd=closed, length=4096), errno.EBADF),
            "unaligned offset": (dict(flags=D, fd=fd, offset=512, length=4096), errno.EINVAL),
            "unaligned length": (dict(flags=D, fd=fd, length=4097), errno.EINVAL),
            "zero length": (dict(flags=D, fd=fd, length=0), errno.EINVAL),
            "overflow": (dict(flags=D, fd=fd, offset=(1 << 64) - 4096, length=8192), errno.EOVERFLOW),
            "past the end": (dict(flags=D, fd=fd, offset=32 * KiB, length=64 * KiB), errno.ERANGE),
            "no provider": (dict(flags=0, fd=fd, length=4096), errno.EINVAL),
            "both providers": (dict(flags=D | uapi.REGISTER_F_NVIDIA, fd=fd, length=4096), errno.EINVAL),
            "unknown flag": (dict(flags=D | (1 << 9), fd=fd, length=4096), errno.EINVAL),
            "reserved": (dict(flags=D, fd=fd, length=4096, reserved=(1, 0)), errno.EINVAL),
            "reserved0": (dict(flags=D, fd=fd, length=4096, __reserved0=1), errno.EINVAL),
            "out field set": (dict(flags=D, fd=fd, length=4096, out_handle=7), errno.EINVAL),
            "nv unaligned va": (dict(flags=uapi.REGISTER_F_NVIDIA, fd=-1, va=fg.VA_BASE + 4096,
                                     length=64 * KiB), errno.EINVAL),
            "no such device": (dict(flags=D | uapi.REGISTER_F_DEVICE, fd=fd, length=4096,
                                    domain=0, bus=0xfe, devfn=0xff), errno.ENODEV),
        }
        for name, (kw, want) in cases.items():
            got = _errno_of(lambda: _register(hub, **kw))
            assert got == want, f"{name}: {errno.errorcode[got]} != {errno.errorcode[want]}"
        # argsz too small
        a = uapi.Register.new(flags=D, fd=fd, length=4096)
        a.argsz = 16
        assert _errno_of(lambda: hub.device.ioctl(uapi.REGISTER, a, "short")) == errno.EINVAL
        assert ru.counters()["regs"] == 0


def test_bad_handles_and_page_requests(target: str) -> None:
    with Hub() as hub, Hub() as other, VgemBuffer(64 * KiB) as buf:
        theirs = other.register_dmabuf(buf.fd)
        for req, cls in ((uapi.UNREGISTER, uapi.Unregister), (uapi.REG_INFO, uapi.RegInfo)):
            for handle in (0, 12345, theirs.handle, 1 << 40):   # unknown, foreign
                a = cls.new(handle=handle)
                assert _errno_of(lambda: hub.device.ioctl(req, a, "bad handle")) == errno.ENOENT
        reg = hub.register_dmabuf(buf.fd)
        h = reg.handle

        def pages(**kw) -> None:
            arr = (ctypes.c_uint64 * 64)()
            args = dict(handle=h, domain=0, count=16, addrs=ctypes.addressof(arr))
            args.update(kw)
            bdf = target.split(":")
            args.setdefault("bus", int(bdf[1], 16))
            args.setdefault("devfn", (int(bdf[2].split(".")[0], 16) << 3) | int(bdf[2].split(".")[1]))
            hub.device.ioctl(uapi.DMA_PAGES, uapi.DmaPages.new(**args), "P2PHUB_DMA_PAGES")

        pages()  # the good one
        assert _errno_of(lambda: pages(count=uapi.DMA_PAGES_MAX + 1)) == errno.E2BIG
        assert _errno_of(lambda: pages(first=16)) == errno.ERANGE
        assert _errno_of(lambda: pages(page_size=3000)) == errno.EINVAL
        assert _errno_of(lambda: pages(page_size=64 * KiB)) == errno.EINVAL
        assert _errno_of(lambda: pages(addrs=0)) == errno.EINVAL
        assert _errno_of(lambda: pages(addrs=8)) == errno.EFAULT
        assert _errno_of(lambda: pages(reserved=(0, 1))) == errno.EINVAL
        assert _errno_of(lambda: pages(bus=0xfe, devfn=0xff)) == errno.ENODEV
        assert _errno_of(lambda: pages(handle=theirs.handle + 100)) == errno.ENOENT
        a = uapi.Export.new(handle=h, reserved=(1, 0))
        assert _errno_of(lambda: hub.device.ioctl(uapi.EXPORT, a, "export")) == errno.EINVAL
        reg.close()
        a = uapi.Unregister.new(handle=h)
        assert _errno_of(lambda: hub.device.ioctl(uapi.UNREGISTER, a, "twice")) == errno.ENOENT
        theirs.close()


# ------------------------------------------------------ the registration cache


def test_registering_the_same_memory_again_returns_the_live_pin(target: str) -> None:
    with Hub() as hub, VgemBuffer(1 * MiB) as buf:
        regs0 = ru.counters()["regs"]
        a = hub.register_dmabuf(buf.fd, device=target)
        dup = os.dup(buf.fd)  # another fd of the same dma-buf names the same memory
        try:
            b = hub.register(dup)
            c = hub.register(buf)  # the host buffer object itself
        finally:
            os.close(dup)
        assert a.handle == b.handle == c.handle and a.shared == 3
        assert ru.counters()["regs"] == regs0 + 1, "a cache hit made a second kernel registration"
        pages = a.dma_pages(target)
        a.close()
        assert a.closed and not b.closed and b.dma_pages(target) == pages
        b.close()
        c.close()   # the last handle releases the pin
        assert ru.counters()["regs"] == regs0
        with pytest.raises(UsageError, match="closed"):
            c.dma_pages(target)
        # another range of the same buffer is other memory
        with hub.register_dmabuf(buf.fd, 0, 512 * KiB) as half, hub.register_dmabuf(buf.fd) as whole:
            assert half.handle != whole.handle


def test_a_revoked_pin_is_never_handed_out_again(resident_gpu: fg.FakeGpu, target: str) -> None:
    fd = resident_gpu.export_dmabuf(4 * MiB, 256 * KiB)
    try:
        with Hub() as hub:
            reg = hub.register_dmabuf(fd, device=target)
            resident_gpu.revoke(fd)
            # the exporter refuses a revoked buffer: a new registration fails, rather than the
            # cache returning the revoked one
            with pytest.raises((P2PHubOSError, RevokedError)):
                hub.register_dmabuf(fd, device=target)
            assert reg.info().revoked and reg.shared == 1
            reg.close()
    finally:
        os.close(fd)


def test_stand_in_memory_registers_through_its_backend_plugin(resident_gpu: fg.FakeGpu, target: str,
                                                              iommu: bool) -> None:
    from p2phub import backend
    assert "fakegpu" in backend.backend_names()
    q = resident_gpu.query()
    mem = resident_gpu.memory(6 * MiB, 1 * MiB)
    with Hub() as hub:
        reg = hub.register(mem, device=target)
        again = hub.register(mem, device=target)
        part = hub.register(mem, offset=512 * KiB, length=256 * KiB)
        assert again.handle == reg.handle and part.handle != reg.handle
        assert reg.provider == Provider.DMABUF and reg.length == MiB and reg.source.backend == "fakegpu"
        pages = reg.dma_pages(target)
        if not iommu:
            assert pages == [q.bar_addr + 6 * MiB + i * 4096 for i in range(256)]
        for r in (part, again, reg):
            r.close()
    c = resident_gpu.query()
    assert (c.bufs, c.attachments, c.pins, c.mappings) == (0, 0, 0, 0)


# ------------------------------------------------- users drained before release


class _User:
    """A stand-in for an NVMe controller or a fence with I/O outstanding on a registration."""

    def __init__(self, busy: bool) -> None:
        self.busy = busy
        self.calls: list[tuple[int, float]] = []

    def quiesce_registration(self, reg, timeout: float) -> None:
        self.calls.append((reg.handle, timeout))
        if self.busy:
            raise P2PHubOSError(errno.EBUSY, f"quiesce {reg}", "commands still in flight")


def test_close_drains_the_users_and_refuses_while_one_is_busy(target: str) -> None:
    regs0 = ru.counters()["regs"]
    with Hub() as hub, VgemBuffer(256 * KiB) as buf:
        reg = hub.register_dmabuf(buf.fd, device=target)
        other = hub.register_dmabuf(buf.fd)
        user = _User(busy=True)
        reg.add_user(user)
        other.close()  # not the last handle: nothing to drain yet
        assert user.calls == []
        with pytest.raises(P2PHubOSError) as ei:
            reg.close(timeout=0.5)
        assert ei.value.errno == errno.EBUSY and not reg.closed
        assert user.calls == [(reg.handle, pytest.approx(0.5, abs=0.1))]
        assert reg.info().state == RegState.LIVE and len(reg.dma_pages(target)) == 64
        with pytest.raises(P2PHubOSError):
            hub.close(timeout=0.1)  # Hub.close drains too, and releases nothing when it cannot
        assert not hub.closed and not reg.closed
        user.busy = False
        reg.close()
        assert reg.closed and len(user.calls) == 3
    assert ru.counters()["regs"] == regs0


def test_hub_close_drains_every_registration_first(target: str) -> None:
    hub = Hub()
    with VgemBuffer(64 * KiB) as b1, VgemBuffer(64 * KiB) as b2:
        r1, r2 = hub.register(b1), hub.register(b2)
        u1, u2 = _User(busy=False), _User(busy=False)
        r1.add_user(u1)
        r2.add_user(u2)
        hub.close()
        assert [c[0] for c in u1.calls] == [r1.handle] and [c[0] for c in u2.calls] == [r2.handle]
        assert r1.closed and r2.closed and hub.closed


# ------------------------------------------------------------- forked children


def test_a_forked_child_can_neither_use_nor_release_the_parents_registrations(target: str) -> None:
    with Hub() as hub, VgemBuffer(64 * KiB) as buf:
        reg = hub.register_dmabuf(buf.fd, device=target)
        pid = os.fork()
        if pid == 0:  # the child: every use refuses, and closing releases nothing of the parent's
            code = 0
            try:
                for use in (lambda: reg.dma_pages(target), reg.info, reg.export,
                            lambda: hub.register(buf)):
                    try:
                        use()
                        code |= 1
                    except Exception as exc:  # noqa: BLE001
                        code |= 0 if "forked child" in str(exc) else 2
                reg.close()
                hub.close()
            except BaseException:  # noqa: BLE001
                code |= 4
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WEXITSTATUS(status) == 0
        info = reg.info()
        assert info.state == RegState.LIVE and len(reg.dma_pages(target)) == 16
        reg.close()


# ------------------------------------------------------------- hub-owned controllers


def test_the_hub_closes_the_controllers_it_opened(target: str) -> None:
    from p2phub.nvme import bind
    hub = Hub()
    try:
        ctrl = hub.nvme(target)
        with VgemBuffer(64 * KiB) as buf:
            reg = hub.register(buf, device=target)
            ctrl.namespace(1).read(reg, lba=0, nbytes=4096)
            hub.close()
            assert ctrl.closed and reg.closed and hub.closed
    finally:
        hub.close()
        bind.unbind(target)


def test_flags_are_checked_in_the_copy_the_kernel_uses() -> None:
    """The argument header is read once for argsz and flags, then again with the whole struct:
    flags changed between the two reads (here while the second read waits on a held page) must
    be refused from the copy the kernel acts on, not let through because the first read was
    clean."""
    why = uffd.available()
    assert why is None, why
    size = ctypes.sizeof(uapi.Unregister)
    fd = os.open("/dev/p2phub", os.O_RDWR | os.O_CLOEXEC)
    try:
        with uffd.HeldPages(2, present=1) as held:
            # The struct ends page 0; argsz names 8 bytes more, which lie in the held page 1.
            # The kernel reads the header, then checks that tail is zero (and waits there on
            # the held page), then copies the struct: the flag changes between those reads.
            # (With the header itself in page 0 and the rest in page 1, the full copy takes
            # the header before it faults, so a later change never reaches it.)
            at = held.addr + mmap.PAGESIZE - size
            hdr = (ctypes.c_uint32 * 2).from_address(at)
            hdr[0], hdr[1] = size + 8, 0
            out: dict[str, int] = {}
            # Through libc: fcntl.ioctl() takes an integer argument as a C int, which no user
            # address fits (OverflowError).
            libc = ctypes.CDLL(None, use_errno=True)

            def unregister() -> None:
                rv = libc.ioctl(fd, ctypes.c_ulong(uapi.UNREGISTER), ctypes.c_void_p(at))
                out["errno"] = ctypes.get_errno() if rv < 0 else 0

            t = threading.Thread(target=unregister)
            t.start()
            assert held.wait_fault(30), "UNREGISTER never reached the check of its tail"
            hdr[1] = 1 << 31                    # an unknown flag, after the first read
            held.release()
            t.join(30)
            assert not t.is_alive()
    finally:
        os.close(fd)
    assert out["errno"] == errno.EINVAL, (
        f"UNREGISTER with an unknown flag in the copy it used returned "
        f"{errno.errorcode.get(out['errno'], out['errno'])}, not EINVAL")


def _module_refs() -> int:
    return int(Path("/sys/module/p2phub/refcnt").read_text())


def test_revocation_fence_holds_the_module(lab: dict[str, str]) -> None:
    """The revocation fence p2phub leaves in a revoked buffer's reservation object outlives every
    p2phub file; its ops are p2phub's code, so it must keep the module loaded (a reference,
    dropped when the exporter lets the fence go). Otherwise rmmod, then anything that prints the
    fence (debugfs bufinfo) or the buffer's release, jumps into unloaded code."""
    base = _module_refs()
    with fg.loaded_module(lab["modules_dir"]), fg.FakeGpu() as resident_gpu, \
            ru.consumer_loaded(lab["modules_dir"]) as consumer:
        buf = resident_gpu.export_dmabuf(7 * MiB, 1 * MiB)
        try:
            p2p = os.open("/dev/p2phub", os.O_RDWR | os.O_CLOEXEC)
            try:
                arg = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF, fd=buf, length=1 * MiB)
                fcntl.ioctl(p2p, uapi.REGISTER, arg, True)
                exp = fcntl.ioctl(p2p, uapi.EXPORT,
                                  uapi.Export.new(handle=arg.out_handle, flags=uapi.EXPORT_F_CLOEXEC), True)
                consumer.command(f"dmabuf {exp} {lab['nvme_baseline']}")
                resident_gpu.revoke(buf)                  # p2phub's fence is added and signalled
                consumer.command("release")
                os.close(exp)
            finally:
                os.close(p2p)
            assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}
            # Nothing of p2phub is open; its fence still sits in the buffer's resv.
            assert ru.wait_until(lambda: _module_refs() == base + 1), (
                f"p2phub holds {_module_refs() - base} module reference(s) for its fence (want 1)")
        finally:
            os.close(buf)
    assert ru.wait_until(lambda: _module_refs() == base), "the fence's module reference was not dropped"
