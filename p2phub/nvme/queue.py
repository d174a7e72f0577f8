"""Queue pairs and futures: the Python side of the rings.

A :class:`QueuePair` wraps one C ``struct p2h_qp`` (SQ + CQ + trackers +
PRP lists). It is handed everything it uses: its ring memory, its doorbell
pointers, the status page (the gate the hot path checks before each
doorbell) and its :class:`QueueHooks` (what the controller wants told); it
never calls into the controller. Every call into C happens under
``QueuePair.lock``: one thread at a time per queue pair.

Completions of single commands come back by a 64-bit tag and complete a
:class:`CommandFuture`; a :class:`BatchFuture` is one C ``struct p2h_batch``
that the hot path's pump submits and completes without Python per request.
Both futures offer ``done()``, ``wait(timeout)``, ``add_done_callback(fn)``,
``exception()``, ``result()`` and ``await``; waiting drives the queue.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import os
import select
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator

from . import spec
from ..errors import UsageError
from .errors import ControllerResetError, NvmeStatusError, NvmeTimeoutError

_tags = itertools.count(1)
TAG_BATCH = 1 << 63
NO_SLOT = 0xFFFFFFFF
PUMP_IDLE_NS = 2_000_000  # the C pump returns to Python after this long without a completion


@dataclass
class QueueHooks:
    """What a queue pair tells its owner. Each gets the queue pair."""

    check_usable: Callable[[], None] = lambda: None
    tick: Callable[["QueuePair"], None] = lambda qp: None            # while waiting: timeouts, CSTS
    state_changed: Callable[["QueuePair"], None] = lambda qp: None   # the status page's state is not 0
    refused: Callable[["QueuePair", int, Any], BaseException] = \
        lambda qp, err, io: UsageError(f"queue {qp.qid}: submission refused ({errno.errorcode.get(err, err)})")


class _FutureBase:
    """done / wait / add_done_callback / exception / result / await, driven by a queue pair."""

    qp: "QueuePair"
    what: str
    mapping: Any = None  # the registration mapping it references (set by the namespace layer)

    def __init__(self) -> None:
        self._exc: BaseException | None = None
        self._done = threading.Event()
        self._callbacks: list[Callable[[Any], None]] = []
        self._timeout_exc: BaseException | None = None  # set when recovery takes over

    def _finish(self) -> None:
        self._done.set()
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb: Callable[[Any], None]) -> None:
        """Call cb(future) once it is done (at once if it is; else from the thread that reaps it)."""
        if self._done.is_set():
            cb(self)
        else:
            self._callbacks.append(cb)
            if self._done.is_set() and cb in self._callbacks:  # finished meanwhile
                self._callbacks.remove(cb)
                cb(self)

    def done(self) -> bool:
        return self._done.is_set()

    def on_stream(self, stream: Any, ops: Any = None) -> None:
        """Make a GPU stream wait for this request with no CPU round trip (see
        ``p2phub.ordering.Fence.on_stream``): work enqueued on `stream` afterwards starts
        once the SSD is done."""
        from ..ordering import as_fence

        as_fence(self).on_stream(stream, ops)

    def wait(self, timeout: float | None = None) -> None:
        """Drive the queue until done, as ``p2phub.ordering.Fence.wait`` does: raise FenceTimeout
        (a TimeoutError) after `timeout` seconds, or the request's failure once it is done."""
        from ..ordering.errors import FenceTimeout

        try:
            self.qp.wait(self, timeout)
        except TimeoutError as exc:
            raise FenceTimeout(str(exc)) from None
        if self._exc is not None:
            raise self._exc

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.qp.wait(self, timeout)
        return self._exc

    def __await__(self) -> Generator[Any, None, Any]:
        if not self.done():
            loop = asyncio.get_running_loop()
            # The wait drives the queue (polling or eventfd sleep) off the event loop.
            yield from loop.run_in_executor(None, self.qp.wait, self, None).__await__()
        return self.result()

    def result(self, timeout: float | None = None) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError


