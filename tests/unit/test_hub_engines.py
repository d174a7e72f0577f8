"""The Hub owns its I/O engines: after hub.close() no thread, fd or locked memory the Hub
started is left, whichever calls ran (load, save, load_batch, save_batch, on a path or a file
from hub.open()) and with the reads
on the copying thread or on their own; and single requests share the batch engine (issued
together, they reach it as one submission). The CUDA copy path runs against the stand-in
libcuda.so.1 of test_batch_fakecuda, in a child process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_batch_fakecuda import fake_libcuda  # noqa: F401 - the stand-in driver fixture

pytestmark = pytest.mark.unit

SCRIPT = r"""
import os, sys, threading, time
import numpy as np
from p2phub import batch, staged
from p2phub.backend import GpuRange
from p2phub.hub import Hub

class FakeCudaOps(staged.HostOps):
    name = "cuda"            # the batch engine copies through (the stand-in) libcuda
    def stream_create(self):
        return 1

def fake_gpu(hub, nbytes):
    buf = np.zeros(nbytes, np.uint8)
    ptr = buf.ctypes.data
    rng = GpuRange("fakecuda", 0, ptr, nbytes, ptr, nbytes, keepalive=[buf])
    reg = staged.StagedRegistration(hub, rng, FakeCudaOps(), "fake GPU memory")
    hub._staging.add(reg)
    return buf, reg

def fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out

def tasks():
    out = {}
    for t in os.listdir("/proc/self/task"):
        try:
            out[t] = open(f"/proc/self/task/{t}/comm").read().strip()
        except OSError:
            pass
    return out

def locked_kb():
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1])

def memfd_maps():
    return sum(1 for line in open("/proc/self/maps") if "memfd:" in line)

def state():
    return ({t.ident: t.name for t in threading.enumerate()}, fds(), tasks(),
            locked_kb(), memfd_maps())

path, out = sys.argv[1], sys.argv[2]
data = np.fromfile(path, np.uint8)
for io_thread in (False, True):
    before = state()
    hub = Hub(mode="staged")
    batch.configure_batch(hub, depth=8, slot=64 << 10, slots=12, io_thread=io_thread)
    host = hub.alloc_host(4 << 20)
    view = np.frombuffer(host.mmap(), np.uint8)
    gpu, greg = fake_gpu(hub, 4 << 20)
    for mem, reg in ((view, host), (gpu, greg)):
        hub.load(path, reg, 8192, 65536, 4096).wait(60)
        assert np.array_equal(mem[4096:4096 + 65536], data[8192:8192 + 65536])
        hub.save(reg, out, 0, 65536, 4096).wait(60)
        assert np.array_equal(np.fromfile(out, np.uint8)[:65536], mem[4096:4096 + 65536])
        offs = np.arange(64) * 12288
        f = hub.load_batch(storage=path, offsets=offs, lengths=4096, memory=reg,
                           mem_offsets=np.arange(64) * 8192)
        f.wait(60)
        for k, o in enumerate(offs):
            assert np.array_equal(mem[k * 8192:k * 8192 + 4096], data[o:o + 4096])
        hub.save_batch(storage=out, offsets=np.arange(8) * 4096, lengths=4096, memory=reg,
                       mem_offsets=np.arange(8) * 8192).wait(60)
        # single requests issued together: each lands, and they share engine submissions
        fences = [hub.load(path, reg, int(o), 4096, 2 << 20 | k * 4096)
                  for k, o in enumerate(offs)]
        for fe in fences:
            fe.wait(60)
        for k, o in enumerate(offs):
            d = (2 << 20) | k * 4096
            assert np.array_equal(mem[d:d + 4096], data[o:o + 4096])
        assert all(fe.stats["requests"] >= 1 for fe in fences)
        # files opened once: one closed by its with-block, one left to hub.close()
        sf = hub.open(path)
        hub.load(sf, reg, 8192, 8192, 3 << 20).wait(60)
        assert np.array_equal(mem[3 << 20:(3 << 20) + 8192], data[8192:16384])
        with hub.open(out, "r+") as wf:
            hub.save(reg, wf, 0, 4096, 3 << 20).wait(60)
            hub.save(reg, wf, 100, 1000, 3 << 20).wait(60)   # unaligned: a buffered fd
    del view
    during = state()
    assert any(n == "p2phub-batch" for n in during[0].values()), during[0]
    hub.close()
    assert sf.closed
    after = state()
    threads = {i: n for i, n in after[0].items() if i not in before[0]}
    assert not threads, f"threads left: {threads}"
    fdl = {fd: t for fd, t in after[1].items() if before[1].get(fd) != t}
    assert not fdl, f"fds left: {fdl}"
    # a joined thread's task leaves /proc a moment after join() returns
    for _ in range(100):
        left = {t: n for t, n in tasks().items() if t not in before[2]}
        if not left:
            break
        time.sleep(0.01)
    assert not left, f"tasks left: {left}"
    assert after[3] == before[3], f"VmLck {before[3]} -> {after[3]} kB"
    assert after[4] == before[4], f"memfd mappings {before[4]} -> {after[4]}"
    del gpu, greg, host
