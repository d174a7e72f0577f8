"""Queue pairs and futures: the Python side of the rings.

A :class:`QueuePair` wraps one C ``struct p2h_qp`` (SQ + CQ + trackers +
PRP lists). It is handed everything it uses: its ring memory, its doorbell
pointers, the status page (the gate the hot path checks before each
doorbell) and its :class:`QueueHooks` (what the controller wants told); it
never calls into the controller. Every call into C happens under
``QueuePair.lock``: one thread at a time per queue pair.

Completions of single commands come back by a 64-bit tag and complete a
:class:`CommandFuture`; a :class:`BatchFuture` is one C ``struct p2h_batch``
that the hot path's pump submits (as many at a time as there are free slots,
one doorbell per round) and completes without Python per request. A batch
made of requests (``Namespace.submit``) also hands out one :class:`OpFuture`
per request; they complete together with the batch. Every future offers
``done()``, ``wait(timeout)``, ``add_done_callback(fn)``, ``exception()``,
``result()`` and ``await``; waiting drives the queue.
"""

from __future__ import annotations

import array
import asyncio
import errno
import itertools
import os
import select
import threading
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Generator, Mapping, Sequence

from .._resource import Resource
from ..errors import UsageError
from . import spec
from .errors import ControllerResetError, NvmeError, NvmeStatusError, NvmeTimeoutError

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
    pumped = False       # completed by the C pump (waiters let it run longer per call)

    def __init__(self) -> None:
        self._exc: BaseException | None = None
        self._fin = False  # a plain flag: waiting drives the queue, nobody blocks on it
        self._callbacks: list[Callable[[Any], None]] = []
        self._timeout_exc: BaseException | None = None  # set when recovery takes over

    def _finish(self) -> None:
        self._fin = True
        callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_done_callback(self, cb: Callable[[Any], None]) -> None:
        """Call cb(future) once it is done (at once if it is; else from the thread that reaps it)."""
        if self._fin:
            cb(self)
        else:
            self._callbacks.append(cb)
            if self._fin and cb in self._callbacks:  # finished meanwhile
                self._callbacks.remove(cb)
                cb(self)

    def done(self) -> bool:
        return self._fin

    @property
    def error(self) -> BaseException | None:
        """The request's failure once done; None while in flight or when it succeeded."""
        return self._exc if self._fin else None

    def poll(self) -> bool:
        """Reap what the queue completed, without waiting (the one way a queue is driven);
        True once this request is done. Raises what a dead queue raises."""
        if not self._fin:
            self.qp.process()
        return self._fin

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
        if not self._fin:  # a done future's callbacks ask it too: no trip through the queue
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
        if self._fin:
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


NOT_DONE = 0xFFFF  # a request batch's status before its command completes (no 15-bit status is)
ABORT_REQUESTED = 0x07  # generic status "Command Abort Requested"


