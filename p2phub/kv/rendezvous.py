"""Where agents find each other's metadata: stores serving stacks already run.

    rdv = open_rendezvous("tcpstore://127.0.0.1:29500")   # torch.distributed.TCPStore
    rdv = open_rendezvous("redis://127.0.0.1:6379/0")     # a Redis server
    rdv.publish(agent.name, agent.metadata())
    agent.add_remote(rdv.lookup("decode-0", timeout=30))

Two hosts with nothing else use the agents' direct handshake (Agent.handshake(host, port)).
Keys are ``p2phub/kv/<name>``; publishing again (a restarted agent) replaces the value.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Protocol
from urllib.parse import urlparse

from ..errors import UsageError
from .._resource import Resource
from .errors import KVError

__all__ = ["Rendezvous", "TCPStoreRendezvous", "RedisRendezvous", "open_rendezvous"]

PREFIX = "p2phub/kv/"


class Rendezvous(Protocol):
    def publish(self, name: str, metadata: bytes) -> None: ...
    def lookup(self, name: str, timeout: float = 30.0) -> bytes: ...
    def remove(self, name: str) -> None: ...
    def close(self) -> None: ...


class TCPStoreRendezvous(Resource):
    """torch.distributed.TCPStore: the store torchrun / vLLM / SGLang already start.
    ``is_master=True`` makes this process serve it (port 0 picks a free port: ``.port``)."""

    def __init__(self, host: str, port: int, is_master: bool = False, timeout: float = 30.0) -> None:
        try:
            from torch.distributed import TCPStore
        except ImportError as exc:
            raise KVError(f"tcpstore rendezvous needs torch (pip install torch): {exc}") from None
        self.store = TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout))
        self.host = host
        self.port = self.store.port

    def publish(self, name: str, metadata: bytes) -> None:
        self.store.set(PREFIX + name, metadata)

    def lookup(self, name: str, timeout: float = 30.0) -> bytes:
        key = PREFIX + name
        try:
            self.store.wait([key], timedelta(seconds=timeout))
        except Exception as exc:  # torch raises its own DistStoreError / RuntimeError
            raise TimeoutError(f"no KV agent {name!r} in the TCPStore at {self.host}:{self.port} "
                               f"within {timeout} s ({type(exc).__name__})") from None
        return bytes(self.store.get(key))

    def remove(self, name: str) -> None:
        self.store.delete_key(PREFIX + name)

    def _close(self) -> None:
        self.store = None  # type: ignore[assignment]


class RedisRendezvous(Resource):
    """A Redis server, spoken to in RESP directly (SET / GET / DEL; no client library)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, db: int = 0,
                 timeout: float = 5.0) -> None:
        self.host, self.port = host, port
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise KVError(f"redis rendezvous: connect to {host}:{port}: {exc.strerror or exc}") from None
        self._buf = b""
        if db:
            self._call(b"SELECT", str(db).encode())

    def _call(self, *args: bytes) -> bytes | int | None:
        out = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        self.sock.sendall(out)
        return self._reply()

    def _line(self) -> bytes:
        while b"\r\n" not in self._buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise KVError(f"redis at {self.host}:{self.port} closed the connection")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\r\n", 1)
        return line

    def _reply(self) -> bytes | int | None:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            raise KVError(f"redis: {rest.decode(errors='replace')}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self._buf) < n + 2:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise KVError(f"redis at {self.host}:{self.port} closed the connection")
                self._buf += chunk
            data, self._buf = self._buf[:n], self._buf[n + 2:]
            return data
        raise KVError(f"redis: unexpected reply {line[:40]!r}")

    def publish(self, name: str, metadata: bytes) -> None:
        self._call(b"SET", (PREFIX + name).encode(), metadata)

    def lookup(self, name: str, timeout: float = 30.0) -> bytes:
        deadline = time.monotonic() + timeout
        while True:
            v = self._call(b"GET", (PREFIX + name).encode())
            if isinstance(v, bytes):
                return v
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no KV agent {name!r} in redis at {self.host}:{self.port} "
                                   f"within {timeout} s")
            time.sleep(0.05)

    def remove(self, name: str) -> None:
        self._call(b"DEL", (PREFIX + name).encode())

    def _close(self) -> None:
        self.sock.close()


def open_rendezvous(url: str, is_master: bool = False, timeout: float = 30.0) -> Rendezvous:
    """``tcpstore://host:port`` or ``redis://host:port[/db]``."""
    u = urlparse(url)
    if not u.hostname or not u.port:
        raise UsageError(f"rendezvous {url!r}: want tcpstore://HOST:PORT or redis://HOST:PORT[/DB]")
    if u.scheme == "tcpstore":
        return TCPStoreRendezvous(u.hostname, u.port, is_master=is_master, timeout=timeout)
    if u.scheme == "redis":
        db = int(u.path.strip("/") or 0)
        return RedisRendezvous(u.hostname, u.port, db=db)
    raise UsageError(f"rendezvous {url!r}: scheme must be tcpstore or redis")