print("ok")
"""


def test_hub_close_leaves_no_thread_fd_or_locked_memory(fake_libcuda, tmp_path) -> None:  # noqa: F811
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(4 << 20))
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_libcuda))
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(tmp_path / "out.bin")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["ok"]


@pytest.mark.unit
def test_per_request_loads_follow_a_path_replaced_by_rename(tmp_path) -> None:
    """hub.load by path keeps one open file per path, but a path renamed over reads the new
    file, and every fd the engines kept is closed with the Hub."""
    from p2phub.hub import Hub

    path = tmp_path / "blocks.bin"
    path.write_bytes(b"\x11" * 8192)
    before = set(os.listdir("/proc/self/fd"))
    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(8192)
        view = memoryview(mem.mmap())
        hub.load(str(path), mem, 0, 4096, 0).wait()
        hub.load(str(path), mem, 4096, 4096, 4096).wait()
        assert bytes(view[:8192]) == b"\x11" * 8192
        new = tmp_path / "blocks.new"
        new.write_bytes(b"\x22" * 8192)
        os.rename(new, path)
        hub.load(str(path), mem, 0, 4096, 0).wait()
        assert bytes(view[:4096]) == b"\x22" * 4096
        assert bytes(view[4096:8192]) == b"\x11" * 4096
        view.release()
        mem.close()
    left = set(os.listdir("/proc/self/fd")) - before
    assert not [f for f in left if os.path.exists(f"/proc/self/fd/{f}")
                and str(tmp_path) in os.readlink(f"/proc/self/fd/{f}")]


@pytest.mark.unit
@pytest.mark.parametrize("held", [False, True], ids=["as-issued", "queued-behind-a-pause"])
def test_saves_and_loads_of_one_file_keep_their_order(tmp_path, held: bool) -> None:
    """Single requests and batches on one file, issued back to back without waiting (into
    different registrations, so no memory ordering relates them): each read sees exactly the
    write queued before it, whether the engine thread runs them as they come or finds them all
    queued at once."""
    import contextlib

    import numpy as np

    from p2phub.hub import Hub

    blk, n = 4096, 16
    path = tmp_path / "order.bin"
    path.write_bytes(bytes(n * blk))
    with Hub(mode="staged") as hub:
        regs = [hub.alloc_host(n * blk) for _ in range(4)]
        views = [np.frombuffer(r.mmap(), np.uint8) for r in regs]
        rng = np.random.default_rng(7)
        for rnd in range(20):
            src_a, src_c = rng.integers(0, 256, n * blk, np.uint8), rng.integers(0, 256, n * blk, np.uint8)
            views[0][:] = src_a
            views[2][:] = src_c
            views[1][:] = 0
            views[3][:] = 0
            offs = np.arange(n) * blk
            pause = hub.engines.paused() if held else contextlib.nullcontext()
            with pause:
                fences = [hub.save(regs[0], str(path), int(o), blk, int(o), sync=False)
                          for o in offs]
                fences.append(hub.load_batch(storage=str(path), offsets=offs, lengths=blk,
                                             memory=regs[1], mem_offsets=offs))
                fences.append(hub.save_batch(storage=str(path), offsets=offs, lengths=blk,
                                             memory=regs[2], mem_offsets=offs, sync=False))
                fences += [hub.load(str(path), regs[3], int(o), blk, int(o)) for o in offs]
            for f in fences:
                f.wait(60)
            assert np.array_equal(views[1], src_a), f"round {rnd}: the batch load missed the saves"
            assert np.array_equal(views[3], src_c), f"round {rnd}: a load missed the batch save"
        del views


FORCED = r"""
import sys
import time
import numpy as np
from p2phub.hub import Hub
from p2phub.ordering import FenceError

