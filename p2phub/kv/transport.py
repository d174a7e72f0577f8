"""The TCP transport of KV transfers: one connection per (sender, receiver) pair.

Wire format (little endian). Every message starts with a 40-byte header:

    magic u32 "P2KV" | type u16 | flags u16 | xfer u64 | req u64 | layer u32 | n u32 | nbytes u64

    AUTH   n bytes of JSON (at most 1 KiB): the challenge-response every connection starts
           with, three messages, before any other (kv/auth.py)
    HELLO  n bytes of JSON {name, incarnation}, both ways, once, after AUTH
    DATA   n runs of 24 bytes (seg u32, flags u32, off u64, len u64), then nbytes of payload
           that land at those runs of the receiver's registered segments, in order; with
           F_PLACED no payload follows: the sender WROTE it there over RDMA (kv/rdma.py)
           and every WRITE completed before this message was sent
    NOTIF  n bytes of notification for the receiver's get_new_notifs()
    READ   n runs of the receiver's segments (nbytes in all) that it sends back, in order, as
           one DATA message with F_READ_RESP and no run table, which the reader lands in the
           local ranges it planned; with F_PLACED (RDMA) n more runs follow, the reader's own
           (segment, offset) for each, and the receiver may instead RDMA-WRITE the bytes there
           and answer with F_READ_RESP|F_PLACED and no payload (kv/rdma.py)
    ACK    receiver -> sender: the transfer `xfer` has landed (after its LAST message)
    ERR    receiver -> sender: the transfer was refused; n bytes of reason
    FAIL   sender -> receiver: the sender gave the transfer up; n bytes of reason
    HB     either way, no body: a heartbeat, sent on a connection that has been quiet for a
           quarter of the peer timeout (a peer silent for the whole timeout is dropped)

The sender's last message of a transfer carries F_LAST; the receiver answers it with ACK.
Payload bytes go from the sender's pool to the socket and from the socket into the
receiver's pool in C (_kvhot.c: sendmsg/readv over many vectors, the GIL released); Python
runs once per message, not per page.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from .. import metrics
from . import _build
from .errors import KVError, KVPeerError, KVRejected
from .fence import FenceTimeout, HostFence
from .._resource import Resource

MAGIC = 0x564B3250  # b"P2KV"
HDR = struct.Struct("<IHHQQIIQ")
WIRE_RUN = 24
HELLO, DATA, NOTIF, ACK, ERR, FAIL, READ, HB, AUTH = 1, 2, 3, 4, 5, 6, 7, 8, 9
F_LAST = 1      # the last message of a transfer: the receiver ACKs it
F_REQ_END = 2   # the last message of a request: the receiver completes its `done` fence
F_READ_RESP = 4  # DATA answering a READ: the payload lands in the reader's planned ranges
F_PLACED = 8     # DATA whose payload the sender already RDMA-WROTE at its runs (none follows)
MAX_CTRL = 1 << 20          # bytes of a HELLO/NOTIF/ERR body
TABLE_CHUNK = 1 << 16       # bytes of a run table read at a time (it grows as bytes come)

hot = _build.hot   # the compiled hot path (kv.cuda's staging uses it too)


def _c_err(rc: int) -> str:
    e = -rc
    return f"{errno.errorcode.get(e, str(e))} ({os.strerror(e)})"


class SegmentIndex:
    """Registered (address, length) ranges, found by address (bisect over their starts)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._index: list[int] = []
        self._segs: list[tuple[int, int]] = []

    def add(self, addr: int, length: int) -> int:
        import bisect
        i = len(self._segs)
        self._segs.append((addr, length))
        k = bisect.bisect(self._starts, addr)
        self._starts.insert(k, addr)
        self._index.insert(k, i)
        return i

    def base(self, i: int) -> int:
        return self._segs[i][0]

    def drop(self, i: int) -> None:
        """Take segment `i` out of service: its index stays taken, no address finds it."""
        k = self._index.index(i)
        del self._starts[k], self._index[k]
        self._segs[i] = (0, 0)

    def find(self, addr: int, length: int) -> int:
        """The index of the segment holding [addr, addr + length); UsageError if none."""
        import bisect
        k = bisect.bisect(self._starts, addr) - 1
        while k >= 0:    # overlapping registrations: look further left
            i = self._index[k]
            a, n = self._segs[i]
            if a <= addr and addr + length <= a + n:
                return i
            k -= 1
        from ..errors import UsageError
        raise UsageError(f"local range {addr:#x}+{length} is in no registered segment")


class RangeLookup:
    """Which of a list of (addr, len) segments holds a range: bisect over the starts, walking
    back only as far as an earlier segment can still reach (segments may overlap)."""

    def __init__(self, segs: Sequence[tuple[int, int]]) -> None:
        order = sorted((a, a + n, i) for i, (a, n) in enumerate(segs) if n > 0)
        self.starts = [o[0] for o in order]
        self.order = order
        self.reach = []
        m = 0
        for _a, e, _i in order:
            m = max(m, e)
            self.reach.append(m)

    def find(self, addr: int, length: int) -> int | None:
        if length <= 0:
            return None
        import bisect
        k = bisect.bisect_right(self.starts, addr) - 1
        end = addr + length
        while k >= 0 and self.reach[k] >= end:
            a, e, i = self.order[k]
            if a <= addr and end <= e:
                return i
            k -= 1
        return None


