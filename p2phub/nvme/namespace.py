"""Namespaces: block I/O between LBAs and registered memory.

Three ways in:

- ``ns.read/write/flush/write_zeroes(...)``: one request, blocking;
- ``ns.submit(ops)`` / ``ns.submit_ops(ops)``: any number of requests of any
  kind and size (a request larger than MDTS is split) into one or several
  buffers. The whole call is checked first (in C): one bad request refuses it
  with a ``UsageError`` naming its index, and nothing is submitted. Then the
  hot path's pump submits the commands as queue slots free (one doorbell per
  round) and records their completions with no Python per command; thousands
  of requests, more than the queue holds, go in one call. ``submit`` returns
  one future per request, ``submit_ops`` one :class:`BatchFuture` (and
  ``op_futures()`` on request). Once the call returns, every failure (the
  gate, a reset, a fence, an error status) arrives through those futures.
- ``ns.read_batch/write_batch(buf, lbas, offsets, nbytes)``: many same-sized
  requests into one buffer, from integer arrays used in place.

A namespace is handed what it uses of its controller (a
:class:`NamespaceContext`); it never calls the controller. Every access is
declared in one place, :meth:`Namespace._declare`, before it is submitted,
and released when its future completes: that is where the per-registration
in-flight count lives (what ``quiesce_registration`` waits for) and where the
ordering layer hooks (``Controller.access_hooks``).
"""

from __future__ import annotations

import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

from .. import metrics
from ..errors import UsageError
from ..ordering import nvme as ordering
from . import prp, spec
from .errors import NvmeError, RegistrationRevokedError
from .queue import NO_SLOT, BatchFuture, OpFuture, OpTable, QueuePair, SameSizeRequests

if TYPE_CHECKING:
    from .buffers import RegMapping

KINDS = {"read": spec.OPC_READ, "write": spec.OPC_WRITE, "flush": spec.OPC_FLUSH,
         "write_zeroes": spec.OPC_WRITE_ZEROES}
NO_BUF = 0xFFFFFFFF


class AccessHook(Protocol):
    """Told of every data access before it is submitted, and again when it has completed.

    ``begin`` may block (a fence waiting on an earlier conflicting access) or raise
    (nothing is then submitted); its return value is handed to ``end``.
    """

    def begin(self, buf: Any, offset: int, length: int, kind: str) -> object: ...

    def end(self, token: object) -> None: ...


