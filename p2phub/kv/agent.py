"""The KV transfer agent: one per process, in the vocabulary serving stacks already use,
over TCP or, with ``rdma_devices``, RDMA (kv/rdma.py: the payload WRITTEN over every NIC
named, the TCP connection kept for control).

    a = Agent("prefill-0", pool=pool)            # registers the pool's segments
    b_md = rendezvous.lookup("decode-0")          # or a.handshake(host, port)
    peer = a.add_remote(b_md)
    x = a.send_request(peer, req=7, local_blocks=[3, 4, 9], remote_blocks=[12, 13, 40],
                       notif=b"req-7")            # one message per layer, posted
    x.wait(timeout=10)                            # or x.state == "DONE", or await x

    # on the decode side
    r = b.expect("prefill-0", 7)
    r.layer(0).wait(5)                           # layer 0 has landed: decode may start
    r.done.wait(5)                               # every layer has landed
    b.get_new_notifs()                           # {"prefill-0": [b"req-7"]}

Lower level, as in NIXL: ``prep_local`` / ``prep_remote`` make descriptor lists once, and
``make_xfer(peer, local, lidx, remote, ridx, notif)`` builds a transfer by index that
``post`` sends (and can send again once it is done).

Bounded failure: every transfer has a deadline (``xfer_timeout``, or ``post(x, timeout=)``,
``expect(..., deadline=)``) after which it fails; connected agents exchange heartbeats, so a
peer that dies, freezes or is cut off for ``peer_timeout`` seconds fails the transfers in
flight on both sides with a KVPeerError naming it; a send or receive that makes no progress
for ``stall_timeout`` fails too. A transfer's ``status`` is "pending", "done" or "failed",
and leaves "pending" by its deadline. A failed request never completes its fences;
connections to other peers and the pool stay usable, and the next transfer to the peer
connects anew: a peer restarted at the same address is taken under its name (its new
metadata comes with the handshake); one that moved is looked up again in the agent's
``rendezvous`` when it has one (else ``add_remote`` its new metadata).

Authenticated: every connection starts with a mutual challenge-response over the
deployment's secret (kv/auth.py: ``P2PHUB_KV_SECRET``, ``P2PHUB_KV_SECRET_FILE``, else a
per-user one good for loopback); a peer that does not prove it gets nothing and is closed.
Bounded: ``limits`` (kv.auth.KVLimits, from the environment by default) caps the connections
still proving, the time to prove, the runs of one message, the queue pairs of one
connection and the inbound connections of one peer; requests nobody released are dropped
past their deadline.
"""

from __future__ import annotations

import array
import errno
import itertools
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Iterable, Sequence

from .. import metrics
from ..errors import UsageError
from . import auth
from . import transport as tp
from ..ordering import AccessKind
from .errors import KVError, KVPeerError
from .layout import KVLayout
from .pool import KVPool
from .._resource import Resource

__all__ = ["Agent", "DescList", "RemoteAgent"]

log = logging.getLogger(__name__)

METADATA_VERSION = 1


class RemoteAgent:
    """What one peer published: its endpoint, segments and KV layout."""

    def __init__(self, md: dict) -> None:
        try:
            if md.get("v") != METADATA_VERSION:
                raise UsageError(f"KV metadata version {md.get('v')!r}, want {METADATA_VERSION}")
            self.name = str(md["name"])
            self.host = str(md["host"])
            self.port = int(md["port"])
            self.incarnation = int(md["incarnation"])
            self.segments = [(int(a), int(n)) for a, n in md["segments"]]
            self.layout = KVLayout.from_dict(md["layout"]) if md.get("layout") else None
            self.device = str(md.get("device", "cpu"))
            self.rdma: list[dict] = list(md.get("rdma") or [])   # its rails, if any
            devs = md.get("devices")
            self.devices = ([int(d) for d in devs] if devs is not None
                            else [-1] * len(self.segments))   # per segment: -1 host, or CUDA
            if len(self.devices) != len(self.segments):
                raise ValueError("one device per segment")
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, UsageError):
                raise
            raise UsageError(f"KV metadata is malformed: {exc!r}") from None

    def find(self, addr: int, length: int) -> tuple[int, int]:
        for i, (a, n) in enumerate(self.segments):
            if a <= addr and addr + length <= a + n:
                return i, addr - a
        raise UsageError(f"remote range {addr:#x}+{length} is in no segment {self.name!r} registered")


class DescList:
    """A prepared descriptor list: local (address, length) or remote (segment, offset, length)."""

    def __init__(self, agent: "Agent", peer: str | None, table: Any, count: int,
                 descs: list[tuple[int, int]]) -> None:
        self.agent = agent
        self.peer = peer
        self.table = table
        self.count = count
        self.descs = descs

    def __len__(self) -> int:
        return self.count


def _int32(values: Iterable[int] | array.array) -> array.array:
    if isinstance(values, array.array) and values.typecode == "i":
        return values
    try:
        return array.array("i", values)
    except (OverflowError, TypeError) as exc:
        raise UsageError(f"block/descriptor indices must be int32s: {exc}") from None