class BatchFuture(_FutureBase):
    """Many requests submitted and reaped by the C pump; per-request status in ``statuses()``.

    ``result()`` returns the number of requests, or raises the first failure:
    ``NvmeStatusError`` (a request completed with an error; ``index`` on the
    exception), ``RegistrationRevokedError`` (the gate refused a request: the
    rest were not sent), or what a controller reset / fence / removal gave.

    A batch made by ``Namespace.submit_ops`` counts requests as the caller
    gave them (each may be several commands): ``statuses()`` and ``index``
    are per request, and :meth:`op_futures` gives one future per request.
    """

    pumped = True
    # What only some batches have, as class defaults: a batch of 4,096 same-sized reads
    # is made thousands of times a second, and every attribute set costs there.
    opcodes: Any = None
    _lat_list: list[int] | None = None
    _op_exc: "Mapping[int, BaseException]" = MappingProxyType({})  # failed requests (ops batches)
    _op_futs: "list[OpFuture] | None" = None
    _ops_seen = 0
    # per request: what its future releases when it is done (set by the namespace layer)
    _op_tokens: list[Any] | None = None
    _op_release: Callable[[Any], None] | None = None

    def __init__(self, qp: "QueuePair", ios: Any, n: int, *, qd: int, opcodes: Any = None,
                 keep: object = None, what: str = "", latencies: bool = False,
                 ops: "OpTable | None" = None) -> None:
        super().__init__()
        ffi = qp.hot.ffi
        self.qp = qp
        self.what = what
        self.n = n
        self._ios = ios
        self._keep = keep
        self._ops = ops
        if ops is not None:  # NOT_DONE until each command completes: who never ran is known
            self._status_mem = array.array("H", b"\xff\xff" * max(n, 1))
            self._status = ffi.from_buffer("uint16_t[]", self._status_mem)
        else:
            self._status = ffi.new("uint16_t[]", max(n, 1))
        self._lat = ffi.new("uint32_t[]", max(n, 1)) if latencies else ffi.NULL
        b = self._b = ffi.new("struct p2h_batch *")
        if isinstance(ios, SameSizeRequests):
            b.tmpl, b.lbas, b.offs = ios.tmpl, ios.lbas, ios.offs
        else:
            b.ios = ios
        b.status = self._status
        b.lat_ns = self._lat
        b.n = n
        b.qd = max(1, min(qd, qp.ntrk))
        if opcodes is not None:
            self.opcodes = opcodes
        if ops is not None:
            self._op_exc = {}
            b.op_of, b.op_left, b.op_done = ops.op_of, ops.op_left, ops.op_done

    @property
    def completed(self) -> int:
        return int(self._b.done)

    @property
    def failures(self) -> int:
        """Commands that completed with an error so far."""
        return int(self._b.errors)

    @property
    def requests(self) -> int:
        """Requests in the batch (as the caller counted them)."""
        return self._ops.n if self._ops is not None else self.n

    def statuses(self) -> list[int]:
        """Per request: the 15-bit NVMe status (0 = success; for a batch of requests, the first
        nonzero status of its commands, or NOT_DONE for one that never completed)."""
        if self._ops is None:
            return list(self._status[0:self.n])
        st = self._status_mem
        first = self._ops.first
        out = []
        for k in range(self._ops.n):
            s = 0
            for j in range(first[k], first[k + 1]):
                if st[j]:
                    s = st[j]
                    break
            out.append(s)
        return out

    def latencies_ns(self) -> list[int]:
        """Per request, submission to completion in ns ([] unless asked for at submission).
        The list is made once, when the batch is done, and shared by every caller."""
        if self._lat_list is None:
            if self._lat == self.qp.hot.ffi.NULL:
                return []
            lat = list(self._lat[0:self.n])
            if not self.done():
                return lat
            self._lat_list = lat
        return self._lat_list

    def latency_histogram(self, bounds_ns: "Sequence[int]") -> tuple[list[int], int, int]:
        """The latencies of a done batch asked for them, bucketed in C: (per bound of
        bounds_ns, ascending, how many took at most that long; how many; their sum in ns).
        Every request of the batch: for a batch that completed them all."""
        if self._lat == self.qp.hot.ffi.NULL or not self.done():
            return [0] * len(bounds_ns), 0, 0
        return bucket_latencies(self.qp.hot, self._lat, self.n, bounds_ns)

    def add_latencies(self, bounds_ns: tuple[int, ...], acc: Any) -> int:
        """Add the latencies of this done batch (asked for at submission) into a histogram's
        counts in one C pass: acc, a writable buffer of at least len(bounds_ns) + 2 uint64
        (array('Q')), gets acc[j] += how many took at most bounds_ns[j] and, after the
        bounds' counts and one slot the caller keeps, acc[nb + 1] += their sum in ns.
        Returns how many latencies were added (0 when none were asked for or not done)."""
        ffi = self.qp.hot.ffi
        if self._lat == ffi.NULL or not self.done():
            return 0
        nb = len(bounds_ns)
        out = ffi.from_buffer("uint64_t[]", acc, require_writable=True)
        if len(out) < nb + 2:
            raise UsageError(f"a histogram of {nb} bounds needs {nb + 2} counters, not {len(out)}")
        _count_latencies(self.qp.hot, self._lat, self.n, bounds_ns, out, out + nb + 1)
        return self.n

    def op_futures(self) -> list["OpFuture"]:
        """One future per request of a batch of requests (made once; done with the batch)."""
        if self._ops is None:
            raise UsageError("op_futures() is for batches of requests (Namespace.submit_ops)")
        with self.qp.lock:
            if self._op_futs is None:
                ops = self._ops
                self._op_futs = [OpFuture(self, k, ops.opcode(k), ops.mapping(k)) for k in range(ops.n)]
                self._ops_seen = 0
                if self.done():
                    for f in self._op_futs:
                        f._settle(self._op_exc.get(f.index))
                else:
                    self._progress()
        return self._op_futs

    # Called by QueuePair under its lock after each pump round.
    def _progress(self) -> None:
        """Settle the futures of the requests whose every command has completed."""
        if self._op_futs is None:
            return
        end = int(self._b.nops_done)
        if end == self._ops_seen:
            return
        done = self._ops.op_done  # type: ignore[union-attr]
        futs = self._op_futs
        for j in range(self._ops_seen, end):
            k = done[j]
            futs[k]._settle(self._op_error(k, None))
        self._ops_seen = end

    def _op_error(self, k: int, not_done: "Callable[[], BaseException] | None") -> BaseException | None:
        """Request k's failure from its commands' statuses, or None when every one succeeded.
        not_done() gives the failure of a command that never completed."""
        ops = self._ops
        assert ops is not None
        st = self._status_mem
        first = ops.first
        for j in range(first[k], first[k + 1]):
            s = st[j]
            if not s:
                continue
            if s == NOT_DONE:
                e = not_done() if not_done is not None else ControllerResetError(f"{ops.what(k)}: not completed")
            elif s & 0x7FF == ABORT_REQUESTED and self._timeout_exc is not None:
                e = self._timeout_exc
            else:
                e = NvmeStatusError(s, opcode=int(self._ios[j].opc), admin=False, qid=self.qp.qid,
                                    cid=0, what=f"{ops.what(k)} (request {k} of {ops.n})")
            e.index = k  # type: ignore[attr-defined]
            return e
        return None

    def _settled(self) -> bool:
        b = self._b
        return b.done >= b.next and (b.refused != 0 or b.next >= b.n)

    # Called by QueuePair under its lock, once settled (or failed by recovery).
    def _conclude(self) -> None:
        if self._fin:
            return
        b = self._b
        if self._exc is None and b.refused:
            io = self._ios[b.bad] if b.bad < self.n else None
            self._exc = self.qp.hooks.refused(self.qp, -b.refused, io)
        if self._ops is not None:
            self._conclude_ops(None)
        elif self._exc is None and b.errors:
            st = self.statuses()
            k = next(i for i, s in enumerate(st) if s)
            opc = int(self._ios[k].opc)
            exc = NvmeStatusError(st[k], opcode=opc, admin=False, qid=self.qp.qid, cid=0,
                                  what=f"{self.what} request {k} ({int(b.errors)} of {self.n} failed)")
            exc.index = k  # type: ignore[attr-defined]
            self._exc = self._timeout_exc or exc
        self._keep = None
        self._finish()

    def _conclude_ops(self, exc_for: "Callable[[OpFuture], BaseException] | None") -> None:
        """Each request's outcome from its commands' statuses: a nonzero status fails it with
        NvmeStatusError; a command that never completed fails it with the batch's failure
        (exc_for(its future) when recovery failed the batch). The first failure is the batch's."""
        b = self._b
        ops = self._ops
        assert ops is not None
        base_exc = self._exc
        if b.errors or b.done < b.n:
            for k in range(ops.n):
                if exc_for is not None:
                    def not_done(k: int = k) -> BaseException:
                        f = self._op_futs[k] if self._op_futs is not None else \
                            OpFuture(self, k, ops.opcode(k), ops.mapping(k))
                        e = exc_for(f)
                        # a reset that a timeout of this batch caused: the timeout is the news
                        return self._timeout_exc or e
                else:
                    def not_done() -> BaseException:
                        return self._timeout_exc or base_exc or ControllerResetError("not completed")
                e = self._op_error(k, not_done)
                if e is not None:
                    self._op_exc[k] = e
            if self._op_exc:
                k0 = min(self._op_exc)
                self._exc = self._op_exc[k0] if base_exc is None or exc_for is not None else base_exc
        if self._op_futs is not None:
            for f in self._op_futs:
                f._settle(self._op_exc.get(f.index))

    def _fail(self, exc: BaseException, exc_for: "Callable[[OpFuture], BaseException] | None" = None) -> None:
        """Recovery's: the controller is stopped; what did not complete fails (each request with
        exc_for(its future) when given)."""
        if self._fin:
            return
        if self._exc is None:
            self._exc = self._timeout_exc or exc
        if self._ops is not None:
            self._conclude_ops(exc_for)
            self._keep = None
            self._finish()
            return
        self._conclude()

    def result(self, timeout: float | None = None) -> int:
        self.qp.wait(self, timeout)
        if self._exc is not None:
            raise self._exc
        return self.requests


