"""hub.open(): a file opened once for many loads and saves. The bytes that arrive are checked
against the file read independently (os.pread), saves are read back through another fd, bad
input gets a clear error, and a close never lets a queued request read a closed fd."""

from __future__ import annotations

import errno
import os
import threading
import time

import numpy as np
import pytest

from p2phub.errors import P2PHubOSError, UsageError
from p2phub.files import StorageFile
from p2phub.hub import Hub
from p2phub.ordering.errors import FenceError

from test_staged import StreamOps, _fake_gpu_reg

pytestmark = pytest.mark.unit

KiB = 1 << 10


@pytest.fixture()
def data_file(tmp_path):
    p = tmp_path / "blocks.bin"
    p.write_bytes(os.urandom(1 << 20))
    return p


@pytest.fixture()
def hub():
    with Hub(mode="staged") as h:
        yield h


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError as exc:
        assert exc.errno == errno.EBADF
        return False


def test_per_request_loads_of_an_open_file_land_every_byte(hub, data_file) -> None:
    data = data_file.read_bytes()
    mem = hub.alloc_host(256 * KiB)
    view = np.frombuffer(mem.mmap(), np.uint8)
    rng = np.random.default_rng(3)
    offs = (rng.integers(0, (len(data) - 8 * KiB) // 512, 48) * 512).tolist()  # some unaligned
    with hub.open(data_file) as f:
        assert isinstance(f, StorageFile) and f.readable and not f.writable
        assert f.size == len(data)
        fences = [hub.load(f, mem, o, 4 * KiB + (k % 3) * 100, k * 5 * KiB)
                  for k, o in enumerate(offs)]
        for fe in fences:
            fe.wait(30)
        # the same file read independently
        fd = os.open(data_file, os.O_RDONLY)
        try:
            for k, o in enumerate(offs):
                n = 4 * KiB + (k % 3) * 100
                assert view[k * 5 * KiB:k * 5 * KiB + n].tobytes() == os.pread(fd, n, o)
        finally:
            os.close(fd)
        # nbytes=None reads to the end; the batch calls take the open file too
        hub.load(f, mem, len(data) - 8 * KiB, None, 0).wait(30)
        assert view[:8 * KiB].tobytes() == data[-8 * KiB:]
        hub.load_batch(storage=f, offsets=[0, 64 * KiB], lengths=4 * KiB, memory=mem,
                       mem_offsets=[128 * KiB, 132 * KiB]).wait(30)
        assert view[128 * KiB:132 * KiB].tobytes() == data[:4 * KiB]
        assert view[132 * KiB:136 * KiB].tobytes() == data[64 * KiB:68 * KiB]
    assert f.closed and not _fd_open(f.fd)
    del view


def test_saves_aligned_and_not_read_back_through_another_fd(hub, tmp_path) -> None:
    mem = hub.alloc_host(64 * KiB)
    view = np.frombuffer(mem.mmap(), np.uint8)
    view[:] = np.random.default_rng(5).integers(0, 256, view.size, np.uint8)
    out = tmp_path / "out.bin"
    with hub.open(out, "w") as f:
        assert f.writable and f.readable
        hub.save(mem, f, 0, 16 * KiB, 0).wait(30)          # aligned: the O_DIRECT fd
        hub.save(mem, f, 16 * KiB + 100, 1000, 20 * KiB).wait(30)   # not: the buffered one
        hub.save(mem, f, 32 * KiB, 4 * KiB, 40 * KiB, sync=False).wait(30)
        # what was saved reads back through the same open file
        hub.load(f, mem, 0, 4 * KiB, 60 * KiB).wait(30)
        assert view[60 * KiB:64 * KiB].tobytes() == view[:4 * KiB].tobytes()
    got = out.read_bytes()
    assert len(got) == 36 * KiB
    assert got[:16 * KiB] == view[:16 * KiB].tobytes()
    assert got[16 * KiB + 100:16 * KiB + 1100] == view[20 * KiB:20 * KiB + 1000].tobytes()
    assert got[32 * KiB:] == view[40 * KiB:44 * KiB].tobytes()
    # "a" keeps what is there, "r+" needs the file
    with hub.open(out, "a") as f:
        assert f.size == 36 * KiB
    with pytest.raises(P2PHubOSError) as ei:
        hub.open(tmp_path / "missing.bin", "r+")
    assert ei.value.errno == errno.ENOENT
    del view


def test_a_file_that_grows_is_read_past_its_first_size(hub, tmp_path) -> None:
    p = tmp_path / "grows.bin"
    p.write_bytes(b"\x01" * 8 * KiB)
    mem = hub.alloc_host(16 * KiB)
    view = memoryview(mem.mmap())
    with hub.open(p) as f:
        with open(p, "ab") as w:
            w.write(b"\x02" * 8 * KiB)
        hub.load(f, mem, 8 * KiB, 8 * KiB, 0).wait(30)
        assert bytes(view[:8 * KiB]) == b"\x02" * 8 * KiB
        os.truncate(p, 4 * KiB)       # shrank: the read comes back short, the fence says so
        with pytest.raises(FenceError, match="ends at byte 4096"):
            hub.load(f, mem, 0, 8 * KiB, 0).wait(30)
    view.release()


def test_bad_input_is_refused_with_its_reason(hub, data_file, tmp_path) -> None:
    mem = hub.alloc_host(16 * KiB)
    with pytest.raises(UsageError, match="mode='rw'"):
        hub.open(data_file, "rw")
    with pytest.raises(UsageError, match="is a directory"):
        hub.open(tmp_path)
    with pytest.raises(P2PHubOSError) as ei:
        hub.open(tmp_path / "missing.bin")
    assert ei.value.errno == errno.ENOENT
    with hub.open(data_file) as f:
        with pytest.raises(UsageError, match="not inside its 1048576 bytes"):
            hub.load(f, mem, (1 << 20) - 4 * KiB, 8 * KiB)
        with pytest.raises(UsageError, match="not inside"):
            hub.load(f, mem, -4096, 4096)
        with pytest.raises(UsageError):
            hub.load(f, mem, 0, 8 * KiB, 12 * KiB)          # past the memory's end
        with pytest.raises(UsageError, match="open for reading only"):
            hub.save(mem, f, 0, 4 * KiB)
        with Hub(mode="staged") as other:
            omem = other.alloc_host(4 * KiB)
            with pytest.raises(UsageError, match="opened by another hub"):
                other.load(f, omem, 0, 4 * KiB)
    with pytest.raises(UsageError, match="closed"):
        hub.load(f, mem, 0, 4 * KiB)
    assert mem.holds == 0


def test_close_waits_for_the_requests_queued_on_it(hub, data_file) -> None:
    data = data_file.read_bytes()
    mem = hub.alloc_host(64 * KiB)
    view = memoryview(mem.mmap())
    f = hub.open(data_file)
    closer = threading.Thread(target=f.close)
    with hub.engines.paused():          # the engine thread runs nothing queued from here
        fences = [hub.load(f, mem, k * 8 * KiB, 4 * KiB, k * 4 * KiB) for k in range(16)]
        closer.start()
        time.sleep(0.2)
        assert closer.is_alive() and _fd_open(f.fd), "closed under queued requests"
    closer.join(30)
    assert not closer.is_alive() and f.closed and not _fd_open(f.fd)
    for k, fe in enumerate(fences):
        fe.wait(30)
        assert bytes(view[k * 4 * KiB:(k + 1) * 4 * KiB]) == data[k * 8 * KiB:k * 8 * KiB + 4 * KiB]
    view.release()


def test_hub_close_closes_its_open_files(data_file) -> None:
    hub = Hub(mode="staged")
    mem = hub.alloc_host(8 * KiB)
    f = hub.open(data_file)
    fence = hub.load(f, mem, 0, 8 * KiB)
    hub.close()
    assert fence.done and fence.exception() is None
    assert f.closed and not _fd_open(f.fd)
    with pytest.raises(UsageError, match="closed"):
        hub.open(data_file)


def test_lane_copies_get_their_own_fd(hub, data_file, tmp_path) -> None:
    """Memory the batch engine does not copy to goes through the staging lanes, which the
    file's close does not wait for: they read a dup of its fd, closed when they end."""
    data = data_file.read_bytes()
    buf = bytearray(64 * KiB)
    with _fake_gpu_reg(hub, StreamOps(), buf) as reg, hub.open(data_file) as f:
        before = set(os.listdir("/proc/self/fd"))
        hub.load(f, reg, 4096, 32 * KiB, 0).wait(30)
        assert bytes(buf[:32 * KiB]) == data[4096:4096 + 32 * KiB]
        out = tmp_path / "lanes.bin"
        with hub.open(out, "w") as g:
            hub.save(reg, g, 0, 32 * KiB).wait(30)
        assert out.read_bytes() == data[4096:4096 + 32 * KiB]
        assert set(os.listdir("/proc/self/fd")) <= before


def test_a_close_racing_requests_never_lets_one_use_a_reused_fd(hub, data_file, tmp_path) -> None:
    """Loads issued from another thread while the file closes: each is either refused
    ("closed") or reads the file it was issued on, even when the process opens another file
    at once and gets the fd number back."""
    data = data_file.read_bytes()
    decoy = tmp_path / "decoy.bin"
    decoy.write_bytes(b"\xee" * len(data))
    mem = hub.alloc_host(512 * KiB)
    view = np.frombuffer(mem.mmap(), np.uint8)
    for rnd in range(8):
        view[:] = 0
        f = hub.open(data_file)
        accepted: list = []
        refused: list[Exception] = []
        started = threading.Event()

        def issue() -> None:
            for k in range(128):
                try:
                    accepted.append((k, hub.load(f, mem, k * 4 * KiB, 4 * KiB, k * 4 * KiB)))
                except UsageError as exc:
                    refused.append(exc)
                    return
                finally:
                    started.set()

        t = threading.Thread(target=issue)
        t.start()
        started.wait(10)
        time.sleep(0.0005 * rnd)
        f.close()
        reused = os.open(decoy, os.O_RDONLY)      # most likely f.fd's number again
        try:
            t.join(30)
            for k, fe in accepted:
                fe.wait(30)
                got = view[k * 4 * KiB:(k + 1) * 4 * KiB].tobytes()
                assert got == data[k * 4 * KiB:(k + 1) * 4 * KiB], f"round {rnd}: request {k}"
            assert all("closed" in str(e) for e in refused)
        finally:
            os.close(reused)
    assert mem.holds == 0
    del view


def test_batches_on_an_open_file(hub, data_file, tmp_path) -> None:
    """load_batch/save_batch take an open file like any other storage: a duplicate of its fd
    (the buffered one for unaligned writes), refused once the file is closed."""
    data = data_file.read_bytes()
    mem = hub.alloc_host(64 * KiB)
    view = np.frombuffer(mem.mmap(), np.uint8)
    out = tmp_path / "batch-out.bin"
    with hub.open(data_file) as f, hub.open(out, "w") as g:
        hub.load_batch(storage=f, offsets=[4 * KiB, 100], lengths=4 * KiB, memory=mem,
                       mem_offsets=[0, 8 * KiB]).wait(30)
        assert view[:4 * KiB].tobytes() == data[4 * KiB:8 * KiB]
        assert view[8 * KiB:12 * KiB].tobytes() == data[100:100 + 4 * KiB]
        hub.save_batch(storage=g, offsets=[0, 5000], lengths=[4 * KiB, 300], memory=mem,
                       mem_offsets=[0, 8 * KiB]).wait(30)
        with pytest.raises(P2PHubOSError, match="open for reading only"):
            hub.save_batch(storage=f, offsets=[0], lengths=4 * KiB, memory=mem, mem_offsets=[0])
    got = out.read_bytes()
    assert got[:4 * KiB] == data[4 * KiB:8 * KiB] and got[5000:5300] == data[100:400]
    with pytest.raises(UsageError, match="closed"):
        hub.load_batch(storage=f, offsets=[0], lengths=4 * KiB, memory=mem, mem_offsets=[0])
    del view


@pytest.mark.parametrize("write", [False, True], ids=["load", "save"])
def test_a_request_past_its_checks_when_the_file_closes_is_refused(hub, data_file,
                                                                    monkeypatch, write) -> None:
    """The close completes between a request's checks and its queueing (forced here): the
    engine queue refuses it, and the memory is left as it was (no hold, no access)."""
    mem = hub.alloc_host(8 * KiB)
    hub.load(str(data_file), mem, 0, 4 * KiB).wait(30)      # the engine queue exists
    f = hub.open(data_file, "r+")
    name = "write_fd" if write else "read_range"
    checked = getattr(f, name)

    def then_closed(*args):
        out = checked(*args)
        t = threading.Thread(target=f.close)
        t.start()
        t.join(10)
        assert f.closed
        return out

    monkeypatch.setattr(f, name, then_closed)
    with pytest.raises(UsageError, match="closed"):
        if write:
            hub.save(mem, f, 0, 4 * KiB)
        else:
            hub.load(f, mem, 0, 4 * KiB)
    assert mem.holds == 0 and len(mem.ordering) == 0
