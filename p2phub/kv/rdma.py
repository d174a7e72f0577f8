"""The RDMA transport of KV transfers: per layer, batched RDMA WRITEs of the request's pages
(contiguous runs merged into one work request), the layer's last one a WRITE_WITH_IMM
carrying (request, layer); the receiver turns each immediate into the completion of that
layer's fence (RC delivers the WRITEs of a QP before the WRITE_WITH_IMM that follows them).

    rx = RdmaAgent("decode", pool, "mlx5_1")      # pool: KVPool.registered(hub, layout)
    tx = RdmaAgent("prefill", pool2, "mlx5_0")
    tx.connect(rx.host, rx.port)                  # a TCP control connection + one RC QP
    r = rx.expect("prefill", req=1, blocks=dst)   # layer(l) / done fences
    tx.send_request("decode", 1, src, dst).wait(30)

Ordering (p2phub.ordering): where the pool is p2phub memory, ``expect()`` declares a
producer access (an RDMA write target) on exactly the pages each layer fills, after earlier
readers of those pages are done, and the layer's fence completes it; ``send_request()``
declares consumer accesses (RDMA sends) on the pages it reads. So an NVMe write or a GPU
kernel that consumes received pages waits for their layer, and fails with it.

QPs come from pyverbs; MRs from the pool's registrations (``reg.mr(pd, POOL_ACCESS)``: dma-buf MR where the NIC has
it, else a CPU-mapped VA MR), or a VA MR of plain host memory; either grants peers remote
write, never remote read. The control connection carries the QP and pool descriptors once
and then only liveness: a peer whose process dies closes it, and every request it owed fails
at once; a sender whose WRITEs do not complete within the
deadline fails the request and drops the QP. A new connect() makes a new QP pair.
"""

from __future__ import annotations

import errno
import json
import select
import socket
import threading
import time
from typing import Any, Sequence

from ..errors import UsageError
from ..ordering import AccessKind
from ..rdma.verbs import Access
from . import transport as tp
from .errors import KVError, KVPeerError
from .fence import HostFence
from .layout import KVLayout
from .pool import KVPool

__all__ = ["RdmaAgent", "pack_imm", "unpack_imm"]

GID_INDEX = 1        # RoCE v2 GID of the port's IPv4 address (default)
PORT_NUM = 1
SQ_DEPTH = 512
RQ_DEPTH = 512
SIGNAL_EVERY = 32    # one signaled WR in this many (selective signaling)
IMM_LAYER_BITS = 8
# The pool is the target of peers' RDMA WRITEs and is never read remotely (senders push,
# nothing pulls), so its MRs grant remote write and not remote read.
POOL_ACCESS = Access.LOCAL_WRITE | Access.REMOTE_WRITE


def pack_imm(req: int, layer: int) -> int:
    """(request, layer) as 32 bits: 24 bits of request id, 8 of layer."""
    if not 0 <= layer < 1 << IMM_LAYER_BITS:
        raise UsageError(f"layer {layer} does not fit the immediate (at most 255)")
    return ((req & 0xFFFFFF) << IMM_LAYER_BITS) | layer


def unpack_imm(imm: int) -> tuple[int, int]:
    return imm >> IMM_LAYER_BITS, imm & ((1 << IMM_LAYER_BITS) - 1)


class _Peer:
    """One peer: a control socket and an RC QP with its CQ."""

    def __init__(self, agent: "RdmaAgent", sock: socket.socket) -> None:
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPCap, QPInitAttr

        self.agent = agent
        self.sock = sock
        self.name = ""
        self.scq = CQ(agent.pd.ctx, SQ_DEPTH)   # sender: reaped by the posting thread
        self.rcq = CQ(agent.pd.ctx, RQ_DEPTH)   # receiver: reaped by the watcher thread
        cap = QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=RQ_DEPTH, max_send_sge=1, max_recv_sge=1)
        self.qp = QP(agent.pd.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.scq, rcq=self.rcq, cap=cap))
        self.gid = agent.pd.ctx.query_gid(PORT_NUM, GID_INDEX)
        self.remote: dict = {}
        self.closed = False
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.last_heard = time.monotonic()
        self.outstanding = 0      # signaled WRs posted and not reaped

    def info(self) -> dict:
        a = self.agent
        return {"name": a.name, "qpn": self.qp.qp_num, "gid": str(self.gid),
                "segments": [[mr.addr, mr.length, mr.rkey] for mr in a.mrs],
                "layout": a.layout.to_dict()}

    def to_rts(self, remote: dict) -> None:
        import pyverbs.enums as e
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        self.remote = remote
        self.name = remote["name"]
        attr = QPAttr(qp_state=e.IBV_QPS_RTS, cur_qp_state=e.IBV_QPS_RESET)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        attr.path_mtu = e.IBV_MTU_1024
        attr.dest_qp_num = remote["qpn"]
        attr.rq_psn = attr.sq_psn = 0
        attr.max_rd_atomic = attr.max_dest_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14          # 4.096 us * 2^14 = 67 ms per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        gr = GlobalRoute(dgid=GID(remote["gid"]), sgid_index=GID_INDEX)
        attr.ah_attr = AHAttr(gr=gr, is_global=1, port_num=PORT_NUM)
        self.qp.to_rts(attr)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
        for o in (self.qp, self.scq, self.rcq):
            try:
                o.close()
            except Exception:
                pass