class SameSizeRequests:
    """Same-sized reads or writes of a batch: one command template and two uint64 arrays
    (LBA, buffer offset per request), checked beforehand (p2h_fill_rw). The pump encodes each
    command from them as it submits it, so no per-request struct is built; ``[k]`` gives
    request k's command (for error messages)."""

    def __init__(self, ffi: Any, tmpl: Any, lbas: Any, offs: Any) -> None:
        self._ffi = ffi
        self.tmpl, self.lbas, self.offs = tmpl, lbas, offs

    def __getitem__(self, k: int) -> Any:
        io = self._ffi.new("struct p2h_io *", self.tmpl[0])
        io.slba, io.buf_off = self.lbas[k], self.offs[k]
        return io


def bucket_latencies(hot: Any, lat: Any, n: int, bounds_ns: "Sequence[int]") -> tuple[list[int], int, int]:
    """Latencies lat[0:n] (uint32_t[], ns) into cumulative buckets in one C pass: (per bound
    of bounds_ns, ascending, how many are at most it; n; their sum)."""
    nb = len(bounds_ns)
    out = hot.ffi.new("uint64_t[]", nb + 1)  # the counts, then the sum
    _count_latencies(hot, lat, n, bounds_ns, out, out + nb)
    v = hot.ffi.unpack(out, nb + 1)
    return v[:nb], n, v[nb]