@dataclass(frozen=True)
class NamespaceContext:
    """What a namespace uses of its controller, handed over when it is made."""

    name: str                                                # the controller (PCI address), for messages
    hot: Any                                                 # the compiled hot path (ffi, lib)
    max_transfer: int                                        # bytes one command moves at most (MDTS)
    qpair: Callable[[], QueuePair]                           # this thread's I/O queue pair
    resolve: Callable[[Any], "tuple[prp.PageList, RegMapping | None]"]  # buffer -> pages, mapping
    access_hooks: list[Any]                                  # AccessHook objects (the controller's list)


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

    def __init__(self, ident: spec.IdentifyNamespace, ctx: NamespaceContext) -> None:
        self.ident = ident
        self.nsid = ident.nsid
        self.lba_size = ident.lba_size
        self.blocks = ident.nsze
        self._lba_shift = self.lba_size.bit_length() - 1
        self._ctx = ctx

    def __repr__(self) -> str:
        return f"<Namespace {self._ctx.name} nsid={self.nsid} {self.blocks}x{self.lba_size}B>"

    # ---------------------------------------------------------------- blocking
    def read(self, buf: Any, lba: int, nbytes: int, offset: int = 0, *, timeout: float | None = None) -> None:
        """Read nbytes from lba into buf[offset:offset+nbytes] (buf: registration or DmaBuffer)."""
        self.submit_ops([Op("read", buf, lba, nbytes, offset)]).result(timeout)

    def write(self, buf: Any, lba: int, nbytes: int, offset: int = 0, *, timeout: float | None = None) -> None:
        """Write buf[offset:offset+nbytes] to lba."""
        self.submit_ops([Op("write", buf, lba, nbytes, offset)]).result(timeout)

    def flush(self, *, timeout: float | None = None) -> None:
        self.submit_ops([Op("flush")]).result(timeout)

    def write_zeroes(self, lba: int, nblocks: int, *, timeout: float | None = None) -> None:
        self.submit_ops([Op("write_zeroes", lba=lba, nblocks=nblocks)]).result(timeout)

    # ---------------------------------------------------------------- asyncio
    async def read_async(self, buf: Any, lba: int, nbytes: int, offset: int = 0) -> None:
        await self.submit_ops([Op("read", buf, lba, nbytes, offset)])

    async def write_async(self, buf: Any, lba: int, nbytes: int, offset: int = 0) -> None:
        await self.submit_ops([Op("write", buf, lba, nbytes, offset)])

    # ---------------------------------------------------------------- requests of any kind and size
    def submit(self, ops: Iterable[Op], *, qpair: QueuePair | None = None,
               qd: int | None = None) -> list[OpFuture]:
        """Submit requests; one future per request (see :meth:`submit_ops`), each done when
        every command of its request has completed."""
        ops = ops if isinstance(ops, list) else list(ops)
        if not ops:
            return []
        return self.submit_ops(ops, qpair=qpair, qd=qd, futures=True).op_futures()

    def submit_ops(self, ops: Sequence[Op], *, qpair: QueuePair | None = None, qd: int | None = None,
                   latencies: bool = False, futures: bool = False) -> BatchFuture:
        """Submit any number of requests (reads and writes of any size into one or several
        buffers, flushes, write zeroes) in one call; one :class:`BatchFuture` back
        (``op_futures()`` gives one per request; ``statuses()`` is per request).

        Checked before anything is submitted, in C: kind, length (a positive multiple of the
        LBA size), LBA range, buffer (open, not revoked, of this controller's Hub), buffer
        range, dword alignment. A bad request refuses the whole call with a ``UsageError``
        (``RegistrationRevokedError`` for a revoked registration) naming its index
        (``exc.index``); nothing reaches the queue. Requests larger than MDTS are split. The
        pump then submits the commands as slots free, at most `qd` in flight (default: as many
        as the queue takes). Once this returns, every failure arrives through the future.
        futures=True makes the per-request futures before submission (what ``submit`` does).
        """
        ops = ops if isinstance(ops, list) else list(ops)
        if not ops:
            raise UsageError("an empty batch")
        qp = qpair or self._ctx.qpair()
        ios, total, table, bufs, bufi, keep = self._encode(ops)
        fut = BatchFuture(qp, ios, total, qd=qd or qp.ntrk, ops=table, latencies=latencies, keep=keep,
                          what=f"batch of {len(ops)} requests nsid={self.nsid}")
        op_futs = fut.op_futures() if futures else None
        # Ordered accesses first: strict mode refuses the batch before anything is sent, and
        # the batch waits here for earlier conflicting accesses (p2phub.ordering).
        ordered = ordering.declare(ops, name=table.what)
        try:
            tokens = self._declare_batch(ops, bufs, bufi, per_op=op_futs is not None)
        except BaseException as exc:
            ordering.abandon(ordered, op_futs or _Same(fut), exc)
            raise
        if op_futs is not None:  # each request's declaration ends with its own future
            fut._op_tokens, fut._op_release = tokens, self._release
        elif tokens:
            fut.add_done_callback(lambda _f: [self._release(t) for t in tokens if t is not None])
        ordering.bind(ordered, op_futs or _Same(fut))
        metrics.nvme_ops(self._ctx.name, ops, fut, op_futs)
        return qp.submit_batch(fut)

    def _encode(self, ops: list[Op]) -> tuple[Any, int, OpTable, list, Any, tuple]:
        """Check every request and encode the commands (C: p2h_fill_ops); raises, naming the
        first bad request, before anything is submitted. (ios, commands, table, buffers,
        buffer index per request, what the commands reference)."""
        ctx = self._ctx
        ffi, lib = ctx.hot.ffi, ctx.hot.lib
        n = len(ops)
        opcs = bytearray(n)
        bufi = array.array("I", bytes(4 * n))
        lbas = array.array("Q", bytes(8 * n))
        lens = array.array("Q", bytes(8 * n))
        offs = array.array("Q", bytes(8 * n))
        bufs: list[tuple[Any, prp.PageList, "RegMapping | None"]] = []
        index: dict[int, int] = {}
        shift = self._lba_shift
        kinds = KINDS
        wz = spec.OPC_WRITE_ZEROES
        i = 0
        try:
            for i, op in enumerate(ops):
                opc = kinds.get(op.kind)
                if opc is None:
                    raise self._bad(i, n, op, f"unknown kind {op.kind!r} (read, write, flush, write_zeroes)")
                opcs[i] = opc
                b = op.buf
                if b is not None:
                    k = index.get(id(b))
                    if k is None:
                        k = index[id(b)] = self._add_buffer(bufs, b, i, n, op)
                    bufi[i] = k
                else:
                    bufi[i] = NO_BUF
                lbas[i] = op.lba
                if opc == wz:
                    lens[i] = op.nblocks << shift if op.nblocks > 0 else 0
                else:
                    lens[i] = op.nbytes if op.nbytes > 0 else 0
                offs[i] = op.offset
        except (OverflowError, TypeError):
            raise self._bad(i, n, ops[i], self._not_uint64(ops[i])) from None
        cbufs = ffi.new("struct p2h_buf[]", max(len(bufs), 1))
        for k, (_b, pl, m) in enumerate(bufs):
            cb = cbufs[k]
            cb.pages, cb.npages = pl.addrs, pl.npages
            cb.slot, cb.gen = (m.slot, m.generation) if m is not None else (NO_SLOT, 0)
        first = array.array("I", bytes(4 * (n + 1)))
        keep = (bufs, cbufs, ffi.from_buffer("uint8_t[]", opcs), ffi.from_buffer("uint64_t[]", lbas),
                ffi.from_buffer("uint64_t[]", lens), ffi.from_buffer("uint64_t[]", offs),
                ffi.from_buffer("uint32_t[]", bufi), ffi.from_buffer("uint32_t[]", first))
        bad, why = ffi.new("int *"), ffi.new("int *")
        args = (n, *keep[2:7], cbufs, len(bufs), self.nsid, shift, self.blocks, ctx.max_transfer, keep[7])
        total = lib.p2h_fill_ops(ffi.NULL, 0, *args, ffi.NULL, ffi.NULL, bad, why)
        if total < 0:
            raise self._refusal(bad[0], why[0], n, ops, bufs, bufi)
        ios = ffi.new("struct p2h_io[]", total)
        op_of, op_left = ffi.new("uint32_t[]", total), ffi.new("uint32_t[]", n)
        if lib.p2h_fill_ops(ios, total, *args, op_of, op_left, bad, why) != total:
            raise UsageError(f"batch of {n} requests: encoding failed")  # not reached: checked above
        table = OpTable(n=n, first=first, op_of=op_of, op_left=op_left, op_done=ffi.new("uint32_t[]", n),
                        opcodes=opcs, bufi=bufi, mappings=[m for _b, _p, m in bufs],
                        describe=lambda k: _describe(ops[k], self.nsid))
        return ios, total, table, bufs, bufi, keep

    def _not_uint64(self, op: Op) -> str:
        if isinstance(op.lba, int) and op.lba < 0:
            return f"LBA range lba={op.lba} is outside namespace {self.nsid} of {self.blocks} blocks"
        if isinstance(op.offset, int) and op.offset < 0:
            return f"buffer range offset={op.offset} is outside the buffer"
        return "LBA, length and offset must be integers in 0..2^64-1"

    def _add_buffer(self, bufs: list, b: Any, i: int, n: int, op: Op) -> int:
        """Resolve a buffer of request i (once per call); its index in bufs."""
        try:
            pl, m = self._ctx.resolve(b)
        except RegistrationRevokedError as exc:
            err = RegistrationRevokedError(f"{op.kind} request {i} of {n}: {exc}", handle=exc.handle)
            err.index = i  # type: ignore[attr-defined]
            raise err from None
        except UsageError as exc:
            raise self._bad(i, n, op, str(exc)) from None
        bufs.append((b, pl, m))
        return len(bufs) - 1

    @staticmethod
    def _bad(i: int, n: int, op: Any, why: str) -> UsageError:
        err = UsageError(f"{getattr(op, 'kind', '?')} request {i} of {n}: {why}")
        err.index = i  # type: ignore[attr-defined]
        return err

    def _refusal(self, i: int, why: int, n: int, ops: Sequence[Op], bufs: list, bufi: Any) -> UsageError:
        op = ops[i]
        if why == 1:
            nblocks = op.nblocks if op.kind == "write_zeroes" else op.nbytes // self.lba_size
            text = (f"LBA range lba={op.lba} nblocks={nblocks} is outside namespace {self.nsid} "
                    f"of {self.blocks} blocks")
        elif why == 2:
            pl = bufs[bufi[i]][1]
            text = f"buffer range offset={op.offset} nbytes={op.nbytes} is outside {pl.name} of {pl.nbytes} bytes"
        elif why == 3:
            text = f"offset={op.offset} must be a multiple of 4 (PRP dword alignment)"
        elif why == 4:
            text = (f"nblocks={op.nblocks} must be positive" if op.kind == "write_zeroes" else
                    f"nbytes={op.nbytes} is not a positive multiple of the LBA size {self.lba_size}")
        elif why == 5:
            text = "no buffer given for its data"
        else:
            text = f"cannot be encoded (reason {why})"
        return self._bad(i, n, op, text)

    def _declare_batch(self, ops: Sequence[Op], bufs: list, bufi: Any, per_op: bool) -> list[Any]:
        """Declare every access of a batch (hooks per request, one hold per request on each
        registration); tokens for :meth:`_release`: one per request (None where nothing was
        declared) when per_op or hooks are set, else one per registration. Nothing stays
        declared if one raises."""
        tokens: list[Any] = []
        try:
            if per_op and not self._ctx.access_hooks:
                # One hold per registration for all its requests; each request releases one.
                shared: dict[int, Any] = {}
                counts: dict[int, int] = {}
                for k in bufi:
                    if k != NO_BUF and bufs[k][2] is not None:
                        counts[k] = counts.get(k, 0) + 1
                for k, cnt in counts.items():
                    m = bufs[k][2]
                    m.hold(cnt)
                    shared[k] = (m, (), 1)
                get = shared.get
                tokens = [get(k) for k in bufi]
            elif self._ctx.access_hooks or per_op:
                for k, op in enumerate(ops):
                    if op.kind in ("flush", "write_zeroes"):
                        tokens.append(self._declare(None, None, 0, 0, op.kind))
                    else:
                        m = bufs[bufi[k]][2]
                        tokens.append(self._declare(op.buf, m, op.offset, op.nbytes, op.kind))
            else:
                counts: dict[int, list] = {}
                for k in bufi:
                    if k != NO_BUF and bufs[k][2] is not None:
                        c = counts.get(k)
                        if c is None:
                            counts[k] = [bufs[k][2], 1]
                        else:
                            c[1] += 1
                for m, cnt in counts.values():
                    m.hold(cnt)
                    tokens.append((m, [], cnt))
        except BaseException:
            for t in tokens:
                if t is not None:
                    self._release(t)
            raise
        return tokens

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
        ctx = self._ctx
        if nbytes > ctx.max_transfer:
            raise UsageError(f"nbytes={nbytes} is above the controller's largest transfer "
                             f"{ctx.max_transfer} (MDTS); use submit() to have it split")
        qp = qpair or ctx.qpair()
        ffi, lib = ctx.hot.ffi, ctx.hot.lib
        pl, mapping = ctx.resolve(buf)
        c_lbas = _u64(ffi, lbas)
        c_offs = _u64(ffi, offsets)
        bad, why, span = ffi.new("int *"), ffi.new("int *"), ffi.new("uint64_t[2]")
        slot = mapping.slot if mapping is not None else NO_SLOT
        gen = mapping.generation if mapping is not None else 0
        # Checked here in one C pass; the pump encodes each command from the template and the
        # two arrays as it submits it (no per-request struct, as in the engine's own loop).
        if lib.p2h_fill_rw(ffi.NULL, n, KINDS[kind], self.nsid, self._lba_shift, nbytes, c_lbas, c_offs,
                           pl.addrs, pl.npages, slot, gen, self.blocks, span, bad, why):
            k = bad[0]
            reason = {1: f"LBA range lba={lbas[k]} nblocks={nbytes // self.lba_size} is outside namespace "
                         f"{self.nsid} of {self.blocks} blocks",
                      2: f"buffer range offset={offsets[k]} nbytes={nbytes} is outside {pl.name} of "
                         f"{pl.nbytes} bytes",
                      3: f"offset={offsets[k]} must be a multiple of 4 (PRP dword alignment)"}[why[0]]
            raise UsageError(f"{kind} batch request {k}: {reason}")
        lo, hi = int(span[0]), int(span[1])
        ios = SameSizeRequests(ffi, self._template(kind, nbytes, pl, mapping), c_lbas, c_offs)
        fut = BatchFuture(qp, ios, n, qd=qd or qp.ntrk, keep=(pl, mapping, c_lbas, c_offs, buf),
                          what=f"{kind} batch of {n} x {nbytes} B nsid={self.nsid}", latencies=latencies)
        fut.mapping = mapping
        ordered = ordering.declare_span(buf, kind, lo, hi - lo, fut.what)
        if ctx.access_hooks:
            try:
                token = self._declare(buf, mapping, lo, hi - lo, kind)
            except BaseException as exc:
                ordering.abandon(ordered, [fut], exc)
                raise
            fut.add_done_callback(lambda _f: self._release(token))
        elif mapping is not None:  # the hold alone: released by the mapping itself
            mapping.hold()
            fut.add_done_callback(mapping.release_for)
        ordering.bind(ordered, [fut])
        metrics.nvme_batch(self._ctx.name, kind, n, nbytes, fut)
        return qp.submit_batch(fut)  # from here on, failures arrive through fut

    def _template(self, kind: str, nbytes: int, pl: prp.PageList, mapping: "RegMapping | None") -> Any:
        """The command template of a same-sized batch (read-only to the pump). A
        registration's are kept on its mapping, which fixes pages, slot and generation."""
        key = (KINDS[kind], self.nsid, nbytes)
        if mapping is not None:
            t = mapping.templates.get(key)
            if t is not None:
                return t
        t = self._ctx.hot.ffi.new("struct p2h_io *", {
            "opc": key[0], "nsid": self.nsid, "nlb": nbytes >> self._lba_shift, "nbytes": nbytes,
            "pages": pl.addrs, "npages": pl.npages,
            "slot": mapping.slot if mapping is not None else NO_SLOT,
            "gen": mapping.generation if mapping is not None else 0})
        if mapping is not None:
            mapping.templates[key] = t
        return t

    # ---------------------------------------------------------------- the engine's own loop
    def run_generated(self, kind: str, buf: Any, nbytes: int, count: int, *, qd: int, seed: int = 1,
                      qpair: QueuePair | None = None, timeout: float = 5.0, slots: int | None = None,
                      latencies: bool = False) -> list[int]:
        """`count` requests of nbytes generated in C (no request array: the benchmark's
        ceiling): uniformly random nbytes-aligned LBAs over the namespace, request i into buf at
        offset (i % slots) * nbytes (slots: default as many as buf holds); at most qd in flight. Runs
        to completion on the queue pair (nothing else may be in flight there). Returns the
        per-request latencies in ns when asked (else []); raises NvmeError if a request failed
        or nothing completed for `timeout` seconds."""
        if kind not in ("read", "write"):
            raise UsageError(f"kind must be 'read' or 'write', not {kind!r}")
        if nbytes <= 0 or nbytes % self.lba_size or nbytes > self._ctx.max_transfer:
            raise UsageError(f"nbytes={nbytes} must be a positive multiple of the LBA size {self.lba_size} "
                             f"and at most {self._ctx.max_transfer} (MDTS)")
        if count <= 0:
            raise UsageError(f"count={count} must be positive")
        ctx = self._ctx
        qp = qpair or ctx.qpair()
        pl, mapping = ctx.resolve(buf)
        fits = pl.nbytes // nbytes
        slots = fits if slots is None else slots
        if not 0 < slots <= fits:
            raise UsageError(f"{slots} slots of {nbytes} bytes do not fit in {pl.name} of {pl.nbytes} bytes")
        lat = ctx.hot.ffi.new("uint32_t[]", count) if latencies else None
        token = self._declare(buf, mapping, 0, slots * nbytes, kind)
        try:
            done, errors = qp.run_generated(
                opc=KINDS[kind], nsid=self.nsid, nlb=nbytes // self.lba_size, nbytes=nbytes, pages=pl.addrs,
                npages=pl.npages, slot=mapping.slot if mapping is not None else NO_SLOT,
                gen=mapping.generation if mapping is not None else 0, span_blocks=self.blocks,
                nslots=slots, count=count, qd=qd, seed=seed, timeout_s=timeout, lat=lat)
        finally:
            if token is not None:
                self._release(token)
        if done < count or errors:
            raise NvmeError(f"{self._ctx.name} nsid={self.nsid}: generated {kind}s stopped at {done} of {count} "
                            f"completed, {errors} with an error status")
        return list(lat[0:count]) if lat is not None else []

    # ---------------------------------------------------------------- the access declaration
    def _declare(self, buf: Any, mapping: "RegMapping | None", offset: int, length: int,
                 kind: str) -> object:
        """The one place an access (buffer, offset, length, kind) is declared before submission.

        Returns a token for :meth:`_release`, called when the access's future is done.
        """
        hooks = self._ctx.access_hooks
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
        return (mapping, done, 1)

    @staticmethod
    def _release(token: object) -> None:
        mapping, done, count = token  # type: ignore[misc]
        for h, t in reversed(done):
            h.end(t)
        if mapping is not None:
            mapping.release(count)


def _describe(op: Op, nsid: int) -> str:
    if op.kind == "flush":
        return f"flush nsid={nsid}"
    if op.kind == "write_zeroes":
        return f"write_zeroes nsid={nsid} lba={op.lba} nblocks={op.nblocks}"
    return f"{op.kind} nsid={nsid} lba={op.lba} nbytes={op.nbytes} offset={op.offset}"


class _Same:
    """A sequence whose every item is one future (a batch's accesses all follow it)."""

    def __init__(self, fut: Any) -> None:
        self.fut = fut

    def __getitem__(self, _i: int) -> Any:
        return self.fut


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
