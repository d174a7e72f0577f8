"""A load_batch of one or two small reads into host memory goes to the engine thread as single
requests (configure_batch's request_entries): the bytes arrive (checked against the file),
the fence, its results and per-entry fences behave as a planned batch's, a read that fails
while running is named by entry, nothing is left held or open, and larger batches and
request_entries=0 are planned as before. A hub.open() file's small batch reads its own fd, queued
behind the file's close; a planned one reads a duplicate."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from p2phub import batch
from p2phub.errors import P2PHubOSError, UsageError
from p2phub.hub import Hub
from p2phub.ordering import AccessKind, FenceError

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture()
def hub():
    h = Hub(mode="staged")
    yield h
    h.close()


@pytest.fixture()
def disk_file(tmp_path):
    p = tmp_path / "data.bin"
    data = np.random.default_rng(11).integers(0, 256, 4 * MiB + 100, dtype=np.uint8)
    data.tofile(p)
    return str(p), data


@pytest.mark.parametrize("n,direct", [(1, True), (2, True), (2, False)])
def test_a_batch_of_few_small_reads_goes_as_single_requests(hub, disk_file, n, direct) -> None:
    path, data = disk_file
    mem = bytearray(MiB)
    with hub.register(mem) as reg:
        offs = [3 * MiB + 4096, 123][:n]
        lens = [4096, 64 * KiB - 5][:n]
        dsts = [512 * KiB, 7][:n]
        f = hub.load_batch(storage=path, offsets=offs, lengths=lens, memory=reg,
                           mem_offsets=dsts, per_entry=True, direct=direct)
        f.wait(30)
        for o, ln, d in zip(offs, lens, dsts):
            assert bytes(mem[d:d + ln]) == data[o:o + ln].tobytes()
        assert list(f.results) == lens
        assert f.stats["requests"] == n and "pieces" not in f.stats
        assert f.stats["entries"] == n and f.stats["submit_path"] in ("io_uring", "aio")
        assert f.stats["io"] == {path: "O_DIRECT" if direct else "buffered"}
        assert all(e.done() and e.exception() is None for e in f.entries)
        assert reg.holds == 0 and len(reg.ordering) == 0


def test_the_entry_form_and_an_fd_go_as_requests_too(hub, disk_file) -> None:
    path, data = disk_file
    mem = bytearray(64 * KiB)
    fd = os.open(path, os.O_RDONLY)
    try:
        with hub.register(mem) as reg:
            f = hub.load_batch([(fd, MiB, 8 * KiB, reg, 4096)])
            f.wait(30)
            assert f.stats["requests"] == 1 and f.stats["io"] == {f"fd {fd}": "buffered"}
            assert bytes(mem[4096:12 * KiB]) == data[MiB:MiB + 8 * KiB].tobytes()
        os.fstat(fd)    # the caller's fd is still the caller's
    finally:
        os.close(fd)


def test_larger_batches_and_request_entries_0_are_planned(hub, disk_file) -> None:
    path, data = disk_file
    mem = bytearray(2 * MiB)
    with hub.register(mem) as reg:
        cases = {
            "three entries": dict(storage=path, offsets=[0, 8192, 4096], lengths=4096),
            "more bytes": dict(storage=path, offsets=[0], lengths=batch._REQUEST_BYTES + 4096),
        }
        for what, kw in cases.items():
            f = hub.load_batch(memory=reg, mem_offsets=np.arange(len(kw["offsets"])) * 4096,
                               **kw)
            f.wait(30)
            assert "requests" not in f.stats and f.stats["pieces"] >= 1, what
        batch.configure_batch(hub, request_entries=0)
        f = hub.load_batch(storage=path, offsets=[MiB], lengths=4096, memory=reg)
        f.wait(30)
        assert "requests" not in f.stats and f.stats["pieces"] == 1
        assert bytes(mem[:4096]) == data[MiB:MiB + 4096].tobytes()
        batch.configure_batch(hub, request_entries=1)
        f = hub.load_batch(storage=path, offsets=[0, 4096], lengths=4096, memory=reg,
                           mem_offsets=[0, 4096])
        f.wait(30)
        assert "requests" not in f.stats
        f = hub.load_batch(storage=path, offsets=[8192], lengths=4096, memory=reg)
        f.wait(30)
        assert f.stats["requests"] == 1


def test_a_hub_open_file_small_batch_reads_its_fd_and_a_planned_one_a_duplicate(hub, disk_file,
                                                                                monkeypatch) -> None:
    path, data = disk_file
    mem = bytearray(MiB)
    dups = []
    with hub.register(mem) as reg, hub.open(path) as opened:
        real_dup = opened.dup
        monkeypatch.setattr(opened, "dup", lambda *a: dups.append(1) or real_dup(*a))
        f = hub.load_batch(storage=opened, offsets=[8192, 3 * MiB], lengths=4096, memory=reg,
                           mem_offsets=[0, 4096], per_entry=True)
        f.wait(30)
        assert f.stats["requests"] == 2 and not dups
        assert f.stats["io"] == {path: "O_DIRECT" if opened.direct else "buffered"}
        assert bytes(mem[:4096]) == data[8192:12288].tobytes()
        assert bytes(mem[4096:8192]) == data[3 * MiB:3 * MiB + 4096].tobytes()
        fds = None
        for k in (1, 2):        # (the first planned batch makes the engine's staging)
            f = hub.load_batch(storage=opened, offsets=[0, 4096, 8192], lengths=4096,
                               memory=reg, mem_offsets=[0, 4096, 8192])
            f.wait(30)
            assert "requests" not in f.stats and len(dups) == k
            assert bytes(mem[:3 * 4096]) == data[:3 * 4096].tobytes()
            now = set(os.listdir("/proc/self/fd"))
            assert fds is None or now == fds        # the duplicate is closed
            fds = now
        assert reg.holds == 0
    # closed: refused by name, planned or not
    for offs in ([0], [0, 4096, 8192]):
        with pytest.raises(UsageError, match="closed"):
            hub.load_batch(storage=opened, offsets=offs, lengths=4096, memory=reg)


def test_a_small_batch_on_a_hub_open_file_closing_meanwhile_is_refused(hub, disk_file) -> None:
    """The file's close begins between the batch's planning and its queueing: nothing is
    queued on the fd the close is about to let go of."""
    path, _data = disk_file
    mem = bytearray(64 * KiB)
    with hub.register(mem) as reg:
        opened = hub.open(path)
        real = batch._send_requests

        def close_first(h, p, fence):
            opened.closing = True       # what close() sets first, under the file's lock
            try:
                return real(h, p, fence)
            finally:
                opened.closing = False
                opened.close()

        batch._send_requests = close_first
        try:
            with pytest.raises(UsageError, match="closed"):
                hub.load_batch(storage=opened, offsets=[0], lengths=4096, memory=reg)
        finally:
            batch._send_requests = real
        assert reg.holds == 0 and len(reg.ordering) == 0


def test_request_entries_refusals(hub) -> None:
    for bad in (-1, batch._MAX_REQUEST_ENTRIES + 1):
        with pytest.raises(UsageError, match="request_entries"):
            batch.configure_batch(hub, request_entries=bad)


def test_bad_small_batches_are_refused_before_anything_is_queued(hub, disk_file) -> None:
    path, _data = disk_file
    mem = bytearray(64 * KiB)
    with hub.register(mem) as reg:
        with pytest.raises(UsageError, match="entry 1: range .* is past the end"):
            hub.load_batch(storage=path, offsets=[0, 4 * MiB], lengths=4096, memory=reg,
                           mem_offsets=[0, 4096])
        with pytest.raises(UsageError, match="entry 0: memory range"):
            hub.load_batch(storage=path, offsets=[0], lengths=4096, memory=reg,
                           mem_offsets=[62 * KiB])
        assert reg.holds == 0 and hub.engines._queue is None   # nothing was ever queued


def test_a_small_batch_entry_that_fails_while_running_is_named(hub, tmp_path) -> None:
    """The file cut short after the batch was checked: the entry past its new end fails
    (EIO, named by entry), the other one's bytes arrive."""
    path = tmp_path / "shrinks.bin"
    data = np.random.default_rng(5).integers(0, 256, MiB, dtype=np.uint8)
    data.tofile(path)
    mem = bytearray(64 * KiB)
    with hub.register(mem) as reg:
        with hub.engines.paused():      # checked and queued, not yet run
            f = hub.load_batch(storage=str(path), offsets=[0, 768 * KiB], lengths=16 * KiB,
                               memory=reg, mem_offsets=[0, 16 * KiB], per_entry=True)
            os.truncate(path, 640 * KiB)
        with pytest.raises(FenceError, match=r"entry 1: read .*shrinks.bin\[786432:\+16384\]"
                                             r": EIO") as got:
            f.wait(30)
        assert isinstance(got.value.__cause__, P2PHubOSError)
        assert got.value.__cause__.errno == errno.EIO
        assert list(f.results) == [16 * KiB, -errno.EIO]
        assert f.entries[0].exception() is None and f.entries[1].exception() is not None
        assert bytes(mem[:16 * KiB]) == data[:16 * KiB].tobytes()
        assert reg.holds == 0


