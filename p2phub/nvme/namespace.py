"""Namespaces: block I/O between LBAs and registered memory.

Two ways in:

- ``ns.read/write/submit(...)``: one future per request (a request bigger
  than MDTS is split), Python per request;
- ``ns.read_batch/write_batch(buf, lbas, offsets, nbytes)``: the fast path.
  Many same-sized requests into one registration (or DMA buffer) in one
  call; the requests are encoded and checked in C, the hot path's pump
  submits and reaps them with no Python and no system call per request, and
  one :class:`BatchFuture` comes back.

Every access is declared in one place, :meth:`Namespace._declare`, before
it is submitted, and released when its future completes: that is where the
per-registration in-flight count lives (what ``quiesce_registration`` waits
for) and where the ordering layer hooks (``Controller.access_hooks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

from .. import metrics
from ..errors import UsageError
from ..ordering import nvme as ordering
from . import prp, spec
from .queue import NO_SLOT, BatchFuture, CommandFuture, QueuePair

if TYPE_CHECKING:
    from .buffers import RegMapping
    from .controller import Controller

KINDS = {"read": spec.OPC_READ, "write": spec.OPC_WRITE, "flush": spec.OPC_FLUSH,
         "write_zeroes": spec.OPC_WRITE_ZEROES}


class AccessHook(Protocol):
    """Told of every data access before it is submitted, and again when it has completed.

    ``begin`` may block (a fence waiting on an earlier conflicting access) or raise
    (nothing is then submitted); its return value is handed to ``end``.
    """

    def begin(self, buf: Any, offset: int, length: int, kind: str) -> object: ...

    def end(self, token: object) -> None: ...


@dataclass
class Op:
    """One request of a batch: ``kind`` is "read", "write", "flush" or "write_zeroes"."""

    kind: str
    buf: Any = None
    lba: int = 0
    nbytes: int = 0
    offset: int = 0
    nblocks: int = 0  # write_zeroes only


def ReadOp(buf: Any, lba: int, nbytes: int, offset: int = 0) -> Op:  # noqa: N802
    return Op("read", buf, lba, nbytes, offset)


def WriteOp(buf: Any, lba: int, nbytes: int, offset: int = 0) -> Op:  # noqa: N802
    return Op("write", buf, lba, nbytes, offset)


class Namespace:
    """One active namespace of a controller."""

    def __init__(self, ctrl: "Controller", ident: spec.IdentifyNamespace) -> None:
        self.ctrl = ctrl
        self.ident = ident
        self.nsid = ident.nsid
        self.lba_size = ident.lba_size
        self.blocks = ident.nsze
        self._lba_shift = self.lba_size.bit_length() - 1

    def __repr__(self) -> str:
        return f"<Namespace {self.ctrl.bdf} nsid={self.nsid} {self.blocks}x{self.lba_size}B>"

    # ---------------------------------------------------------------- blocking
    def read(self, buf: Any, lba: int, nbytes: int, offset: int = 0, *, timeout: float | None = None) -> None:
        """Read nbytes from lba into buf[offset:offset+nbytes] (buf: registration or DmaBuffer)."""
        self.submit([Op("read", buf, lba, nbytes, offset)])[0].result(timeout)

    def write(self, buf: Any, lba: int, nbytes: int, offset: int = 0, *, timeout: float | None = None) -> None:
        """Write buf[offset:offset+nbytes] to lba."""
        self.submit([Op("write", buf, lba, nbytes, offset)])[0].result(timeout)

    def flush(self, *, timeout: float | None = None) -> None:
        self.submit([Op("flush")])[0].result(timeout)

    def write_zeroes(self, lba: int, nblocks: int, *, timeout: float | None = None) -> None:
        self.submit([Op("write_zeroes", lba=lba, nblocks=nblocks)])[0].result(timeout)

    # ---------------------------------------------------------------- asyncio
    async def read_async(self, buf: Any, lba: int, nbytes: int, offset: int = 0) -> None:
        await self.submit([Op("read", buf, lba, nbytes, offset)])[0]

    async def write_async(self, buf: Any, lba: int, nbytes: int, offset: int = 0) -> None:
        await self.submit([Op("write", buf, lba, nbytes, offset)])[0]

    # ---------------------------------------------------------------- one future per request
    def submit(self, ops: Iterable[Op], *, qpair: QueuePair | None = None) -> list[CommandFuture]:
        """Submit requests: every op is validated first, then all go out with one doorbell
        per queue-full round. Returns one future per op."""
        qp = qpair or self.ctrl.io_qpair()
        ops = list(ops)
        ios, piece_futs, op_futs, accesses = self._prepare(ops, qp)
        # Ordered accesses first: strict mode refuses the batch before anything is sent, and
        # the batch waits here for earlier conflicting accesses (p2phub.ordering).
        ordered = ordering.declare(ops, [f.what for f in op_futs])
        tokens: list[object] = []
        try:
            for a in accesses:
                tokens.append(self._declare(*a))
        except BaseException as exc:
            for t in tokens:
                if t is not None:
                    self._release(t)
            ordering.abandon(ordered, op_futs, exc)
            raise
        for fut, token in zip(op_futs, tokens):
            if token is not None:
                fut.add_done_callback(lambda _f, t=token: self._release(t))
        try:
            qp.submit_all(ios, piece_futs)
        except BaseException as exc:
            for fut in op_futs:
                if not fut.done() and not fut.cids:
                    fut._fail(exc)  # never reached the device: release its declaration
            ordering.abandon(ordered, op_futs, exc)
            raise
        ordering.bind(ordered, op_futs)
        metrics.nvme_submitted(self.ctrl, ops, op_futs)
        return op_futs

    # ---------------------------------------------------------------- the fast path
    def read_batch(self, buf: Any, lbas: Sequence[int], offsets: Sequence[int], nbytes: int, *,
                   qd: int | None = None, qpair: QueuePair | None = None,
                   latencies: bool = False) -> BatchFuture:
        """len(lbas) reads of nbytes each: LBA lbas[i] into buf at offsets[i]. One future back."""
        return self.submit_batch("read", buf, lbas, offsets, nbytes, qd=qd, qpair=qpair, latencies=latencies)

    def write_batch(self, buf: Any, lbas: Sequence[int], offsets: Sequence[int], nbytes: int, *,
                    qd: int | None = None, qpair: QueuePair | None = None,
                    latencies: bool = False) -> BatchFuture:
        """len(lbas) writes of nbytes each: buf at offsets[i] to LBA lbas[i]. One future back."""
        return self.submit_batch("write", buf, lbas, offsets, nbytes, qd=qd, qpair=qpair, latencies=latencies)

    def submit_batch(self, kind: str, buf: Any, lbas: Sequence[int], offsets: Sequence[int], nbytes: int, *,
                     qd: int | None = None, qpair: QueuePair | None = None,
                     latencies: bool = False) -> BatchFuture:
        """The batch API: requests encoded and checked in C, submitted and reaped by the hot
        path's pump (at most `qd` in flight; default: as many as the queue takes). lbas and
        offsets: sequences of ints, or buffers of uint64 (array('Q'), numpy) used in place.
        A bad request refuses the whole batch before anything is sent (UsageError naming it).
        """
        if kind not in ("read", "write"):
            raise UsageError(f"batch kind must be 'read' or 'write', not {kind!r}")
        n = len(lbas)
        if len(offsets) != n:
            raise UsageError(f"{n} LBAs but {len(offsets)} offsets")
        if n == 0:
            raise UsageError("an empty batch")
        if nbytes <= 0 or nbytes % self.lba_size:
            raise UsageError(f"nbytes={nbytes} is not a positive multiple of the LBA size {self.lba_size}")
        if nbytes > self.ctrl.max_transfer:
            raise UsageError(f"nbytes={nbytes} is above the controller's largest transfer "
                             f"{self.ctrl.max_transfer} (MDTS); use submit() to have it split")
        qp = qpair or self.ctrl.io_qpair()
        ffi, lib = self.ctrl.hot.ffi, self.ctrl.hot.lib
        pl, mapping = self.ctrl.resolve_buffer(buf)
        c_lbas = _u64(ffi, lbas)
        c_offs = _u64(ffi, offsets)
        ios = ffi.new("struct p2h_io[]", n)
        bad, why = ffi.new("int *"), ffi.new("int *")
        slot = mapping.slot if mapping is not None else NO_SLOT
        gen = mapping.generation if mapping is not None else 0
        if lib.p2h_fill_rw(ios, n, KINDS[kind], self.nsid, self._lba_shift, nbytes, c_lbas, c_offs,
                           pl.addrs, pl.npages, slot, gen, self.blocks, bad, why):
            k = bad[0]
            reason = {1: f"LBA range lba={lbas[k]} nblocks={nbytes // self.lba_size} is outside namespace "
                         f"{self.nsid} of {self.blocks} blocks",
                      2: f"buffer range offset={offsets[k]} nbytes={nbytes} is outside {pl.name} of "
                         f"{pl.nbytes} bytes",
                      3: f"offset={offsets[k]} must be a multiple of 4 (PRP dword alignment)"}[why[0]]
            raise UsageError(f"{kind} batch request {k}: {reason}")
        lo = min(offsets)
        hi = max(offsets) + nbytes
        fut = BatchFuture(qp, ios, n, qd=qd or qp.ntrk, keep=(pl, mapping, c_lbas, c_offs, buf),
                          what=f"{kind} batch of {n} x {nbytes} B nsid={self.nsid}", latencies=latencies)
        fut.mapping = mapping
        ordered = ordering.declare([Op(kind, buf, offset=lo, nbytes=hi - lo)], [fut.what])
        try:
            token = self._declare(buf, mapping, lo, hi - lo, kind)
        except BaseException as exc:
            ordering.abandon(ordered, [fut], exc)
            raise
        if token is not None:
            fut.add_done_callback(lambda _f: self._release(token))
        ordering.bind(ordered, [fut])
        metrics.nvme_batch(self.ctrl, kind, n, nbytes, fut)
        try:
            qp.submit_batch(fut)
        except BaseException as exc:
            fut._fail(exc)
            raise
        return fut

    # ---------------------------------------------------------------- the access declaration
    def _declare(self, buf: Any, mapping: "RegMapping | None", offset: int, length: int,
                 kind: str) -> object:
        """The one place an access (buffer, offset, length, kind) is declared before submission.

        Returns a token for :meth:`_release`, called when the access's future is done.
        """
        hooks = self.ctrl.access_hooks
        if mapping is None and not hooks:
            return None
        done: list[tuple[Any, object]] = []
        try:
            for h in hooks:
                done.append((h, h.begin(buf, offset, length, kind)))
        except BaseException:
            for h, t in reversed(done):
                h.end(t)
            raise
        if mapping is not None:
            mapping.hold()
        return (mapping, done)

    @staticmethod
    def _release(token: object) -> None:
        mapping, done = token  # type: ignore[misc]
        for h, t in reversed(done):
            h.end(t)
        if mapping is not None:
            mapping.release()

    # ---------------------------------------------------------------- helpers
    def _prepare(self, ops: list[Op], qp: QueuePair) -> tuple[Any, list[CommandFuture], list[CommandFuture],
                                                              list[tuple[Any, Any, int, int, str]]]:
        """Validate every op, split by MDTS; (p2h_io array, future per piece, future per op, accesses)."""
        ffi = self.ctrl.hot.ffi
        pieces: list[tuple[int, int, int, int, int, Any, int]] = []
        futs: list[CommandFuture] = []
        accesses: list[tuple[Any, Any, int, int, str]] = []
        for op in ops:
            if op.kind not in KINDS:
                raise UsageError(f"unknown op kind {op.kind!r}")
            opc = KINDS[op.kind]
            what = f"{op.kind} nsid={self.nsid} lba={op.lba}"
            mapping = None
            if op.kind == "flush":
                parts: list[tuple[int, int, int, int, Any]] = [(0, 0, 0, 0, None)]
            elif op.kind == "write_zeroes":
                self._check_lba(op.lba, op.nblocks)
                parts = [(op.lba + i, min(0x10000, op.nblocks - i), 0, 0, None)
                         for i in range(0, op.nblocks, 0x10000)]
            else:
                pl, mapping = self.ctrl.resolve_buffer(op.buf)
                if op.nbytes <= 0 or op.nbytes % self.lba_size:
                    raise UsageError(f"{what}: nbytes={op.nbytes} is not a positive multiple of "
                                     f"the LBA size {self.lba_size}")
                self._check_lba(op.lba, op.nbytes // self.lba_size)
                pl.validate_range(op.offset, op.nbytes)
                parts = [(lba, n // self.lba_size, n, off, pl)
                         for lba, n, off in prp.split(op.lba, op.nbytes, op.offset, self.lba_size,
                                                      self.ctrl.max_transfer)]
                accesses.append((op.buf, mapping, op.offset, op.nbytes, op.kind))
            if op.kind in ("flush", "write_zeroes"):
                accesses.append((None, None, 0, 0, op.kind))
            fut = CommandFuture(qp, opc, len(parts), keep=(op.buf, mapping), what=what)
            fut.mapping = mapping
            futs.append(fut)
            for lba, nlb, nbytes, off, pl in parts:
                pieces.append((opc, lba, nlb, nbytes, off, (pl, mapping), len(futs) - 1))
        ios = ffi.new("struct p2h_io[]", len(pieces))
        for i, (opc, lba, nlb, nbytes, off, (pl, mapping), _k) in enumerate(pieces):
            io = ios[i]
            io.opc = opc
            io.nsid = self.nsid
            io.slba = lba
            io.nlb = nlb
            io.nbytes = nbytes
            io.buf_off = off
            if pl is not None:
                io.pages = pl.addrs
                io.npages = pl.npages
            io.slot = mapping.slot if mapping is not None else NO_SLOT
            io.gen = mapping.generation if mapping is not None else 0
            io.tag = self.ctrl.next_tag()
        return ios, [futs[p[6]] for p in pieces], futs, accesses

    def _check_lba(self, lba: int, nblocks: int) -> None:
        if lba < 0 or nblocks <= 0 or lba + nblocks > self.blocks:
            raise UsageError(f"LBA range lba={lba} nblocks={nblocks} is outside namespace {self.nsid} "
                             f"of {self.blocks} blocks")


def _u64(ffi: Any, seq: Sequence[int]) -> Any:
    """A uint64_t[] over seq: in place for a buffer of 8-byte items, else a copy (range-checked)."""
    try:
        mv = memoryview(seq)  # type: ignore[arg-type]
    except TypeError:
        mv = None
    if mv is not None and mv.itemsize == 8 and mv.format in ("Q", "L", "<Q", "=Q", "K") and mv.c_contiguous:
        return ffi.from_buffer("uint64_t[]", seq)
    try:
        return ffi.new("uint64_t[]", list(seq))
    except OverflowError:
        raise UsageError("LBAs and offsets must be integers in 0..2^64-1") from None
