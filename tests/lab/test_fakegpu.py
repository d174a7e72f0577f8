"""The stand-in GPU (p2phub_fakegpu.ko): binding, dma-buf export, revoke, FREE, BAR views, bad input."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import gzip
import mmap
import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from p2phub.errors import P2PHubOSError, RevokedError
from p2phub.hostmem import VgemBuffer
from p2phub.hub import Hub

import p2phub_fakegpu as fg
import regutil as ru

pytestmark = pytest.mark.lab

MiB = 1 << 20
KiB = 1 << 10


@pytest.fixture(scope="module")
def gpu_module(lab: dict[str, str]) -> Iterator[None]:
    with fg.loaded_module(lab["modules_dir"]):
        yield


@pytest.fixture
def gpu(gpu_module: None) -> Iterator[fg.FakeGpu]:
    with fg.FakeGpu() as g:
        before = g.query()
        yield g
        after = g.query()
    # Every test leaves nothing behind.
    assert (after.bufs, after.attachments, after.mappings, after.pins) == (0, 0, 0, 0)
    assert (after.page_tables, after.dma_mappings) == (0, 0)
    assert after.misuse == before.misuse, "a test misused the NVIDIA P2P API unexpectedly"


@pytest.fixture(scope="module")
def gpu_file(lab: dict[str, str]) -> fg.GpuFile:
    return fg.GpuFile(lab["gpu_file"])


def _errno(exc: pytest.ExceptionInfo[P2PHubOSError]) -> int:
    return exc.value.errno


def test_binds_the_ivshmem_device(gpu: fg.FakeGpu, lab: dict[str, str]) -> None:
    drv = Path(f"/sys/bus/pci/devices/{lab['gpu']}/driver")
    assert drv.resolve().name == fg.MODULE
    q = gpu.query()
    assert q.bar_size == 64 * MiB
    assert q.va_base == fg.VA_BASE
    res2 = Path(f"/sys/bus/pci/devices/{lab['gpu']}/resource").read_text().splitlines()[2]
    assert int(res2.split()[0], 16) == q.bar_addr
    assert Path("/sys/kernel/debug/p2phub_fakegpu/state").read_text().startswith("bar2 ")


def test_export_dmabuf_size_and_exporter(gpu: fg.FakeGpu) -> None:
    fd = gpu.export_dmabuf(1 * MiB, 2 * MiB)
    try:
        info = fg.dmabuf_info(fd)
        assert int(info["size"]) == 2 * MiB
        assert info["exp_name"] == fg.MODULE
        assert os.lseek(fd, 0, os.SEEK_END) == 2 * MiB
        assert gpu.query().bufs == 1
    finally:
        os.close(fd)
    assert gpu.query().bufs == 0


def test_export_whole_bar_and_last_page(gpu: fg.FakeGpu) -> None:
    size = gpu.query().bar_size
    for off, length in ((0, size), (size - fg.EXPORT_ALIGN, fg.EXPORT_ALIGN)):
        os.close(gpu.export_dmabuf(off, length))


def _vgem_render_node() -> str:
    for node in sorted(Path("/sys/class/drm").glob("renderD*")):
        if "vgem" in str((node / "device").resolve()):
            return f"/dev/dri/{node.name}"
    pytest.fail("no vgem render node: the lab loads vgem")


# struct drm_prime_handle { __u32 handle; __u32 flags; __s32 fd; }
class _DrmPrimeHandle(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("fd", ctypes.c_int32)]


DRM_IOCTL_PRIME_FD_TO_HANDLE = (3 << 30) | (ctypes.sizeof(_DrmPrimeHandle) << 16) | (ord("d") << 8) | 0x2E


def test_importer_without_peer2peer_is_refused(gpu: fg.FakeGpu) -> None:
    """vgem imports with a static attachment (no allow_peer2peer): attach must fail with EOPNOTSUPP."""
    fd = gpu.export_dmabuf(0, 64 * 1024)
    drm = os.open(_vgem_render_node(), os.O_RDWR | os.O_CLOEXEC)
    try:
        refused = gpu.query().attach_refused
        arg = _DrmPrimeHandle(fd=fd)
        with pytest.raises(OSError) as exc:
            fcntl.ioctl(drm, DRM_IOCTL_PRIME_FD_TO_HANDLE, arg, True)
        assert exc.value.errno == errno.EOPNOTSUPP
        q = gpu.query()
        assert q.attach_refused == refused + 1
        assert q.attachments == 0
    finally:
        os.close(drm)
        os.close(fd)


def test_revoke_is_idempotent_and_counted(gpu: fg.FakeGpu) -> None:
    fd = gpu.export_dmabuf(0, 1 * MiB)
    try:
        assert gpu.revoke(fd) == fg.Revoked(0, 0)
        assert gpu.query().bufs_revoked == 1
        assert gpu.revoke(fd) == fg.Revoked(0, 0)
        assert gpu.query().bufs_revoked == 1
        assert "revoked" in Path("/sys/kernel/debug/p2phub_fakegpu/state").read_text()
    finally:
        os.close(fd)
    assert gpu.query().bufs_revoked == 0


def test_revoked_buffer_refuses_new_importers(gpu: fg.FakeGpu) -> None:
    fd = gpu.export_dmabuf(0, 64 * 1024)
    drm = os.open(_vgem_render_node(), os.O_RDWR | os.O_CLOEXEC)
    try:
        gpu.revoke(fd)
        with pytest.raises(OSError) as exc:
            fcntl.ioctl(drm, DRM_IOCTL_PRIME_FD_TO_HANDLE, _DrmPrimeHandle(fd=fd), True)
        assert exc.value.errno in (errno.EOPNOTSUPP, errno.ENODEV)
    finally:
        os.close(drm)
        os.close(fd)


def test_revoke_of_foreign_fds_is_refused(gpu: fg.FakeGpu, tmp_path: Path) -> None:
    with open(tmp_path / "plain", "w") as f:
        with pytest.raises(P2PHubOSError) as exc:
            gpu.revoke(f.fileno())
        assert _errno(exc) == errno.EINVAL
    with pytest.raises(P2PHubOSError) as exc:
        gpu.revoke(-1)
    assert _errno(exc) == errno.EBADF
    # A dma-buf of another exporter (vgem dumb buffer, via PRIME) is not ours.
    foreign = _vgem_dmabuf()
    try:
        with pytest.raises(P2PHubOSError) as exc:
            gpu.revoke(foreign)
        assert _errno(exc) == errno.EINVAL
    finally:
        os.close(foreign)


def _vgem_dmabuf() -> int:
    """A 64 KiB vgem dumb buffer exported as a dma-buf fd."""

    class CreateDumb(ctypes.Structure):
        _fields_ = [("height", ctypes.c_uint32), ("width", ctypes.c_uint32), ("bpp", ctypes.c_uint32),
                    ("flags", ctypes.c_uint32), ("handle", ctypes.c_uint32), ("pitch", ctypes.c_uint32),
                    ("size", ctypes.c_uint64)]

    create = (3 << 30) | (ctypes.sizeof(CreateDumb) << 16) | (ord("d") << 8) | 0xB2
    to_fd = (3 << 30) | (ctypes.sizeof(_DrmPrimeHandle) << 16) | (ord("d") << 8) | 0x2D
    card = next(n for n in sorted(Path("/sys/class/drm").glob("card*"))
                if "-" not in n.name and "vgem" in str((n / "device").resolve()))
    drm = os.open(f"/dev/dri/{card.name}", os.O_RDWR | os.O_CLOEXEC)
    try:
        d = CreateDumb(height=16, width=1024, bpp=32)
        fcntl.ioctl(drm, create, d, True)
        h = _DrmPrimeHandle(handle=d.handle, flags=os.O_CLOEXEC | os.O_RDWR)
        fcntl.ioctl(drm, to_fd, h, True)
        return int(h.fd)
    finally:
        os.close(drm)


@pytest.mark.parametrize(
    ("offset", "length", "err"),
    [
        (0, 0, errno.EINVAL),  # empty
        (100, 4096, errno.EINVAL),  # unaligned offset
        (0, 4097, errno.EINVAL),  # unaligned length
        (64 * MiB, 4096, errno.ERANGE),  # starts at the end
        (63 * MiB, 2 * MiB, errno.ERANGE),  # runs past the end
        ((1 << 64) - 4096, 8192, errno.ERANGE),  # offset + length overflows
    ],
)
def test_bad_exports(gpu: fg.FakeGpu, offset: int, length: int, err: int) -> None:
    with pytest.raises(P2PHubOSError) as exc:
        gpu.export_dmabuf(offset, length)
    assert _errno(exc) == err


def test_abi_checks(gpu: fg.FakeGpu) -> None:
    for bad in (
        fg.ExportArgs.new(length=4096, flags=1),
        fg.ExportArgs.new(length=4096, reserved=1),
        fg.ExportArgs(argsz=8, length=4096),
    ):
        with pytest.raises(P2PHubOSError) as exc:
            gpu._ioctl(fg.EXPORT_DMABUF, bad, "export")
        assert _errno(exc) == errno.EINVAL
    q = fg.QueryArgs.new()
    q.reserved[3] = 1
    with pytest.raises(P2PHubOSError) as exc:
        gpu._ioctl(fg.QUERY, q, "query")
    assert _errno(exc) == errno.EINVAL
    with pytest.raises(OSError) as oexc:
        fcntl.ioctl(gpu.fd, fg._io(fg.IOCTL_BASE + 9), b"\0" * 64)
    assert oexc.value.errno == errno.ENOTTY


def test_free_of_unregistered_range(gpu: fg.FakeGpu) -> None:
    before = gpu.query()
    with pytest.raises(P2PHubOSError) as exc:
        gpu.free_va(fg.VA_BASE, fg.GPU_PAGE_SIZE)
    assert _errno(exc) == errno.ENOENT
    with pytest.raises(P2PHubOSError) as exc:
        gpu.free_va(fg.VA_BASE, 0)
    assert _errno(exc) == errno.EINVAL
    with pytest.raises(P2PHubOSError) as exc:
        gpu.free_va((1 << 64) - fg.GPU_PAGE_SIZE, 2 * fg.GPU_PAGE_SIZE)
    assert _errno(exc) == errno.ERANGE
    q = gpu.query()
    assert (q.page_tables, q.dma_mappings) == (0, 0)
    assert q.callbacks == before.callbacks


def test_nvidia_p2p_symbols_are_exported(gpu_module: None) -> None:
    syms = {line.split()[2] for line in Path("/proc/kallsyms").read_text().splitlines()
            if line.endswith("[p2phub_fakegpu]")}
    for name in ("nvidia_p2p_get_pages", "nvidia_p2p_put_pages", "nvidia_p2p_free_page_table",
                 "nvidia_p2p_dma_map_pages", "nvidia_p2p_dma_unmap_pages",
                 "nvidia_p2p_get_pages_persistent", "nvidia_p2p_put_pages_persistent"):
        assert name in syms, name


def test_host_file_writes_are_seen_through_the_bar(gpu: fg.FakeGpu, gpu_file: fg.GpuFile) -> None:
    off, length = 3 * MiB + 4096, 3 * 4096
    data = gpu_file.fill(off, length, b"host->bar:" + os.urandom(6))
    with gpu.map_bar(3 * MiB, 1 * MiB) as bar:
        assert bar[4096:4096 + length] == data


def test_bar_writes_reach_the_host_file(gpu: fg.FakeGpu, gpu_file: fg.GpuFile) -> None:
    pattern = (b"bar->host:" + os.urandom(6)) * 512
    with gpu.map_bar(5 * MiB, 64 * 1024) as bar:
        bar[:len(pattern)] = pattern
    assert gpu_file.read(5 * MiB, len(pattern)) == pattern


def test_bar_mmap_bounds(gpu: fg.FakeGpu) -> None:
    size = gpu.query().bar_size
    with pytest.raises(OSError):
        gpu.map_bar(size - 4096, 8192)
    with gpu.map_bar(size - 4096, 4096) as bar:
        assert len(bar) == 4096


# ---------------------------------------------------------------- the importer's side
# p2phub_fakegpu_consumer.ko is a minimal in-kernel importer / NVIDIA P2P
# consumer: it checks what the stand-in GPU hands to a real kernel consumer.

Consumer = ru.Consumer


@pytest.fixture
def consumer(gpu_module: None, lab: dict[str, str]) -> Iterator[Consumer]:
    with ru.consumer_loaded(lab["modules_dir"]) as c:
        yield c


def _core_pins_on_map() -> bool:
    """Whether the dma-buf core pins a dynamic importer's attachment before each map: where
    CONFIG_DMABUF_MOVE_NOTIFY is there and off (Debian's 6.1 and 6.12). 7.0 dropped the option
    and always notifies instead: no pin."""
    rel = os.uname().release
    for p in (Path("/proc/config.gz"), Path(f"/boot/config-{rel}"), Path(f"/lib/modules/{rel}/config"),
              Path(f"/lib/modules/{rel}/build/.config")):
        if p.exists():
            text = gzip.decompress(p.read_bytes()).decode() if p.suffix == ".gz" else p.read_text()
            return "# CONFIG_DMABUF_MOVE_NOTIFY is not set" in text.splitlines()
    pytest.fail(f"no kernel config for {rel} (/proc/config.gz, /boot, /lib/modules/{rel})", pytrace=False)


def test_p2p_importer_gets_device_addresses(gpu: fg.FakeGpu, consumer: Consumer,
                                            lab: dict[str, str]) -> None:
    q = gpu.query()
    off, length = 2 * MiB, 1 * MiB
    fd = gpu.export_dmabuf(off, length)
    try:
        consumer.command(f"dmabuf {fd} {lab['nvme_baseline']}")
        st = consumer.state()
        assert st["map_err"] == 0 and st["mapped"] == 1
        assert st["sg_total"] == length and st["sg_contiguous"] == 1
        if lab["iommu"] == "1":
            assert st["sg_first"] != q.bar_addr + off, "expected an IOVA through the IOMMU"
        else:
            assert st["sg_first"] == q.bar_addr + off
        now = gpu.query()
        assert (now.attachments, now.mappings) == (1, 1)
        # the core pins a dynamic importer's attachment on map only without move notification
        assert now.pins == (1 if _core_pins_on_map() else 0)

        # Revoke: move_notify reaches the importer, which unmaps (and so unpins).
        assert gpu.revoke(fd) == fg.Revoked(mappings_left=0, pins_left=0)
        st = consumer.state()
        assert st["move_notifies"] == 1 and st["mapped"] == 0
        consumer.command("release")
        assert gpu.query().attachments == 0

        # A revoked buffer refuses new attachments, even peer-to-peer ones.
        with pytest.raises(OSError) as exc:
            consumer.command(f"dmabuf {fd} {lab['nvme_baseline']}")
        assert exc.value.errno == errno.ENODEV
    finally:
        os.close(fd)


def test_nvidia_p2p_pages_and_free_callback(gpu: fg.FakeGpu, consumer: Consumer,
                                            lab: dict[str, str]) -> None:
    q = gpu.query()
    off, length = 4 * MiB, 4 * fg.GPU_PAGE_SIZE
    va = fg.FakeGpu.va(off)
    peer = lab["nvme_baseline"]
    consumer.command(f"nv {va:x} {length:x} {peer}")
    st = consumer.state()
    assert st["nv_held"] == 1 and st["nv_entries"] == 4
    assert st["nv_first_phys"] == q.bar_addr + off
    if lab["iommu"] == "0":
        assert st["nv_first_dma"] == q.bar_addr + off
    now = gpu.query()
    assert (now.page_tables, now.dma_mappings) == (1, 1)

    # cudaFree() while registered: the callback runs, the consumer acks it.
    assert gpu.free_va(va + fg.GPU_PAGE_SIZE, fg.GPU_PAGE_SIZE) == 1
    st = consumer.state()
    assert st["free_callbacks"] == 1 and st["nv_held"] == 0
    now = gpu.query()
    assert (now.page_tables, now.dma_mappings) == (0, 0)
    assert now.callbacks == q.callbacks + 1
    assert now.callbacks_unacked == q.callbacks_unacked
    with pytest.raises(P2PHubOSError) as exc:
        gpu.free_va(va, length)
    assert _errno(exc) == errno.ENOENT

    # The range can be taken again, and released the normal way.
    consumer.command(f"nv {va:x} {length:x} {peer}")
    consumer.command("release")
    now = gpu.query()
    assert (now.page_tables, now.dma_mappings) == (0, 0)
    assert now.misuse == q.misuse


@pytest.mark.parametrize(
    ("va_off", "length"),
    [
        (4096, fg.GPU_PAGE_SIZE),  # VA not 64 KiB aligned
        (0, 4096),  # length not a multiple of 64 KiB
        (64 * MiB, fg.GPU_PAGE_SIZE),  # past the fake GPU's memory
        (-fg.GPU_PAGE_SIZE, 2 * fg.GPU_PAGE_SIZE),  # below VA_BASE
    ],
)
def test_nvidia_p2p_bad_ranges(consumer: Consumer, lab: dict[str, str],
                               va_off: int, length: int) -> None:
    with fg.FakeGpu() as gpu:
        misuse = gpu.query().misuse
        with pytest.raises(OSError) as exc:
            consumer.command(f"nv {fg.VA_BASE + va_off:x} {length:x} {lab['nvme_baseline']}")
        assert exc.value.errno == errno.EINVAL
        q = gpu.query()
    assert q.page_tables == 0
    assert q.misuse == misuse + 1  # refused with a ratelimited message, nothing else


# ------------------------------------------------- p2phub.ko against the stand-in GPU
# Revocation must reach the importers of p2phub's exports before the exporter (or
# NVIDIA) takes the memory back, and p2phub must keep the NVIDIA driver's lock rules.

def _in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, dict[str, object]]:
    """Run fn in a daemon thread; the dict gets "result" or "error" when it ends."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _finish(t: threading.Thread, out: dict[str, object], what: str, timeout: float = 60.0) -> object:
    t.join(timeout)
    assert not t.is_alive(), f"{what} did not return within {timeout:.0f} s (a deadlock)"
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out.get("result")


def test_revoke_waits_for_the_importers_of_p2phub_exports(gpu: fg.FakeGpu, consumer: Consumer,
                                                         lab: dict[str, str]) -> None:
    """The stand-in GPU revokes a buffer p2phub registered and exported: REVOKE (which waits for
    the fences in the buffer's resv, as an exporter does) returns only after the export's importer
    was told and its in-flight work (a fence) finished; p2phub's own mapping stays until then."""
    fd = gpu.export_dmabuf(6 * MiB, 1 * MiB)
    try:
        with Hub() as hub, hub.register_dmabuf(fd, device=lab["nvme_target"]) as reg:
            consumer.command("hold")
            consumer.command(f"dmabuf {reg.dmabuf_fd} {lab['nvme_baseline']}")
            assert consumer.state()["mapped"] == 1
            mapped = gpu.query().mappings
            t, out = _in_thread(lambda: gpu.revoke(fd))
            try:
                assert ru.wait_until(lambda: consumer.state()["fence_pending"] == 1, 60)
                assert consumer.state()["move_notifies"] >= 1   # again from the notify work
                time.sleep(0.5)
                assert t.is_alive(), "REVOKE returned while an importer of the export was busy"
                assert reg.info().revoked
                # The export importer's mapping stays until it is done; the target's own
                # mapping (no importer uses it) went at once, inside move_notify.
                assert gpu.query().mappings == mapped - 1, "p2phub unmapped before the importers finished"
            finally:
                consumer.command("signal")
                _finish(t, out, "REVOKE")
                consumer.command("release")
            assert ru.wait_until(lambda: gpu.query().mappings == 0)
    finally:
        os.close(fd)
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


def test_free_waits_for_the_importers_of_p2phub_exports(gpu: fg.FakeGpu, consumer: Consumer,
                                                       lab: dict[str, str]) -> None:
    """cudaFree (FREE) of memory p2phub pinned through nvidia_p2p and exported: the free callback
    returns (and NVIDIA unmaps) only after the export's importer was told and finished."""
    va = gpu.va(28 * MiB)
    q0 = gpu.query()
    with Hub() as hub, hub.register_nvidia(va, 1 * MiB, device=lab["nvme_target"]) as reg:
        consumer.command("hold")
        consumer.command(f"dmabuf {reg.dmabuf_fd} {lab['nvme_baseline']}")
        assert consumer.state()["mapped"] == 1
        t, out = _in_thread(lambda: gpu.free_va(va, 1 * MiB))
        try:
            assert ru.wait_until(lambda: consumer.state()["fence_pending"] == 1, 60)
            assert consumer.state()["move_notifies"] >= 1   # again from the notify work
            time.sleep(0.5)
            assert t.is_alive(), "the free callback returned while an importer of the export was busy"
            assert gpu.query().dma_mappings >= 1, "NVIDIA unmapped before the importers finished"
        finally:
            consumer.command("signal")
            callbacks = _finish(t, out, "FREE")
            consumer.command("release")
        assert callbacks == 1
        assert reg.info().revoked
    q = gpu.query()
    assert (q.page_tables, q.dma_mappings) == (0, 0)
    assert q.callbacks_unacked == q0.callbacks_unacked
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


STATE = Path("/sys/kernel/debug/p2phub_fakegpu/state")


def _free_is_waiting() -> bool:
    """FREE holds the stand-in's API lock and has not run its callbacks yet."""
    return "nv waiting_callbacks 1" in STATE.read_text()


def _pin_refused(st: dict[str, int]) -> bool:
    """Refused at pin (CONFIG_DMABUF_MOVE_NOTIFY) or, when the core pins per map, at the map."""
    return -errno.EOPNOTSUPP in (st["pin_err"], st["map_err"]) and st["mapped"] == 0


def _attach_once(consumer: Consumer, fd: int, peer: str, pin: bool) -> dict[str, int]:
    """Attach (and map) dma-buf fd for peer, read the consumer's state, release."""
    try:
        consumer.command(f"dmabuf {fd} {peer}{' pin' if pin else ''}")
        return consumer.state()
    finally:
        consumer.command("release")


def test_pin_of_a_revocable_export_is_refused(gpu: fg.FakeGpu, consumer: Consumer,
                                              lab: dict[str, str]) -> None:
    """A pinned importer ignores move_notify, so exports of revocable memory (a dma-buf exporter
    that revokes, NVIDIA P2P) refuse it; exports of memory that is never revoked (vgem) accept."""
    peer = lab["nvme_baseline"]
    fd = gpu.export_dmabuf(8 * MiB, 256 * 1024)
    try:
        with Hub() as hub:
            with hub.register_dmabuf(fd) as reg:
                assert reg.info().revocable and not reg.info().read_only
                assert _pin_refused(_attach_once(consumer, reg.dmabuf_fd, peer, pin=True))
                assert _attach_once(consumer, reg.dmabuf_fd, peer, pin=False)["mapped"] == 1
            with hub.register_nvidia(gpu.va(32 * MiB), 256 * 1024) as reg:
                assert _pin_refused(_attach_once(consumer, reg.dmabuf_fd, peer, pin=True))
            with VgemBuffer(256 * 1024) as buf, hub.register_dmabuf(buf.fd) as reg:
                assert not reg.info().revocable
                st = _attach_once(consumer, reg.dmabuf_fd, peer, pin=True)
                assert (st["pin_err"], st["map_err"], st["mapped"]) == (0, 0, 1)
    finally:
        os.close(fd)
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


@pytest.fixture
def callback_delay(gpu_module: None) -> Iterator[Callable[[int], None]]:
    knob = Path("/sys/kernel/debug/p2phub_fakegpu/callback_delay_ms")

    def set_delay(ms: int) -> None:
        knob.write_text(str(ms))

    yield set_delay
    set_delay(0)


@pytest.mark.parametrize("rounds", [2])
def test_free_racing_dma_pages_does_not_deadlock(gpu: fg.FakeGpu, callback_delay, rounds: int,
                                                 lab: dict[str, str]) -> None:
    """FREE holds the driver's API lock across the free callback (which takes the registration's
    lock); DMA_PAGES mapping the registration for a new device calls dma_map_pages (API lock).
    p2phub must not hold its lock across that call: it used to, and both hung for ever."""
    callback_delay(3000)
    va = gpu.va(36 * MiB)
    with Hub() as hub:
        for _ in range(rounds):
            reg = hub.register_nvidia(va, 1 * MiB)
            t, out = _in_thread(lambda: gpu.free_va(va, 1 * MiB))
            assert ru.wait_until(_free_is_waiting, 30)   # FREE holds the API lock now
            p, pout = _in_thread(lambda: reg.dma_pages(lab["nvme_target"]))
            assert _finish(t, out, "FREE") == 1
            try:
                pages = _finish(p, pout, "DMA_PAGES")
            except RevokedError:
                pass                # mapped after the free: refused
            else:
                assert False, f"DMA_PAGES after the free callback returned {len(pages)} addresses"
            assert reg.info().revoked
            reg.close()
    q = gpu.query()
    assert (q.page_tables, q.dma_mappings) == (0, 0)
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


def test_free_racing_unregister(gpu: fg.FakeGpu, callback_delay, lab: dict[str, str]) -> None:
    """UNREGISTER while FREE is about to run the callback: release claims the page table, unmaps
    under the registration lock (the callback waits), and its put_pages meets a table NVIDIA
    already freed; nothing is touched after it was freed (the stand-in counts misuse, KASAN
    sees the rest) and nothing leaks."""
    callback_delay(2000)
    va = gpu.va(40 * MiB)
    with Hub() as hub:
        for _ in range(3):
            reg = hub.register_nvidia(va, 1 * MiB, device=lab["nvme_target"])
            t, out = _in_thread(lambda: gpu.free_va(va, 1 * MiB))
            assert ru.wait_until(_free_is_waiting, 30)
            u, uout = _in_thread(reg.close)
            _finish(t, out, "FREE")
            _finish(u, uout, "UNREGISTER")
    q = gpu.query()
    assert (q.page_tables, q.dma_mappings) == (0, 0)
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


def _vgem_dmabuf_read_only() -> int:
    """A fresh 64 KiB vgem dumb buffer exported without DRM_RDWR: a read-only dma-buf fd."""

    class CreateDumb(ctypes.Structure):
        _fields_ = [("height", ctypes.c_uint32), ("width", ctypes.c_uint32), ("bpp", ctypes.c_uint32),
                    ("flags", ctypes.c_uint32), ("handle", ctypes.c_uint32), ("pitch", ctypes.c_uint32),
                    ("size", ctypes.c_uint64)]

    create = (3 << 30) | (ctypes.sizeof(CreateDumb) << 16) | (ord("d") << 8) | 0xB2
    to_fd = (3 << 30) | (ctypes.sizeof(_DrmPrimeHandle) << 16) | (ord("d") << 8) | 0x2D
    card = next(n for n in sorted(Path("/sys/class/drm").glob("card*"))
                if "-" not in n.name and "vgem" in str((n / "device").resolve()))
    drm = os.open(f"/dev/dri/{card.name}", os.O_RDWR | os.O_CLOEXEC)
    try:
        d = CreateDumb(height=16, width=1024, bpp=32)
        fcntl.ioctl(drm, create, d, True)
        h = _DrmPrimeHandle(handle=d.handle, flags=os.O_CLOEXEC)
        fcntl.ioctl(drm, to_fd, h, True)
        return int(h.fd)
    finally:
        os.close(drm)


def test_read_only_dmabuf_stays_read_only(consumer: Consumer, lab: dict[str, str]) -> None:
    """A dma-buf fd not open for writing gives a read-only export: O_RDONLY, no writable mmap,
    and no device mapping that lets the device write."""
    ro = _vgem_dmabuf_read_only()
    try:
        assert fcntl.fcntl(ro, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        with Hub() as hub, hub.register_dmabuf(ro, device=lab["nvme_target"]) as reg:
            assert len(reg.dma_pages(lab["nvme_target"])) == 16
            assert reg.info().read_only and not reg.info().revocable   # what the NVMe engine reads
            fd = reg.dmabuf_fd
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            with pytest.raises(OSError) as exc:
                mmap.mmap(fd, reg.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            assert exc.value.errno == errno.EACCES
            with mmap.mmap(fd, reg.length, mmap.MAP_SHARED, mmap.PROT_READ) as m:
                assert m[:16] == bytes(16)
            try:
                consumer.command(f"dmabuf {fd} {lab['nvme_baseline']}")   # maps DMA_BIDIRECTIONAL
                st = consumer.state()
            finally:
                consumer.command("release")
            assert st["map_err"] == -errno.EACCES and st["mapped"] == 0
    finally:
        os.close(ro)
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


def test_export_notify_races_export_close(lab: dict[str, str]) -> None:
    """The registration dies (its file closes) while the last reference to its mapped export is
    dropped: the notify work must not touch the export's inode once its file is on its way out
    (KASAN reports it on the debug kernel; elsewhere this must simply leave nothing behind)."""
    for _ in range(50):
        hub = Hub()
        reg = hub.register(VgemBuffer(64 * KiB))
        fd = reg.export()
        m = mmap.mmap(fd, reg.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m[:4] = b"race"
        t, out = _in_thread(hub.close)
        m.close()
        os.close(fd)
        _finish(t, out, "close")
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


def test_free_does_not_wait_for_ever_for_a_stuck_importer(gpu: fg.FakeGpu, consumer: Consumer,
                                                         lab: dict[str, str]) -> None:
    """The free callback runs under NVIDIA's API lock, which every other NVIDIA release waits
    for: an importer of the export that never finishes must not hold it for ever. After
    revoke_wait_ms the memory is revoked anyway (logged), and FREE returns."""
    param = Path("/sys/module/p2phub/parameters/revoke_wait_ms")
    old = param.read_text().strip() if param.exists() else None
    va = gpu.va(44 * MiB)
    try:
        if old is not None:
            param.write_text("500")
        with Hub() as hub, hub.register_nvidia(va, 1 * MiB, device=lab["nvme_target"]) as reg:
            consumer.command("hold")
            consumer.command(f"dmabuf {reg.dmabuf_fd} {lab['nvme_baseline']}")
            assert consumer.state()["mapped"] == 1
            t, out = _in_thread(lambda: gpu.free_va(va, 1 * MiB))
            try:
                t.join(30)
                stuck = t.is_alive()
                assert consumer.state()["fence_pending"] == 1     # the importer never finished
            finally:
                consumer.command("signal")
                callbacks = _finish(t, out, "FREE")
                consumer.command("release")
            assert not stuck, "the free callback waited 30 s (without end) for a stuck importer"
            assert callbacks == 1 and reg.info().revoked
    finally:
        if old is not None:
            param.write_text(old)

@pytest.fixture
def legacy_put_pages(gpu_module: None) -> Iterator[None]:
    """The stand-in's R470-era put_pages: it reads the table's gpu_uuid before its lookup."""
    knob = Path("/sys/module/p2phub_fakegpu/parameters/legacy_put_pages")
    knob.write_text("1")
    yield
    knob.write_text("0")


def test_no_put_pages_on_a_table_a_racing_callback_freed(gpu: fg.FakeGpu, callback_delay,
                                                          legacy_put_pages,
                                                          lab: dict[str, str]) -> None:
    """DMA_PAGES is blocked in dma_map_pages behind FREE (which holds the API lock); UNREGISTER
    claims the page table and waits for that map; FREE's callback finds the table claimed and
    returns, and the driver frees the table. Release must then not hand it to put_pages, which
    an R470-era driver dereferences first (the stand-in counts that read as misuse; KASAN sees
    the use-after-free on the debug kernel)."""
    callback_delay(3000)
    va = gpu.va(44 * MiB)
    misuse = gpu.query().misuse
    with Hub() as hub:
        reg = hub.register_nvidia(va, 1 * MiB)
        t, out = _in_thread(lambda: gpu.free_va(va, 1 * MiB))
        assert ru.wait_until(_free_is_waiting, 30)    # FREE holds the API lock now
        p, pout = _in_thread(lambda: reg.dma_pages(lab["nvme_target"]))
        time.sleep(1.0)                               # DMA_PAGES waits in dma_map_pages
        u, uout = _in_thread(reg.close)
        assert _finish(t, out, "FREE") == 1
        with pytest.raises((RevokedError, P2PHubOSError)):
            _finish(p, pout, "DMA_PAGES")
        _finish(u, uout, "UNREGISTER")
    q = gpu.query()
    assert q.misuse == misuse, "put_pages was called on a page table the driver had freed"
    assert (q.page_tables, q.dma_mappings) == (0, 0)
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}