def test_a_small_batch_is_no_ordered_access_as_a_planned_one_is_not(hub, disk_file) -> None:
    """A batch does not wait for the memory's live accesses (hub.load does): the same
    whether it is planned or sent as requests."""
    path, data = disk_file
    mem = bytearray(64 * KiB)
    with hub.register(mem) as reg:
        a = reg.ordering.acquire(0, 64 * KiB, AccessKind.GPU_READ, "a kernel reading it")
        try:
            f = hub.load_batch(storage=path, offsets=[4096], lengths=4096, memory=reg)
            f.wait(30)
            assert f.stats["requests"] == 1
            assert reg.ordering.live() == [a]
        finally:
            reg.ordering.retire(a)
        assert bytes(mem[:4096]) == data[4096:8192].tobytes()


def test_small_batches_queued_at_close_complete_and_leave_nothing(disk_file) -> None:
    path, data = disk_file
    h = Hub(mode="staged")
    mem = bytearray(MiB)
    reg = h.register(mem)
    fences = [h.load_batch(storage=path, offsets=[k * 8192], lengths=4096, memory=reg,
                           mem_offsets=[k * 4096]) for k in range(100)]
    h.close()
    for k, f in enumerate(fences):
        assert f.done() and f.exception() is None and f.stats["requests"] == 1
        assert bytes(mem[k * 4096:(k + 1) * 4096]) == data[k * 8192:k * 8192 + 4096].tobytes()
    assert reg.holds == 0
    with pytest.raises(UsageError, match="closed"):
        h.load_batch(storage=path, offsets=[0], lengths=4096, memory=reg)