def _send_json(sock: socket.socket, d: dict) -> None:
    body = json.dumps(d).encode()
    sock.sendall(len(body).to_bytes(4, "little") + body)


def _recv_json(sock: socket.socket, timeout: float) -> dict:
    sock.settimeout(timeout)
    n = int.from_bytes(tp._recv_all(sock, 4), "little")
    if n > tp.MAX_CTRL:
        raise KVError(f"control message of {n} bytes")
    return json.loads(tp._recv_all(sock, n))


class RdmaRequest:
    """The receiving side of one request: a fence per layer and ``done`` (all layers)."""

    def __init__(self, peer: str, req: int, layers: int, blocks: Sequence[int] | None) -> None:
        self.peer, self.req = peer, req
        self.layers = [HostFence(f"kv request {req} layer {i} from {peer}") for i in range(layers)]
        self.done = HostFence(f"kv request {req} from {peer}")
        self.blocks = list(blocks) if blocks is not None else None
        self.landed: set[int] = set()
        self.error: BaseException | None = None
        self.last_rx = time.monotonic()

    def layer(self, i: int) -> HostFence:
        return self.layers[i]

    def _landed(self, layer: int) -> None:
        if self.error is not None or layer >= len(self.layers):
            return
        self.last_rx = time.monotonic()
        self.landed.add(layer)
        self.layers[layer].set()
        if len(self.landed) == len(self.layers):
            self.done.set()

    def _fail(self, exc: BaseException) -> None:
        if self.error is not None or self.done.done():
            return
        self.error = exc
        for f in self.layers:
            f.fail(exc)
        self.done.fail(exc)

    def visible_blocks(self, layer: int) -> list[int]:
        """The pages of `layer` a consumer may read: all of them once its fence is done."""
        return list(self.blocks or []) if layer in self.landed else []


