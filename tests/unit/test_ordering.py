"""p2phub.ordering on the host: the range tracker against a brute-force model, the
producer/consumer table, waiting and strict modes, timeouts, fences and their failures,
and GPU-stream fencing against a fake stream runtime (a thread that executes the ops)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import gc
import itertools
import queue
import threading
import time
import weakref
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2phub.errors import P2PHubOSError, UsageError
from p2phub.ordering import (CONSUMERS, PRODUCERS, Access, AccessKind, Fence, FenceError,
                             FenceTimeout, HostFence, Ordering, OrderingError, OrderingTimeout,
                             RangeTracker, SourceFence, WordPool)

SPACE = 96


# ----------------------------------------------------------------------------- tracker


def brute_conflicts(live: list[Access], start: int, end: int, kind: AccessKind) -> list[Access]:
    return [a for a in live if a.overlaps(start, end) and (kind.producer or a.producer)]


class TrackerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.t = RangeTracker()
        self.live: list[Access] = []

    @rule(start=st.integers(0, SPACE - 1), length=st.integers(1, 24),
          kind=st.sampled_from(list(AccessKind)))
    def insert(self, start: int, length: int, kind: AccessKind) -> None:
        end = min(SPACE, start + length)
        got = self.t.conflicts(start, end, kind)
        assert got == brute_conflicts(self.live, start, end, kind)
        a = Access(kind, start, end)
        assert self.t.enter(a) == got
        self.live.append(a)

    @rule(start=st.integers(0, SPACE - 1), length=st.integers(1, 24),
          kind=st.sampled_from(list(AccessKind)))
    def enter_strict(self, start: int, length: int, kind: AccessKind) -> None:
        end = min(SPACE, start + length)
        want = brute_conflicts(self.live, start, end, kind)
        a = Access(kind, start, end)
        assert self.t.enter(a, strict=True) == want
        if not want:  # entered only without conflicts
            self.live.append(a)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10_000))
    def remove(self, i: int) -> None:
        a = self.live.pop(i % len(self.live))
        self.t.remove(a)

    @precondition(lambda self: self.live)
    @rule(picks=st.lists(st.integers(0, 10_000), min_size=1, max_size=8), stale=st.booleans())
    def remove_all(self, picks: list[int], stale: bool) -> None:
        """Completions retired together: lone segments and shared ones in any order, and an
        access no longer live (withdrawn meanwhile) skipped."""
        chosen: list[Access] = []
        for i in picks:
            if self.live:
                chosen.append(self.live.pop(i % len(self.live)))
        if stale:
            chosen.insert(len(chosen) // 2, Access(AccessKind.NVME_READ, 0, 1))
        self.t.remove_all(chosen)

    @rule(start=st.integers(0, SPACE - 1), length=st.integers(1, SPACE))
    def query(self, start: int, length: int) -> None:
        end = min(SPACE, start + length)
        assert self.t.overlapping(start, end) == [a for a in self.live if a.overlaps(start, end)]

    @invariant()
    def segments_match_the_model(self) -> None:
        segs = self.t.segments()
        assert len(self.t) == len(self.live)
        prev_end = -1
        prev_accs: tuple = ()
        for s, e, accs in segs:
            assert s < e and accs, (s, e, accs)
            assert s >= prev_end
            if s == prev_end:
                assert accs != prev_accs, "equal neighbours must be merged"
            for x in range(s, e):  # every byte carries exactly the live accesses covering it
                assert accs == tuple(a for a in self.live if a.start <= x < a.end)
            prev_end, prev_accs = e, accs
        covered = {x for s, e, _ in segs for x in range(s, e)}
        assert covered == {x for a in self.live for x in range(a.start, a.end)}
        assert self.t.nsegments <= 2 * len(self.live) + 1


TestTrackerModel = TrackerModel.TestCase
TestTrackerModel.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 4096)), min_size=1,
                max_size=400))
def test_many_disjoint_consumer_ranges_then_removal_leaves_nothing(ranges) -> None:
    t = RangeTracker()
    accs = [Access(AccessKind.NVME_WRITE, s, s + n) for s, n in ranges]
    for a in accs:
        t.insert(a)
    assert len(t) == len(accs)
    for a in reversed(accs):
        t.remove(a)
    assert len(t) == 0 and t.nsegments == 0


def test_tracker_scales_to_100k_ranges() -> None:
    t = RangeTracker()
    accs = [Access(AccessKind.NVME_READ, i * 8192, i * 8192 + 4096) for i in range(100_000)]
    for a in accs:
        t.insert(a)
    assert t.nsegments == 100_000
    t0 = time.perf_counter()
    for i in range(2000):
        assert t.conflicts(i * 8192 + 4096, i * 8192 + 8192, AccessKind.GPU_WRITE) == []
    per = (time.perf_counter() - t0) / 2000
    assert per < 1e-3, f"conflict check at 100k live ranges took {per * 1e6:.1f} us"
    t.remove(accs[500])
    assert t.conflicts(500 * 8192, 501 * 8192, AccessKind.GPU_WRITE) == []


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 200), max_size=60), st.lists(st.integers(-5, 205), max_size=30))
def test_sorted_keys_around_matches_a_scan(keys, probes) -> None:
    """floor (the key below x), irange's first key (the key above) and irange over keys split
    into many small blocks agree with a plain scan of the sorted keys."""
    from p2phub.ordering.tracker import _SortedKeys

    class Small(_SortedKeys):
        LOAD = 2

    k = Small()
    for x in keys:
        k.add(x)
    ordered = sorted(keys)
    for x in probes:
        below = max((y for y in ordered if y <= x), default=None)
        above = min((y for y in ordered if y >= x), default=None)
        assert (k.irange(x, 1 << 30) or [None])[0] == above
        assert k.floor(x) == below
        assert k.irange(x, x + 20) == [y for y in ordered if x <= y < x + 20]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 300), st.integers(1, 40)), max_size=80))
def test_sorted_keys_add_in_gap_matches_a_scan(ranges) -> None:
    """add_in_gap adds a start exactly when its range overlaps no range added before (by a
    plain scan), and the keys stay sorted across small blocks."""
    from p2phub.ordering.tracker import _SortedKeys

    class Small(_SortedKeys):
        LOAD = 2

    k, ends = Small(), {}
    for s, n in ranges:
        free = all(e <= s or s + n <= b for b, e in ends.items())
        assert k.add_in_gap(s, s + n, ends) == free
        if free:
            ends[s] = s + n
        assert list(k) == sorted(ends) and len(k) == len(ends)


def test_removing_an_unknown_access_is_an_error() -> None:
    t = RangeTracker()
    with pytest.raises(KeyError):
        t.remove(Access(AccessKind.GPU_READ, 0, 10))


# ----------------------------------------------------------------------------- the table


@pytest.mark.parametrize("first", list(AccessKind), ids=lambda k: k.name)
@pytest.mark.parametrize("second", list(AccessKind), ids=lambda k: k.name)
def test_conflict_table(first: AccessKind, second: AccessKind) -> None:
    """Every pair: overlapping ranges conflict unless both are consumers; disjoint never."""
    o = Ordering("reg", 1 << 16, strict=True)
    a = o.enter(0, 4096, first, "first")
    expect = first.producer or second.producer
    if expect:
        with pytest.raises(OrderingError) as ei:
            o.enter(2048, 4096, second, "second")
        assert ei.value.conflict is a
        assert first.label in str(ei.value) and second.label in str(ei.value)
        assert "first" in str(ei.value) and "second" in str(ei.value)
    else:
        b = o.enter(2048, 4096, second, "second")
        assert b.deps == []
    o.enter(4096 * 2, 4096, second, "disjoint")  # never conflicts
    assert first.conflicts_with(second) is expect


def test_kinds_split_into_the_issue_table() -> None:
    assert {k.name for k in PRODUCERS} == {"NVME_READ", "RDMA_RECV", "RDMA_WRITE_TARGET",
                                         "RDMA_READ_DEST", "GPU_WRITE", "SOCKET_RECV"}
    assert {k.name for k in CONSUMERS} == {"NVME_WRITE", "RDMA_SEND", "RDMA_READ_SOURCE",
                                         "GPU_READ", "SOCKET_SEND"}


def test_adjacent_ranges_do_not_conflict() -> None:
    o = Ordering("reg", 8192, strict=True)
    o.enter(0, 4096, AccessKind.GPU_WRITE)
    o.enter(4096, 4096, AccessKind.NVME_READ)


def test_bad_ranges_and_kinds_are_refused() -> None:
    o = Ordering("reg", 4096)
    for off, n in ((-1, 10), (0, 0), (4000, 200), (0, -5)):
        with pytest.raises(UsageError, match="not inside"):
            o.enter(off, n, AccessKind.GPU_READ)
    with pytest.raises(UsageError, match="AccessKind"):
        o.enter(0, 10, "read")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- modes


def test_waiting_mode_waits_for_the_earlier_fence() -> None:
    o = Ordering("reg", 1 << 20)
    read = o.acquire(0, 8192, AccessKind.NVME_READ, "ssd read")
    src = HostFence("ssd read cqe")
    read.bind(src)
    order: list[str] = []

    def consumer() -> None:
        acc = o.acquire(4096, 4096, AccessKind.RDMA_SEND, "send")
        order.append("send starts")
        acc.bind(HostFence()).__class__  # bound, never completed: stays live

    th = threading.Thread(target=consumer)
    th.start()
    time.sleep(0.05)
    assert order == []  # still waiting for the read
    order.append("read completes")
    src.set()
    th.join(2)
    assert order == ["read completes", "send starts"]
    assert [a.kind for a in o.live()] == [AccessKind.RDMA_SEND]


def test_first_come_first_served() -> None:
    """A producer queued behind consumers is not overtaken by consumers that come later."""
    o = Ordering("reg", 4096)
    c1 = o.enter(0, 4096, AccessKind.NVME_WRITE)
    p = o.enter(0, 4096, AccessKind.NVME_READ)
    c2 = o.enter(0, 4096, AccessKind.NVME_WRITE)
    assert p.deps == [c1] and c2.deps == [p]


def test_strict_mode_raises_naming_both_and_enters_nothing() -> None:
    o = Ordering("reg A", 1 << 20, strict=True)
    a = o.enter(0, 4096, AccessKind.NVME_READ, "lba 0")
    with pytest.raises(OrderingError) as ei:
        o.acquire(100, 10, AccessKind.RDMA_SEND, "to node b")
    msg = str(ei.value)
    assert "nvme read" in msg and "lba 0" in msg and "rdma send" in msg and "to node b" in msg
    assert ei.value.access is not None and ei.value.conflict is a
    assert o.live() == [a]


def test_timeout_withdraws_and_names_the_blocker() -> None:
    o = Ordering("reg", 4096, timeout=0.05)
    a = o.acquire(0, 4096, AccessKind.GPU_WRITE, "kernel")
    a.bind(HostFence())
    t0 = time.monotonic()
    with pytest.raises(OrderingTimeout) as ei:
        o.acquire(0, 100, AccessKind.NVME_WRITE, "flush out")
    assert 0.04 < time.monotonic() - t0 < 1.0
    assert ei.value.conflict is a and "gpu write" in str(ei.value)
    assert isinstance(ei.value, TimeoutError)
    assert o.live() == [a]  # the late one was withdrawn
    with pytest.raises(OrderingTimeout):
        o.acquire(0, 100, AccessKind.NVME_WRITE, timeout=0.01)  # per-call timeout


def test_unbound_access_blocks_followers_until_withdrawn() -> None:
    o = Ordering("reg", 4096)
    a = o.enter(0, 4096, AccessKind.NVME_READ)
    b = o.enter(0, 4096, AccessKind.NVME_WRITE)
    threading.Timer(0.05, lambda: a.cancel(RuntimeError("submit failed"))).start()
    with pytest.raises(FenceError, match="submit failed"):  # a producer failed: no consume
        o.wait_deps(b, 2)


# ----------------------------------------------------------------------------- failures


def test_consumer_behind_a_failed_producer_fails_producer_goes_ahead() -> None:
    o = Ordering("reg", 4096)
    r = o.acquire(0, 4096, AccessKind.NVME_READ, "read")
    src = HostFence("cqe")
    r.bind(src)
    results: dict[str, object] = {}

    def run(name: str, kind: AccessKind) -> None:
        try:
            o.acquire(0, 4096, kind, name).bind(HostFence()).fence  # noqa: B018
            results[name] = "ok"
        except FenceError as exc:
            results[name] = exc

    t = threading.Thread(target=run, args=("send", AccessKind.RDMA_SEND))
    t.start()
    time.sleep(0.02)
    src.fail(FenceError("NVMe status 0x281 (unrecovered read error)"))
    t.join(2)
    exc = results["send"]
    assert isinstance(exc, FenceError) and "0x281" in str(exc) and "read" in str(exc)
    assert r.fence is not None and r.fence.failed()
    with pytest.raises(FenceError, match="0x281"):
        r.fence.wait(0)
    assert o.live() == []
    o.acquire(0, 4096, AccessKind.NVME_READ, "retry")  # the range is usable again


def test_fail_all_wakes_waiters_with_the_reason() -> None:
    o = Ordering("reg", 4096)
    a = o.acquire(0, 4096, AccessKind.RDMA_WRITE_TARGET, "remote write")
    a.bind(HostFence())
    woke: list[BaseException] = []

    def waiter() -> None:
        try:
            a.fence.wait(5)  # type: ignore[union-attr]
        except FenceError as exc:
            woke.append(exc)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.02)
    assert o.fail_all("queue pair 0x11 was destroyed") == 1
    th.join(2)
    assert woke and "queue pair 0x11 was destroyed" in str(woke[0])
    assert o.live() == []


def test_close_refuses_then_forces() -> None:
    o = Ordering("reg", 4096)
    a = o.acquire(0, 4096, AccessKind.NVME_READ, "lba 7")
    src = HostFence()
    a.bind(src)
    with pytest.raises(P2PHubOSError) as ei:
        o.close(timeout=0.01)
    assert ei.value.errno == errno.EBUSY and "lba 7" in str(ei.value)
    o.close(force=True, reason="dead controller")
    with pytest.raises(FenceError, match="dead controller"):
        a.fence.wait(0)  # type: ignore[union-attr]
    with pytest.raises(UsageError, match="closed"):
        o.enter(0, 1, AccessKind.GPU_READ)


def test_close_waits_for_fences_that_complete() -> None:
    o = Ordering("reg", 4096)
    a = o.acquire(0, 4096, AccessKind.NVME_READ)
    src = HostFence()
    a.bind(src)
    threading.Timer(0.03, src.set).start()
    o.close(timeout=2)
    assert o.live() == []


# ----------------------------------------------------------------------------- fences


def test_fence_interface() -> None:
    f = HostFence("x")
    seen: list[Fence] = []
    f.add_done_callback(seen.append)
    assert not f.done()
    with pytest.raises(FenceTimeout):
        f.wait(0.01)
    with pytest.raises(FenceTimeout):
        f.exception(0.01)
    f.set()
    assert f.done() and f.exception() is None and seen == [f]
    f.wait(0)
    f.add_done_callback(seen.append)
    assert seen == [f, f]
    assert not f.set()  # once


def test_fence_await() -> None:
    async def main() -> tuple[float, BaseException | None]:
        ok, bad = HostFence(), HostFence()
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, ok.set)
        loop.call_later(0.02, lambda: bad.fail("controller gone"))
        t0 = time.monotonic()
        await ok
        try:
            await bad
        except FenceError as exc:
            return time.monotonic() - t0, exc
        return 0.0, None

    dt, exc = asyncio.run(main())
    assert dt >= 0.015 and exc is not None and "controller gone" in str(exc)


class FakeFuture:
    """The NVMe CommandFuture protocol, completed by a thread."""

    def __init__(self) -> None:
        self._ev = threading.Event()
        self._exc: BaseException | None = None
        self._cbs: list = []
        self.polls = 0

    def poll(self) -> bool:
        self.polls += 1
        return self._ev.is_set()

    def done(self) -> bool:
        return self._ev.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._ev.wait(timeout):
            raise TimeoutError("still running")
        return self._exc

    def add_done_callback(self, cb) -> None:
        if self._ev.is_set():
            cb(self)
        else:
            self._cbs.append(cb)

    def finish(self, exc: BaseException | None = None) -> None:
        self._exc = exc
        self._ev.set()
        cbs, self._cbs = self._cbs, []    # let go of them once done, as NVMe futures do
        for cb in cbs:
            cb(self)


def test_source_fence_follows_a_future_and_its_failure() -> None:
    fut = FakeFuture()
    f = SourceFence(fut, "nvme read")
    assert not f.done() and fut.polls >= 1  # done() drives the source
    with pytest.raises(FenceTimeout):
        f.wait(0.01)
    fut.finish(OSError(errno.EIO, "controller is dead"))
    with pytest.raises(FenceError, match="controller is dead") as ei:
        f.wait(1)
    assert isinstance(ei.value.__cause__, OSError)


def test_binding_an_access_to_a_future() -> None:
    o = Ordering("reg", 4096)
    a = o.acquire(0, 4096, AccessKind.NVME_READ)
    fut = FakeFuture()
    fence = a.bind(fut)
    assert o.live() == [a]
    threading.Timer(0.02, fut.finish).start()
    fence.wait(2)
    assert o.live() == []


@contextlib.contextmanager
def _collector_off() -> Iterator[None]:
    """No cycle collection meanwhile: what is freed is freed by reference counts alone."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _bound_work(o: Ordering, offset: int,
                kind: AccessKind) -> tuple[Any, Any, FakeFuture, Any]:
    """A 4 KiB access of `o` bound to a FakeFuture: (access, its fence, the work, a weak
    reference to the work)."""
    a = o.acquire(offset, 4096, kind)
    work = FakeFuture()
    return a, a.bind(work), work, weakref.ref(work)