def test_a_small_batch_times_out_then_completes_and_can_be_awaited(hub, disk_file) -> None:
    """A wait with a limit on a small batch held behind paused() times out and leaves it
    queued; it completes once the engine thread goes on, its bytes right; an asyncio await of
    another one returns once its read landed (completed by the collector thread)."""
    import asyncio

    from p2phub.ordering import FenceTimeout

    path, data = disk_file
    mem = bytearray(64 * KiB)
    with hub.register(mem) as reg:
        with hub.engines.paused():
            f = hub.load_batch(storage=path, offsets=[8192], lengths=4096, memory=reg)
            with pytest.raises(FenceTimeout):
                f.wait(0.01)
            assert not f.done()
        f.wait(30)
        assert bytes(mem[:4096]) == data[8192:12288].tobytes()

        async def restore() -> None:
            g = hub.load_batch(storage=path, offsets=[MiB, 2 * MiB], lengths=4096, memory=reg,
                               mem_offsets=[4096, 8192])
            await asyncio.wait_for(g, 30)
            assert g.stats["requests"] == 2

        asyncio.run(restore())
        assert bytes(mem[4096:8192]) == data[MiB:MiB + 4096].tobytes()
        assert bytes(mem[8192:12288]) == data[2 * MiB:2 * MiB + 4096].tobytes()
        assert reg.holds == 0


def test_batches_on_a_hub_open_file_racing_its_close_read_it_or_are_refused(hub, disk_file,
                                                                           tmp_path) -> None:
    """Threads issue small and planned batches on a hub.open() file while it closes and its
    fd number is taken again by another file (other bytes): each batch either is refused as
    closed or lands the file's own bytes, and nothing is left held."""
    import threading

    path, data = disk_file
    other = tmp_path / "other.bin"
    other.write_bytes(b"\xee" * (4 * MiB))
    mem = bytearray(8 * 64 * KiB)
    with hub.register(mem) as reg:
        for _round in range(5):
            opened = hub.open(path)
            go, bad, some = threading.Barrier(5), [], threading.Semaphore(0)

            def issue(t: int) -> None:
                base = t * 64 * KiB
                go.wait()
                for k in range(40):
                    n = 1 + k % 3           # 1 and 2 entries go as requests, 3 are planned
                    offs = [((t * 40 + k) * 3 + j) * 4096 % (4 * MiB) for j in range(n)]
                    dsts = [base + j * 4096 for j in range(n)]
                    try:
                        f = hub.load_batch(storage=opened, offsets=offs, lengths=4096,
                                           memory=reg, mem_offsets=dsts)
                    except UsageError as exc:
                        if "closed" not in str(exc):
                            bad.append(repr(exc))
                        continue
                    try:
                        f.wait(30)
                    except Exception as exc:  # noqa: BLE001 - any failure is the finding
                        bad.append(repr(exc))
                        continue
                    for o, d in zip(offs, dsts):
                        if bytes(mem[d:d + 4096]) != data[o:o + 4096].tobytes():
                            bad.append(f"thread {t} batch {k}: wrong bytes at {o}")
                    some.release()

            threads = [threading.Thread(target=issue, args=(t,)) for t in range(4)]
            for th in threads:
                th.start()
            go.wait()
            for _ in range(8):          # some batches ran before the close begins
                some.acquire(timeout=30)
            opened.close()
            reuse = [os.open(other, os.O_RDONLY) for _ in range(4)]    # the fd numbers again
            for th in threads:
                th.join(60)
            for fd in reuse:
                os.close(fd)
            assert not bad, bad[:5]
        assert reg.holds == 0 and len(reg.ordering) == 0