class RdmaAgent:
    """A KV agent over RDMA (RC QPs, one per peer), with a TCP control connection per peer."""

    def __init__(self, name: str, pool: KVPool, device: str, host: str = "127.0.0.1",
                 port: int = 0, stall_timeout: float = 5.0,
                 peer_timeout: float | None = None) -> None:
        """stall_timeout: seconds a started request may go without progress (a layer on the
        receiver, a completion on the sender); peer_timeout (default stall_timeout): seconds
        without a heartbeat on the control connection before a peer counts as dead."""
        from ..rdma import ProtectionDomain

        self.name = name
        self.peer_timeout = float(peer_timeout or stall_timeout)
        self.pool = pool
        self.layout: KVLayout = pool.layout
        self.stall_timeout = stall_timeout
        self.pd = ProtectionDomain(device)
        self.mrs: list[Any] = []
        self._own_mrs: list[Any] = []
        try:
            for seg in pool.segments:
                if seg.registration is not None:
                    mr = seg.registration.mr(self.pd, POOL_ACCESS)
                else:
                    mr = _VaMr(self.pd, seg.addr, seg.length)
                self.mrs.append(mr)
        except BaseException:
            for mr in self.mrs:
                mr.close()
            self.pd.close()
            raise
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._reqs: dict[tuple[str, int], RdmaRequest] = {}
        self._closed = False
        self._listener = socket.create_server((host, port))
        self.host, self.port = self._listener.getsockname()[:2]
        threading.Thread(target=self._accept_loop, daemon=True, name=f"kv-rdma-accept-{name}").start()
        threading.Thread(target=self._heartbeat, daemon=True, name=f"kv-rdma-hb-{name}").start()

    def _heartbeat(self) -> None:
        """A byte on every control connection every peer_timeout / 4 s: a peer that stops
        hearing them (a killed or frozen process) drops the connection."""
        while not self._closed:
            time.sleep(self.peer_timeout / 4)
            with self._lock:
                peers = list(self._peers.values())
            for p in peers:
                try:
                    p.sock.send(b"h", socket.MSG_DONTWAIT)
                except OSError:
                    pass

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            try:
                remote = _recv_json(sock, self.stall_timeout)
                peer = _Peer(self, sock)
                peer.to_rts(remote)
                self._post_recvs(peer, RQ_DEPTH)
                _send_json(sock, peer.info())
            except Exception:
                sock.close()
                continue
            self._add_peer(peer)

    def connect(self, host: str, port: int) -> str:
        """Connect to the RdmaAgent at host:port (control socket + a new QP pair)."""
        try:
            sock = socket.create_connection((host, port), timeout=self.stall_timeout)
        except OSError as exc:
            raise KVPeerError(f"{host}:{port}", "unreachable", f"{exc.strerror or exc}") from None
        peer = _Peer(self, sock)
        try:
            _send_json(sock, peer.info())
            remote = _recv_json(sock, self.stall_timeout)
            peer.to_rts(remote)
            self._post_recvs(peer, RQ_DEPTH)
        except BaseException:
            peer.close()
            raise
        self._add_peer(peer)
        return peer.name

    def _add_peer(self, peer: _Peer) -> None:
        with self._lock:
            old = self._peers.get(peer.name)
            self._peers[peer.name] = peer
        if old is not None:
            self._drop(old, KVPeerError(old.name, "restarted", "replaced by a new connection"))
        peer.sock.settimeout(None)
        threading.Thread(target=self._watch, args=(peer,), daemon=True,
                         name=f"kv-rdma-{peer.name}").start()

    def _post_recvs(self, peer: _Peer, n: int) -> None:
        from pyverbs.wr import SGE, RecvWR
        mr = self.mrs[0]
        for i in range(n):  # a WRITE_WITH_IMM consumes a receive but writes nothing into it
            peer.qp.post_recv(RecvWR(wr_id=i, num_sge=1, sg=[SGE(mr.addr, 0, mr.lkey)]))

    def _watch(self, peer: _Peer) -> None:
        """Receive side: reap immediates into layer fences; notice the peer's death (EOF on
        the control socket) and stalls (a started request silent for stall_timeout)."""
        import pyverbs.enums as e
        from pyverbs.wr import SGE, RecvWR
        mr = self.mrs[0]
        fd = peer.sock.fileno()
        prev = time.monotonic()
        while not peer.closed:
            tick = time.monotonic()
            if tick - prev > 1.0:
                # This process was frozen (a verbs call holding the GIL, the host starving us):
                # silence in that time is ours, not the peer's.
                peer.last_heard = max(peer.last_heard, tick)
            prev = tick
            try:
                with peer.lock:
                    n, wcs = peer.rcq.poll(num_entries=64) if not peer.closed else (0, [])
            except Exception as exc:
                self._drop(peer, KVPeerError(peer.name, "reset", f"CQ poll: {exc}"))
                return
            for wc in wcs:
                if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                    if wc.status != e.IBV_WC_SUCCESS:
                        self._drop(peer, KVPeerError(peer.name, "reset", f"receive status {wc.status}"))
                        return
                    req, layer = unpack_imm(wc.imm_data)
                    self._request(peer.name, req)._landed(layer)
                    with peer.lock:
                        if not peer.closed:
                            peer.qp.post_recv(RecvWR(wr_id=0, num_sge=1, sg=[SGE(mr.addr, 0, mr.lkey)]))
                elif wc.status != e.IBV_WC_SUCCESS and not peer.closed:
                    self._drop(peer, KVPeerError(peer.name, "reset", f"receive status {wc.status}"))
                    return
            if n:
                continue
            try:
                r, _, _ = select.select([fd], [], [], 0.0005)
            except (OSError, ValueError):   # closed under us by close() or _drop()
                if peer.closed:
                    return
                raise
            if r:
                try:
                    data = peer.sock.recv(64)
                except OSError:
                    data = b""
                if not data:
                    self._drop(peer, KVPeerError(peer.name, "closed",
                                                 "the control connection closed (process gone)"))
                    return
                peer.last_heard = time.monotonic()
            now = time.monotonic()
            if now - peer.last_heard > self.peer_timeout:
                self._drop(peer, KVPeerError(peer.name, "dead", f"no heartbeat for "
                                             f"{self.peer_timeout} s (process killed or frozen)"))
                return
            with self._lock:
                stalled = [q for (p, _), q in self._reqs.items() if p == peer.name and q.landed
                           and not q.done.done() and now - q.last_rx > self.stall_timeout]
            for q in stalled:
                q._fail(KVPeerError(peer.name, "stalled", f"request {q.req}: no layer for "
                                                         f"{self.stall_timeout} s"))

    def _drop(self, peer: _Peer, exc: BaseException) -> None:
        with self._lock:
            if self._peers.get(peer.name) is peer:
                del self._peers[peer.name]
            owed = [q for (p, _), q in self._reqs.items() if p == peer.name and not q.done.done()]
        peer.error = exc
        for q in owed:
            q._fail(exc)
        with peer.lock:  # not while a sender posts on it
            peer.close()

    # ------------------------------------------------------------------ receiving
    def _request(self, peer: str, req: int) -> RdmaRequest:
        with self._lock:
            q = self._reqs.get((peer, req & 0xFFFFFF))
            if q is None:
                q = self._reqs[(peer, req & 0xFFFFFF)] = RdmaRequest(peer, req, self.layout.num_layers, None)
            return q

    def expect(self, peer: str, req: int, blocks: Sequence[int] | None = None,
               timeout: float | None = None) -> RdmaRequest:
        """The receiving side of `req` from `peer`; `blocks` are the pages it will fill.

        With `blocks`, each layer's pages become a producer access of the pool's
        registrations, completed by that layer's fence; this waits (up to `timeout`)
        for earlier accesses that read those pages (strict ordering raises instead)."""
        q = self._request(peer, req)
        if blocks is not None:
            q.blocks = list(blocks)
            try:
                self.pool.declare(q.blocks, range(self.layout.num_layers),
                                  AccessKind.RDMA_WRITE_TARGET, q.layers,
                                  f"kv request {req} from {peer}", timeout)
            except BaseException as exc:
                q._fail(exc)
                self.release(peer, req)
                raise
        return q

    def release(self, peer: str, req: int) -> None:
        """Forget `req`; one that did not complete fails (its pages never become visible)."""
        with self._lock:
            q = self._reqs.pop((peer, req & 0xFFFFFF), None)
        if q is not None:
            q._fail(KVError(f"kv request {req} from {peer} was released before it completed"))

    # ------------------------------------------------------------------ sending
    def send_request(self, peer: str, req: int, local_blocks: Sequence[int],
                     remote_blocks: Sequence[int], layers: Sequence[int] | None = None,
                     pace: float = 0.0) -> HostFence:
        """WRITE the pages of every layer (default all) and end each layer with a
        WRITE_WITH_IMM; returns a fence done when every WR completed (synchronous here:
        the call posts and reaps; ``pace`` seconds between layers stand for a producer)."""
        import pyverbs.enums as e
        from pyverbs.wr import SGE, SendWR

        with self._lock:
            p = self._peers.get(peer)
        if p is None:
            raise KVPeerError(peer, "unreachable", "not connected (connect() first)")
        rlay = KVLayout.from_dict(p.remote["layout"])
        self.layout.check_compatible(rlay)
        rsegs = p.remote["segments"]
        h = tp.hot()
        lids, rids = tp_int32(local_blocks), tp_int32(remote_blocks)
        if len(lids) != len(rids):
            raise UsageError(f"{len(lids)} local blocks but {len(rids)} remote blocks")
        n = len(lids)
        fence = HostFence(f"kv rdma request {req} to {peer}")
        lay = self.layout
        sent = list(layers) if layers is not None else range(lay.num_layers)
        # The pages this request reads: consumers until it completes (or fails).
        try:
            self.pool.declare(local_blocks, sent, AccessKind.RDMA_SEND, [fence] * len(sent),
                              f"kv rdma request {req} to {peer}", None)
        except BaseException as exc:
            fence.fail(exc)     # ends the accesses declared so far
            raise
        cap = max(1, n)
        liov = h.ffi.new("struct kv_iov[]", cap)
        wire = h.ffi.new("struct kv_wire[]", cap)
        bad = h.ffi.new("size_t *")
        lp, rp = h.ffi.from_buffer("int32_t[]", lids), h.ffi.from_buffer("int32_t[]", rids)
        try:
            for li, ly in enumerate(sent):
                wrs: list[Any] = []
                for kv in range(lay.kv):
                    lseg, lbase = lay.block_base(ly, kv)
                    rseg, rbase = rlay.block_base(ly, kv)
                    rc = h.lib.kv_plan(lp, rp, n, self.pool.segments[lseg].addr + lbase,
                                       lay.blocks_per_layer, rseg, rbase, rlay.blocks_per_layer,
                                       lay.block_bytes, liov, wire, cap, bad)
                    if rc < 0:
                        raise UsageError(f"request {req}: pair {bad[0]} is outside the pools")
                    lmr = self.mrs[lseg]
                    raddr, rlen, rkey = rsegs[rseg]
                    loff0 = lmr.addr - self.pool.segments[lseg].addr
                    for i in range(rc):
                        wr = SendWR(wr_id=ly, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                                    sg=[SGE(liov[i].addr + loff0, liov[i].len, lmr.lkey)],
                                    send_flags=0)
                        wr.set_wr_rdma(rkey, raddr + wire[i].off)
                        wrs.append(wr)
                if not wrs:
                    continue
                last = wrs[-1]
                last.opcode = e.IBV_WR_RDMA_WRITE_WITH_IMM
                last.imm_data = pack_imm(req, ly)
                self._post_all(p, wrs)
                if pace and li + 1 < len(sent):
                    time.sleep(pace)
        except KVPeerError as exc:
            fence.fail(exc)
            self._drop(p, exc)
            return fence
        except Exception as exc:  # a verbs error: fail this request, drop the QP pair
            err = KVPeerError(peer, "reset", f"{type(exc).__name__}: {exc}")
            fence.fail(err)
            self._drop(p, err)
            return fence
        fence.set()
        return fence

    def _post_all(self, p: _Peer, wrs: list[Any]) -> None:
        """Post one WR at a time, every SIGNAL_EVERY-th and the last signaled; keep at most
        two signaled ones outstanding, and on a full send queue (ENOMEM) reap one and retry."""
        import pyverbs.enums as e
        from pyverbs.pyverbs_error import PyverbsRDMAError
        for i, wr in enumerate(wrs):
            signaled = (i + 1) % SIGNAL_EVERY == 0 or i == len(wrs) - 1
            if signaled:
                wr.send_flags = e.IBV_SEND_SIGNALED
                while p.outstanding >= 2:
                    self._reap_send(p)
            while True:
                with p.lock:
                    if p.closed:
                        raise p.error or KVPeerError(p.name, "closed", "connection dropped")
                    try:
                        p.qp.post_send(wr)
                        break
                    except PyverbsRDMAError as exc:
                        full = exc.error_code == errno.ENOMEM
                        if not full:
                            raise KVPeerError(p.name, "reset", f"post_send: {exc}") from None
                if p.outstanding == 0:
                    time.sleep(0.001)   # the queue frees as unsignaled WRs retire
                else:
                    self._reap_send(p)
            if signaled:
                p.outstanding += 1
        while p.outstanding:
            self._reap_send(p)

    def _reap_send(self, p: _Peer) -> None:
        """Wait for one signaled completion (within stall_timeout); fail on an error status."""
        import pyverbs.enums as e
        deadline = time.monotonic() + self.stall_timeout
        while True:
            with p.lock:
                if p.closed:
                    raise p.error or KVPeerError(p.name, "closed", "connection dropped")
                n, wcs = p.scq.poll(num_entries=1)
            if n:
                p.outstanding -= 1
                wc = wcs[0]
                if wc.status != e.IBV_WC_SUCCESS:
                    raise KVPeerError(p.name, "reset", f"RDMA WRITE completed with status "
                                                       f"{wc.status} (peer gone or stalled)")
                return
            if time.monotonic() > deadline:
                raise KVPeerError(p.name, "stalled", f"no RDMA completion within {self.stall_timeout} s")
            time.sleep(0.0002)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            with p.lock:
                p.close()
        with self._lock:
            reqs = list(self._reqs.values())
            self._reqs.clear()
        for q in reqs:   # their producer accesses end with them
            q._fail(KVError(f"kv request {q.req} from {q.peer}: agent {self.name} closed"))
        for mr in self.mrs:
            mr.close()
        self.mrs = []
        self.pd.close()

    def __enter__(self) -> "RdmaAgent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _VaMr:
    """A VA MR of plain host memory (a pool not made by p2phub)."""

    def __init__(self, pd: Any, addr: int, length: int) -> None:
        from pyverbs.mr import MR
        self._mr = MR(pd.pd, length, int(POOL_ACCESS), address=addr)
        self.addr, self.length, self.lkey, self.rkey = addr, length, self._mr.lkey, self._mr.rkey

    def close(self) -> None:
        self._mr.close()


def tp_int32(values: Sequence[int]):
    import array
    try:
        return array.array("i", values)
    except (OverflowError, TypeError) as exc:
        raise UsageError(f"block ids must be int32s: {exc}") from None