def memfd_maps():
    return sum(1 for line in open("/proc/self/maps") if "memfd:" in line)

path = sys.argv[1]
data = np.fromfile(path, np.uint8)
with Hub(mode="staged") as hub:
    base = memfd_maps()
    for how in ("load", "load_batch"):
        mem = hub.alloc_host(1 << 20)
        keep = hub.alloc_host(1 << 20)      # still open: nothing may land in it by mistake
        with hub.engines.paused():          # the engine has not started these yet
            if how == "load":
                fences = [hub.load(path, mem, k * 4096, 4096, k * 4096) for k in range(64)]
            else:
                fences = [hub.load_batch(storage=path, offsets=np.arange(64) * 4096,
                                         lengths=4096, memory=mem,
                                         mem_offsets=np.arange(64) * 4096)]
            mem.close(force=True, timeout=0.2)
            assert mem.closed and mem.holds > 0, mem.holds
            if how == "load":                # single requests fail at once, with the reason
                for f in fences:
                    try:
                        f.wait(0)
                        raise AssertionError("a forced close left a request standing")
                    except FenceError as exc:
                        assert "closed" in str(exc), exc
        for f in fences:                     # a batch completes when the engine has run it
            f.exception(60)
        # the engine runs them now, into memory the close has not freed yet
        hub.load(path, keep, 0, 65536, 0).wait(60)
        view = np.frombuffer(keep.mmap(), np.uint8)
        assert np.array_equal(view[:65536], data[:65536])
        assert not view[65536:].any()
        del view
        keep.close()
        for _ in range(500):                # freed by the last transfer's completion
            if mem.holds == 0 and memfd_maps() == base:
                break
            time.sleep(0.01)
        assert mem.holds == 0 and memfd_maps() == base, (mem.holds, memfd_maps(), base)
