"""A small RC queue pair over pyverbs whose work requests are ordered accesses and fences.

    qp = QueuePair(pd)                         # pd: p2phub.rdma.ProtectionDomain
    qp.connect(peer_info)                      # QpInfo exchanged out of band (qp.info())
    f = qp.write(mr, 0, remote, 0, n)          # RDMA WRITE of mr[0:n] -> remote[0:n]
    f.wait(5)                                  # a Fence: wait/done/await/on_stream

Every operation declares its access on the local registration before anything is posted
(p2phub.ordering): WRITE, WRITE_WITH_IMM and SEND read the local range (consumer), READ
and RECV fill it (producer). In the default mode the post waits for conflicting earlier
accesses (an NVMe read still filling the bytes to send); in strict mode it raises
OrderingError and posts nothing. The completion is the fence; it releases the range.

Remote notifications: the receiver calls ``expect_write(mr, off, n, imm)`` (a producer
access on its range, plus a posted RECV); the sender's
``write_with_imm(..., imm)`` lands the bytes and consumes that RECV; the receiver's fence
completes once the bytes are visible to a consumer there (after
cuFlushGPUDirectRDMAWrites where the GPU needs it).

RDMA write visibility has three steps, reported by ``fence.state``: POSTED (the NIC has
the request), REMOTE_COMPLETE (the sender's completion: the responder acknowledged the
bytes), VISIBLE (the receiver's notification fence, after any flush its GPU needs).

Do not mix SENDs and notified WRITEs in flight on one QP: RC consumes RECVs in order,
and a SEND would land in a notification's RECV (the lent range) and complete nothing.
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Callable

from .._resource import Resource
from ..errors import UsageError
from ..ordering import AccessKind, Fence
from ..ordering.errors import FenceError
from .mr import MemoryRegion, ProtectionDomain

__all__ = ["QueuePair", "QpInfo", "RemoteBuffer", "RdmaFence", "NotifyFence", "RdmaError",
           "WriteState", "remote_buffer"]

_WC_STATUS = {
    0: "SUCCESS", 1: "LOC_LEN_ERR", 2: "LOC_QP_OP_ERR", 3: "LOC_EEC_OP_ERR", 4: "LOC_PROT_ERR",
    5: "WR_FLUSH_ERR", 6: "MW_BIND_ERR", 7: "BAD_RESP_ERR", 8: "LOC_ACCESS_ERR",
    9: "REM_INV_REQ_ERR", 10: "REM_ACCESS_ERR", 11: "REM_OP_ERR", 12: "RETRY_EXC_ERR",
    13: "RNR_RETRY_EXC_ERR", 14: "LOC_RDD_VIOL_ERR", 15: "REM_INV_RD_REQ_ERR",
    16: "REM_ABORT_ERR", 17: "INV_EECN_ERR", 18: "INV_EEC_STATE_ERR", 19: "FATAL_ERR",
    20: "RESP_TIMEOUT_ERR", 21: "GENERAL_ERR",
}


class RdmaError(FenceError):
    """A work request completed in error; ``status`` is the ibv_wc_status."""

    def __init__(self, what: str, status: int, vendor_err: int = 0) -> None:
        name = _WC_STATUS.get(status, str(status))
        super().__init__(f"{what}: completion status IBV_WC_{name} ({status}), "
                         f"vendor error {vendor_err:#x}")
        self.status = status
        self.vendor_err = vendor_err


class WriteState(enum.IntEnum):
    POSTED = 1            # the NIC has the request
    REMOTE_COMPLETE = 2   # the sender's completion arrived (the responder has the bytes)
    VISIBLE = 3           # the receiver's consumers can see the bytes (flushed if needed)


@dataclass(frozen=True)
class QpInfo:
    """What a peer needs to connect to a queue pair (exchange it out of band)."""

    qp_num: int
    gid: str          # the port GID, as pyverbs prints it (fe80::..., ::ffff:10.0.0.1)
    port: int = 1
    gid_index: int = 1
    psn: int = 0


@dataclass(frozen=True)
class RemoteBuffer:
    """A peer's memory region as seen from here: address, rkey, length."""

    addr: int
    rkey: int
    length: int

    def check(self, offset: int, length: int) -> int:
        if offset < 0 or length <= 0 or offset + length > self.length:
            raise UsageError(f"remote range [{offset:#x}, +{length:#x}) is outside the "
                             f"peer's {self.length} bytes")
        return self.addr + offset


