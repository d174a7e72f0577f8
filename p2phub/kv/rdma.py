"""The RDMA data path of the KV agent: its NICs ("rails") and, per connection, one RC queue
pair per rail, built on p2phub.rdma (``ProtectionDomain``, ``reg_mr`` / ``reg_va``,
``QueuePair.write_many``).

The agent's TCP connection to the peer stays the control channel (handshake, heartbeats,
notifications, acknowledgements, READ requests); over RDMA only the payload moves. For each
DATA message the sender posts WRITEs of the runs straight from its segments into the
receiver's, striped over the rails (runs longer than STRIPE are cut so every rail carries a
share), and goes on posting the next message's while they fly; once a message's WRITEs
completed (the responder acknowledged the bytes: they are in the receiver's memory) it
sends that message's header and run table with F_PLACED and no payload, in order. The
receiver checks the runs against its segments and completes the layer's fence as for a TCP
message: the fences, deadlines, heartbeats and failure rules are the TCP transport's.

READ: the reader sends the runs it wants (the peer's segments) and, beside them, where
they go in its own segments; the peer checks the runs against its segments as for TCP and
answers by WRITING them there over the same queue pairs (the reader's MRs came in its
handshake), then sends an empty F_READ_RESP|F_PLACED answer. Where it cannot (a range of
the reader's registered after the connection was made, CUDA memory without an MR) it
answers over TCP with the bytes, as without RDMA. Nothing is ever read remotely.

    a = Agent("prefill", pool, rdma_devices=["mlx5_0", "mlx5_1"])   # two rails
    a.transport_to("decode")                                         # "rdma" or "tcp"
    a.rail_bytes()                                                   # {"mlx5_0": ..., ...}

The receiver's segments are MRs on each of its rails with remote write granted (never
remote read): a pool made by p2phub through ``reg_mr`` on its registration, any other host
memory through ``reg_va``. Sender rail i talks to receiver rail i mod (its rail count).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from ..errors import UsageError
from ..rdma.verbs import Access
from .errors import KVPeerError
from .transport import SegmentIndex
from .._resource import Resource

__all__ = ["Rails", "Link", "POOL_ACCESS", "STRIPE"]

# The segments are the target of peers' RDMA WRITEs and are never read remotely.
POOL_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE
WINDOW = 32          # WRITEs per signaled group (write_many)
DEPTH = 256          # send queue depth of each queue pair
STRIPE = 1 << 20     # bytes: longer runs are cut so every rail carries a share
MOST = DEPTH // WINDOW - 1   # signaled groups in flight per queue pair


class Rail(Resource):
    """One NIC: a protection domain and an MR of every registered segment."""

    def __init__(self, device: str) -> None:
        from ..rdma import ProtectionDomain
        self.device = device
        self.pd = ProtectionDomain(device)
        self.mrs: list[Any] = []
        self.bytes = 0          # payload bytes this agent WRITEs through it

    def gid(self) -> str:
        return str(self.pd.ctx.query_gid(1, 1))

    def _close(self) -> None:
        for mr in self.mrs:
            if mr is not None:
                mr.close()
        self.mrs = []
        self.pd.close()


class Rails(Resource):
    """The agent's NICs, each named; every segment is registered on each."""

    def __init__(self, devices: list[str]) -> None:
        if not devices or len(set(devices)) != len(devices):
            raise UsageError(f"rdma_devices={devices!r}: want distinct RDMA device names")
        self.rails: list[Rail] = []
        self.segments = SegmentIndex()
        try:
            for d in devices:
                self.rails.append(Rail(d))
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.rails)

    @property
    def devices(self) -> list[str]:
        return [r.device for r in self.rails]

    def add_segment(self, addr: int, length: int, registration: Any = None) -> None:
        """Register one segment on every rail: ``reg_mr`` on a p2phub registration, else a
        VA MR of the caller's host memory."""
        made: list[Any] = []
        try:
            for r in self.rails:
                mr = (r.pd.reg_mr(registration, POOL_ACCESS) if registration is not None
                      else r.pd.reg_va(addr, length, POOL_ACCESS))
                made.append(mr)
        except BaseException:
            for mr in made:
                mr.close()
            raise
        for r, mr in zip(self.rails, made):
            r.mrs.append(mr)
        self.segments.add(addr, length)

    def drop_segment(self, i: int) -> None:
        """Deregister segment `i`'s MR on every rail (a peer's WRITE into it now fails at its
        NIC); its index stays taken (segment ids are positional), no address finds it."""
        for r in self.rails:
            mr, r.mrs[i] = r.mrs[i], None
            if mr is not None:
                mr.close()
        self.segments.drop(i)

    def metadata(self) -> list[dict]:
        """What a peer needs to WRITE into our segments, per rail ([0, 0]: no MR)."""
        return [{"device": r.device, "gid": r.gid(),
                 "mrs": [[mr.addr, mr.rkey] if mr is not None else [0, 0] for mr in r.mrs]}
                for r in self.rails]

    def stats(self) -> dict[str, int]:
        return {r.device: r.bytes for r in self.rails}

    def _close(self) -> None:
        for r in self.rails:
            r.close()
        self.rails = []


@dataclasses.dataclass
class _Target:
    mrs: list[tuple[int, int]]      # per remote segment: (MR address, rkey)