print("ok")
"""


def test_a_forced_close_frees_memory_only_after_its_transfers(tmp_path) -> None:
    """close(force=True) fails the fences of transfers still queued at once, but the memory
    stays mapped until the engine has run them (it reads into it); then it is freed. Before,
    the engine wrote into unmapped memory and the process died."""
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1 << 20))
    res = subprocess.run([sys.executable, "-c", FORCED, str(src)], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    assert res.stdout.split() == ["ok"]


def test_the_results_collector_sleeps_through_batches(tmp_path, monkeypatch) -> None:
    """A batch's place on the engine thread carries no result: batches waited on one after
    another wake no results collector (it would take the GIL from the batch's own thread),
    and single requests not waited on, between batches, still complete, their fences and
    bytes right, nothing left behind in the queue's tables."""
    import threading

    import numpy as np

    from p2phub import batch
    from p2phub.hub import Hub

    path = tmp_path / "data.bin"
    data = np.random.default_rng(5).integers(0, 256, 1 << 20, dtype=np.uint8)
    data.tofile(path)
    reaps: list[str] = []
    reap = batch._Queue.reap

    def counted(self):  # type: ignore[no-untyped-def]
        n = reap(self)
        if n:
            reaps.append(threading.current_thread().name)
        return n

    monkeypatch.setattr(batch._Queue, "reap", counted)
    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(1 << 20)
        view = np.frombuffer(mem.mmap(), np.uint8)
        offs = np.arange(16) * 4096
        for _ in range(10):
            hub.load_batch(storage=str(path), offsets=offs, lengths=4096, memory=mem,
                           mem_offsets=offs).wait(30)
        assert reaps == [], reaps
        fences = []
        for k in range(6):
            fences.append(hub.load(str(path), mem, 65536 * (k + 1), 4096, 65536 * (k + 1)))
            hub.load_batch(storage=str(path), offsets=offs, lengths=4096, memory=mem,
                           mem_offsets=offs).wait(30)
        for f in fences:
            f.wait(30)
        for k in range(6):
            o = 65536 * (k + 1)
            assert np.array_equal(view[o:o + 4096], data[o:o + 4096])
        q = hub.engines._queue           # nothing waits in its tables for a result
        assert not q._pending, q._pending
        del view
        mem.close()


def test_a_batch_wakes_the_engine_thread_once(tmp_path) -> None:
    """A batch waited on at once costs the engine thread one wake-up (its hand-over): its
    reservation alone does not wake the thread, and its last run releases it as it ends.
    What depends on the thread coming to a reservation still works: a request queued behind
    a batch runs after it, a save with sync (its fsync before the release) lands, and
    paused() reaches a thread that sleeps."""
    import numpy as np

    from p2phub.hub import Hub

    path = tmp_path / "data.bin"
    data = np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8)
    data.tofile(path)
    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(1 << 20)
        view = np.frombuffer(mem.mmap(), np.uint8)
        offs = np.arange(4) * 4096
        hub.load_batch(storage=str(path), offsets=offs, lengths=4096, memory=mem,
                       mem_offsets=offs).wait(30)
        q = hub.engines._queue
        before = q.stats()["wakes"]
        for k in range(10):
            o = np.array([k * 8192])
            hub.load_batch(storage=str(path), offsets=o, lengths=4096, memory=mem,
                           mem_offsets=o + 65536).wait(30)
        wakes = q.stats()["wakes"] - before
        assert wakes <= 12, f"{wakes} wake-ups of the engine thread for 10 batches"
        for k in range(10):
            o = 65536 + k * 8192
            assert np.array_equal(view[o:o + 4096], data[k * 8192:k * 8192 + 4096])
        # a request queued right behind a batch, neither waited on yet
        fb = hub.load_batch(storage=str(path), offsets=np.array([0]), lengths=4096,
                            memory=mem, mem_offsets=np.array([131072]))
        fr = hub.load(str(path), mem, 4096, 4096, 131072)
        fr.wait(30)
        assert fb.done()
        assert np.array_equal(view[131072:135168], data[4096:8192])
        # a save with sync: released after its fsync
        out = tmp_path / "out.bin"
        out.write_bytes(b"\0" * (1 << 16))
        hub.save_batch(storage=str(out), offsets=np.array([0, 8192]), lengths=4096,
                       memory=mem, mem_offsets=np.array([65536, 73728])).wait(30)
        got = np.fromfile(out, np.uint8)
        assert np.array_equal(got[:4096], data[:4096])
        assert np.array_equal(got[8192:12288], data[8192:12288])
        with hub.engines.paused():      # the thread sleeps: paused() wakes it to get there
            pass
        hub.load_batch(storage=str(path), offsets=offs, lengths=4096, memory=mem,
                       mem_offsets=offs).wait(30)
        del view
        mem.close()


