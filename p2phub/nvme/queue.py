"""Queue pairs and futures: the Python side of the rings.

A :class:`QueuePair` wraps one C ``struct p2h_qp`` (SQ + CQ + trackers +
PRP lists). Every call into C happens under ``QueuePair.lock``: one thread
at a time per queue pair. Completions are matched back to their waiter by a
64-bit tag the hot path carries through the tracker.

A :class:`CommandFuture` completes when every piece of its request has
(a request bigger than MDTS is several commands). ``result()`` drives the
queue itself: it polls the completion queue (or sleeps on the interrupt
eventfd), and on the wall-clock deadline hands the command to the
controller's recovery (abort, then reset).
"""

from __future__ import annotations

import itertools
import os
import select
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from . import spec
from ..errors import UsageError
from .errors import ControllerResetError, NvmeStatusError, NvmeTimeoutError

if TYPE_CHECKING:
    from .controller import Controller

_tags = itertools.count(1)


class CommandFuture:
    """One request (maybe several commands) in flight. Holds its buffer alive until done."""

    def __init__(self, qp: "QueuePair", opcode: int, parts: int, keep: object = None,
                 what: str = "") -> None:
        self.qp = qp
        self.opcode = opcode
        self.what = what
        self._parts = parts
        self._keep = keep  # the page list / registration: alive until completion
        self._exc: BaseException | None = None
        self._dw0 = 0
        self._done = threading.Event()
        self._callbacks: list[Callable[["CommandFuture"], None]] = []
        self.cids: list[int] = []
        self.latency_ns = 0
        self._timeout_exc: BaseException | None = None  # set when recovery takes over

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
            self._finish()

    def _fail(self, exc: BaseException) -> None:
        if self._done.is_set():
            return
        if self._exc is None:
            self._exc = self._timeout_exc or exc
        self._parts = 0
        self._finish()

    def _finish(self) -> None:
        self._keep = None
        self._done.set()
        for cb in self._callbacks:
            cb(self)

    def add_done_callback(self, cb: Callable[["CommandFuture"], None]) -> None:
        if self._done.is_set():
            cb(self)
        else:
            self._callbacks.append(cb)

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.qp.wait(self, timeout)
        return self._exc

    def result(self, timeout: float | None = None) -> int:
        """Wait (driving the queue) and return CQE DW0; raise the command's error."""
        self.qp.wait(self, timeout)
        if self._exc is not None:
            raise self._exc
        return self._dw0


