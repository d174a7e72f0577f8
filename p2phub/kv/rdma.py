"""The RDMA data path of the KV agent: its NICs ("rails") and, per connection, one RC queue
pair per rail, built on p2phub.rdma (``ProtectionDomain``, ``reg_mr`` / ``reg_va``,
``QueuePair.write_many``).

The agent's TCP connection to the peer stays the control channel (handshake, heartbeats,
notifications, acknowledgements, READ); over RDMA only the payload moves. For each DATA
message the sender WRITEs the runs straight from its segments into the receiver's,
striped over the rails (runs longer than STRIPE are cut so every rail carries a share),
waits for their completions (the responder acknowledged the bytes: they are in the
receiver's memory), then sends the message's header and run table with F_PLACED and no
payload. The receiver checks the runs against its segments and completes the layer's fence
as for a TCP message: the fences, deadlines, heartbeats and failure rules are the TCP
transport's.

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
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ..rdma.verbs import Access
from .errors import KVPeerError
from .transport import SegmentIndex

if TYPE_CHECKING:
    from .transport import Message

__all__ = ["Rails", "Link", "POOL_ACCESS", "STRIPE"]

# The segments are the target of peers' RDMA WRITEs and are never read remotely.
POOL_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE
WINDOW = 32          # WRITEs per signaled group (write_many)
DEPTH = 256          # send queue depth of each queue pair
STRIPE = 1 << 20     # bytes: longer runs are cut so every rail carries a share


class Rail:
    """One NIC: a protection domain and an MR of every registered segment."""

    def __init__(self, device: str) -> None:
        from ..rdma import ProtectionDomain
        self.device = device
        self.pd = ProtectionDomain(device)
        self.mrs: list[Any] = []
        self.bytes = 0          # payload bytes this agent WRITEs through it

    def gid(self) -> str:
        return str(self.pd.ctx.query_gid(1, 1))

    def close(self) -> None:
        for mr in self.mrs:
            mr.close()
        self.mrs = []
        self.pd.close()


class Rails:
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

    def metadata(self) -> list[dict]:
        """What a peer needs to WRITE into our segments, per rail."""
        return [{"device": r.device, "gid": r.gid(),
                 "mrs": [[mr.addr, mr.rkey] for mr in r.mrs]} for r in self.rails]

    def stats(self) -> dict[str, int]:
        return {r.device: r.bytes for r in self.rails}

    def close(self) -> None:
        for r in self.rails:
            r.close()
        self.rails = []


@dataclasses.dataclass
class _Target:
    mrs: list[tuple[int, int]]      # per remote segment: (MR address, rkey)


class Link:
    """One connection's queue pairs: `n` of them, QP i on local rail i mod len(rails)."""

    def __init__(self, rails: Rails, n: int, peer: str) -> None:
        from ..rdma.qp import QueuePair
        self.rails = rails
        self.peer = peer
        self.qps: list[Any] = []
        self.targets: list[_Target] = []
        try:
            for i in range(n):
                self.qps.append(QueuePair(rails.rails[i % len(rails)].pd, depth=DEPTH))
        except BaseException:
            self.close()
            raise

    def infos(self) -> list[dict]:
        return [dataclasses.asdict(q.info()) for q in self.qps]

    def connect(self, infos: list[dict], remote_rails: list[dict] | None = None) -> None:
        """Connect QP i to the peer's QP i; with `remote_rails` (the sender's side), QP i
        WRITEs into remote rail i mod their count."""
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

    def write(self, m: "Message", timeout: float) -> None:
        """WRITE message `m`'s runs into the peer's segments, striped over the queue pairs;
        return once every WRITE completed. Raises KVPeerError ("stalled" when a group does
        not complete within `timeout` seconds, "reset" on an error completion)."""
        from ..ordering.errors import FenceError, FenceTimeout
        nq = len(self.qps)
        ops: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(nq)]
        load = [0] * nq
        rails = self.rails.rails
        for i in range(m.nruns):
            la, n = int(m.iov[i].addr), int(m.iov[i].len)
            rseg, roff = int(m.wire[i].seg), int(m.wire[i].off)
            lseg = self.rails.segments.find(la, n)
            seg_addr = self.rails.segments.base(lseg)
            while n > 0:
                c = min(n, STRIPE)
                j = load.index(min(load))
                lmr = rails[j % len(rails)].mrs[lseg]
                raddr, rkey = self.targets[j].mrs[rseg]
                ops[j].append((lmr.addr + (la - seg_addr), lmr.lkey, c, raddr + roff, rkey))
                load[j] += c
                la, roff, n = la + c, roff + c, n - c
        fences: list[collections.deque] = [collections.deque() for _ in range(nq)]
        cursor = [0] * nq
        most = DEPTH // WINDOW - 1
        try:
            while any(cursor[j] < len(ops[j]) for j in range(nq)):
                for j in range(nq):
                    if cursor[j] >= len(ops[j]):
                        continue
                    while len(fences[j]) >= most:
                        self._wait(fences[j].popleft(), timeout)
                    group = ops[j][cursor[j]:cursor[j] + WINDOW]
                    fences[j].append(self.qps[j].write_many(group))
                    cursor[j] += len(group)
            for dq in fences:
                while dq:
                    self._wait(dq.popleft(), timeout)
        except FenceTimeout:
            raise KVPeerError(self.peer, "stalled",
                              f"RDMA WRITEs not complete within {timeout} s") from None
        except FenceError as exc:
            raise KVPeerError(self.peer, "reset", str(exc)) from None
        for j in range(nq):
            rails[j % len(rails)].bytes += load[j]

    @staticmethod
    def _wait(fence: Any, timeout: float) -> None:
        from ..ordering.errors import FenceTimeout
        t0 = time.monotonic()
        fence.wait(timeout)
        if not fence.done():   # pragma: no cover - wait raises on timeout
            raise FenceTimeout(f"{fence} after {time.monotonic() - t0} s")

    def close(self) -> None:
        for q in self.qps:
            try:
                q.close()
            except Exception:  # noqa: BLE001 - closing a dead QP must not stop the others
                pass
        self.qps = []