def _count_latencies(hot: Any, lat: Any, n: int, bounds_ns: "Sequence[int]", counts: Any,
                     total: Any) -> None:
    """counts[j] += how many of lat[0:n] are at most bounds_ns[j]; total[0] += their sum."""
    nb = len(bounds_ns)
    if hot.lib.p2h_lat_buckets(lat, n, _bounds(hot.ffi, bounds_ns), nb, counts, total):
        raise UsageError(f"{nb} histogram bounds: at most 64")


_BOUNDS: dict[tuple[int, ...], Any] = {}   # bucket bounds as the C call takes them, made once


def _bounds(ffi: Any, bounds_ns: "Sequence[int]") -> Any:
    key = bounds_ns if type(bounds_ns) is tuple else tuple(bounds_ns)
    b = _BOUNDS.get(key)
    if b is None:
        b = _BOUNDS[key] = ffi.new("uint64_t[]", list(key))
    return b


@dataclass
class OpTable:
    """The requests of a batch as the caller gave them: request k is commands
    first[k]..first[k+1]-1 (a request larger than MDTS is several)."""

    n: int
    first: Any                       # uint32 array, n + 1 entries
    op_of: Any                       # per command: its request (cffi uint32_t[])
    op_left: Any                     # per request: commands not yet completed (cffi uint32_t[])
    op_done: Any                     # requests in completion order (cffi uint32_t[])
    opcodes: Any                     # per request
    bufi: Any                        # per request: index into mappings, or NO_BUF
    mappings: list[Any]              # per buffer: its RegMapping or None
    describe: Callable[[int], str]   # request k in words, for errors

    def opcode(self, k: int) -> int:
        return int(self.opcodes[k])

    def mapping(self, k: int) -> Any:
        i = self.bufi[k]
        return self.mappings[i] if i < len(self.mappings) else None

    def what(self, k: int) -> str:
        return self.describe(k)