class CommandFuture(_FutureBase):
    """One request (maybe several commands) in flight. Holds its buffer alive until done."""

    def __init__(self, qp: "QueuePair", opcode: int, parts: int, keep: object = None,
                 what: str = "") -> None:
        super().__init__()
        self.qp = qp
        self.opcode = opcode
        self.what = what
        self._parts = parts
        self._keep = keep  # the page list / registration mapping: alive until completion
        self._dw0 = 0
        self.cids: list[int] = []
        self.latency_ns = 0

    # Called by QueuePair under its lock.
    def _complete_part(self, status: int, dw0: int, cid: int, lat_ns: int) -> None:
        if status and self._exc is None and self._timeout_exc is not None:
            self._exc = self._timeout_exc  # aborted by the engine after its deadline
        if status and self._exc is None:
            self._exc = NvmeStatusError(status, opcode=self.opcode, admin=self.qp.qid == 0,
                                        qid=self.qp.qid, cid=cid, what=self.what)
        self._dw0 = dw0
        self.latency_ns = max(self.latency_ns, lat_ns)
        self._parts -= 1
        if self._parts == 0:
            self._keep = None
            self._finish()

    def _fail(self, exc: BaseException) -> None:
        if self._done.is_set():
            return
        if self._exc is None:
            self._exc = self._timeout_exc or exc
        self._parts = 0
        self._keep = None
        self._finish()

    def result(self, timeout: float | None = None) -> int:
        """Wait (driving the queue) and return CQE DW0; raise the command's error."""
        self.qp.wait(self, timeout)
        if self._exc is not None:
            raise self._exc
        return self._dw0


class BatchFuture(_FutureBase):
    """Many requests submitted and reaped by the C pump; per-request status in ``statuses()``.

    ``result()`` returns the number of requests, or raises the first failure:
    ``NvmeStatusError`` (a request completed with an error; ``index`` on the
    exception), ``RegistrationRevokedError`` (the gate refused a request: the
    rest were not sent), or what a controller reset / fence / removal gave.
    """

    def __init__(self, qp: "QueuePair", ios: Any, n: int, *, qd: int, opcodes: Any = None,
                 keep: object = None, what: str = "", latencies: bool = False) -> None:
        super().__init__()
        ffi = qp.hot.ffi
        self.qp = qp
        self.what = what
        self.n = n
        self._ios = ios
        self._keep = keep
        self._status = ffi.new("uint16_t[]", max(n, 1))
        self._lat = ffi.new("uint32_t[]", max(n, 1)) if latencies else ffi.NULL
        b = self._b = ffi.new("struct p2h_batch *")
        b.ios = ios
        b.status = self._status
        b.lat_ns = self._lat
        b.n = n
        b.qd = max(1, min(qd, qp.ntrk))
        self.opcodes = opcodes

    @property
    def completed(self) -> int:
        return int(self._b.done)

    def statuses(self) -> list[int]:
        """Per request: the 15-bit NVMe status (0 = success)."""
        return list(self._status[0:self.n])

    def latencies_ns(self) -> list[int]:
        return list(self._lat[0:self.n]) if self._lat != self.qp.hot.ffi.NULL else []

    def _settled(self) -> bool:
        b = self._b
        return b.done >= b.next and (b.refused != 0 or b.next >= b.n)

    # Called by QueuePair under its lock, once settled (or failed by recovery).
    def _conclude(self) -> None:
        if self._done.is_set():
            return
        b = self._b
        if self._exc is None and b.refused:
            io = self._ios[b.bad] if b.bad < self.n else None
            self._exc = self.qp.hooks.refused(self.qp, -b.refused, io)
        if self._exc is None and b.errors:
            st = self.statuses()
            k = next(i for i, s in enumerate(st) if s)
            opc = int(self._ios[k].opc)
            exc = NvmeStatusError(st[k], opcode=opc, admin=False, qid=self.qp.qid, cid=0,
                                  what=f"{self.what} request {k} ({int(b.errors)} of {self.n} failed)")
            exc.index = k  # type: ignore[attr-defined]
            self._exc = self._timeout_exc or exc
        self._keep = None
        self._finish()

    def _fail(self, exc: BaseException) -> None:
        if self._done.is_set():
            return
        if self._exc is None:
            self._exc = self._timeout_exc or exc
        self._conclude()

    def result(self, timeout: float | None = None) -> int:
        self.qp.wait(self, timeout)
        if self._exc is not None:
            raise self._exc
        return self.n