class Agent(Resource):
    """A KV transfer agent over TCP.

    ``stall_timeout``: seconds a send or receive may make no progress, and a transfer's
    last byte may wait for its acknowledgement. ``peer_timeout`` (default stall_timeout):
    seconds a connected peer may send nothing, not even a heartbeat (heartbeats go out every
    quarter of it), before it counts as dead and its transfers fail on both sides.
    ``xfer_timeout``: the deadline of every transfer posted and every request expected,
    in seconds (overridden per call). ``rendezvous``: where to publish this agent's metadata
    and look a peer up again when its address no longer answers (a restarted peer).

    ``rdma_devices``: the RDMA NICs this agent moves payload through (each one used, a
    request's runs striped across them); ``transport``: "auto" (RDMA to a peer that
    published rails when this agent has some, TCP otherwise), "tcp" or "rdma" (refuse a
    peer without rails). ``transport_to(peer)`` says which a peer gets.

    ``secret``: the key every connection proves (default: kv.auth.load_secret, from the
    environment or the per-user file); an agent bound beyond loopback needs one configured.
    ``limits``: kv.auth.KVLimits (default from the environment)."""

    def __init__(self, name: str, pool: KVPool | None = None, host: str = "127.0.0.1",
                 port: int = 0, stall_timeout: float = 5.0, *,
                 peer_timeout: float | None = None, xfer_timeout: float = 120.0,
                 rendezvous: Any = None, transport: str = "auto",
                 rdma_devices: Sequence[str] | None = None,
                 secret: bytes | str | None = None,
                 limits: auth.KVLimits | None = None) -> None:
        if not name or not isinstance(name, str):
            raise UsageError("agent name must be a non-empty string")
        if transport not in ("auto", "tcp", "rdma"):
            raise UsageError(f"transport={transport!r}: want 'auto', 'tcp' or 'rdma'")
        if transport == "rdma" and not rdma_devices:
            raise UsageError("transport='rdma' needs rdma_devices (the NICs to use)")
        if isinstance(rdma_devices, str):
            rdma_devices = [rdma_devices]
        for what, v in (("stall_timeout", stall_timeout), ("peer_timeout", peer_timeout),
                        ("xfer_timeout", xfer_timeout)):
            if v is not None and not v > 0:
                raise UsageError(f"{what}={v} must be > 0")
        if len(name.encode()) > auth.MAX_NAME:
            raise UsageError(f"agent name of {len(name.encode())} bytes: at most {auth.MAX_NAME}")
        self.limits = limits if limits is not None else auth.KVLimits.from_env()
        self._secret = auth.load_secret(secret)
        self.name = name
        self.stall_timeout = float(stall_timeout)
        self.peer_timeout = float(peer_timeout or stall_timeout)
        self.xfer_timeout = float(xfer_timeout)
        self.rendezvous = rendezvous
        self._live: set[tp.Xfer] = set()      # posted, not yet done: watched for deadlines
        self.transport = transport
        self.rails: Any = None                # kv.rdma.Rails: this agent's NICs
        if rdma_devices and transport != "tcp":
            from .rdma import Rails
            self.rails = Rails(list(rdma_devices))
        self.incarnation = int.from_bytes(os.urandom(6), "little")
        self._lock = threading.RLock()
        self._segments: list[tuple[int, int]] = []
        self._segdev: list[int] = []           # per segment: -1 host, else its CUDA ordinal
        self._any_cuda = False
        self._segidx = tp.SegmentIndex()
        self._segc: Any = None
        self._remotes: dict[str, RemoteAgent] = {}
        self._out: dict[str, tp.Connection] = {}
        self._in: dict[str, tp.Connection] = {}
        self._failed: list[tp.Connection] = []   # dropped, their threads maybe still ending
        self._inbound_reqs: dict[tuple[str, int], tp.InboundRequest] = {}
        self._notifs: dict[str, list[bytes]] = {}
        self._notif_cv = threading.Condition(self._lock)
        self._xids = itertools.count(1)
        self._closed = False
        self._conn_hooks = tp.ConnectionHooks(
            inbound=self._inbound, inbound_error=self._inbound_error, notified=self._notify,
            segment_table=self._seg_table, segment_devices=self._segment_devices,
            failed=self._connection_failed, run_cap=self._run_cap)
        self.pool: KVPool | None = None
        self.layout: KVLayout | None = None
        self.cuda_device: int | None = None   # a CUDA pool's device: transfers are staged
        self.stage_chunk = 4 << 20            # bytes per staging chunk (two per direction)
        self._proving = 0                     # accepted connections not yet proven
        self._gone: dict[tuple[str, int], BaseException] = {}   # pruned failed requests
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = self._listener.getsockname()[:2]
        if not self._secret.configured and not auth.is_loopback(self.host):
            self._listener.close()
            raise UsageError(
                f"agent {name!r}: listening on {self.host or host!r} (beyond loopback) needs a "
                f"deployment secret: set {auth.ENV_SECRET} or {auth.ENV_SECRET_FILE} (the "
                f"same on every agent); the per-user one ({self._secret.source}) is for "
                "agents of one user on one host")
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name=f"kv-accept-{name}")
        self._accept_thread.start()
        self._watch_thread = threading.Thread(target=self._watch_loop, daemon=True,
                                              name=f"kv-watch-{name}")
        self._watch_thread.start()
        if pool is not None:
            self.register_pool(pool)
        metrics.track_agent(self)
        if rendezvous is not None:
            rendezvous.publish(self.name, self.metadata())

    # ------------------------------------------------------------------ liveness, deadlines
    def _watch_loop(self) -> None:
        """Heartbeats on quiet connections; transfers and requests past their deadline fail."""
        period = min(self.peer_timeout / 4, 0.25)
        while not self._closed:
            time.sleep(period)
            with self._lock:
                conns = list(self._out.values()) + list(self._in.values())
                late = [x for x in self._live if x.deadline < time.monotonic()]
                overdue = [r for r in self._inbound_reqs.values()
                           if r.deadline < time.monotonic() and not r.done.done()]
                self._prune_inbound()
            for c in conns:
                c.heartbeat(self.peer_timeout / 4)
            for x in late:
                self._expire(x)
            for r in overdue:
                r._fail(KVPeerError(r.peer, "timed out", f"request {r.req} not complete "
                                    f"within its deadline ({r.deadline - r.created:.1f} s)"))

    def _prune_inbound(self) -> None:
        """Forget requests nobody released, a grace period past their deadline (a last
        message still on its way is answered with ERR for a failed one: its error is kept,
        for a bounded number of them). Under the agent lock."""
        grace = 2 * max(self.stall_timeout, self.peer_timeout)
        now = time.monotonic()
        old = [k for k, r in self._inbound_reqs.items()
               if r.deadline + grace < now and r.done.done()]
        for k in old:
            r = self._inbound_reqs.pop(k)
            if r.error is not None:
                self._gone[k] = r.error
        while len(self._gone) > 4096:
            del self._gone[next(iter(self._gone))]

    def _run_cap(self) -> tuple[int, str]:
        """The most runs one inbound message may have, and the limit that says so: the
        agent's max_runs, and with a KV pool alone registered, its pages."""
        cap, why = self.limits.max_runs, "max_runs, P2PHUB_KV_MAX_RUNS"
        lay, pool = self.layout, self.pool
        if lay is not None and pool is not None and len(self._segments) == len(pool.segments):
            pages = lay.num_layers * lay.kv * lay.blocks_per_layer
            if pages < cap:
                cap, why = pages, "the pages of this agent's KV layout"
        return cap, why

    def _expire(self, x: tp.Xfer) -> None:
        """Fail `x` past its deadline. One whose bytes are on the wire takes its connection
        with it (the stream cannot be cut mid-message; the receiver fails the request and
        the next transfer reconnects); one still queued is never sent."""
        exc = KVPeerError(x.peer, "timed out", f"transfer {x.id} not done within its "
                          f"deadline ({x.timeout:.1f} s)")
        if x.started:
            with self._lock:
                conn = self._out.get(x.peer)
            if conn is not None:
                conn._fail_transfer(x, exc)
                return
        x._finish(exc)

    # ------------------------------------------------------------------ memory
    def register_memory(self, addr: int, length: int, registration: Any = None, *,
                        device: int | None = None) -> int:
        """Register a range for transfers; returns its segment index. `device` None: host
        memory; an int: memory of that CUDA device (VRAM), moved over TCP through pinned
        staging buffers. With RDMA rails a host range becomes an MR on each (``reg_mr`` on
        `registration`, a p2phub registration of exactly that range, else a VA MR); a CUDA
        range does too where it has a registration the NIC can map (``reg_mr``: dma-buf or
        peer memory), and otherwise this agent moves payload over TCP (staged), or refuses
        under transport='rdma'."""
        if addr <= 0 or length <= 0:
            raise UsageError(f"register_memory: address {addr:#x} / length {length} must be > 0")
        if device is not None:
            if not isinstance(device, int) or device < 0:
                raise UsageError(f"register_memory: device={device!r} must be a CUDA ordinal >= 0")
            from . import cuda
            cuda.driver().primary_context(device)   # UsageError where there is no CUDA
        h = tp.hot()
        if self.rails is not None:
            try:
                if device is not None and registration is None:
                    raise UsageError("CUDA memory without a p2phub registration has no RDMA MR")
                self.rails.add_segment(addr, length, registration)
            except Exception as exc:
                if device is None or self.transport == "rdma":
                    raise
                log.info("kv %s: cuda:%d memory cannot be an RDMA MR (%s); payload goes over "
                         "TCP, staged through pinned host memory", self.name, device, exc)
                self.rails.close()
                self.rails = None
        with self._lock:
            self._segments.append((addr, length))
            self._segdev.append(-1 if device is None else device)
            self._any_cuda = self._any_cuda or device is not None
            self._segidx.add(addr, length)
            self._segc = None       # the C table is built again when next used: a pool
            return len(self._segments) - 1   # registered page by page costs one build

    def register_pool(self, pool: KVPool) -> None:
        """Register every segment of `pool` (once); its layout is published with the metadata."""
        if self.pool is not None:
            raise UsageError(f"agent {self.name!r} already has a KV pool")
        if pool.device == "cuda" and pool.cuda_device is not None:
            from . import cuda
            drv = cuda.driver()   # UsageError where there is no CUDA
            drv.primary_context(pool.cuda_device)
        elif pool.device != "cpu":
            raise UsageError(f"the TCP transport moves host or CUDA memory; this pool is on "
                             f"{pool.device} (use the RDMA transport, or a host staging pool)")
        if pool.closed:
            raise UsageError("the KV pool is closed")
        if self._segments:
            raise UsageError("register the KV pool before any other memory (segment ids 0..n-1)")
        dev = pool.cuda_device if pool.device == "cuda" else None
        if dev is not None and self.rails is not None and self.transport == "rdma" and any(
                s.registration is None for s in pool.segments):
            raise UsageError("transport='rdma' needs an RDMA MR of every segment; this CUDA pool "
                             "has no p2phub registration (KVPool.from_tensors has; or use "
                             "transport='auto' or 'tcp': it is staged over TCP)")
        for s in pool.segments:
            self.register_memory(s.addr, s.length, s.registration, device=dev)
        if pool.device == "cuda":
            self.cuda_device = pool.cuda_device
        self.pool = pool
        self.layout = pool.layout

    @property
    def segments(self) -> list[tuple[int, int]]:
        """(address, length) of every registered segment, by segment id (a copy)."""
        with self._lock:
            return list(self._segments)

    def _segment_devices(self) -> list[int] | None:
        return None if not self._any_cuda else self._segdev

    def _inbound_error(self, peer: str, req: int) -> BaseException | None:
        with self._lock:
            r = self._inbound_reqs.get((peer, req))
            return self._gone.get((peer, req)) if r is None else r.error

    def _seg_table(self) -> tuple[Any, int]:
        with self._lock:
            if self._segc is None and self._segments:
                c = tp.hot().ffi.new("struct kv_iov[]", len(self._segments))
                for i, (a, n) in enumerate(self._segments):
                    c[i].addr, c[i].len = a, n
                self._segc = c
            return (self._segc if self._segc is not None else tp.hot().ffi.NULL), len(self._segments)

    # ------------------------------------------------------------------ metadata
    def metadata(self) -> bytes:
        """This agent as bytes for a peer's add_remote (endpoint, segments, layout)."""
        return json.dumps({
            "v": METADATA_VERSION, "name": self.name, "host": self.host, "port": self.port,
            "incarnation": self.incarnation, "segments": self._segments,
            "device": "cpu" if self.cuda_device is None else "cuda",
            "devices": self._segdev,
            "layout": self.layout.to_dict() if self.layout else None,
            "rdma": self.rails.metadata() if self.rails is not None else None,
        }).encode()

    def transport_to(self, peer: str) -> str:
        """"rdma" or "tcp": how payload goes to `peer` (RDMA when both ends have rails and
        this agent was not told "tcp"). A peer without rails under transport="rdma" is
        refused (UsageError)."""
        ra = self.remote(peer)
        if self.rails is not None and ra.rdma:
            return "rdma"
        if self.transport == "rdma":
            raise UsageError(f"transport='rdma' but peer {peer!r} published no RDMA rails")
        return "tcp"

    def rail_bytes(self) -> dict[str, int]:
        """Payload bytes WRITTEN through each of this agent's NICs (empty without RDMA)."""
        return self.rails.stats() if self.rails is not None else {}

    def add_remote(self, md: bytes | str | dict) -> str:
        """Load a peer's metadata (replacing what was known of it: a restarted peer)."""
        if isinstance(md, (bytes, str)):
            try:
                md = json.loads(md)
            except json.JSONDecodeError as exc:
                raise UsageError(f"KV metadata is not JSON: {exc}") from None
        if not isinstance(md, dict):
            raise UsageError("KV metadata must be a JSON object")
        ra = RemoteAgent(md)
        if ra.name == self.name and ra.incarnation == self.incarnation:
            raise UsageError("add_remote: that is this agent's own metadata")
        with self._lock:
            old = self._remotes.get(ra.name)
            self._remotes[ra.name] = ra
            stale = self._out.pop(ra.name, None) if old and old.incarnation != ra.incarnation else None
        if stale is not None:
            stale.close()
        return ra.name

    def _check_hello(self, peer: str, ra: RemoteAgent, hello: dict) -> RemoteAgent:
        """The peer's handshake answer: the agent wanted, or that agent restarted at the same
        address (its new metadata taken, checked as add_remote checks it, so a changed
        layout is refused and not mixed up). Returns what is known of it now."""
        if hello.get("name") != peer:
            raise KVPeerError(peer, "restarted",
                              f"{ra.host}:{ra.port} is now agent {hello.get('name')!r}; "
                              "add_remote the new metadata of the one wanted")
        if int(hello.get("incarnation", -1)) == ra.incarnation:
            return ra
        try:
            return self._adopt(peer, hello.get("metadata"))
        except UsageError as exc:
            raise KVPeerError(peer, "restarted", f"{ra.host}:{ra.port} restarted with "
                              f"metadata that does not fit: {exc}") from None

    def _adopt(self, peer: str, md: Any) -> RemoteAgent:
        """Load the metadata a restarted `peer` sent in its handshake (keeping the
        connection this is called from)."""
        if not md:
            raise UsageError("its handshake carried no metadata")
        new = RemoteAgent(json.loads(md) if isinstance(md, (str, bytes)) else md)
        if new.name != peer:
            raise UsageError(f"its metadata names {new.name!r}")
        old = self.remote(peer)
        if (old.layout is None) != (new.layout is None) or (
                old.layout is not None and old.layout.to_dict() != new.layout.to_dict()):
            raise UsageError("its KV layout changed")
        log.info("kv peer %r restarted (incarnation %d -> %d); reconnecting under its name",
                 peer, old.incarnation, new.incarnation)
        with self._lock:
            self._remotes[peer] = new
        return new

    def _lookup_again(self, peer: str, old: RemoteAgent) -> RemoteAgent | None:
        """`peer`'s metadata from the rendezvous, if it has moved (a restart elsewhere)."""
        if self.rendezvous is None:
            return None
        try:
            md = self.rendezvous.lookup(peer, self.stall_timeout)
        except Exception as exc:   # the rendezvous is down too: report the first failure
            log.info("kv peer %r: rendezvous lookup failed: %s", peer, exc)
            return None
        try:
            new = RemoteAgent(json.loads(md) if isinstance(md, (bytes, str)) else md)
        except (UsageError, json.JSONDecodeError):
            return None
        if new.incarnation == old.incarnation or new.name != peer:
            return None
        self.add_remote(md)
        return self.remote(peer)

    def remove_remote(self, name: str) -> None:
        with self._lock:
            self._remotes.pop(name, None)
            conn = self._out.pop(name, None)
        if conn is not None:
            conn.close()

    def remote(self, name: str) -> RemoteAgent:
        with self._lock:
            ra = self._remotes.get(name)
        if ra is None:
            raise UsageError(f"unknown KV peer {name!r}: add_remote() its metadata first")
        return ra

    def handshake(self, host: str, port: int, timeout: float | None = None) -> str:
        """Direct TCP handshake with the agent listening at host:port, nothing else needed:
        each side learns the other's metadata. Returns the peer's name."""
        timeout = timeout or self.stall_timeout
        try:
            s = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise KVPeerError(f"{host}:{port}", "unreachable",
                              f"handshake: {exc.strerror or exc}") from None
        with s:
            try:
                peer = self.prove(s, timeout, f"{host}:{port}")
            except auth.KVAuthError as exc:
                raise KVPeerError(f"{host}:{port}", "unauthenticated", str(exc)) from None
            body = json.dumps({"name": self.name, "incarnation": self.incarnation,
                               "want": "metadata", "metadata": self.metadata().decode()}).encode()
            s.sendall(tp.HDR.pack(tp.MAGIC, tp.HELLO, 0, 0, 0, 0, len(body), 0) + body)
            reply = tp.recv_hello(s, timeout)
        if "metadata" not in reply:
            raise KVError(f"handshake with {host}:{port}: no metadata in the reply")
        md = json.loads(reply["metadata"])
        if not isinstance(md, dict) or md.get("name") != peer:
            raise KVError(f"handshake with {host}:{port}: it proved the name {peer!r} but sent "
                          f"metadata of another agent")
        log.debug("%s: handshake with %s:%d", self.name, host, port)
        return self.add_remote(md)

    def prove(self, sock: socket.socket, timeout: float, where: str) -> str:
        """The client's side of the mutual challenge-response on a fresh connection to
        another agent; returns the name that agent proved (kv.auth.KVAuthError if none)."""
        return auth.client_handshake(sock, self._secret, self.name, timeout, where)

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            where = _where(addr)
            with self._lock:
                full = self._proving >= self.limits.max_unauthenticated
                if not full:
                    self._proving += 1
            if full:
                self._auth_failed("too_many", f"{where}: closed at once: "
                                  f"{self.limits.max_unauthenticated} connections are still "
                                  "proving the KV secret (max_unauthenticated, "
                                  "P2PHUB_KV_MAX_UNAUTHENTICATED)")
                sock.close()
                continue
            try:
                threading.Thread(target=self._accept_one, args=(sock, where), daemon=True,
                                 name=f"kv-accept-{self.name}").start()
            except RuntimeError as exc:   # no thread to be had: this connection only
                with self._lock:
                    self._proving -= 1
                log.warning("kv %s: connection from %s closed: %s", self.name, where, exc)
                sock.close()

    def _auth_failed(self, reason: str, msg: str) -> None:
        log.warning("kv %s: refused %s", self.name, msg)
        metrics.kv_auth_failed(self.name, reason)

    def _accept_one(self, sock: socket.socket, where: str) -> None:
        try:
            try:
                peer = auth.server_handshake(sock, self._secret, self.name,
                                             self.limits.auth_timeout, where)
            finally:
                with self._lock:
                    self._proving -= 1
        except auth.KVAuthError as exc:
            self._auth_failed(exc.reason, str(exc))
            sock.close()
            return
        except Exception as exc:  # noqa: BLE001 - a bad handshake ends that socket only
            self._auth_failed("malformed", f"connection from {where}: {exc}")
            sock.close()
            return
        try:
            hello = tp.recv_hello(sock, self.stall_timeout)
            if hello.get("name") != peer:
                raise KVError(f"its HELLO names {hello.get('name')!r}, but it proved {peer!r}")
            if hello.get("want") == "metadata":
                md = json.loads(hello["metadata"])
                if not isinstance(md, dict) or md.get("name") != peer:
                    raise KVError(f"{peer!r} sent metadata of another agent "
                                  f"({md.get('name') if isinstance(md, dict) else None!r})")
                self.add_remote(md)
                body = json.dumps({"name": self.name, "metadata": self.metadata().decode()}).encode()
                sock.sendall(tp.HDR.pack(tp.MAGIC, tp.HELLO, 0, 0, 0, 0, len(body), 0) + body)
                sock.close()
                return
            self._check_peer_conns(peer)
            link = None
            if hello.get("qps") and self.rails is not None:
                from .rdma import Link
                nq = len(hello["qps"])
                if nq > self.limits.max_qps or nq != len(hello.get("rdma") or []):
                    raise KVError(f"{nq} queue pairs asked for: one per rail it published "
                                  f"({len(hello.get('rdma') or [])}), at most "
                                  f"{self.limits.max_qps} (max_qps, P2PHUB_KV_MAX_QPS)")
                link = Link(self.rails, nq, peer)
                try:   # its MRs too, when it sent them: READs are answered by RDMA WRITE
                    link.connect(hello["qps"], hello.get("rdma") or None)
                except BaseException:
                    link.close()
                    raise
            tp.send_hello(sock, self.name, self.incarnation, self.metadata(),
                          extra={"qps": link.infos()} if link is not None else None)
            sock.settimeout(None)
            _tune(sock)
        except Exception as exc:  # noqa: BLE001 - a bad handshake ends that socket only
            log.info("kv %s: handshake of %r from %s refused: %s", self.name, peer, where, exc)
            why = f"{self.name}: {exc}".encode()[:tp.MAX_CTRL]   # it proved itself: tell it
            try:
                sock.sendall(tp.HDR.pack(tp.MAGIC, tp.ERR, 0, 0, 0, 0, len(why), 0) + why)
            except OSError:
                pass
            sock.close()
            return
        conn = tp.Connection(self, sock, peer, outbound=False,
                             incarnation=int(hello.get("incarnation", 0)), hooks=self._conn_hooks)
        conn.rdma = link
        with self._lock:
            old = self._in.get(peer)
            self._in[peer] = conn
        if old is not None:
            old.close()
        conn.start()

    def _check_peer_conns(self, peer: str) -> None:
        """Refuse one more inbound connection of `peer` when max_conns_per_peer of them
        (the one it would replace included) still have threads running."""
        with self._lock:
            cur = self._in.get(peer)
            n = sum(1 for c in self._failed if not c.outbound and c.peer == peer and c.alive())
            n += cur is not None
        if n >= self.limits.max_conns_per_peer:
            raise KVError(f"{n} connections of {peer!r} are still open (max_conns_per_peer="
                          f"{self.limits.max_conns_per_peer}, P2PHUB_KV_MAX_CONNS_PER_PEER)")

    def connect(self, peer: str) -> tp.Connection:
        """The open connection to `peer`, made now if there is none."""
        with self._lock:
            conn = self._out.get(peer)
            if conn is not None and not conn.down:
                return conn
        ra = self.remote(peer)
        try:
            sock = socket.create_connection((ra.host, ra.port), timeout=self.stall_timeout)
        except OSError as exc:
            moved = self._lookup_again(peer, ra)
            if moved is None:
                raise KVPeerError(peer, "unreachable",
                                  f"connect to {ra.host}:{ra.port}: {exc.strerror or exc} (a "
                                  "restarted peer needs its new metadata: add_remote, or give "
                                  "the agent a rendezvous)") from None
            ra = moved
            try:
                sock = socket.create_connection((ra.host, ra.port), timeout=self.stall_timeout)
            except OSError as exc2:
                raise KVPeerError(peer, "unreachable", f"connect to {ra.host}:{ra.port} (looked "
                                  f"up again): {exc2.strerror or exc2}") from None
        link = None
        try:
            if self.transport_to(peer) == "rdma":
                from .rdma import Link
                link = Link(self.rails, len(self.rails), peer)
        except BaseException:
            sock.close()
            raise
        try:
            _tune(sock)
            try:
                proven = self.prove(sock, self.stall_timeout, f"{ra.host}:{ra.port}")
            except auth.KVAuthError as exc:
                raise KVPeerError(peer, "unauthenticated", str(exc)) from None
            if proven != peer:
                raise KVPeerError(peer, "restarted", f"{ra.host}:{ra.port} is now agent "
                                  f"{proven!r}; add_remote the new metadata of the one wanted")
            tp.send_hello(sock, self.name, self.incarnation,
                          extra={"qps": link.infos(), "rdma": self.rails.metadata()}
                          if link is not None else None)
            hello = tp.recv_hello(sock, self.stall_timeout)
            sock.settimeout(None)
            ra = self._check_hello(peer, ra, hello)
            if link is not None:   # after _check_hello: a restarted peer's MRs are new
                if not hello.get("qps"):
                    raise KVError("the peer answered without queue pairs (it has no RDMA rails "
                                  "now)")
                link.connect(hello["qps"], ra.rdma)
        except BaseException as exc:
            sock.close()
            if link is not None:
                link.close()
            if isinstance(exc, (OSError, TypeError, ValueError)) or (
                    isinstance(exc, KVError) and not isinstance(exc, KVPeerError)):
                raise KVPeerError(peer, "unreachable",
                                  f"handshake with {ra.host}:{ra.port}: {exc}") from None
            raise
        conn = tp.Connection(self, sock, peer, outbound=True, incarnation=ra.incarnation,
                             hooks=self._conn_hooks)
        conn.rdma = link
        log.info("kv %s -> %s: %s", self.name, peer,
                 f"RDMA over {', '.join(self.rails.devices)}" if link is not None else "TCP")
        with self._lock:
            self._out[peer] = conn
        conn.start()
        return conn

    def _connection_failed(self, conn: tp.Connection, exc: BaseException) -> None:
        if not self._closed:
            log.info("kv %s: connection %s %r ended: %s", self.name,
                     "to" if conn.outbound else "from", conn.peer, exc)
        with self._lock:
            table = self._out if conn.outbound else self._in
            if table.get(conn.peer) is conn:
                del table[conn.peer]
            self._failed = [c for c in self._failed if c.alive()] + [conn]
            waiting = [r for (p, _), r in self._inbound_reqs.items()
                       if p == conn.peer and not r.done.done()] if not conn.outbound else []
        for r in waiting:  # the peer is gone: nothing it owed us will arrive
            r._fail(exc)

    # ------------------------------------------------------------------ receiving side
    def _inbound(self, peer: str, req: int, deadline: float | None = None) -> tp.InboundRequest:
        with self._lock:
            r = self._inbound_reqs.get((peer, req))
            if r is None:
                dl = time.monotonic() + (self.xfer_timeout if deadline is None else deadline)
                r = self._inbound_reqs[(peer, req)] = tp.InboundRequest(peer, req, self.layout, dl)
                self._gone.pop((peer, req), None)
            elif deadline is not None and not r.done.done():
                r.deadline = time.monotonic() + deadline
            return r

    def expect(self, peer: str, req: int, blocks: Sequence[int] | None = None,
               timeout: float | None = None, *,
               deadline: float | None = None) -> tp.InboundRequest:
        """The receiving side of request `req` from `peer`: ``layer(l)`` and ``done`` fences.

        With `blocks` (the pages the request fills), each layer's pages become a producer
        access of the pool's registrations, completed by that layer's fence, so a consumer
        of those pages (an NVMe write, a GPU kernel) waits for its layer and fails with the
        request. This first waits (up to `timeout`) for earlier readers of the pages; strict
        ordering raises instead. Call it before the sender starts.

        `deadline` (seconds from now, default the agent's xfer_timeout): a request not
        complete by then fails (KVPeerError "timed out"), and so does the sender's transfer."""
        if deadline is not None and not deadline > 0:
            raise UsageError(f"deadline={deadline} must be > 0 seconds")
        r = self._inbound(peer, req, deadline)
        if blocks is not None:
            if self.pool is None:
                raise UsageError(f"agent {self.name!r} has no KV pool to declare blocks on")
            layers = range(self.pool.layout.num_layers)
            try:
                with self._lock:
                    ra = self._remotes.get(peer)
                rdma = self.rails is not None and ra is not None and bool(ra.rdma)
                self.pool.declare(blocks, layers,
                                  AccessKind.RDMA_WRITE_TARGET if rdma else AccessKind.SOCKET_RECV,
                                  [r.layer(ly) for ly in layers],
                                  f"kv request {req} from {peer}", timeout)
            except BaseException as exc:
                r._fail(exc)
                self.release(peer, req)
                raise
        return r

    def release(self, peer: str, req: int) -> None:
        """Forget `req`; one that did not complete fails (its pages never become visible)."""
        with self._lock:
            r = self._inbound_reqs.pop((peer, req), None)
        if r is not None:
            r._fail(KVError(f"kv request {req} from {peer} was released before it completed"))

    def _notify(self, peer: str, body: bytes) -> None:
        with self._lock:
            self._notifs.setdefault(peer, []).append(body)
            self._notif_cv.notify_all()

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call, by peer name."""
        with self._lock:
            out, self._notifs = self._notifs, {}
            return out

    def wait_notif(self, peer: str, msg: bytes, timeout: float) -> None:
        """Block until `peer` sent notification `msg` (kept for get_new_notifs otherwise)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                lst = self._notifs.get(peer, [])
                if msg in lst:
                    lst.remove(msg)
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no notification {msg!r} from {peer!r} within {timeout} s")
                self._notif_cv.wait(left)

    # ------------------------------------------------------------------ sending side: KV
    def _plan_layer(self, ra: RemoteAgent, layer: int, lids: array.array, rids: array.array,
                    req: int) -> tp.Message:
        h = tp.hot()
        lay, rlay = self.layout, ra.layout
        assert lay is not None and rlay is not None and self.pool is not None
        n = len(lids)
        cap = max(1, n * lay.kv)
        liov = h.ffi.new("struct kv_iov[]", cap)
        wire = h.ffi.new("struct kv_wire[]", cap)
        bad = h.ffi.new("size_t *")
        used = 0
        lp, rp = h.ffi.from_buffer("int32_t[]", lids), h.ffi.from_buffer("int32_t[]", rids)
        for kv in range(lay.kv):
            lseg, lbase = lay.block_base(layer, kv)
            rseg, rbase = rlay.block_base(layer, kv)
            rc = h.lib.kv_plan(lp, rp, n, self.pool.segments[lseg].addr + lbase,
                               lay.blocks_per_layer, rseg, rbase, rlay.blocks_per_layer,
                               lay.block_bytes, liov + used, wire + used, cap - used, bad)
            if rc == -errno.ERANGE:
                i = bad[0]
                raise UsageError(f"request {req}: pair {i} (local block {lids[i]}, remote block "
                                 f"{rids[i]}) is outside the pools ({lay.blocks_per_layer} local, "
                                 f"{rlay.blocks_per_layer} remote blocks per layer)")
            if rc < 0:
                raise KVError(f"request {req}: planning runs failed ({rc})")
            used += rc
        m = tp.Message(tp.DATA, req, layer, wire, liov, used, n * lay.kv * lay.block_bytes)
        m.dev = -1 if self.cuda_device is None else self.cuda_device
        return m

    def make_request(self, peer: str, req: int, local_blocks: Sequence[int],
                     remote_blocks: Sequence[int], layers: Iterable[int] | None = None,
                     notif: bytes = b"", end: bool = True) -> tp.Xfer:
        """A transfer of request `req`'s pages: for every layer (default all), K and V of
        local_blocks[i] -> remote_blocks[i]. One message per layer; the receiver completes
        that layer's fence when its message has landed. ``end`` marks the request complete
        after the last of these layers (``done`` on the receiver)."""
        if self.layout is None or self.pool is None:
            raise UsageError(f"agent {self.name!r} has no KV pool")
        ra = self.remote(peer)
        if ra.layout is None:
            raise UsageError(f"peer {peer!r} published no KV layout")
        self.layout.check_compatible(ra.layout)
        if not isinstance(req, int) or not 0 <= req < 1 << 64:
            raise UsageError(f"request id {req!r} must be an int in [0, 2^64)")
        lids, rids = _int32(local_blocks), _int32(remote_blocks)
        if len(lids) != len(rids):
            raise UsageError(f"{len(lids)} local blocks but {len(rids)} remote blocks")
        layer_list = list(range(self.layout.num_layers) if layers is None else layers)
        for ly in layer_list:
            self.layout.check_layer(ly)
        msgs = [self._plan_layer(ra, ly, lids, rids, req) for ly in layer_list]
        if notif:
            msgs.append(tp.Message(tp.NOTIF, req, 0, body=bytes(notif)))
        if not msgs:
            raise UsageError("a transfer needs at least one layer or a notification")
        if end:
            msgs[-1].last = True  # F_REQ_END carried in the header (see post)
        x = tp.Xfer(peer, msgs, next(self._xids))
        x.reads = (lids, layer_list)
        return x

    def send_request(self, peer: str, req: int, local_blocks: Sequence[int],
                     remote_blocks: Sequence[int], layers: Iterable[int] | None = None,
                     notif: bytes = b"", end: bool = True, *,
                     timeout: float | None = None) -> tp.Xfer:
        """make_request + post (`timeout`: the transfer's deadline, as for post)."""
        x = self.make_request(peer, req, local_blocks, remote_blocks, layers, notif, end)
        self.post(x, timeout)
        return x

    # ------------------------------------------------------------------ sending side: NIXL-like
    def prep_local(self, descs: Sequence[tuple[int, int]]) -> DescList:
        """(address, length) ranges inside this agent's registered segments."""
        h = tp.hot()
        c = h.ffi.new("struct kv_iov[]", max(1, len(descs)))
        look = tp.RangeLookup(list(self._segments))   # sorted: vLLM prepares thousands at once
        for i, (a, n) in enumerate(descs):
            if look.find(a, n) is None:
                raise UsageError(f"local descriptor {i} ({a:#x}+{n}) is in no registered segment")
            c[i].addr, c[i].len = a, n
        return DescList(self, None, c, len(descs), list(descs))

    def prep_remote(self, peer: str, descs: Sequence[tuple[int, int]]) -> DescList:
        """(address, length) ranges inside `peer`'s registered segments (by its metadata)."""
        h = tp.hot()
        ra = self.remote(peer)
        c = h.ffi.new("struct kv_wire[]", max(1, len(descs)))
        look = tp.RangeLookup(ra.segments)
        for i, (a, n) in enumerate(descs):
            if n <= 0:
                raise UsageError(f"remote descriptor {i}: length {n}")
            seg = look.find(a, n)
            if seg is None:
                raise UsageError(f"remote range {a:#x}+{n} is in no segment {peer!r} registered")
            c[i].seg, c[i].off, c[i].len = seg, a - ra.segments[seg][0], n
        return DescList(self, peer, c, len(descs), list(descs))

    def make_xfer(self, peer: str, local: DescList, local_idx: Sequence[int], remote: DescList,
                  remote_idx: Sequence[int], notif: bytes = b"", req: int = 0,
                  op: str = "WRITE") -> tp.Xfer:
        """Move local[local_idx[i]] to remote[remote_idx[i]] for every i ("WRITE"), or the
        other way ("READ": the peer sends them back), as NIXL's make_prepped_xfer;
        contiguous neighbours merge into one run. A notification reaches the peer after."""
        if op not in ("WRITE", "READ"):
            raise UsageError(f"op {op!r} must be 'WRITE' or 'READ'")
        if remote.peer != peer or local.peer is not None:
            raise UsageError("make_xfer: want a local list and a list prepared for this peer")
        ra = self.remote(peer)
        h = tp.hot()
        li, ri = _int32(local_idx), _int32(remote_idx)
        if len(li) != len(ri):
            raise UsageError(f"{len(li)} local indices but {len(ri)} remote indices")
        n = len(li)
        liov = h.ffi.new("struct kv_iov[]", max(1, n))
        wire = h.ffi.new("struct kv_wire[]", max(1, n))
        bad = h.ffi.new("size_t *")
        total = h.ffi.new("uint64_t *")
        rc = h.lib.kv_plan_descs(h.ffi.from_buffer("int32_t[]", li), h.ffi.from_buffer("int32_t[]", ri),
                                 n, local.table, local.count, remote.table, remote.count,
                                 liov, wire, max(1, n), bad, total)
        if rc == -errno.ERANGE:
            raise UsageError(f"index pair {bad[0]} ({li[bad[0]]}, {ri[bad[0]]}) is outside the "
                             f"lists ({local.count} local, {remote.count} remote)")
        if rc == -errno.EINVAL:
            raise UsageError(f"index pair {bad[0]}: local and remote descriptors differ in length")
        msgs = self._by_device(tp.DATA if op == "WRITE" else tp.READ, req, ra, wire, liov, rc,
                               int(total[0]))
        if op == "READ" and self.rails is not None and ra.rdma:
            for m in msgs:
                if m.dev < 0:
                    m.dest = self._dest_runs(m.iov, m.nruns)
        if notif:
            msgs.append(tp.Message(tp.NOTIF, req, 0, body=bytes(notif)))
        return tp.Xfer(peer, msgs, next(self._xids))

    def _dest_runs(self, iov: Any, n: int) -> tuple[Any, Any]:
        """Where a READ's runs land here, as (segment, offset, length) wire runs, and one
        iov of that table to send beside the READ (the peer WRITEs the bytes there)."""
        h = tp.hot()
        segs = self.rails.segments
        table = h.ffi.new("struct kv_wire[]", max(1, n))
        for i in range(n):
            a, ln = int(iov[i].addr), int(iov[i].len)
            k = segs.find(a, ln)
            table[i].seg, table[i].off, table[i].len = k, a - segs.base(k), ln
        one = h.ffi.new("struct kv_iov[]", 1)
        one[0].addr = int(h.ffi.cast("uintptr_t", table))
        one[0].len = n * tp.WIRE_RUN
        return table, one

    def _by_device(self, type_: int, req: int, ra: RemoteAgent, wire: Any, liov: Any, n: int,
                   total: int) -> list[tp.Message]:
        """One message per (local device, remote device) pair of the planned runs (a message
        is staged through one device's buffers on each side); READ messages carry their
        index in the layer field, which the answer echoes."""
        if not self._any_cuda and all(d < 0 for d in ra.devices):
            return [tp.Message(type_, req, 0, wire, liov, n, total)]
        groups: dict[tuple[int, int], list[int]] = {}
        for i in range(n):
            ldev = self._segdev[self._segidx.find(liov[i].addr, liov[i].len)]
            groups.setdefault((ldev, ra.devices[wire[i].seg]), []).append(i)
        h = tp.hot()
        msgs = []
        for k, ((ldev, _rdev), idx) in enumerate(groups.items()):
            if len(groups) == 1:
                lv, wv = liov, wire
            else:
                lv = h.ffi.new("struct kv_iov[]", len(idx))
                wv = h.ffi.new("struct kv_wire[]", len(idx))
                for j, i in enumerate(idx):
                    lv[j], wv[j] = liov[i], wire[i]
            m = tp.Message(type_, req, k if type_ == tp.READ else 0, wv, lv, len(idx),
                           sum(int(liov[i].len) for i in idx))
            m.dev = ldev
            msgs.append(m)
        return msgs

    def send_notif(self, peer: str, msg: bytes, timeout: float | None = None) -> None:
        """A notification alone (ordered after every transfer posted to `peer` before it)."""
        self.remote(peer)
        x = tp.Xfer(peer, [tp.Message(tp.NOTIF, 0, 0, body=bytes(msg))], next(self._xids))
        self.post(x)
        x.wait(timeout or self.stall_timeout * 2)

    def post(self, xfer: tp.Xfer, timeout: float | None = None) -> str:
        """Send `xfer` (again, once it is done). Returns its state: "PROC", or "ERR" at once
        when the peer cannot be reached (xfer.error says why). It fails ("timed out") if
        not acknowledged within `timeout` seconds (default the agent's xfer_timeout)."""
        if self._closed:
            raise UsageError(f"agent {self.name!r} is closed")
        if timeout is not None and not timeout > 0:
            raise UsageError(f"timeout={timeout} must be > 0 seconds")
        if xfer.fence.done():
            xfer._reset(next(self._xids))
        elif xfer.posted:
            raise UsageError(f"kv xfer {xfer.id} is still in flight; one post at a time")
        if xfer.reads is not None and self.pool is not None:
            # The pages it sends: consumers until the receiver acknowledged them (or the
            # transfer failed); this waits for earlier writers of those pages.
            pages, layers = xfer.reads
            try:
                kind = (AccessKind.RDMA_SEND if self.transport_to(xfer.peer) == "rdma"
                        else AccessKind.SOCKET_SEND)
                self.pool.declare(pages, layers, kind, [xfer.fence] * len(layers),
                                  f"kv xfer {xfer.id} to {xfer.peer}", None)
            except BaseException as exc:
                xfer._finish(exc)    # ends the accesses declared so far
                raise
        xfer.posted = time.monotonic()
        xfer.timeout = self.xfer_timeout if timeout is None else float(timeout)
        xfer.deadline = xfer.posted + xfer.timeout
        xfer.on_done = self._xfer_done
        with self._lock:
            self._live.add(xfer)
        try:
            conn = self.connect(xfer.peer)
        except KVPeerError as exc:
            xfer._finish(exc)
            return xfer.state
        conn.submit(xfer)
        return xfer.state

    def _xfer_done(self, x: tp.Xfer) -> None:
        metrics.kv_sent(self.name, x)
        x.posted = 0.0
        with self._lock:
            self._live.discard(x)

    # ------------------------------------------------------------------ lifetime
    def _close(self) -> None:
        self._closed = True     # at once: the agent's threads stop on it
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._out.values()) + list(self._in.values()) + self._failed
            self._out.clear()
            self._in.clear()
            self._failed = []
        for c in conns:
            c.close()
        if self.rails is not None:
            self.rails.close()
            self.rails = None

    def __repr__(self) -> str:
        return f"<kv.Agent {self.name!r} at {self.host}:{self.port}, {len(self._segments)} segments>"


def _where(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return f"[{addr[0]}]:{addr[1]}" if ":" in str(addr[0]) else f"{addr[0]}:{addr[1]}"
    return str(addr)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