class Message:
    """One DATA or NOTIF message, planned once: header fields, run table, payload ranges."""

    __slots__ = ("type", "req", "layer", "wire", "iov", "nruns", "nbytes", "body", "last", "dev",
                 "dest")

    def __init__(self, type_: int, req: int, layer: int, wire: Any = None, iov: Any = None,
                 nruns: int = 0, nbytes: int = 0, body: bytes = b"") -> None:
        self.type = type_
        self.req = req
        self.layer = layer
        self.wire = wire
        self.iov = iov
        self.nruns = nruns
        self.nbytes = nbytes
        self.body = body
        self.last = False
        self.dev = -1       # the device of its local ranges: -1 host, else a CUDA ordinal
        self.dest: Any = None   # READ over RDMA: its local runs as (segment, offset) wire runs


class Xfer:
    """A transfer to one peer: its messages, its state, and a fence completed by the ACK."""

    DONE, PROC, ERR = "DONE", "PROC", "ERR"

    def __init__(self, peer: str, messages: list[Message], xid: int) -> None:
        self.peer = peer
        self.messages = messages
        self.id = xid
        self.fence = HostFence(f"kv xfer {xid} to {peer}")
        self.error: BaseException | None = None
        self.posted = 0.0
        self.nbytes = sum(m.nbytes for m in messages)
        self.on_done: Callable[["Xfer"], None] | None = None
        self.reads: tuple[Any, list[int]] | None = None   # (pages, layers) of the sender's pool
        self.deadline = float("inf")   # monotonic time by which it must be done (set by post)
        self.timeout = 0.0             # the seconds that deadline allowed
        self.started = False           # its first byte went to the socket

    def _reset(self, xid: int) -> None:
        self.id = xid
        self.fence = HostFence(f"kv xfer {xid} to {self.peer}")
        self.error = None
        self.started = False

    @property
    def state(self) -> str:
        """NIXL's words: "PROC" (pending), "DONE", "ERR" (failed)."""
        if not self.fence.done():
            return self.PROC
        return self.ERR if self.fence.failed() else self.DONE

    @property
    def status(self) -> str:
        """"pending", "done" or "failed": a posted transfer leaves "pending" by its deadline."""
        return _STATUS[self.state]

    def _finish(self, exc: BaseException | None) -> None:
        """Complete it (the first completion wins: a late ACK does not undo a failure)."""
        if exc is not None:
            if not self.fence.fail(exc):
                return
            self.error = exc
        elif not self.fence.set():
            return
        if self.on_done is not None:
            self.on_done(self)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the receiver acknowledged it; raise its error (KVPeerError, KVRejected)."""
        try:
            self.fence.exception(timeout)
        except FenceTimeout:
            raise TimeoutError(f"kv xfer {self.id} to {self.peer}: not done after {timeout} s") from None
        if self.error is not None:
            raise self.error

    def __await__(self):
        yield from self.fence.__await__()


_STATUS = {Xfer.PROC: "pending", Xfer.DONE: "done", Xfer.ERR: "failed"}


class InboundRequest:
    """What a receiver knows of one request from one peer: a fence per layer, completed when
    that layer's pages have all landed, failed (never completed) when the request fails."""

    def __init__(self, peer: str, req: int, layout: Any = None,
                 deadline: float = float("inf")) -> None:
        self.peer = peer
        self.req = req
        self.deadline = deadline   # monotonic time by which it must be done, or it fails
        self.created = time.monotonic()
        self._lock = threading.Lock()
        self._fences: dict[int, HostFence] = {}
        self._runs: dict[int, list[bytes]] = {}   # per layer: the run tables that landed
        self.error: BaseException | None = None
        self.done = HostFence(f"kv request {req} from {peer}")
        self._layout = layout

    @property
    def status(self) -> str:
        """"pending", "done" (every layer landed) or "failed"."""
        if not self.done.done():
            return "pending"
        return "failed" if self.done.failed() else "done"

    def layer(self, layer: int) -> HostFence:
        """The fence of `layer` (made pending if nothing arrived for it yet); a layer the
        layout does not have is refused (UsageError), never left pending."""
        nlayers = self._layout.num_layers if self._layout is not None else 1
        if not isinstance(layer, int) or not 0 <= layer < nlayers:
            from ..errors import UsageError
            raise UsageError(f"kv request {self.req} from {self.peer}: no layer {layer!r} "
                             f"(the layout has {nlayers}: 0..{nlayers - 1})")
        return self._fence(layer)

    def _fence(self, layer: int) -> HostFence:
        with self._lock:
            f = self._fences.get(layer)
            if f is None:
                f = self._fences[layer] = HostFence(f"kv request {self.req} layer {layer} from {self.peer}")
                if self.error is not None:
                    f.fail(self.error)
            return f

    def _landed(self, layer: int, wire: bytes) -> None:
        with self._lock:
            if self.error is not None:
                return
            self._runs.setdefault(layer, []).append(wire)
        self._fence(layer).set()

    def _complete(self) -> None:
        with self._lock:
            if self.error is not None:
                return
        self.done.set()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is not None or self.done.done():
                return
            self.error = exc
            fences = list(self._fences.values())
        for f in fences:
            f.fail(exc)  # no-op for layers that already landed
        self.done.fail(exc)

    def landed_layers(self) -> list[int]:
        """Layers whose pages all landed (of a failed request too: a layer is whole or absent)."""
        with self._lock:
            return sorted(self._runs)

    def visible_blocks(self, layer: int) -> list[tuple[int, int]]:
        """(kv, block) pages of `layer` that landed (empty unless the layer's fence is done)."""
        with self._lock:
            tables = list(self._runs.get(layer, ()))
        out = []
        lay = self._layout
        for wire in tables:
            for seg, _fl, off, ln in struct.iter_unpack("<IIQQ", wire):
                for o in range(off, off + ln, lay.block_bytes):
                    ly, kv, blk = lay.locate(seg, o)
                    out.append((kv, blk))
        return out