class OpFuture(_FutureBase):
    """One request of a batch of requests: done when its batch is, with its own outcome
    (``result()`` returns 0 or raises what failed this request; ``index`` names it)."""

    pumped = True

    def __init__(self, batch: BatchFuture, index: int, opcode: int, mapping: Any) -> None:
        self._exc = None
        self._fin = False
        self._callbacks = []
        self._timeout_exc = None
        self.qp = batch.qp
        self.batch = batch
        self.index = index
        self.opcode = opcode
        self.mapping = mapping

    @property
    def what(self) -> str:  # type: ignore[override]
        ops = self.batch._ops
        return ops.what(self.index) if ops is not None else ""

    def _settle(self, exc: BaseException | None) -> None:
        if self._fin:
            return
        self._exc = exc
        b = self.batch
        if b._op_tokens is not None and b._op_release is not None:
            t = b._op_tokens[self.index]
            if t is not None:
                b._op_release(t)
        self._finish()

    def _fail(self, exc: BaseException) -> None:
        self.batch._fail(exc)

    def result(self, timeout: float | None = None) -> int:
        self.qp.wait(self, timeout)
        if self._exc is not None:
            raise self._exc
        return 0


class QueuePair(Resource):
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
            raise NvmeError(f"queue {qid}: cannot allocate the tracker table for depth {depth}")
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

    def submit_batch(self, fut: BatchFuture) -> BatchFuture:
        """Attach a batch: the pump submits it (up to its qd in flight, as slots free, one
        doorbell per round) whenever the queue is driven. Never raises: a queue that cannot
        take it (controller resetting, gone) fails the future instead."""
        try:
            with self.lock:
                self.hooks.check_usable()
                if self.c is None:
                    raise NvmeError(f"queue {self.qid} is closed")
                while self.hot.lib.p2h_batch_attach(self.c, fut._b) < 0:
                    self._process_locked()  # 64 batches attached: let one finish
                self._batches[int(fut._b.id)] = fut
                self._process_locked()       # first submission round now
        except Exception as exc:  # noqa: BLE001 - it arrives through the future
            with self.lock:
                if self.c is not None and fut._b.attached:
                    self.hot.lib.p2h_batch_detach(self.c, fut._b)
                    self._batches.pop(int(fut._b.id), None)
                fut._fail(exc)
        self._after_process()
        return fut

    def run_generated(self, *, opc: int, nsid: int, nlb: int, nbytes: int, pages: Any, npages: int,
                      slot: int, gen: int, span_blocks: int, nslots: int, count: int, qd: int,
                      seed: int, timeout_s: float, lat: Any = None) -> tuple[int, int]:
        """The engine's own loop (the benchmark's ceiling): `count` requests generated in C from
        one template, at uniformly random nlb-aligned LBAs below span_blocks, request i at buffer
        offset (i % nslots) * nbytes; at most qd in flight; run to completion on this queue pair
        with nothing else in flight. lat: a uint32_t[count] for per-request latencies, or None.
        Returns (completed, errors); stops early when nothing completes for timeout_s."""
        ffi, lib = self.hot.ffi, self.hot.lib
        tmpl = ffi.new("struct p2h_io *")
        tmpl.opc, tmpl.nsid, tmpl.nlb, tmpl.nbytes = opc, nsid, nlb, nbytes
        tmpl.pages, tmpl.npages, tmpl.slot, tmpl.gen = pages, npages, slot, gen
        b = ffi.new("struct p2h_batch *")
        b.tmpl = tmpl
        b.span_blocks = span_blocks
        b.nslots = nslots
        b.rng = seed or 1
        b.n = count
        b.qd = max(1, min(qd, self.ntrk))
        b.lat_ns = lat if lat is not None else ffi.NULL
        with self.lock:
            self.hooks.check_usable()
            if self.c is None:
                raise NvmeError(f"queue {self.qid} is closed")
            done = lib.p2h_batch_run(self.c, b, int(timeout_s * 1e9))
        if done < 0:
            raise NvmeError(f"queue {self.qid}: generated batch refused ({errno.errorcode.get(-done, done)})")
        return int(done), int(b.errors)

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
            fut._progress()
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
        idle_ns = PUMP_IDLE_NS if fut.pumped else 0
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
                b._fail(exc_for(int(b._ios[0].opc) if b.n else 0, 0, b),
                        lambda f: exc_for(f.opcode, 0, f))
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

    def _close(self) -> None:
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
