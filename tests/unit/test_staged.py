"""Staged mode on the host: Hub modes and reasons, staged registrations, and the pipelined
load/save engine end to end through real files (O_DIRECT where the file system has it),
with host memory and with a copy engine that behaves like a GPU's (copies run later, on
a stream thread, and complete at events)."""

from __future__ import annotations

import asyncio
import ctypes
import os
import queue
import threading
import time
from pathlib import Path

import pytest

from p2phub import staged
from p2phub.backend import GpuRange
from p2phub.errors import P2PHubError, UsageError
from p2phub.hub import Hub
from p2phub.staged import StagedModeError, StagedRegistration

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture()
def hub(tmp_path):
    h = Hub(mode="staged")
    staged.configure(h, chunk=64 * KiB, lanes=3)
    yield h
    h.close()


@pytest.fixture()
def data_file(tmp_path):
    data = os.urandom(MiB + 3 * KiB + 17)
    p = tmp_path / "data.bin"
    p.write_bytes(data)
    return p, data


# ---------------------------------------------------------------- modes


def test_auto_without_device_is_staged_and_names_doctor_checks(tmp_path) -> None:
    with Hub(path=str(tmp_path / "absent")) as h:
        assert h.mode == "staged"
        line = h.mode_reason
        assert "\n" not in line and line.startswith("kmod.")


def test_asked_for_staged(tmp_path) -> None:
    with Hub(mode="staged") as h:
        assert h.mode == "staged" and h.mode_reason == "asked for: Hub(mode='staged')"


def test_unreadable_device_node_is_staged_with_devnode_reason(tmp_path, monkeypatch) -> None:
    node = tmp_path / "p2phub"
    node.write_bytes(b"")
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    mode, why = staged.choose_mode(str(node), "auto")
    assert mode == "staged" and why.startswith("kmod.devnode:")


def test_bad_mode_is_refused() -> None:
    with pytest.raises(UsageError, match="mode="):
        Hub(mode="fast")


def test_p2p_mode_without_device_raises(tmp_path) -> None:
    with pytest.raises(P2PHubError, match="does not exist"):
        Hub(path=str(tmp_path / "absent"), mode="p2p")


def test_staged_hub_refuses_p2p_only_calls(hub) -> None:
    with pytest.raises(StagedModeError, match="staged mode"):
        hub.register_dmabuf(0, 0, 4096)
    with pytest.raises(StagedModeError, match="staged mode"):
        hub.info()