class QueuePair:
    """An SQ/CQ pair (qid 0 is the admin queue)."""

    def __init__(self, ctrl: "Controller", qid: int, depth: int, *, prp_stride: int,
                 vector: int | None) -> None:
        from . import _build

        self.ctrl = ctrl
        self.qid = qid
        self.depth = depth
        self.vector = vector  # MSI-X vector, or None when polled
        self.lock = threading.RLock()
        self.hot = _build.load()
        ffi, lib = self.hot.ffi, self.hot.lib
        self.sq_buf = ctrl.alloc_dma(depth * 64, name=f"sq{qid}")
        self.cq_buf = ctrl.alloc_dma(depth * 16, name=f"cq{qid}")
        ntrk = min(depth - 1, 4095)
        if prp_stride:
            ntrk = min(ntrk, (4 << 20) // prp_stride)
            self.prp_buf = ctrl.alloc_dma(ntrk * prp_stride, name=f"prp{qid}")
            prp_cpu, prp_dma = self.prp_buf.cptr, self.prp_buf.dma_addr
        else:
            self.prp_buf = None
            prp_cpu, prp_dma = ffi.NULL, 0
        self.ntrk = ntrk
        self.c = lib.p2h_qp_create(
            qid, depth, ntrk, self.sq_buf.cptr, self.cq_buf.cptr,
            ctrl.doorbell_ptr(spec.sq_doorbell(qid, ctrl.cap.dstrd)),
            ctrl.doorbell_ptr(spec.cq_doorbell(qid, ctrl.cap.dstrd)),
            prp_cpu, prp_dma, prp_stride)
        if self.c == ffi.NULL:
            raise MemoryError(f"queue {qid}: cannot create tracker table for depth {depth}")
        self._pending: dict[int, tuple[CommandFuture, int]] = {}  # tag -> (future, opcode)
        self._cpl = ffi.new("struct p2h_cpl[]", 256)
        self._cids = ffi.new("uint16_t[]", 256)
        self._bad = ffi.new("int *")
        self.eventfd = -1
        self.timeout_s = ctrl.io_timeout_s if qid else ctrl.admin_timeout_s

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
            self.ctrl._check_usable()
            for t, f, c in zip(tags, futures, cmds):
                self._pending[t] = (f, c[0] & 0xFF)
            got = lib.p2h_submit_raw(self.c, flat, ctags, n, cids)
            for i in range(got, n):
                del self._pending[tags[i]]
            for i in range(got):
                futures[i].cids.append(cids[i])
        return got

    def submit_io(self, ios: Any, n: int, futures: list[CommandFuture]) -> int:
        """Queue n prepared ``struct p2h_io`` (tags preset), one doorbell. Returns how many."""
        lib = self.hot.lib
        cids = self._cids if n <= 256 else self.hot.ffi.new("uint16_t[]", n)
        with self.lock:
            self.ctrl._check_usable()
            for i in range(n):
                self._pending[ios[i].tag] = (futures[i], ios[i].opc)
            ret = lib.p2h_submit_io(self.c, ios, n, cids, self._bad)
            got = max(ret, 0)
            for i in range(got, n):
                self._pending.pop(ios[i].tag, None)
            for i in range(got):
                futures[i].cids.append(cids[i])
        if ret < 0:
            raise UsageError(f"queue {self.qid}: malformed I/O request (PRP range outside its page list)")
        return got

    # ---------------------------------------------------------------- completion

    def process(self) -> int:
        """Reap whatever completed; returns how many commands."""
        lib = self.hot.lib
        total = 0
        with self.lock:
            while True:
                got = lib.p2h_reap(self.c, self._cpl, 256)
                for i in range(got):
                    c = self._cpl[i]
                    entry = self._pending.pop(c.tag, None)
                    if entry is not None:
                        entry[0]._complete_part(c.status, c.dw0, c.cid, c.lat_ns)
                total += got
                if got < 256:
                    return total

    def outstanding(self, age_s: float = 0.0) -> list[tuple[int, CommandFuture | None, int, float]]:
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
                f, opc = self._pending.get(tags[i], (None, -1))
                out.append((cids[i], f, opc, ages[i] / 1e9))
        return out

    def wait(self, fut: CommandFuture, timeout: float | None = None) -> None:
        """Drive this queue until fut is done; raise TimeoutError after `timeout` (caller's)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        next_check = time.monotonic() + min(0.05, self.timeout_s / 4)
        spins = 0
        while not fut.done():
            got = self.process()
            if fut.done():
                return
            now = time.monotonic()
            if deadline is not None and now > deadline:
                raise TimeoutError(f"{fut.what or 'command'} still running after {timeout} s")
            if now >= next_check:
                next_check = now + min(0.05, self.timeout_s / 4)
                self.ctrl._check_timeouts(self)
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

    def fail_all(self, exc_for: Callable[[int, int], BaseException]) -> int:
        """Forget every outstanding command (controller reset); fail its future."""
        with self.lock:
            pending, self._pending = self._pending, {}
            for _tag, (f, opc) in pending.items():
                f._fail(exc_for(opc, f.cids[-1] if f.cids else 0))
            self.hot.lib.p2h_qp_reset(self.c)
        return len(pending)

    def stats(self) -> dict[str, int]:
        c = self.c
        return {"qid": self.qid, "depth": self.depth, "trackers": self.ntrk,
                "submitted": c.submitted, "completed": c.completed,
                "doorbells": c.doorbells, "stale_cqes": c.stale_cqes,
                "outstanding": len(self._pending)}

    def close(self) -> None:
        if self.c is not None:
            self.hot.lib.p2h_qp_destroy(self.c)
            self.c = None
        if self.eventfd >= 0:
            os.close(self.eventfd)
            self.eventfd = -1


def timeout_error(fut: CommandFuture, cid: int, recovery: str, age_s: float) -> NvmeTimeoutError:
    name = spec.opcode_name(fut.qp.qid == 0, fut.opcode)
    how = {"abort": "the controller aborted it", "reset": "the controller was reset"}[recovery]
    return NvmeTimeoutError(
        f"{fut.what + ': ' if fut.what else ''}{name} on queue {fut.qp.qid} (cid 0x{cid:04x}) "
        f"did not complete within {fut.qp.timeout_s:g} s (waited {age_s:.2f} s); {how}",
        opcode=fut.opcode, admin=fut.qp.qid == 0, qid=fut.qp.qid, cid=cid, recovery=recovery)


def reset_error(qid: int, opc: int, cid: int) -> ControllerResetError:
    return ControllerResetError(
        f"{spec.opcode_name(qid == 0, opc)} on queue {qid} (cid 0x{cid:04x}) was outstanding "
        f"when the controller was reset; it may or may not have executed")