def test_a_finished_access_lets_its_work_go_without_the_collector() -> None:
    """An access and its fence refer to each other; the finished work (an NVMe batch and its
    buffers) must not be held in that cycle until the collector runs."""
    o = Ordering("reg", 4096)
    with _collector_off():
        _a, fence, work, gone = _bound_work(o, 0, AccessKind.NVME_READ)
        work.finish()
        del work
        assert gone() is None and fence.done() and o.live() == []
        fence.wait(0)


def test_an_access_follows_a_future_itself_through_waits_failures_and_withdrawal() -> None:
    """An access bound to a future (an NVMe batch) completes with it, drives it when polled,
    waits on it in slices and takes its failure; a withdrawn one lets the work go at once."""
    o = Ordering("reg", 8192)
    a = o.acquire(0, 4096, AccessKind.NVME_READ)
    work = FakeFuture()
    fence = a.bind(work)
    polls = work.polls
    assert not fence.done() and work.polls > polls          # done() drives the future
    with pytest.raises(FenceTimeout):
        fence.wait(0.05)
    threading.Timer(0.05, work.finish, (OSError(5, "media error"),)).start()
    with pytest.raises(FenceError, match="media error") as ei:
        fence.wait(5)                                         # woken by the future's failure
    assert isinstance(ei.value.__cause__, OSError)
    assert o.live() == []
    later = o.acquire(0, 4096, AccessKind.GPU_READ)           # a consumer after a failed producer
    assert later.deps == []                                   # ... finds the range free
    later.cancel()

    with _collector_off():
        b, fence2, work2, gone = _bound_work(o, 4096, AccessKind.NVME_WRITE)
        o.withdraw(b, OSError(125, "cancelled"))
        assert fence2.done() and isinstance(fence2.exception(), OSError)
        del work2                                             # its owner lets go: so does the fence
        assert gone() is None and o.live() == []
        c, _fence3, work3, _gone3 = _bound_work(o, 4096, AccessKind.NVME_WRITE)
        o.withdraw(c)
        work3.finish()                                        # work that ends later changes nothing
        assert isinstance(c.fence.exception(), FenceError) and o.live() == []