class Link(Resource):
    """One connection's queue pairs: `n` of them, QP i on local rail i mod len(rails)."""

    def __init__(self, rails: Rails, n: int, peer: str) -> None:
        from ..rdma.qp import QueuePair
        self.rails = rails
        self.peer = peer
        self.qps: list[Any] = []
        self.targets: list[_Target] = []
        self._inflight: list[collections.deque] = []   # per QP: posted groups' fences
        try:
            for i in range(n):
                self.qps.append(QueuePair(rails.rails[i % len(rails)].pd, depth=DEPTH))
                self._inflight.append(collections.deque())
        except BaseException:
            self.close()
            raise

    def infos(self) -> list[dict]:
        return [dataclasses.asdict(q.info()) for q in self.qps]

    def connect(self, infos: list[dict], remote_rails: list[dict] | None = None) -> None:
        """Connect QP i to the peer's QP i; with `remote_rails` (the peer's rails: its MRs),
        QP i WRITEs into remote rail i mod their count (the sender's side, and the side
        answering READs)."""
        from ..rdma.qp import QpInfo
        if len(infos) != len(self.qps):
            raise KVPeerError(self.peer, "unreachable", f"{len(infos)} queue pairs in the "
                              f"handshake, {len(self.qps)} wanted")
        for q, info in zip(self.qps, infos):
            q.connect(QpInfo(**info))
        if remote_rails is not None:
            if not remote_rails:
                raise KVPeerError(self.peer, "unreachable", "it published no RDMA rails")
            self.targets = [_Target([(int(a), int(k)) for a, k in remote_rails[i % len(remote_rails)]["mrs"]])
                            for i in range(len(self.qps))]

    def post(self, iov: Any, wire: Any, nruns: int, timeout: float) -> list[Any]:
        """Post RDMA WRITEs of runs iov[i] (local address, length) -> wire[i] (the peer's
        segment, offset), striped over the queue pairs; return the fences to wait for (the
        last of this call on each queue pair used: RC completes a queue pair's WRITEs in
        order). Does not wait for them: WRITEs of later messages are posted behind them,
        so the link stays busy between messages. Waits only when a queue pair already has
        its most groups in flight. Raises KVPeerError ("stalled", "reset"); UsageError when
        a run is outside the segments (before anything is posted)."""
        nq = len(self.qps)
        ops: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(nq)]
        load = [0] * nq
        rails = self.rails.rails
        segs = self.rails.segments
        for i in range(nruns):
            la, n = int(iov[i].addr), int(iov[i].len)
            rseg, roff = int(wire[i].seg), int(wire[i].off)
            lseg = segs.find(la, n)
            seg_addr = segs.base(lseg)
            while n > 0:
                c = min(n, STRIPE)
                j = load.index(min(load))
                lmr = rails[j % len(rails)].mrs[lseg]
                tgt = self.targets[j].mrs
                if lmr is None or rseg >= len(tgt) or not tgt[rseg][1]:
                    raise UsageError(f"run {i}: segment {lseg if lmr is None else rseg} has no "
                                     "RDMA MR (deregistered, or not in the peer's metadata)")
                raddr, rkey = tgt[rseg]
                ops[j].append((lmr.addr + (la - seg_addr), lmr.lkey, c, raddr + roff, rkey))
                load[j] += c
                la, roff, n = la + c, roff + c, n - c
        fences: list[Any] = []
        try:
            for k in range(0, max(len(o) for o in ops), WINDOW):   # the rails in turn
                for j in range(nq):
                    group, fl = ops[j][k:k + WINDOW], self._inflight[j]
                    if not group:
                        continue
                    while fl and fl[0].done():
                        fl.popleft().wait(0)      # raises a failed group's error
                    while len(fl) >= MOST:
                        self._wait(fl.popleft(), timeout)
                    fl.append(self.qps[j].write_many(group))
            for j in range(nq):
                if ops[j]:
                    fences.append(self._inflight[j][-1])
                    rails[j % len(rails)].bytes += load[j]
        except BaseException as exc:
            raise self._peer_error(exc, timeout) from None
        return fences

    def wait(self, fences: list[Any], timeout: float) -> None:
        """Wait until every fence `post` returned completed (the responder acknowledged the
        bytes: they are in the peer's memory). Raises KVPeerError."""
        try:
            for f in fences:
                self._wait(f, timeout)
        except BaseException as exc:
            raise self._peer_error(exc, timeout) from None

    def write(self, iov: Any, wire: Any, nruns: int, timeout: float) -> None:
        """post + wait: return once every WRITE of these runs completed."""
        self.wait(self.post(iov, wire, nruns, timeout), timeout)

    def can_place(self, wire: bytes, nruns: int) -> bool:
        """Whether every run of `wire` (the peer's segment, flags, offset, length) lands in a
        segment the peer published an MR of, on every queue pair's target rail."""
        import struct
        if not self.targets:
            return False
        for seg, _f, _o, _n in struct.iter_unpack("<IIQQ", wire[:nruns * 24]):
            for t in self.targets:
                if seg >= len(t.mrs) or not t.mrs[seg][1]:
                    return False
        return True

    def _peer_error(self, exc: BaseException, timeout: float) -> BaseException:
        from ..ordering.errors import FenceError, FenceTimeout
        if isinstance(exc, FenceTimeout):
            return KVPeerError(self.peer, "stalled", f"RDMA WRITEs not complete within {timeout} s")
        if isinstance(exc, FenceError):
            return KVPeerError(self.peer, "reset", str(exc))
        return exc

    @staticmethod
    def _wait(fence: Any, timeout: float) -> None:
        from ..ordering.errors import FenceTimeout
        t0 = time.monotonic()
        fence.wait(timeout)
        if not fence.done():   # pragma: no cover - wait raises on timeout
            raise FenceTimeout(f"{fence} after {time.monotonic() - t0} s")

    def _close(self) -> None:
        for q in self.qps:
            try:
                q.close()
            except Exception:  # noqa: BLE001 - closing a dead QP must not stop the others
                pass
        self.qps = []