class QueuePair:
    """An SQ/CQ pair (qid 0 is the admin queue), handed its memory, doorbells and hooks."""

    def __init__(self, hot: Any, qid: int, depth: int, *, sq: Any, cq: Any, prp: Any, prp_stride: int,
                 ntrk: int, sq_db: Any, cq_db: Any, status: Any, timeout_s: float,
                 vector: int | None = None, hooks: QueueHooks | None = None) -> None:
        self.hot = hot
        self.qid = qid
        self.depth = depth
        self.vector = vector  # MSI-X vector, or None when polled
        self.hooks = hooks or QueueHooks()
        self.timeout_s = timeout_s
        self.lock = threading.RLock()
        ffi, lib = hot.ffi, hot.lib
        self.sq_buf, self.cq_buf, self.prp_buf = sq, cq, prp
        self.ntrk = ntrk
        self.c = lib.p2h_qp_create(qid, depth, ntrk, sq.cptr, cq.cptr, sq_db, cq_db,
                                   prp.cptr if prp is not None else ffi.NULL,
                                   prp.dma_addr if prp is not None else 0, prp_stride if prp else 0)
        if self.c == ffi.NULL:
            raise MemoryError(f"queue {qid}: cannot create tracker table for depth {depth}")
        self.c.st = status if status is not None else ffi.NULL
        self._pending: dict[int, tuple[CommandFuture, int]] = {}  # tag -> (future, opcode)
        self._batches: dict[int, BatchFuture] = {}                 # batch id -> future
        self._cpl = ffi.new("struct p2h_cpl[]", 256)
        self._cids = ffi.new("uint16_t[]", 256)
        self._bad = ffi.new("int *")
        self.eventfd = -1
        self._state_seen = False

    # ---------------------------------------------------------------- submission

    def submit_raw(self, cmds: list[list[int]], futures: list[CommandFuture]) -> int:
        """Queue raw commands (dwords; CID filled in), one doorbell. Returns how many were queued."""
        ffi, lib = self.hot.ffi, self.hot.lib
        n = len(cmds)
        flat = ffi.new("uint32_t[]", [d for c in cmds for d in c])
        tags = [next(_tags) for _ in range(n)]
        ctags = ffi.new("uint64_t[]", tags)
        cids = ffi.new("uint16_t[]", n)
        with self.lock:
            self.hooks.check_usable()
            for t, f, c in zip(tags, futures, cmds):
                self._pending[t] = (f, c[0] & 0xFF)
            got = lib.p2h_submit_raw(self.c, flat, ctags, n, cids)
            for i in range(max(got, 0), n):
                del self._pending[tags[i]]
            for i in range(max(got, 0)):
                futures[i].cids.append(cids[i])
        if got < 0:
            if got == -errno.EIO:
                self.hooks.state_changed(self)  # recover now (outside the lock), then report
            raise self.hooks.refused(self, -got, None)
        return got

    def submit_io(self, ios: Any, n: int, futures: list[CommandFuture]) -> int:
        """Queue n prepared ``struct p2h_io`` (tags preset), one doorbell. Returns how many."""
        lib = self.hot.lib
        cids = self._cids if n <= 256 else self.hot.ffi.new("uint16_t[]", n)
        with self.lock:
            self.hooks.check_usable()
            for i in range(n):
                self._pending[ios[i].tag] = (futures[i], ios[i].opc)
            ret = lib.p2h_submit_io(self.c, ios, n, cids, self._bad)
            got = max(ret, 0)
            for i in range(got, n):
                self._pending.pop(ios[i].tag, None)
            for i in range(got):
                futures[i].cids.append(cids[i])
            bad = self._bad[0]
        if ret < 0:
            if ret == -errno.EIO:
                self.hooks.state_changed(self)  # recover now (outside the lock), then report
            raise self.hooks.refused(self, -ret, ios[bad] if bad >= 0 else None)
        return got

    def submit_all(self, ios: Any, futures: list[CommandFuture]) -> None:
        """Queue every request, reaping to make room when the ring is full."""
        n = len(futures)
        done = 0
        while done < n:
            got = self.submit_io(ios + done, n - done, futures[done:])
            done += got
            if done < n:
                self.process()
                if got == 0:
                    self.hooks.tick(self)
                    time.sleep(0)

    def submit_batch(self, fut: BatchFuture) -> BatchFuture:
        """Attach a batch: the pump submits it (up to its qd in flight) whenever the queue is driven."""
        with self.lock:
            self.hooks.check_usable()
            while self.hot.lib.p2h_batch_attach(self.c, fut._b) < 0:
                self._process_locked()  # 64 batches attached: let one finish
            self._batches[int(fut._b.id)] = fut
            self._process_locked()       # first submission round now
        self._after_process()
        return fut

    # ---------------------------------------------------------------- completion

    def process(self, idle_ns: int = 0) -> int:
        """Pump once (submit from attached batches, reap); returns single commands completed."""
        with self.lock:
            total = self._process_locked(idle_ns)
        self._after_process()
        return total

    def _after_process(self) -> None:
        # Outside the queue's lock: recovery takes every queue's lock in turn.
        if self._state_seen:
            self._state_seen = False
            self.hooks.state_changed(self)

    def _process_locked(self, idle_ns: int = 0) -> int:
        lib = self.hot.lib
        total = 0
        if self.c is None:
            return 0
        while True:
            got = lib.p2h_pump(self.c, self._cpl, 256, idle_ns)
            if got < 0:
                self._settle_batches()
                if got == -errno.EIO:
                    self._state_seen = True
                return total
            for i in range(got):
                c = self._cpl[i]
                entry = self._pending.pop(c.tag, None)
                if entry is not None:
                    entry[0]._complete_part(c.status, c.dw0, c.cid, c.lat_ns)
            total += got
            if self._batches:
                self._settle_batches()
            if got < 256:
                return total
            idle_ns = 0

    def _settle_batches(self) -> None:
        for bid, fut in list(self._batches.items()):
            if fut._settled():
                self.hot.lib.p2h_batch_detach(self.c, fut._b)
                del self._batches[bid]
                fut._conclude()

    def outstanding(self, age_s: float = 0.0) -> list[tuple[int, Any, int, float]]:
        """(cid, future, opcode, age_s) of commands older than age_s."""
        ffi, lib = self.hot.ffi, self.hot.lib
        n = self.ntrk
        cids = ffi.new("uint16_t[]", n)
        tags = ffi.new("uint64_t[]", n)
        ages = ffi.new("uint64_t[]", n)
        with self.lock:
            got = lib.p2h_outstanding(self.c, int(age_s * 1e9), cids, tags, ages, n)
            out = []
            for i in range(got):
                t = int(tags[i])
                if t & TAG_BATCH:
                    b = self._batches.get((t >> 32) & 63)
                    out.append((cids[i], b, int(b._ios[t & 0xFFFFFFFF].opc) if b else -1, ages[i] / 1e9))
                else:
                    f, opc = self._pending.get(t, (None, -1))
                    out.append((cids[i], f, opc, ages[i] / 1e9))
        return out

    @property
    def busy(self) -> int:
        """Commands in flight."""
        return int(self.ntrk - self.c.nfree) if self.c is not None else 0

    def wait(self, fut: _FutureBase, timeout: float | None = None) -> None:
        """Drive this queue until fut is done; raise TimeoutError after `timeout` (caller's)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        tick = min(0.05, self.timeout_s / 4)
        next_check = time.monotonic() + tick
        spins = 0
        idle_ns = PUMP_IDLE_NS if isinstance(fut, BatchFuture) else 0
        while not fut.done():
            got = self.process(idle_ns)
            if fut.done():
                return
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TimeoutError(f"{fut.what or 'command'} still running after {timeout} s")
            if now >= next_check:
                next_check = now + tick
                self.hooks.tick(self)
            if got:
                spins = 0
                continue
            spins += 1
            if self.eventfd >= 0:
                self._sleep_on_eventfd(0.01)
            elif spins > 64:
                # Long waits (timeouts, slow media) need not burn a whole CPU.
                time.sleep(0 if spins < 2048 else 0.0002)

    def _sleep_on_eventfd(self, timeout_s: float) -> None:
        r, _, _ = select.select([self.eventfd], [], [], timeout_s)
        if r:
            try:
                os.eventfd_read(self.eventfd)
            except BlockingIOError:
                pass

    # ---------------------------------------------------------------- recovery

    def fail_all(self, exc_for: Callable[[int, int, Any], BaseException], reset_rings: bool = True) -> int:
        """Forget every outstanding command (the controller is stopped); fail its future.

        exc_for(opcode, cid, future) gives each future's exception. Call it only once the
        controller can no longer DMA (disabled, fenced, or its fd closed). reset_rings=False
        when the ring memory is already unmapped (the queue pair is dead then).
        """
        with self.lock:
            pending, self._pending = self._pending, {}
            batches, self._batches = self._batches, {}
            if self.c is not None:
                for b in batches.values():
                    self.hot.lib.p2h_batch_detach(self.c, b._b)
                if reset_rings and not self.c.dead:
                    self.hot.lib.p2h_qp_reset(self.c)
            for _tag, (f, opc) in pending.items():
                f._fail(exc_for(opc, f.cids[-1] if f.cids else 0, f))
            for b in batches.values():
                b._fail(exc_for(int(b._ios[0].opc) if b.n else 0, 0, b))
        return len(pending) + len(batches)

    def set_dead(self) -> None:
        """No MMIO from this queue pair from now on (BAR0 is going away)."""
        with self.lock:
            if self.c is not None:
                self.c.dead = 1

    def stats(self) -> dict[str, int]:
        c = self.c
        return {"qid": self.qid, "depth": self.depth, "trackers": self.ntrk,
                "submitted": c.submitted, "completed": c.completed,
                "doorbells": c.doorbells, "stale_cqes": c.stale_cqes, "refused": c.refused,
                "outstanding": len(self._pending) + sum(b._b.next - b._b.done for b in self._batches.values())}

    def close(self) -> None:
        with self.lock:
            if self.c is not None:
                self.hot.lib.p2h_qp_destroy(self.c)
                self.c = None


def timeout_error(fut: Any, cid: int, recovery: str, age_s: float) -> NvmeTimeoutError:
    qp = fut.qp
    opc = getattr(fut, "opcode", None)
    if opc is None:
        opc = spec.OPC_READ
    name = spec.opcode_name(qp.qid == 0, opc)
    how = {"abort": "the controller aborted it", "reset": "the controller was reset"}[recovery]
    return NvmeTimeoutError(
        f"{fut.what + ': ' if fut.what else ''}{name} on queue {qp.qid} (cid 0x{cid:04x}) "
        f"did not complete within {qp.timeout_s:g} s (waited {age_s:.2f} s); {how}",
        opcode=opc, admin=qp.qid == 0, qid=qp.qid, cid=cid, recovery=recovery)


def reset_error(qid: int, opc: int, cid: int, why: str = "the controller was reset") -> ControllerResetError:
    return ControllerResetError(
        f"{spec.opcode_name(qid == 0, opc)} on queue {qid} (cid 0x{cid:04x}) was outstanding "
        f"when {why}; it may or may not have executed")
