"""The KV agent under the NIXL adapter: p2phub.kv.Agent, plus NIXL's metadata exchange
(partial metadata merged into what is known of a peer, invalidation by a peer), spoken
over the KV agent's own handshake (the secret proven both ways first, kv/auth.py) so
nothing else listens."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

from ..errors import UsageError
from ..kv import transport as tp
from ..kv.agent import Agent
from ..kv.auth import KVAuthError
from ..kv.errors import KVError
from .errors import nixlInvalidParamError, nixlRemoteDisconnectError

__all__ = ["NixlKVAgent", "exchange"]

_EMPTY = [0, 0]     # a segment slot a partial metadata leaves out (matches no address)


class NixlKVAgent(Agent):
    """p2phub.kv.Agent whose ``add_remote`` also takes NIXL's partial and invalidating
    metadata (marked ``"nixl": {"partial": true}`` / ``{"invalidate": true}``)."""

    def add_remote(self, md: bytes | str | dict) -> str:
        if isinstance(md, (bytes, str)):
            try:
                md = json.loads(md)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise UsageError(f"KV metadata is not JSON: {exc}") from None
        if not isinstance(md, dict):
            raise UsageError("KV metadata must be a JSON object")
        flags = md.get("nixl") or {}
        name = str(md.get("name", ""))
        if flags.get("invalidate"):
            self.remove_remote(name)
            return name
        if flags.get("partial"):
            with self._lock:
                old = self._remotes.get(name)
            if old is not None and old.incarnation == int(md.get("incarnation", -1)):
                segs = [list(s) for s in old.segments]
                for i, s in enumerate(md.get("segments", [])):
                    if list(s) != _EMPTY:
                        segs.extend([_EMPTY] * (i + 1 - len(segs)))
                        segs[i] = list(s)
                md = dict(md, segments=segs)
        return super().add_remote(md)

    def deregister_range(self, addr: int, length: int) -> None:
        """Take the registered segment (addr, length) out of service: its slot stays (segment
        ids are positional on the wire) but matches no address, so inbound runs into it are
        refused and the metadata shows an empty slot."""
        with self._lock:
            try:
                i = self._segidx.find(addr, length)
            except UsageError:
                i = -1
            if i < 0 or self._segments[i] != (addr, length):
                try:        # (overlapping segments: the index found another one)
                    i = self._segments.index((addr, length))
                except ValueError:
                    raise UsageError(f"{addr:#x}+{length} is not a registered segment") from None
            self._segments[i] = (0, 0)
            self._segidx.drop(i)
            if self.rails is not None:   # a peer's RDMA WRITE into it now fails at its NIC
                self.rails.drop_segment(i)
            self._segc = None       # built again when next used

    def metadata_dict(self, keep: list[tuple[int, int]] | None = None,
                      flags: dict | None = None) -> dict:
        """This agent's metadata; with `keep`, only the segments holding one of those
        (address, length) ranges (the others left as empty slots: segment ids stay put)."""
        md = json.loads(self.metadata())
        if keep is not None:
            md["segments"] = [
                [a, n] if any(a <= ka and ka + kn <= a + n for ka, kn in keep) else list(_EMPTY)
                for a, n in md["segments"]]
        if flags:
            md["nixl"] = flags
        return md


def exchange(agent: NixlKVAgent, host: str, port: int, md: dict, timeout: float) -> dict:
    """Send `md` to the agent listening at host:port (it loads it as a peer's metadata) and
    return the metadata it answers with. Retries a refused connection until `timeout`
    (the peer may still be starting)."""
    if not isinstance(port, int) or not 0 < port < 65536:
        raise nixlInvalidParamError(f"port {port!r} must be 1..65535")
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((host, port), timeout=timeout)
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise nixlRemoteDisconnectError(
                    f"no NIXL agent at {host}:{port}: {exc.strerror or exc}") from None
            time.sleep(0.05)
    with s:
        body = json.dumps({"name": agent.name, "incarnation": agent.incarnation,
                           "want": "metadata", "metadata": json.dumps(md)}).encode()
        try:
            peer = agent.prove(s, timeout, f"{host}:{port}")
            s.sendall(tp.HDR.pack(tp.MAGIC, tp.HELLO, 0, 0, 0, 0, len(body), 0) + body)
            reply = tp.recv_hello(s, timeout)
        except KVAuthError as exc:
            raise nixlRemoteDisconnectError(f"metadata exchange refused: {exc}") from None
        except (OSError, KVError) as exc:
            raise nixlRemoteDisconnectError(f"metadata exchange with {host}:{port}: {exc}") from None
    got: Any = reply.get("metadata")
    if not got:
        raise nixlRemoteDisconnectError(f"{host}:{port} answered the metadata exchange without metadata")
    out = json.loads(got)
    if not isinstance(out, dict) or out.get("name") != peer:
        raise nixlRemoteDisconnectError(f"{host}:{port} proved the name {peer!r} but answered "
                                        "with metadata of another agent")
    return out