def test_requests_batches_and_pauses_from_many_threads_all_land(tmp_path) -> None:
    """Four threads issue single loads while a fifth runs batches and pauses on the same
    engine thread: every request's result reaches its own fence (a request is filed under the
    ticket the queue gives it), every byte lands where its request put it, and no request is
    left uncollected."""
    import threading

    import numpy as np

    from p2phub.hub import Hub

    block, per_thread = 4096, 150
    data = np.random.default_rng(7).integers(0, 256, 4 * per_thread * block, np.uint8)
    path = tmp_path / "blocks.bin"
    path.write_bytes(data.tobytes())
    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(data.size + 64 * block)
        f = hub.open(str(path), "r")
        errors: list[BaseException] = []

        def loads(k: int) -> None:
            try:
                fences = []
                for i in range(per_thread):
                    o = (k * per_thread + i) * block
                    src = str(path) if i % 2 else f    # by path and through the open file
                    fences.append(hub.load(src, mem, o, block, o))
                for fe in fences:
                    fe.wait(30)
                    assert fe.stats["requests"] >= 1
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        def batches() -> None:
            try:
                offs = np.arange(64) * block
                for r in range(20):
                    hub.load_batch(storage=f, offsets=offs, lengths=block, memory=mem,
                                   mem_offsets=data.size + offs).wait(30)
                    if r % 4 == 0:
                        with hub.engines.paused():
                            pass
                    else:
                        hub.engines.wait_queued()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=loads, args=(k,)) for k in range(4)]
        threads.append(threading.Thread(target=batches))
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        view = np.frombuffer(mem.mmap(), np.uint8)
        assert np.array_equal(view[:data.size], data)
        assert np.array_equal(view[data.size:], data[:64 * block])
        hub.engines.wait_queued()
        assert not hub.engines._queue._pending
        del view
        f.close()
        mem.close()


def test_a_request_queued_out_of_step_with_the_tickets_still_completes(tmp_path, caplog) -> None:
    """Were something to queue on the engine thread without the engines' lock, a request's
    ticket would not be the one expected: it is filed under the ticket it got, with an error
    logged, and still completes with its bytes (its memory held until then)."""
    import logging

    from p2phub.hub import Hub

    path = tmp_path / "blocks.bin"
    path.write_bytes(bytes(range(256)) * 16)
    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(4096)
        hub.load(str(path), mem, 0, 4096).wait(30)      # the queue exists
        q = hub.engines._queue
        mark = q.lib.sio_queue_reserve(q.q)             # behind the Python side's back
        with caplog.at_level(logging.ERROR, logger="p2phub.batch"):
            fence = hub.load(str(path), mem, 0, 4096)
        assert fence.ticket == mark + 1
        assert "where" in caplog.text and "expected" in caplog.text
        q.release(mark)
        fence.wait(30)
        assert bytes(memoryview(mem.mmap())[:4096]) == path.read_bytes()
        assert not q._pending
        mem.close()


def test_a_waited_request_is_collected_by_its_waiter_whenever_it_comes(tmp_path) -> None:
    """Lone loads a millisecond apart, each waited on at once: the waiting thread collects
    its own result (the results collector, woken by the same completion, stands back for a
    thread registered for it) rather than a second thread taking the GIL and completing the
    fence. A wait that times out still times out, and a fence left unwaited is still
    completed by the collector. Bytes checked against the file."""
    import threading
    import time

    import numpy as np

    from p2phub.hub import Hub
    from p2phub.ordering import FenceTimeout

    path = tmp_path / "data.bin"
    data = np.random.default_rng(9).integers(0, 256, 1 << 20, dtype=np.uint8)
    data.tofile(path)
    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(1 << 20)
        view = np.frombuffer(mem.mmap(), np.uint8)
        hub.load(str(path), mem, 0, 4096).wait(30)          # the queue exists
        q = hub.engines._queue
        by: list[str] = []
        for k in range(100):
            time.sleep(0.001)
            f = hub.load(str(path), mem, 4096 * k, 4096, 4096 * (255 - k))
            f.add_done_callback(lambda _f: by.append(threading.current_thread().name))
            f.wait(30)
        ours = by.count(threading.current_thread().name)
        assert ours >= 80, by       # (before: the collector took 60-99 of them)
        for k in range(100):
            o = 4096 * (255 - k)
            assert np.array_equal(view[o:o + 4096], data[4096 * k:4096 * (k + 1)])
        with hub.engines.paused():
            f = hub.load(str(path), mem, 0, 4096)
            with pytest.raises(FenceTimeout):
                f.wait(0.00005)
            with pytest.raises(FenceTimeout):
                f.wait(0.001)
        f.wait(30)
        left = hub.load(str(path), mem, 8192, 4096, 8192)
        deadline = time.monotonic() + 30
        while not left.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert left.done() and left.exception() is None
        assert not q._pending
        del view
        mem.close()