# ----------------------------------------------------------------------------- GPU streams


class FakeWords:
    def __init__(self, n: int) -> None:
        self.buf = (ctypes.c_uint32 * n)()
        self.host_ptr = self.dev_ptr = ctypes.addressof(self.buf)
        self.count = n

    def close(self) -> None:
        pass


class FakeStream:
    """A stream: a thread running enqueued ops in order, like a GPU would."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()
        self.log: list[str] = []
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self) -> None:
        while True:
            op = self.q.get()
            if op is None:
                return
            op()

    def launch(self, name: str, fn=None) -> None:
        def run() -> None:
            if fn is not None:
                fn()
            self.log.append(name)
        self.q.put(run)

    def sync(self, timeout: float = 5) -> None:
        ev = threading.Event()
        self.q.put(ev.set)
        assert ev.wait(timeout), "stream stuck"


class FakeOps:
    name = "fake"

    def __init__(self) -> None:
        self.flushes = 0
        self.flush_needed = True

    def claims_stream(self, s) -> bool:
        return isinstance(s, FakeStream)

    def stream_handle(self, s) -> int:
        return id(s)

    def stream_device(self, s) -> int:
        return 0

    def alloc_completion_words(self, n: int, device: int = 0) -> FakeWords:
        return FakeWords(n)

    def stream_wait_value32(self, s: FakeStream, addr: int, value: int) -> None:
        def wait() -> None:
            w = ctypes.c_uint32.from_address(addr)
            while ((w.value - value) & 0xFFFFFFFF) >= 0x80000000:
                time.sleep(0.0001)
        s.q.put(wait)

    def stream_write_value32(self, s: FakeStream, addr: int, value: int) -> None:
        s.q.put(lambda: setattr(ctypes.c_uint32.from_address(addr), "value", value))

    def stream_synchronize(self, s: FakeStream) -> None:
        s.sync()

    def rdma_flush_required(self, device: int = 0) -> bool:
        return self.flush_needed

    def flush_rdma_writes(self, device: int = 0) -> None:
        self.flushes += 1


@pytest.fixture
def ops() -> FakeOps:
    WordPool._pools.pop(("fake", 0), None)
    return FakeOps()


def test_on_stream_holds_the_kernel_until_the_host_completes(ops: FakeOps) -> None:
    s = FakeStream()
    f = HostFence("nvme read")
    data = {"v": "old"}
    seen: list[str] = []
    f.on_stream(s, ops)
    s.launch("consumer", lambda: seen.append(data["v"]))
    time.sleep(0.05)
    assert s.log == []  # held
    data["v"] = "new"
    f.set()
    s.sync()
    assert seen == ["new"]


def test_an_nvme_future_holds_a_stream_itself(ops: FakeOps) -> None:
    """The README's `fut.on_stream(stream)`: a CommandFuture is a fence source of its own."""
    from p2phub.nvme.queue import CommandFuture

    class QueuePairStub:  # what a future needs of its queue pair: something to drive it
        qid = 1

        def wait(self, fut: object, timeout: float | None) -> None:
            pass

        def process(self) -> int:
            return 0

    fut = CommandFuture(QueuePairStub(), opcode=2, parts=1, what="read")  # type: ignore[arg-type]
    s = FakeStream()
    fut.on_stream(s, ops)
    s.launch("consumer", lambda: None)
    time.sleep(0.05)
    assert s.log == []  # held until the SSD's completion
    fut._complete_part(0, 0, 1, 0)
    s.sync()
    assert s.log == ["consumer"]