class ConnectionOwner(Protocol):
    """The settings a connection reads of its agent (kv.agent.Agent)."""

    name: str
    stall_timeout: float
    peer_timeout: float
    stage_chunk: int


@dataclass(frozen=True)
class ConnectionHooks:
    """What a connection asks of the agent that owns it; the agent fills them in."""

    inbound: Callable[[str, int], "InboundRequest"]                # (peer, req), made on first use
    inbound_error: Callable[[str, int], BaseException | None]      # why a known request failed here
    notified: Callable[[str, bytes], None]                         # a notification arrived
    segment_table: Callable[[], tuple[Any, int]]                   # the C table of our segments, count
    segment_devices: Callable[[], Sequence[int] | None]            # per segment: -1 host, else CUDA
                                                                   # ordinal; None when all are host
    failed: Callable[["Connection", BaseException], None]          # this connection went down
    run_cap: Callable[[], tuple[int, str]]                         # most runs in one message's
                                                                   # table, and the limit's name


class Connection(Resource):
    """One TCP connection to a peer. Outbound ones send transfers (a sender thread) and read
    ACKs; inbound ones read transfers into the agent's segments and answer them."""

    def __init__(self, agent: ConnectionOwner, sock: socket.socket, peer: str, outbound: bool,
                 incarnation: int = 0, *, hooks: ConnectionHooks) -> None:
        self.agent = agent
        self.hooks = hooks
        self.sock = sock
        sock.setblocking(False)
        self.fd = sock.fileno()
        self.peer = peer
        self.incarnation = incarnation
        self.outbound = outbound
        self.down = False
        self._lock = threading.Lock()
        self._tx = threading.Lock()        # one sender of bytes at a time (state: _lock)
        self._queue: "queue.Queue[Xfer | None]" = queue.Queue()
        self._pending: dict[int, tuple[Xfer, float]] = {}   # sent, awaiting ACK: deadline
        self._active: dict[int, set[int]] = {}              # inbound: xfer -> requests
        self._last_rx = time.monotonic()
        self._last_tx = time.monotonic()
        self._skip: set[int] = set()                        # inbound: refused transfers
        self.error: BaseException | None = None
        self._tx_stage: dict[int, Any] = {}   # CUDA ordinal -> pinned staging, per direction
        self._rx_stage: dict[int, Any] = {}
        self.rdma: Any = None          # a kv.rdma.Link: DATA payloads go over RDMA
        self._reader = threading.Thread(target=self._read_loop, daemon=True,
                                        name=f"kv-rx-{peer}")
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"kv-tx-{peer}") if outbound else None

    def start(self) -> None:
        self._reader.start()
        if self._sender is not None:
            self._sender.start()

    @property
    def timeout_ms(self) -> int:
        return int(self.agent.stall_timeout * 1000)

    def heartbeat(self, quiet: float) -> None:
        """Send HB when nothing was sent for `quiet` seconds. Never waits: a connection whose
        lock is held is sending (the peer hears that), and a full socket buffer is the
        peer not reading (its own deadline), so a heartbeat is skipped rather than queued."""
        if self.down or time.monotonic() - self._last_tx < quiet:
            return
        if not self._tx.acquire(blocking=False):
            return
        try:
            if self.down:
                return
            hdr = HDR.pack(MAGIC, HB, 0, 0, 0, 0, 0, 0)
            try:
                n = self.sock.send(hdr, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except OSError:
                return          # the reader sees the connection end
            if n < len(hdr):    # rare: keep the stream in step, within the send deadline
                rc = hot().lib.kv_send(self.fd, hdr[n:], len(hdr) - n, hot().ffi.NULL, 0,
                                       hot().ffi.NULL, 0, self.timeout_ms)
                if rc < 0:
                    return
            self._last_tx = time.monotonic()
        finally:
            self._tx.release()

    # ------------------------------------------------------------------ sending
    def _send_raw(self, type_: int, flags: int, xfer: int, req: int, layer: int,
                  body: bytes = b"", wire: Any = None, nruns: int = 0, iov: Any = None,
                  niov: int = 0, nbytes: int = 0) -> None:
        h = hot()
        n = nruns if type_ in (DATA, READ) else len(body)
        hdr = HDR.pack(MAGIC, type_, flags, xfer, req, layer, n, nbytes)
        if type_ not in (DATA, READ):
            hdr += body
        with self._tx:
            if self.down:
                raise self._closed_error()
            rc = h.lib.kv_send(self.fd, hdr, len(hdr),
                               wire if wire is not None else h.ffi.NULL, nruns,
                               iov if iov is not None else h.ffi.NULL, niov, self.timeout_ms)
            self._last_tx = time.monotonic()
        if rc < 0:
            if rc == -errno.ETIMEDOUT:
                raise KVPeerError(self.peer, "stalled",
                                  f"no send progress for {self.agent.stall_timeout} s")
            raise KVPeerError(self.peer, "closed", f"send failed: {_c_err(rc)}")

    def submit(self, xfer: Xfer) -> None:
        if self.down:
            xfer._finish(self._closed_error())
            return
        self._queue.put(xfer)

    def _send_loop(self) -> None:
        while True:
            xfer = self._queue.get()
            if xfer is None or self.down:
                if xfer is not None:
                    xfer._finish(self._closed_error())
                break
            if xfer.fence.done():   # failed while queued (its deadline): never started
                continue
            xfer.started = True
            try:
                msgs = xfer.messages
                with self._lock:
                    self._pending[xfer.id] = (xfer, float("inf"))
                if any(m.dev >= 0 for m in msgs):
                    self._send_staged(xfer, msgs)
                    continue
                placed: list[tuple[int, Message, list]] = []   # RDMA-posted, not announced
                for i, m in enumerate(msgs):
                    flags = (F_LAST if i == len(msgs) - 1 else 0) | (F_REQ_END if m.last else 0)
                    if m.type == DATA and self.rdma is not None:
                        fences = (self.rdma.post(m.iov, m.wire, m.nruns, self.agent.stall_timeout)
                                  if m.nruns else [])
                        placed.append((flags, m, fences))
                        self._announce(xfer, placed, wait=False)
                        continue
                    self._announce(xfer, placed, wait=True)   # its data lands before this
                    if m.type == DATA:
                        self._send_raw(DATA, flags, xfer.id, m.req, m.layer, wire=m.wire,
                                       nruns=m.nruns, iov=m.iov, niov=m.nruns, nbytes=m.nbytes)
                    elif m.type == READ and self.rdma is not None and m.dest is not None:
                        # the peer WRITEs the runs into m.dest (our segments) over RDMA
                        self._send_raw(READ, flags | F_PLACED, xfer.id, m.req, m.layer,
                                       wire=m.wire, nruns=m.nruns, iov=m.dest[1], niov=1,
                                       nbytes=m.nbytes)
                    elif m.type == READ:
                        self._send_raw(READ, flags, xfer.id, m.req, m.layer, wire=m.wire,
                                       nruns=m.nruns, nbytes=m.nbytes)
                    else:
                        self._send_raw(m.type, flags, xfer.id, m.req, m.layer, body=m.body)
                self._announce(xfer, placed, wait=True)
                # The ACK is due within stall_timeout of the last byte; a READ answered over
                # RDMA is WRITTEN by the peer first (as long as the bytes take: its WRITEs have
                # their own progress deadline there, its heartbeats keep coming here, and the
                # transfer's deadline still holds)
                due = (float("inf") if self.rdma is not None and any(
                    m.type == READ and m.dest is not None for m in msgs)
                    else time.monotonic() + self.agent.stall_timeout)
                with self._lock:
                    if xfer.id in self._pending:
                        self._pending[xfer.id] = (xfer, due)
            except KVPeerError as exc:
                self._fail_connection(exc)
                break
            except Exception as exc:  # a bug or a bad message: fail this transfer only
                with self._lock:
                    self._pending.pop(xfer.id, None)
                xfer._finish(exc if isinstance(exc, KVError)
                             else KVError(f"kv xfer {xfer.id} to {self.peer}: {exc}"))
        for st in self._tx_stage.values():
            st.close()
        self._tx_stage = {}
        # Drain what is still queued: it will never be sent on this connection.
        while True:
            try:
                x = self._queue.get_nowait()
            except queue.Empty:
                break
            if x is not None:
                x._finish(self._closed_error())

    def _announce(self, xfer: Xfer, placed: list, wait: bool) -> None:
        """Send the F_PLACED header and run table of each RDMA-posted message whose WRITEs
        completed, in order; with `wait`, wait for all of them (before a message that must
        follow their data, and at the end of the transfer)."""
        while placed:
            flags, m, fences = placed[0]
            if not wait and not all(f.done() for f in fences):
                return
            self.rdma.wait(fences, self.agent.stall_timeout)
            self._send_raw(DATA, flags | F_PLACED, xfer.id, m.req, m.layer, wire=m.wire,
                           nruns=m.nruns, nbytes=m.nbytes)
            placed.pop(0)

    def _stage(self, direction: str, dev: int) -> Any:
        """The pinned staging buffer of this direction for CUDA device `dev` (made once)."""
        table = self._tx_stage if direction == "send to" else self._rx_stage
        st = table.get(dev)
        if st is None:
            from . import cuda
            st = table[dev] = cuda.Staging(cuda.driver(), dev,
                                           f"kv {direction} {self.peer!r} (cuda:{dev})",
                                           self.agent.stage_chunk)
        return st

    def _send_staged(self, xfer: Xfer, msgs: list[Message]) -> None:
        """Send `xfer`, each DATA message from CUDA memory staged chunk by chunk in C
        (kv_cuda_send); host DATA, READ and control messages as usual. A CUDA error before a
        message's first byte fails this transfer only (the receiver is told with FAIL); one
        in the middle of a message leaves the byte stream out of step, so it drops this
        connection (its other transfers fail with it; the next one reconnects)."""
        h = hot()
        for i, m in enumerate(msgs):
            flags = (F_LAST if i == len(msgs) - 1 else 0) | (F_REQ_END if m.last else 0)
            if m.type == READ:
                self._send_raw(READ, flags, xfer.id, m.req, m.layer, wire=m.wire,
                               nruns=m.nruns, nbytes=m.nbytes)
                continue
            if m.type != DATA:
                self._send_raw(m.type, flags, xfer.id, m.req, m.layer, body=m.body)
                continue
            if m.dev < 0:
                self._send_raw(DATA, flags, xfer.id, m.req, m.layer, wire=m.wire,
                               nruns=m.nruns, iov=m.iov, niov=m.nruns, nbytes=m.nbytes)
                continue
            st = self._stage("send to", m.dev)
            hdr = HDR.pack(MAGIC, DATA, flags, xfer.id, m.req, m.layer, m.nruns, m.nbytes)
            with self._tx:
                if self.down:
                    raise self._closed_error()
                rc = h.lib.kv_cuda_send(st.c, self.fd, hdr, len(hdr), m.wire, m.nruns, m.iov,
                                        m.nruns, st.stage, st.chunk, st.streams, self.timeout_ms,
                                        st.cuerr, st.sent)
                self._last_tx = time.monotonic()
            if rc == -errno.EIO:
                exc = st.error(f"device-to-host copy of request {m.req} layer {m.layer}")
                if st.sent[0]:
                    with self._lock:   # this transfer fails with the CUDA error, not the drop
                        self._pending.pop(xfer.id, None)
                    self._fail_connection(KVPeerError(self.peer, "reset", f"{exc} in the middle "
                                                      "of a message; connection dropped"))
                    raise exc
                if i:
                    self._send_raw(FAIL, 0, xfer.id, 0, 0, body=str(exc).encode()[:MAX_CTRL])
                raise exc
            if rc < 0:
                if rc == -errno.ETIMEDOUT:
                    raise KVPeerError(self.peer, "stalled",
                                      f"no send progress for {self.agent.stall_timeout} s")
                raise KVPeerError(self.peer, "closed", f"send failed: {_c_err(rc)}")
        with self._lock:
            if xfer.id in self._pending:
                self._pending[xfer.id] = (xfer, time.monotonic() + self.agent.stall_timeout)

    # ------------------------------------------------------------------ receiving
    def _recv(self, n: int) -> bytes:
        h = hot()
        buf = bytearray(n)
        if n:
            rc = h.lib.kv_recv_exact(self.fd, h.ffi.from_buffer(buf), n, self.timeout_ms)
            self._check_rx(rc)
        return bytes(buf)

    def _recv_table(self, what: str, nruns: int, nbytes: int) -> bytes:
        """A message's table of `nruns` runs, bounded before anything is allocated (every run
        holds at least one of the message's `nbytes`, and no more runs than the agent's
        limit) and read in chunks, so memory grows only with the bytes that came."""
        cap, limit = self.hooks.run_cap()
        if nruns > nbytes:
            raise KVPeerError(self.peer, "reset", f"{what} with {nruns} runs for {nbytes} bytes "
                              "(a run holds at least one byte)")
        if nruns > cap:
            raise KVPeerError(self.peer, "reset", f"{what} with {nruns} runs: more than {cap} "
                              f"({limit})")
        n = nruns * WIRE_RUN
        if n <= TABLE_CHUNK:
            return self._recv(n)
        parts = []
        while n:
            parts.append(self._recv(min(n, TABLE_CHUNK)))
            n -= len(parts[-1])
        return b"".join(parts)

    def _check_rx(self, rc: int) -> None:
        if rc >= 0:
            self._last_rx = time.monotonic()
            return
        if rc == -errno.ETIMEDOUT:
            raise KVPeerError(self.peer, "stalled",
                              f"no bytes for {self.agent.stall_timeout} s in the middle of a message")
        if rc == -errno.ENOTCONN:
            raise KVPeerError(self.peer, "closed", "the connection was closed")
        raise KVPeerError(self.peer, "reset", f"receive failed: {_c_err(rc)}")

    def _wait_readable(self) -> bool:
        """Wait for the next header; raise KVPeerError when a deadline passes first, or
        when the peer sent nothing, not even a heartbeat, for its peer timeout."""
        tick = time.monotonic()
        while not self.down:
            r, _, _ = select.select([self.fd], [], [], 0.1)
            if r:
                return True
            now = time.monotonic()
            if now - tick > 1.0:
                # This process was frozen (stopped, starved): the silence was ours.
                self._last_rx = max(self._last_rx, now)
            tick = now
            silent = now - self._last_rx
            if silent > self.agent.peer_timeout:
                raise KVPeerError(self.peer, "silent",
                                  f"no message or heartbeat for {silent:.1f} s (peer timeout "
                                  f"{self.agent.peer_timeout} s): dead, frozen or partitioned")
            with self._lock:
                late = [x for x, dl in self._pending.values() if dl < now]
                busy = bool(self._active)
            if late:
                raise KVPeerError(self.peer, "stalled",
                                  f"no acknowledgement of transfer {late[0].id} within "
                                  f"{self.agent.stall_timeout} s of its last byte")
            if busy and now - self._last_rx > self.agent.stall_timeout:
                raise KVPeerError(self.peer, "stalled",
                                  f"a transfer started and nothing came for {self.agent.stall_timeout} s")
        return False

    def _read_loop(self) -> None:
        try:
            while self._wait_readable():
                raw = self._recv(HDR.size)
                magic, type_, flags, xid, req, layer, n, nbytes = HDR.unpack(raw)
                if magic != MAGIC:
                    raise KVPeerError(self.peer, "reset", f"bad magic {magic:#x}: not a p2phub KV stream")
                if type_ == DATA and flags & F_READ_RESP:
                    self._on_read_resp(flags, xid, layer, n, nbytes)
                elif type_ == DATA and flags & F_PLACED:
                    self._on_placed(flags, xid, req, layer, n, nbytes)
                elif type_ == DATA:
                    self._on_data(flags, xid, req, layer, n, nbytes)
                elif type_ == READ:
                    self._on_read(flags, xid, req, layer, n, nbytes)
                elif type_ in (NOTIF, ERR, FAIL, HELLO):
                    if n > MAX_CTRL:
                        raise KVPeerError(self.peer, "reset", f"control message of {n} bytes")
                    body = self._recv(n)
                    if type_ == NOTIF and xid in self._skip:
                        if flags & F_LAST:
                            self._skip.discard(xid)
                    elif type_ == NOTIF:
                        self._track(xid, req)
                        if flags & F_REQ_END:  # complete first: a notified request is done
                            self.hooks.inbound(self.peer, req)._complete()
                        self.hooks.notified(self.peer, body)
                        if flags & F_LAST:
                            self._finish_inbound(xid)
                    elif type_ == ERR:
                        self._acked(xid, KVRejected(self.peer, body.decode(errors="replace")))
                    elif type_ == FAIL:
                        self._fail_inbound(xid, KVPeerError(self.peer, "aborted",
                                                            body.decode(errors="replace")))
                elif type_ == ACK:
                    self._acked(xid, None)
                elif type_ == HB:
                    if n or nbytes:
                        raise KVPeerError(self.peer, "reset", "a heartbeat with a body")
                else:
                    raise KVPeerError(self.peer, "reset", f"unknown message type {type_}")
        except KVPeerError as exc:
            self._fail_connection(exc)
        except Exception as exc:  # never let the thread die silently
            self._fail_connection(KVPeerError(self.peer, "reset", f"receiver error: {exc!r}"))
        finally:
            for st in self._rx_stage.values():
                st.close()
            self._rx_stage = {}

    def _track(self, xid: int, req: int) -> None:
        with self._lock:
            self._active.setdefault(xid, set()).add(req)

    def _data_runs(self, flags: int, xid: int, req: int, nruns: int, nbytes: int) -> bytes | None:
        """A DATA message's run table; None when the message belongs to a refused transfer
        (its payload is then dropped here)."""
        wire = self._recv_table("DATA", nruns, nbytes)
        if xid in self._skip:  # the rest of a refused transfer: drop it
            self._check_rx(hot().lib.kv_discard(self.fd, nbytes, self.timeout_ms))
            if flags & F_LAST:
                self._skip.discard(xid)
            return None
        self._track(xid, req)
        return wire

    def _land(self, flags: int, xid: int, req: int, layer: int, wire: bytes) -> None:
        inb = self.hooks.inbound(self.peer, req)
        inb._landed(layer, wire)
        metrics.kv_landed(self.agent.name, wire)
        if flags & F_REQ_END:
            inb._complete()
        if flags & F_LAST:
            self._finish_inbound(xid)

    def _refuse(self, flags: int, xid: int, req: int, layer: int, exc: BaseException) -> None:
        """Fail the transfer here, tell the sender (ERR), drop the rest of its messages."""
        self._fail_inbound(xid, exc)
        self._send_ctrl(ERR, xid, req, layer, str(exc).encode())
        if not flags & F_LAST:
            self._skip.add(xid)

    def _reject(self, flags: int, xid: int, req: int, layer: int, nbytes: int, why: str) -> None:
        """Refuse a message whose payload is still unread: drop it, then refuse."""
        self._check_rx(hot().lib.kv_discard(self.fd, nbytes, self.timeout_ms))
        metrics.kv_refused(self.agent.name)
        self._refuse(flags, xid, req, layer, KVRejected(self.peer, f"request {req} layer {layer}: {why}"))

    def _bad_run(self, wire: bytes, i: int, nsegs: int) -> str:
        seg, _f, off, ln = struct.unpack_from("<IIQQ", wire, i * WIRE_RUN)
        return (f"run {i} (segment {seg}, offset {off}, {ln} bytes) is outside the "
                f"{nsegs} registered segment(s)")

    def _runs_iov(self, wire: bytes, nruns: int) -> tuple[Any, int, int, int, int]:
        """`wire`'s runs as addresses in our segments: (iov, rc, index of the first bad
        run, total bytes, segment count); rc < 0 when a run is outside every segment."""
        h = hot()
        segs, nsegs = self.hooks.segment_table()
        iov = h.ffi.new("struct kv_iov[]", max(1, nruns))
        bad, total = h.ffi.new("size_t *"), h.ffi.new("uint64_t *")
        wp = h.ffi.from_buffer("struct kv_wire[]", wire) if nruns else h.ffi.NULL
        rc = h.lib.kv_runs_to_iov(segs, nsegs, wp, nruns, iov, bad, total)
        return iov, rc, bad[0], total[0], nsegs

    def _runs_device(self, wire: bytes, nruns: int) -> int | None:
        """The device of the segments `wire`'s runs land in (-1 host); None when they are
        on more than one device (a sender plans one message per device pair)."""
        devs = self.hooks.segment_devices()
        if devs is None or not nruns:
            return -1
        found = {devs[seg] if seg < len(devs) else -1
                 for seg, _f, _o, _n in struct.iter_unpack("<IIQQ", wire)}
        return found.pop() if len(found) == 1 else None

    def _on_data(self, flags: int, xid: int, req: int, layer: int, nruns: int, nbytes: int) -> None:
        wire = self._data_runs(flags, xid, req, nruns, nbytes)
        if wire is None:
            return
        dev = self._runs_device(wire, nruns)
        if dev is None:
            return self._reject(flags, xid, req, layer, nbytes,
                                "its runs land in memory of more than one device")
        if dev >= 0:
            return self._on_data_staged(flags, xid, req, layer, nruns, nbytes, wire, dev)
        h = hot()
        segs, nsegs = self.hooks.segment_table()
        bad = h.ffi.new("size_t *")
        wp = h.ffi.from_buffer("struct kv_wire[]", wire) if nruns else h.ffi.NULL
        rc = h.lib.kv_recv_runs(self.fd, segs, nsegs, wp, nruns, nbytes,
                                self.timeout_ms, bad)
        if rc == -errno.EINVAL:
            why = (self._bad_run(wire, bad[0], nsegs) if bad[0] < nruns
                   else f"runs add up to other than the {nbytes} payload bytes")
            return self._reject(flags, xid, req, layer, nbytes, why)
        self._check_rx(rc)
        self._land(flags, xid, req, layer, wire)

    def _on_placed(self, flags: int, xid: int, req: int, layer: int, nruns: int,
                   nbytes: int) -> None:
        """DATA whose bytes the sender already WROTE over RDMA: check the runs, land."""
        if self.rdma is None:
            raise KVPeerError(self.peer, "reset", "RDMA-placed DATA on a connection without RDMA")
        wire = self._recv_table("DATA", nruns, nbytes)
        if xid in self._skip:
            if flags & F_LAST:
                self._skip.discard(xid)
            return
        self._track(xid, req)
        _iov, rc, bad, total, nsegs = self._runs_iov(wire, nruns)
        if rc < 0 or total != nbytes:
            why = (self._bad_run(wire, bad, nsegs) if rc < 0
                   else f"runs add up to {total} bytes, not {nbytes}")
            return self._refuse(flags, xid, req, layer,
                                KVRejected(self.peer, f"request {req} layer {layer}: {why}"))
        self._land(flags, xid, req, layer, wire)

    def _on_data_staged(self, flags: int, xid: int, req: int, layer: int, nruns: int,
                        nbytes: int, wire: bytes, dev: int) -> None:
        """DATA into CUDA memory of device `dev`: check the runs, read the payload chunk by
        chunk into the staging halves, each chunk's host-to-device copies queued while the
        next is read; the layer lands once both streams are synchronized."""
        h = hot()
        iov, rc, bad, total, nsegs = self._runs_iov(wire, nruns)
        if rc < 0:
            return self._reject(flags, xid, req, layer, nbytes, self._bad_run(wire, bad, nsegs))
        if total != nbytes:
            return self._reject(flags, xid, req, layer, nbytes,
                                f"runs add up to other than the {nbytes} payload bytes")
        st = self._stage("receive from", dev)
        rc = h.lib.kv_cuda_recv(st.c, self.fd, iov, nruns, nbytes, st.stage, st.chunk,
                                st.streams, self.timeout_ms, st.cuerr)
        if rc == -errno.EIO:   # the payload was read: the stream is in step
            return self._refuse(flags, xid, req, layer,
                                st.error(f"host-to-device copy of request {req} layer {layer}"))
        self._check_rx(rc)
        self._land(flags, xid, req, layer, wire)   # only now: its bytes are on the GPU

    def _on_read(self, flags: int, xid: int, req: int, layer: int, nruns: int, nbytes: int) -> None:
        """Serve a READ: check the runs against our segments, send their bytes back (over
        RDMA into the reader's segments when it named them and we can, else on the socket)."""
        wire = self._recv_table("READ", nruns, nbytes)
        dest = self._recv_table("READ", nruns, nbytes) if flags & F_PLACED else None
        dev = self._runs_device(wire, nruns)
        if dev is None:
            self._send_ctrl(ERR, xid, req, layer, f"READ of request {req}: its runs are in "
                            "memory of more than one device".encode())
            if not flags & F_LAST:
                self._skip.add(xid)
            return
        iov, rc, bad, total, nsegs = self._runs_iov(wire, nruns)
        if rc < 0 or total != nbytes:
            why = (f"run {bad} is outside the {nsegs} registered segment(s)" if rc < 0
                   else f"runs add up to {total} bytes, not {nbytes}")
            self._send_ctrl(ERR, xid, req, layer, f"READ of request {req}: {why}".encode())
            if not flags & F_LAST:
                self._skip.add(xid)
            return
        if (dest is not None and dev < 0 and self.rdma is not None and nruns
                and self.rdma.can_place(dest, nruns)):
            self.rdma.write(iov, hot().ffi.from_buffer("struct kv_wire[]", dest), nruns,
                            self.agent.stall_timeout)
            self._send_raw(DATA, F_READ_RESP | F_PLACED, xid, req, layer, nbytes=nbytes)
        elif dev >= 0:
            self._send_read_resp_staged(xid, req, layer, iov, nruns, nbytes, dev)
        else:
            self._send_raw(DATA, F_READ_RESP, xid, req, layer, iov=iov, niov=nruns, nbytes=nbytes)
        if flags & F_LAST:
            self._send_ctrl(ACK, xid, 0, 0)
        else:
            self._track(xid, req)

    def _send_read_resp_staged(self, xid: int, req: int, layer: int, iov: Any, nruns: int,
                               nbytes: int, dev: int) -> None:
        """Answer a READ from CUDA memory: the runs' bytes staged chunk by chunk (no run
        table). A CUDA error before the first byte is an ERR; one later drops the connection."""
        h = hot()
        st = self._stage("send to", dev)
        hdr = HDR.pack(MAGIC, DATA, F_READ_RESP, xid, req, layer, 0, nbytes)
        with self._tx:
            if self.down:
                raise self._closed_error()
            rc = h.lib.kv_cuda_send(st.c, self.fd, hdr, len(hdr), h.ffi.NULL, 0, iov, nruns,
                                    st.stage, st.chunk, st.streams, self.timeout_ms,
                                    st.cuerr, st.sent)
            self._last_tx = time.monotonic()
        if rc == -errno.EIO:
            exc = st.error(f"device-to-host copy answering READ of request {req}")
            if st.sent[0]:
                raise KVPeerError(self.peer, "reset", f"{exc} in the middle of a message")
            self._send_ctrl(ERR, xid, req, layer, str(exc).encode()[:MAX_CTRL])
            return
        if rc < 0:
            if rc == -errno.ETIMEDOUT:
                raise KVPeerError(self.peer, "stalled",
                                  f"no send progress for {self.agent.stall_timeout} s")
            raise KVPeerError(self.peer, "closed", f"send failed: {_c_err(rc)}")

    def _on_read_resp(self, flags: int, xid: int, index: int, nruns: int, nbytes: int) -> None:
        """The bytes of our READ message `index` of transfer `xid`: into its planned ranges
        (with F_PLACED the peer already WROTE them there over RDMA: nothing follows)."""
        h = hot()
        if nruns:
            raise KVPeerError(self.peer, "reset", "a READ answer with a run table")
        if flags & F_PLACED:
            if self.rdma is None:
                raise KVPeerError(self.peer, "reset", "an RDMA-placed READ answer without RDMA")
            return
        with self._lock:
            ent = self._pending.get(xid)
        msgs = ent[0].messages if ent is not None else []
        m = msgs[index] if index < len(msgs) else None
        if m is None or m.type != READ or m.nbytes != nbytes:
            # not ours (any more): drop the bytes, keep the stream in step
            self._check_rx(h.lib.kv_discard(self.fd, nbytes, self.timeout_ms))
            return
        if m.dev < 0:
            self._check_rx(h.lib.kv_recv_iov(self.fd, m.iov, m.nruns, self.timeout_ms))
            return
        st = self._stage("receive from", m.dev)
        rc = h.lib.kv_cuda_recv(st.c, self.fd, m.iov, m.nruns, nbytes, st.stage, st.chunk,
                                st.streams, self.timeout_ms, st.cuerr)
        if rc == -errno.EIO:   # the payload was read: the stream is in step
            self._acked(xid, st.error(f"host-to-device copy of READ transfer {xid}"))
            return
        self._check_rx(rc)

    def _send_ctrl(self, type_: int, xid: int, req: int, layer: int, body: bytes = b"") -> None:
        self._send_raw(type_, 0, xid, req, layer, body=body)

    def _finish_inbound(self, xid: int) -> None:
        """The transfer's last message arrived: ACK it, or ERR when one of its requests
        failed here meanwhile (its deadline, a release), so both sides report the failure."""
        with self._lock:
            reqs = self._active.pop(xid, set())
        for r in reqs:
            err = self.hooks.inbound_error(self.peer, r)
            if err is not None:
                self._send_ctrl(ERR, xid, r, 0, f"request {r}: {err}".encode()[:MAX_CTRL])
                return
        self._send_ctrl(ACK, xid, 0, 0)
        metrics.kv_received(self.agent.name)

    def _fail_inbound(self, xid: int, exc: BaseException) -> None:
        with self._lock:
            reqs = self._active.pop(xid, set())
        metrics.kv_refused(self.agent.name)
        for r in reqs:
            self.hooks.inbound(self.peer, r)._fail(exc)

    def _acked(self, xid: int, exc: BaseException | None) -> None:
        with self._lock:
            ent = self._pending.pop(xid, None)
        if ent is not None:
            ent[0]._finish(exc)

    # ------------------------------------------------------------------ failure, close
    def _closed_error(self) -> BaseException:
        return self.error or KVPeerError(self.peer, "closed", "the connection is closed")

    def _fail_connection(self, exc: BaseException) -> None:
        with self._lock:
            if self.down:
                return
            self.down = True
            self.error = exc
            pending = [x for x, _ in self._pending.values()]
            self._pending.clear()
            active = dict(self._active)
            self._active.clear()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self.rdma is not None:   # its QPs go: a WRITE still waited for fails now
            self.rdma.close()
        for x in pending:
            x._finish(exc)
        for _xid, reqs in active.items():
            for r in reqs:
                self.hooks.inbound(self.peer, r)._fail(exc)
        self._queue.put(None)
        self.hooks.failed(self, exc)

    def _fail_transfer(self, xfer: Xfer, exc: BaseException) -> None:
        """Fail `xfer` (its deadline passed); if its bytes are on this connection, drop the
        connection: the receiver fails the request, the next transfer reconnects."""
        with self._lock:
            on_wire = self._pending.pop(xfer.id, None) is not None
        xfer._finish(exc)
        if on_wire:
            self._fail_connection(KVPeerError(self.peer, "reset", f"dropped: {exc}"))

    def alive(self) -> bool:
        """Whether one of its threads still runs (a dropped connection's end their work:
        Agent.close waits for them, so staging buffers are freed when it returns)."""
        return any(t is not None and t.is_alive() for t in (self._reader, self._sender))

    def _close(self) -> None:
        self._fail_connection(KVPeerError(self.peer, "closed", "closed locally"))
        for t in (self._reader, self._sender):
            if t is not None and t.is_alive() and t is not threading.current_thread():
                t.join(timeout=2)
        try:
            self.sock.close()
        except OSError:
            pass


def hello_body(name: str, incarnation: int, metadata: bytes | None = None) -> bytes:
    d: dict = {"name": name, "incarnation": incarnation}
    if metadata is not None:
        d["metadata"] = metadata.decode()
    return json.dumps(d).encode()


def send_hello(sock: socket.socket, name: str, incarnation: int,
               metadata: bytes | None = None, extra: dict | None = None) -> None:
    body = hello_body(name, incarnation, metadata)
    if extra:
        body = json.dumps({**json.loads(body), **extra}).encode()
    sock.sendall(HDR.pack(MAGIC, HELLO, 0, 0, 0, 0, len(body), 0) + body)


def recv_hello(sock: socket.socket, timeout: float) -> dict:
    sock.settimeout(timeout)
    raw = _recv_all(sock, HDR.size)
    magic, type_, _f, _x, _r, _l, n, _nb = HDR.unpack(raw)
    if magic == MAGIC and type_ == ERR and n <= MAX_CTRL:   # a proven peer says why not
        raise KVError(f"handshake refused: {_recv_all(sock, n).decode(errors='replace')}")
    if magic != MAGIC or type_ != HELLO or n > MAX_CTRL:
        raise KVError(f"handshake: not a p2phub KV peer (magic {magic:#x}, type {type_})")
    try:
        return json.loads(_recv_all(sock, n))
    except json.JSONDecodeError as exc:
        raise KVError(f"handshake: bad HELLO: {exc}") from None


def _recv_all(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise KVError("handshake: the peer closed the connection")
        buf += chunk
    return bytes(buf)