def remote_buffer(mr: MemoryRegion) -> RemoteBuffer:
    """What a peer needs to address `mr` (send it to them)."""
    return RemoteBuffer(mr.addr, mr.rkey, mr.length)


class RdmaFence(Fence):
    """One work request's completion. ``state`` follows WriteState for writes."""

    needs_driving = True

    def __init__(self, qp: "QueuePair", what: str) -> None:
        super().__init__(what)
        self.qp = qp
        self.state = 0
        self.byte_len = 0
        self.imm: int | None = None

    def _poll(self) -> None:
        self.qp.poll()


class NotifyFence(RdmaFence):
    """The receiver's side of a notified WRITE: completes, VISIBLE, when a
    WRITE_WITH_IMM carrying ``imm`` has landed and been made visible."""


class QueuePair(Resource):
    """An RC queue pair on a ProtectionDomain, with its own completion queue."""

    def __init__(self, pd: ProtectionDomain, *, depth: int = 256, port: int = 1,
                 gid_index: int = 1, max_inline: int = 0) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPCap, QPInitAttr

        if not isinstance(pd, ProtectionDomain):
            raise UsageError(f"pd must be a p2phub.rdma.ProtectionDomain, not {type(pd).__name__}")
        self.pd = pd
        self.port = port
        self.gid_index = gid_index
        self.depth = depth
        self._e = e
        self.cq = CQ(pd.ctx, 2 * depth)
        cap = QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1,
                    max_inline_data=max_inline)
        self.qp = QP(pd.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.gid = pd.ctx.query_gid(port, gid_index)
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._pending: dict[int, RdmaFence] = {}            # wr_id -> fence
        self._recv_wqes: dict[int, tuple[str, Any]] = {}    # wr_id -> ("notify", None) | ("recv", args)
        self._expect: dict[int, collections.deque[NotifyFence]] = {}
        self.unexpected: collections.deque[tuple[int, int]] = collections.deque(maxlen=1024)
        self.on_notify: Callable[[int, int], None] | None = None  # (imm, byte_len), unexpected
        self._closed = False
        self._dead: str = ""

    # ------------------------------------------------------------------ connection
    def info(self) -> QpInfo:
        return QpInfo(self.qp.qp_num, str(self.gid), self.port, self.gid_index, 0)

    def connect(self, peer: QpInfo, *, mtu: int | None = None, timeout: int = 14,
                retry_cnt: int = 7, rnr_retry: int = 7, max_rd_atomic: int = 16) -> None:
        """Move to RTS against `peer` (its QpInfo)."""
        e = self._e
        from pyverbs.addr import AHAttr, GID, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RESET)
        attr.qp_access_flags = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
                                | e.IBV_ACCESS_REMOTE_READ)
        attr.path_mtu = e.IBV_MTU_1024 if mtu is None else mtu
        attr.dest_qp_num = peer.qp_num
        attr.rq_psn = peer.psn
        attr.sq_psn = 0
        attr.max_rd_atomic = max_rd_atomic
        attr.max_dest_rd_atomic = max_rd_atomic
        attr.min_rnr_timer = 12
        attr.timeout = timeout
        attr.retry_cnt = retry_cnt
        attr.rnr_retry = rnr_retry
        import ipaddress
        try:  # pyverbs wants all eight 4-digit groups
            gid = ipaddress.IPv6Address(peer.gid).exploded
        except ValueError:
            raise UsageError(f"peer GID {peer.gid!r} is not an IPv6-style GID") from None
        gr = GlobalRoute(dgid=GID(gid), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=self.port)
        self.qp.to_rts(attr)

    # ------------------------------------------------------------------ posting
    def _usable(self) -> None:
        if self._closed:
            raise UsageError(f"{self} is closed")
        if self._dead:
            raise FenceError(f"{self} is dead: {self._dead}")

    @staticmethod
    def _local(mr: MemoryRegion, offset: int, length: int, what: str) -> None:
        if not isinstance(mr, MemoryRegion):
            raise UsageError(f"{what}: local side must be a p2phub.rdma.MemoryRegion")
        if mr.closed:
            raise UsageError(f"{what}: {mr} is closed")
        if offset < 0 or length <= 0 or offset + length > mr.length:
            raise UsageError(f"{what}: local range [{offset:#x}, +{length:#x}) is outside "
                             f"the {mr.length}-byte MR")

    def _declared(self, mr: MemoryRegion, offset: int, length: int, kind: AccessKind,
                  what: str, timeout: float | None, post: Callable[[RdmaFence], None],
                  fence: RdmaFence) -> RdmaFence:
        """Declare the access (wait or raise), post, bind the access to the fence."""
        self._usable()
        ordering = mr.registration.ordering
        acc = ordering.acquire(offset, length, kind, what, timeout=timeout)
        try:
            with self._lock:
                self._usable()
                post(fence)
        except BaseException as exc:
            acc.cancel(exc)
            raise
        acc.bind(fence)
        return fence

    def _post_send(self, fence: RdmaFence, opcode: int, mr: MemoryRegion, offset: int,
                   length: int, remote_addr: int = 0, rkey: int = 0, imm: int | None = None) -> None:
        from pyverbs.wr import SGE, SendWR

        e = self._e
        wr_id = next(self._ids)
        kw: dict[str, Any] = {}
        if imm is not None:
            kw["imm_data"] = imm
        wr = SendWR(wr_id=wr_id, opcode=opcode, num_sge=1,
                    sg=[SGE(mr.addr + offset, length, mr.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED, **kw)
        if opcode in (e.IBV_WR_RDMA_WRITE, e.IBV_WR_RDMA_WRITE_WITH_IMM, e.IBV_WR_RDMA_READ):
            wr.set_wr_rdma(rkey, remote_addr)
        self._pending[wr_id] = fence
        try:
            self.qp.post_send(wr)
        except BaseException:
            del self._pending[wr_id]
            raise
        fence.state = WriteState.POSTED

    def write(self, mr: MemoryRegion, offset: int, remote: RemoteBuffer, remote_offset: int,
              length: int, *, timeout: float | None = None) -> RdmaFence:
        """RDMA WRITE mr[offset:+length] -> remote[remote_offset:+length]."""
        what = f"rdma write {length} B -> {remote.addr + remote_offset:#x}"
        self._local(mr, offset, length, what)
        raddr = remote.check(remote_offset, length)
        return self._declared(mr, offset, length, AccessKind.RDMA_SEND, what, timeout,
                              lambda f: self._post_send(f, self._e.IBV_WR_RDMA_WRITE, mr, offset,
                                                        length, raddr, remote.rkey),
                              RdmaFence(self, what))

    def write_with_imm(self, mr: MemoryRegion, offset: int, remote: RemoteBuffer,
                       remote_offset: int, length: int, imm: int, *,
                       timeout: float | None = None) -> RdmaFence:
        """RDMA WRITE with immediate: the receiver's expect_write(..., imm) completes."""
        if not 0 <= imm < 1 << 32:
            raise UsageError(f"imm={imm} is not a 32-bit value")
        what = f"rdma write+imm {imm:#x} {length} B -> {remote.addr + remote_offset:#x}"
        self._local(mr, offset, length, what)
        raddr = remote.check(remote_offset, length)
        return self._declared(mr, offset, length, AccessKind.RDMA_SEND, what, timeout,
                              lambda f: self._post_send(f, self._e.IBV_WR_RDMA_WRITE_WITH_IMM, mr,
                                                        offset, length, raddr, remote.rkey, imm),
                              RdmaFence(self, what))

    def read(self, mr: MemoryRegion, offset: int, remote: RemoteBuffer, remote_offset: int,
             length: int, *, timeout: float | None = None) -> RdmaFence:
        """RDMA READ remote[remote_offset:+length] -> mr[offset:+length]."""
        what = f"rdma read {length} B <- {remote.addr + remote_offset:#x}"
        self._local(mr, offset, length, what)
        raddr = remote.check(remote_offset, length)
        return self._declared(mr, offset, length, AccessKind.RDMA_READ_DEST, what, timeout,
                              lambda f: self._post_send(f, self._e.IBV_WR_RDMA_READ, mr, offset,
                                                        length, raddr, remote.rkey),
                              RdmaFence(self, what))

    def write_many(self, ops: "list[tuple[int, int, int, int, int]]") -> RdmaFence:
        """RDMA WRITEs of (local address, lkey, length, remote address, rkey), posted in
        order with only the last one signaled: RC completes a QP's WRITEs in order, so the
        fence completes when the responder has acknowledged all of them (or fails with the
        first error: an unsignaled WRITE that fails flushes the ones after it).

        No ordering declarations: this is for a caller that declares its accesses itself,
        over a whole request (the KV agent). At most ``depth`` WRITEs may be outstanding on
        the QP: the caller waits for earlier fences before posting more."""
        from pyverbs.wr import SGE, SendWR

        if not ops:
            raise UsageError("write_many: no WRITEs")
        if len(ops) > self.depth:
            raise UsageError(f"write_many: {len(ops)} WRITEs, more than the queue's {self.depth}")
        e = self._e
        total = sum(op[2] for op in ops)
        fence = RdmaFence(self, f"rdma write of {len(ops)} runs, {total} B")
        with self._lock:
            self._usable()
            wr_id = 0
            for i, (laddr, lkey, n, raddr, rkey) in enumerate(ops):
                last = i == len(ops) - 1
                wr_id = next(self._ids)
                wr = SendWR(wr_id=wr_id, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                            sg=[SGE(laddr, n, lkey)],
                            send_flags=e.IBV_SEND_SIGNALED if last else 0)
                wr.set_wr_rdma(rkey, raddr)
                if last:
                    self._pending[wr_id] = fence
                try:
                    self.qp.post_send(wr)
                except BaseException:
                    self._pending.pop(wr_id, None)
                    if i:   # the ones posted still complete: a last, signaled, empty WRITE
                        self._dead = f"write_many: post failed after {i} WRITEs"
                    raise
            fence.state = WriteState.POSTED
            fence.byte_len = total
        return fence

    def send(self, mr: MemoryRegion, offset: int, length: int, *,
             timeout: float | None = None) -> RdmaFence:
        """SEND mr[offset:+length] into the peer's next posted RECV."""
        what = f"rdma send {length} B"
        self._local(mr, offset, length, what)
        return self._declared(mr, offset, length, AccessKind.RDMA_SEND, what, timeout,
                              lambda f: self._post_send(f, self._e.IBV_WR_SEND, mr, offset,
                                                        length),
                              RdmaFence(self, what))

    def _post_recv(self, mr: MemoryRegion, offset: int, length: int, kind: str) -> int:
        from pyverbs.wr import SGE, RecvWR

        wr_id = next(self._ids)
        wr = RecvWR(wr_id=wr_id, num_sge=1, sg=[SGE(mr.addr + offset, length, mr.lkey)])
        self._recv_wqes[wr_id] = (kind, (mr, offset, length))
        try:
            self.qp.post_recv(wr)
        except BaseException:
            del self._recv_wqes[wr_id]
            raise
        return wr_id

    def recv(self, mr: MemoryRegion, offset: int, length: int, *,
             timeout: float | None = None) -> RdmaFence:
        """Post a RECV into mr[offset:+length]; the fence completes when a SEND lands
        (``fence.byte_len`` bytes)."""
        what = f"rdma recv {length} B"
        self._local(mr, offset, length, what)

        def post(f: RdmaFence) -> None:
            wr_id = self._post_recv(mr, offset, length, "recv")
            self._pending[wr_id] = f
            f.state = WriteState.POSTED

        return self._declared(mr, offset, length, AccessKind.RDMA_RECV, what, timeout, post,
                              RdmaFence(self, what))

    def expect_write(self, mr: MemoryRegion, offset: int, length: int, imm: int, *,
                     timeout: float | None = None) -> NotifyFence:
        """Lend mr[offset:+length] to the peer's notified WRITE carrying `imm`.

        Declares a producer access on the range now (waiting for, or in strict mode
        refusing, earlier accesses to it), posts a RECV for the notification,
        and returns a fence that completes when the bytes have landed and are visible to
        consumers here. Later accesses to the range (an NVMe write of it) wait for it."""
        if not 0 <= imm < 1 << 32:
            raise UsageError(f"imm={imm} is not a 32-bit value")
        what = f"rdma write target imm {imm:#x}"
        self._local(mr, offset, length, what)
        fence = NotifyFence(self, what)
        fence.imm = imm
        fence.registration = mr.registration  # type: ignore[attr-defined]

        def post(f: RdmaFence) -> None:
            self._expect.setdefault(imm, collections.deque()).append(f)  # type: ignore[arg-type]
            try:
                # pyverbs wants an SGE: the lent range itself (a WRITE_WITH_IMM consumes
                # the RECV without writing through it).
                self._post_recv(mr, offset, length, "notify")
            except BaseException:
                self._expect[imm].pop()
                raise

        return self._declared(mr, offset, length, AccessKind.RDMA_WRITE_TARGET, what, timeout,
                              post, fence)  # type: ignore[return-value]

    # ------------------------------------------------------------------ completions
    def poll(self, max_wc: int = 64) -> int:
        """Reap completions and complete their fences; returns how many were reaped."""
        done: list[tuple[RdmaFence, BaseException | None]] = []
        with self._lock:
            if self._closed:
                return 0
            n, wcs = self.cq.poll(max_wc)
            for wc in wcs[:n]:
                self._one(wc, done)
        for f, exc in done:  # outside the lock: callbacks may post
            if exc is None and isinstance(f, NotifyFence):
                try:
                    f.registration.ordering.make_visible()  # type: ignore[attr-defined]
                except BaseException as e:  # noqa: BLE001 - a failed flush fails the fence
                    exc = e
                else:
                    f.state = WriteState.VISIBLE
            f._complete(exc)
        return n

    def _one(self, wc: Any, done: list) -> None:
        e = self._e
        ok = wc.status == e.IBV_WC_SUCCESS
        wr_id = wc.wr_id
        recv = self._recv_wqes.pop(wr_id, None)
        if recv is not None:
            kind, args = recv
            if ok and wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                imm = int(wc.imm_data)
                q = self._expect.get(imm)
                if not q:  # a provider/binding that hands imm_data over in network order
                    swapped = int.from_bytes(imm.to_bytes(4, "little"), "big")
                    if self._expect.get(swapped):
                        imm, q = swapped, self._expect[swapped]
                if kind == "recv":
                    # A notification consumed a data RECV: put the data RECV back.
                    f = self._pending.pop(wr_id)
                    new = self._post_recv(*args, "recv")
                    self._pending[new] = f
                if q:
                    f2 = q.popleft()
                    if not q:
                        del self._expect[imm]
                    f2.byte_len = wc.byte_len
                    f2.state = WriteState.REMOTE_COMPLETE
                    done.append((f2, None))
                else:
                    self.unexpected.append((imm, wc.byte_len))
                    if self.on_notify is not None:
                        self.on_notify(imm, wc.byte_len)
                return
            if kind == "notify":
                if ok:  # a SEND landed in a notification's RECV: not a notification
                    self.unexpected.append((-1, wc.byte_len))
                    return
                self._fail_one_expect(RdmaError("notification RECV", wc.status, wc.vendor_err), done)
                return
            f = self._pending.pop(wr_id, None)
            if f is None:
                return
            if ok:
                f.byte_len = wc.byte_len
                f.state = WriteState.REMOTE_COMPLETE
                done.append((f, None))
            else:
                done.append((f, RdmaError(f.what, wc.status, wc.vendor_err)))
            return
        f = self._pending.pop(wr_id, None)
        if f is None:
            return
        if ok:
            f.byte_len = wc.byte_len
            f.state = WriteState.REMOTE_COMPLETE
            done.append((f, None))
        else:
            if wc.status != 5:  # not a flush: the QP is now in error
                self._dead = f"{f.what} failed with IBV_WC_{_WC_STATUS.get(wc.status, wc.status)}"
            done.append((f, RdmaError(f.what, wc.status, wc.vendor_err)))

    def _fail_one_expect(self, exc: BaseException, done: list) -> None:
        for imm, q in list(self._expect.items()):
            if q:
                done.append((q.popleft(), exc))
                if not q:
                    del self._expect[imm]
                return

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._pending) + sum(len(q) for q in self._expect.values())

    # ------------------------------------------------------------------ lifetime
    def _close(self) -> None:
        """Destroy the QP; every fence still pending fails ("queue pair destroyed")."""
        with self._lock:
            if self._closed:
                return
            self._closed = True   # under the lock: posts racing the close see it
            num = self.qp_num_str
            pending = list(self._pending.values())
            for q in self._expect.values():
                pending.extend(q)
            self._pending.clear()
            self._expect.clear()
            self._recv_wqes.clear()
            try:
                self.qp.close()
            finally:
                self.cq.close()
        for f in pending:
            f._complete(FenceError(f"{f.what}: can never complete: the queue pair "
                                   f"{num} was destroyed"))

    @property
    def qp_num_str(self) -> str:
        try:
            return f"{self.qp.qp_num:#x}"
        except Exception:  # noqa: BLE001 - closed pyverbs objects refuse attribute reads
            return "?"


    def __repr__(self) -> str:
        return f"<QueuePair {self.pd.device}>"


def connected_pair(pd_a: ProtectionDomain, pd_b: ProtectionDomain,
                   **kw: Any) -> tuple[QueuePair, QueuePair]:
    """Two queue pairs connected to each other (both ends in this process)."""
    a, b = QueuePair(pd_a, **kw), QueuePair(pd_b, **kw)
    try:
        a.connect(b.info())
        b.connect(a.info())
    except BaseException:
        a.close()
        b.close()
        raise
    return a, b