def test_on_stream_of_a_done_fence_enqueues_nothing_and_of_a_failed_one_raises(ops) -> None:
    s = FakeStream()
    done = HostFence()
    done.set()
    done.on_stream(s, ops)
    bad = HostFence("x")
    bad.fail("dead controller")
    with pytest.raises(FenceError, match="dead controller"):
        bad.on_stream(s, ops)
    assert s.q.qsize() == 0


def test_a_failing_fence_releases_the_stream(ops: FakeOps) -> None:
    s = FakeStream()
    f = HostFence()
    f.on_stream(s, ops)
    s.launch("after")
    f.fail("queue pair destroyed")
    s.sync()  # not stuck
    assert s.log == ["after"]


def test_words_are_reused_with_growing_values(ops: FakeOps) -> None:
    s = FakeStream()
    for _ in range(3 * WordPool.CHUNK // 2):
        f = HostFence()
        f.on_stream(s, ops)
        f.set()
    s.sync()
    pool = WordPool.for_ops(ops, 0)
    assert len(pool._chunks) == 1  # every slot went back to the pool


def test_gpu_access_orders_against_nvme_both_ways(ops: FakeOps) -> None:
    o = Ordering("reg", 1 << 20)
    s = FakeStream()
    mem = {"bytes": "zeros"}
    # NVMe read fills [0, 64K); a GPU read of it must wait, on the stream.
    rd = o.acquire(0, 65536, AccessKind.NVME_READ, "ssd read")
    cqe = HostFence("cqe")
    rd.bind(cqe)
    got: list[str] = []
    with o.gpu_access(0, 4096, AccessKind.GPU_READ, s, ops=ops) as g:
        s.launch("kernel", lambda: (time.sleep(0.05), got.append(mem["bytes"])))
    assert g.access.deps == [rd]
    time.sleep(0.02)
    assert got == []
    mem["bytes"] = "ssd data"
    cqe.set()
    # An NVMe write of the range the kernel reads may overlap it (both consume) ...
    w = o.acquire(0, 4096, AccessKind.NVME_WRITE, timeout=0)
    assert w.deps == []
    wf = HostFence()
    w.bind(wf)
    wf.set()
    # ... but an NVMe read into it must wait for the kernel's end.
    t0 = time.monotonic()
    o.acquire(0, 4096, AccessKind.NVME_READ, "overwrite", timeout=5).cancel()
    assert got == ["ssd data"] and time.monotonic() - t0 < 5
    assert g.done() and g.access.fence.done()  # type: ignore[union-attr]


def test_gpu_access_behind_a_failed_producer_raises(ops: FakeOps) -> None:
    o = Ordering("reg", 4096)
    rd = o.acquire(0, 4096, AccessKind.NVME_READ)
    rd.bind(HostFence()).__class__  # noqa: B018
    f = rd.fence
    assert f is not None
    rd.cancel(FenceError("reset: command aborted"))
    # The failed access was released, so a new GPU read has no deps at all.
    with o.gpu_access(0, 4096, AccessKind.GPU_READ, FakeStream(), ops=ops) as g:
        pass
    assert g.access.deps == []
    with pytest.raises(UsageError, match="GPU_READ or GPU_WRITE"):
        o.gpu_access(0, 4096, AccessKind.NVME_READ, FakeStream(), ops=ops)


def test_make_visible_flushes_only_where_required(ops: FakeOps) -> None:
    o = Ordering("reg", 4096)
    o.make_visible()  # host memory: nothing
    o.gpu_device = (ops, 0)
    o.make_visible()
    ops.flush_needed = False
    o.make_visible()
    assert ops.flushes == 1


def test_many_threads_many_ranges_never_overlap_a_producer() -> None:
    """Stress: threads acquire random ranges and kinds; a shadow map checks that no byte
    is ever held by a producer together with anything else."""
    o = Ordering("reg", 256)
    held = [[0, 0] for _ in range(256)]  # [producers, consumers] per byte
    lock = threading.Lock()
    errors: list[str] = []
    rng_seed = itertools.count()

    def worker() -> None:
        import random
        r = random.Random(next(rng_seed))
        for _ in range(200):
            s = r.randrange(0, 250)
            n = r.randrange(1, 256 - s + 1)
            kind = r.choice(list(AccessKind))
            a = o.acquire(s, n, kind)
            with lock:
                for x in range(s, s + n):
                    p, c = held[x]
                    if p or (kind.producer and c):
                        errors.append(f"byte {x}: {kind} with p={p} c={c}")
                    held[x][0 if kind.producer else 1] += 1
            f = HostFence()
            a.bind(f)
            time.sleep(r.random() * 0.0005)
            with lock:
                for x in range(s, s + n):
                    held[x][0 if kind.producer else 1] -= 1
            f.set()

    ths = [threading.Thread(target=worker) for _ in range(6)]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert not errors, errors[:5]
    assert o.live() == []


def test_an_nvme_future_is_driven_by_its_poll_and_names_its_error() -> None:
    from p2phub.nvme.errors import NvmeStatusError
    from p2phub.nvme.queue import CommandFuture

    class QueuePairStub:
        qid = 1
        reaped = 0

        def process(self) -> int:
            self.reaped += 1
            return 0

        def wait(self, fut: object, timeout: float | None) -> None:
            pass

    qp = QueuePairStub()
    fut = CommandFuture(qp, opcode=2, parts=1, what="read")  # type: ignore[arg-type]
    fence = SourceFence(fut, "read")
    assert not fut.poll() and fut.error is None and qp.reaped == 1
    assert not fence.poll() and qp.reaped == 2          # the fence drives its future's queue
    fut._complete_part(0x281, 0, 1, 0)                  # media error: unrecovered read
    assert fut.poll() and qp.reaped == 2                # done: nothing left to reap
    assert isinstance(fut.error, NvmeStatusError) and fence.poll()
    assert fence.exception(0) is fut.error


def test_a_batch_over_one_span_is_one_access_with_declares_rules() -> None:
    """ordering.nvme.declare_span (read_batch/write_batch): one access over the span, the
    same waits, strict refusal and withdrawal as declare()."""
    from p2phub import Hub
    from p2phub.ordering import OrderingTimeout
    from p2phub.ordering.nvme import bind, declare_span

    with Hub(mode="staged") as hub:
        reg = hub.alloc_host(16384)
        (i, o, a), = declare_span(reg, "read", 4096, 8192, "read batch")
        assert i == 0 and o is reg.ordering and o.live() == [a]
        assert (a.kind, a.start, a.end, a.what) == (AccessKind.NVME_READ, 4096, 12288, "read batch")
        o.timeout = 0.05
        with pytest.raises(OrderingTimeout):
            declare_span(reg, "write", 0, 8192, "write batch")   # waits for the read, times out
        assert o.live() == [a]                                     # and is withdrawn
        assert declare_span(reg, "flush", 0, 4096, "") == []       # not a data access
        fut = FakeFuture()
        bind([(i, o, a)], [fut])
        fut.finish()
        a.fence.wait(1)
        assert o.live() == []
        o.strict = True
        declare_span(reg, "read", 0, 4096, "first")
        with pytest.raises(OrderingError):
            declare_span(reg, "write", 0, 4096, "second")
        assert len(o.live()) == 1
        for acc in o.live():
            acc.cancel()