def test_the_staged_reason_comes_from_capability_facts_not_the_doctor(tmp_path) -> None:
    import subprocess
    import sys
    code = ("import sys; from p2phub.hub import Hub; h = Hub(path=%r); "
            "print(h.mode, any(m.startswith('p2phub.doctor') for m in sys.modules))"
            % str(tmp_path / "absent"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["staged", "False"]


# ---------------------------------------------------------------- registrations


def test_host_buffer_registration(hub) -> None:
    buf = bytearray(8192)
    with hub.register(buf, offset=4096) as reg:
        assert isinstance(reg, StagedRegistration) and reg.mode == "staged"
        assert reg.length == 4096 and reg.reason == hub.mode_reason
        for call in (lambda: reg.dma_pages("0000:00:04.0"), reg.export, lambda: reg.dmabuf_fd):
            with pytest.raises(StagedModeError, match="peer-to-peer mode"):
                call()
        with pytest.raises(UsageError, match="ProtectionDomain"):
            reg.mr(object())
    assert reg.closed


def test_registration_refusals(hub) -> None:
    for bad, match in ((None, "cannot register"), (3, "cannot register"),
                       (b"readonly", "read-only"), (object(), "not memory p2phub knows")):
        with pytest.raises(UsageError, match=match):
            hub.register(bad)
    with pytest.raises(UsageError, match="ends past"):
        hub.register(bytearray(100), offset=50, length=60)


def test_hub_close_closes_registrations(tmp_path) -> None:
    h = Hub(mode="staged")
    reg = h.register(bytearray(4096))
    h.close()
    assert reg.closed and h.closed


# ---------------------------------------------------------------- load / save with host memory


def test_load_whole_file(hub, data_file) -> None:
    path, data = data_file
    buf = bytearray(len(data))
    with hub.register(buf) as reg:
        fence = hub.load(path, reg)
        assert fence.wait(30) is None or fence.wait(30) == len(data)
        assert fence.done() and fence.exception() is None
        assert fence.path == "staged" and fence.stats["seconds"] > 0
    assert bytes(buf) == data


@pytest.mark.parametrize("offset,nbytes,dest_offset", [
    (0, 4096, 0), (1, 4095, 3), (4095, 70 * KiB + 5, 0), (65 * KiB - 1, 200 * KiB, 999),
    (MiB, 3 * KiB + 17, 0)])
def test_load_ranges(hub, data_file, offset, nbytes, dest_offset) -> None:
    path, data = data_file
    buf = bytearray(nbytes + dest_offset + 10)
    with hub.register(buf) as reg:
        hub.load(str(path), reg, offset, nbytes, dest_offset).wait(30)
    assert bytes(buf[dest_offset:dest_offset + nbytes]) == data[offset:offset + nbytes]
    assert not any(buf[:dest_offset]) and not any(buf[dest_offset + nbytes:])


def test_load_from_open_file_and_fd(hub, data_file) -> None:
    path, data = data_file
    buf = bytearray(len(data))
    with hub.register(buf) as reg, open(path, "rb") as f:
        hub.load(f, reg).wait(30)
        assert bytes(buf) == data
        buf[:] = bytes(len(buf))
        hub.load(f.fileno(), reg, 10, 100).wait(30)
        assert bytes(buf[:100]) == data[10:110]


def test_load_range_errors(hub, data_file, tmp_path) -> None:
    path, data = data_file
    with hub.register(bytearray(len(data))) as reg:
        with pytest.raises(UsageError, match="not inside"):
            hub.load(path, reg, len(data) - 10, 11)
        with pytest.raises(UsageError, match="ends past"):
            hub.load(path, reg, 0, len(data), dest_offset=1)
        with pytest.raises(P2PHubError, match="ENOENT"):
            hub.load(tmp_path / "missing", reg)
        with pytest.raises(UsageError, match="not a path"):
            hub.load(3.5, reg)


@pytest.mark.parametrize("offset,nbytes", [(0, MiB), (4096, 256 * KiB), (3, 70 * KiB + 1)])
def test_save(hub, tmp_path, offset, nbytes) -> None:
    data = os.urandom(nbytes)
    out = tmp_path / "out.bin"
    with hub.register(bytearray(data)) as reg:
        fence = hub.save(reg, out, offset)
        fence.wait(30)
        assert fence.stats["direct"] == (offset % 4096 == 0 and nbytes % 4096 == 0) or \
            not fence.stats["direct"]
    got = out.read_bytes()
    assert got[offset:] == data and len(got) == offset + nbytes


def test_round_trip_through_a_block_device_like_fd(hub, tmp_path) -> None:
    """Save then load back through one fd (what a block device path gives)."""
    data = os.urandom(512 * KiB)
    p = tmp_path / "dev.img"
    p.write_bytes(bytes(MiB))
    with hub.register(bytearray(data)) as src, hub.register(bytearray(len(data))) as dst:
        hub.save(src, p, 128 * KiB).wait(30)
        hub.load(p, dst, 128 * KiB, len(data)).wait(30)
        assert bytes(dst.source.keepalive[0]) == data
    assert p.stat().st_size == MiB


def test_close_while_busy_is_refused(hub, data_file) -> None:
    path, data = data_file
    reg = hub.register(bytearray(len(data)))
    reg.hold()                   # as a running transfer does
    with pytest.raises(OSError, match="EBUSY"):
        reg.close()
    reg.unhold()
    reg.close()
    with pytest.raises(UsageError, match="closed"):
        hub.load(path, reg)


# ---------------------------------------------------------------- fence interface


def test_fence_callbacks_and_await(hub, data_file) -> None:
    path, data = data_file
    buf = bytearray(len(data))
    seen = []
    with hub.register(buf) as reg:
        fence = hub.load(path, reg)
        fence.add_done_callback(lambda f: seen.append(f))

        async def main() -> None:
            await hub.load(path, reg)
        asyncio.run(main())
        fence.wait(30)
        assert seen == [fence]
        fence.on_stream(None)    # complete: nothing to enqueue
        late = []
        fence.add_done_callback(late.append)
        assert late == [fence]


def test_a_short_source_fails_the_fence(hub, tmp_path) -> None:
    p = tmp_path / "grows.bin"
    p.write_bytes(bytes(300 * KiB))
    buf = bytearray(300 * KiB)
    with hub.register(buf) as reg:
        with hub.engines.paused():        # the engine is busy: the load waits in its queue
            fence = hub.load(p, reg)
            os.truncate(p, 100 * KiB)     # the file is truncated under the load
        exc = fence.exception(30)
        assert exc is not None and "ends at byte" in str(exc)
        with pytest.raises(Exception, match="ends at byte"):
            fence.wait(1)
        assert reg.holds == 0


# ---------------------------------------------------------------- a GPU-like copy engine


class StreamOps:
    """Copies run later on a per-stream worker thread; events complete when the stream gets
    to them: the ordering a GPU gives, so a lane that reused a buffer before its copy ran
    would corrupt the data."""

    name = "fakegpu"

    def __init__(self) -> None:
        self.streams: dict[int, queue.Queue] = {}
        self.events: dict[int, threading.Event] = {}
        self.n = 0
        self.copies = 0
        self.bound: set[int] = set()

    def bind_thread(self, ordinal: int = 0) -> None:
        self.bound.add(threading.get_ident())

    def pinned(self, size: int):
        return staged.HostOps().pinned(size)

    def stream_create(self) -> int:
        self.n += 1
        q: queue.Queue = queue.Queue()
        self.streams[self.n] = q

        def run() -> None:
            while True:
                item = q.get()
                if item is None:
                    return
                item()
        threading.Thread(target=run, daemon=True).start()
        return self.n

    def stream_destroy(self, s: int) -> None:
        self.streams.pop(s).put(None)

    def _copy(self, dst: int, src: int, n: int, s: int) -> None:
        assert threading.get_ident() in self.bound

        def do() -> None:
            time.sleep(0.001)
            ctypes.memmove(dst, src, n)
            self.copies += 1
        self.streams[s].put(do)

    copy_h2d = copy_d2h = _copy

    def event_create(self) -> int:
        self.n += 1
        self.events[self.n] = threading.Event()
        self.events[self.n].set()
        return self.n

    def event_destroy(self, ev: int) -> None:
        del self.events[ev]

    def event_record(self, ev: int, s: int) -> None:
        e = self.events[ev]
        e.clear()
        self.streams[s].put(e.set)

    def event_synchronize(self, ev: int) -> None:
        assert self.events[ev].wait(10)


def _fake_gpu_reg(hub: Hub, ops: StreamOps, buf: bytearray) -> StagedRegistration:
    ptr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    rng = GpuRange("fakegpu", 0, ptr, len(buf), ptr, len(buf), keepalive=[buf])
    reg = StagedRegistration(hub, rng, ops, "fake GPU buffer")
    hub._staging.add(reg)
    return reg


def test_pipelined_load_and_save_with_deferred_copies(hub, data_file, tmp_path) -> None:
    path, data = data_file
    ops = StreamOps()
    buf = bytearray(len(data))
    with _fake_gpu_reg(hub, ops, buf) as reg:
        fence = hub.load(path, reg)
        fence.wait(30)
        assert bytes(buf) == data            # complete means: every copy has run
        assert ops.copies == len(staged._pieces(0, len(data), 64 * KiB, True))
        out = tmp_path / "out.bin"
        hub.save(reg, out).wait(30)
        assert out.read_bytes() == data


def test_pieces_cover_the_range_exactly() -> None:
    for offset, n, chunk, direct in ((0, 1, 4096, True), (5, 10000, 8192, True),
                                     (4096, 3 * 8192, 8192, True), (7, 12345, 4096, False)):
        got = bytearray()
        pieces = staged._pieces(offset, n, chunk, direct)
        src = bytes(range(256)) * ((offset + n + 3 * chunk) // 256 + 1)
        for start, length, skip, useful in pieces:
            if direct:
                assert start % 4096 == 0 and length % 4096 == 0
            assert length <= chunk + (4096 if direct else 0) and skip + useful <= length
            got += src[start + skip:start + skip + useful]
        assert bytes(got) == src[offset:offset + n]


def test_configure_validates(hub) -> None:
    with pytest.raises(UsageError, match="chunk"):
        staged.configure(hub, chunk=1000)
    with pytest.raises(UsageError, match="lanes"):
        staged.configure(hub, lanes=0)


def test_a_registration_staged_for_its_own_reason_says_it_on_every_path(hub) -> None:
    why = "pairs.gpu_nvme: asked for"
    reg = staged.register(hub, bytearray(4096), reason=why)
    assert reg.reason == why and reg.mode == "staged"
    path = reg.path("0000:42:00.0")
    assert path.kind.value == "staged" and why in path.reason
    reg.close()


def test_p2p_calls_without_the_module_still_raise_module_not_loaded(tmp_path) -> None:
    from p2phub.errors import ModuleNotLoadedError
    with Hub(path=str(tmp_path / "absent")) as h:
        with pytest.raises(ModuleNotLoadedError, match="staged mode"):
            h.register_dmabuf(0, 0, 4096)


def test_load_and_save_name_a_wrong_source_or_destination(hub, data_file, tmp_path) -> None:
    with hub.register(bytearray(4096)) as reg:
        with pytest.raises(UsageError, match="is a directory: want a file or a block device"):
            hub.load(str(tmp_path), reg)
        with pytest.raises(UsageError, match="is a directory"):
            hub.save(reg, str(tmp_path))
    with pytest.raises(UsageError, match=r"the destination must be memory registered with this hub.*NoneType"):
        hub.load(str(data_file), None)
    with pytest.raises(UsageError, match=r"the source must be memory registered with this hub"):
        hub.save(b"bytes", str(tmp_path / "out"))



def test_a_lane_transfer_refused_at_start_closes_its_file_once(hub, data_file, monkeypatch) -> None:
    """A load on the staging lanes whose start fails: the error reaches the caller, the file
    p2phub opened for it is closed exactly once, and the memory is neither held nor ordered."""
    path, data = data_file
    ops = StreamOps()
    buf = bytearray(len(data))
    closed: list[int] = []
    real_close = os.close

    def counting_close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)

    with _fake_gpu_reg(hub, ops, buf) as reg:
        stager = hub.engines.stager(ops, 0)

        def refuse(*_a, **_k) -> None:
            raise UsageError("the stager is closed")
        monkeypatch.setattr(stager, "start", refuse)
        monkeypatch.setattr(os, "close", counting_close)
        with pytest.raises(UsageError, match="stager is closed"):
            hub.load(path, reg)
        monkeypatch.setattr(os, "close", real_close)
        assert len(closed) == 1 and len(set(closed)) == 1
        assert reg.holds == 0
        monkeypatch.undo()
        hub.load(path, reg).wait(30)       # the range was released: it loads now
        assert bytes(buf) == data


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_kb(start: int, length: int) -> int:
    """AnonHugePages of the mappings of this process inside [start, start + length)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < start + length and start < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def test_staging_memory_is_huge_page_memory_at_a_2_mib_boundary() -> None:
    """Staging slots that disks read into sit on transparent huge pages where the kernel
    offers them (an O_DIRECT read is then one segment per 2 MiB): the buffer starts on a
    2 MiB boundary, is writable end to end, and where THP is on ("always" or "madvise")
    its touched bytes are huge pages; close() unmaps it."""
    from p2phub.hostmem import HUGE_PAGE, HugeMapping
    from p2phub.staged import HostOps

    buf = HostOps().pinned(5 * HUGE_PAGE + 4096)
    try:
        assert buf.ptr % HUGE_PAGE == 0 and len(buf.view) == buf.size == 5 * HUGE_PAGE + 4096
        buf.view[:] = b"\x5a" * buf.size
        assert buf.view[0] == buf.view[-1] == 0x5A
        if _thp_mode() in ("always", "madvise") and buf.mapping.huge:
            assert _anon_huge_kb(buf.ptr, 5 * HUGE_PAGE) >= 4096, "no huge pages behind staging"
    finally:
        buf.close()
    with pytest.raises(UsageError, match="a mapping of 0 bytes"):
        HugeMapping(0)
