"""Who may talk to a KV agent: a mutual challenge-response over a per-deployment secret, and
the limits on what a connection may cost before and after it proved itself.

Every KV connection (the agents' control and data connections, the RDMA rendezvous riding on
them, the NIXL adapter's metadata exchange, ``p2phub kv serve/send``) starts with three AUTH
messages before anything else is said:

    client -> server  AUTH {"name": client name, "nonce": 32 random bytes, hex}
    server -> client  AUTH {"name": server name, "nonce": 32 random bytes, hex,
                            "mac": HMAC-SHA256(key, "server" | both nonces | both names)}
    client -> server  AUTH {"mac": HMAC-SHA256(key, "client" | both nonces | both names)}

Each side checks the other's MAC (``hmac.compare_digest``) before it sends anything of its
own (segments, metadata, rkeys, incarnation): a failed proof is one log line, one count in
``p2phub_kv_auth_failures_total`` and a closed connection. The client's name is bound to the
connection that proved it; its HELLO must carry the same name.

The key: ``P2PHUB_KV_SECRET`` (at least 16 bytes), or the file ``P2PHUB_KV_SECRET_FILE`` names
(owned by this user or root, no group or other access); with neither, a per-user secret that
this module creates (0600) in ``$XDG_RUNTIME_DIR/p2phub/kv-secret`` or
``/tmp/p2phub-<uid>/kv-secret``: two processes of one user on one host share it, other users
cannot read it. That one is good for loopback only: an agent bound beyond loopback without a
configured secret is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import stat
import struct
import tempfile
import threading
import time
from typing import Any

from ..errors import UsageError
from .errors import KVError

__all__ = ["KVAuthError", "KVLimits", "Secret", "load_secret", "client_handshake",
           "server_handshake", "is_loopback"]

log = logging.getLogger(__name__)

ENV_SECRET = "P2PHUB_KV_SECRET"
ENV_SECRET_FILE = "P2PHUB_KV_SECRET_FILE"
MIN_SECRET = 16            # bytes
MAX_SECRET = 4096          # bytes read of a secret file
NONCE = 32                 # bytes
MAX_AUTH = 1024            # bytes of an AUTH body
MAX_NAME = 256             # bytes of an agent name
PROTOCOL = b"p2phub-kv-auth-1"


class KVAuthError(KVError):
    """A KV connection did not prove the shared secret (or the secret cannot be had).
    ``reason``: "bad_proof", "no_proof", "timeout", "malformed" or "secret" (the metric's
    label)."""

    def __init__(self, msg: str, reason: str = "secret") -> None:
        super().__init__(msg)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class KVLimits:
    """What one agent lets connections cost. Each is read from ``P2PHUB_KV_<NAME upper>`` by
    ``from_env`` (docs/settings.md), and named in the error or log line when it is hit."""

    max_unauthenticated: int = 32     # connections accepted and not yet proven, at once
    auth_timeout: float = 5.0         # seconds from accept to the client's proof
    max_conns_per_peer: int = 4       # inbound connections (each a thread) per proven name
    max_runs: int = 1 << 20           # runs in one message's table (24 bytes each)
    max_qps: int = 16                 # RDMA queue pairs one connection may ask for

    @classmethod
    def from_env(cls) -> "KVLimits":
        vals: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            env = "P2PHUB_KV_" + f.name.upper()
            raw = os.environ.get(env)
            if raw is None or not raw.strip():
                continue
            try:
                v = float(raw) if f.type in (float, "float") else int(raw)
            except ValueError:
                raise UsageError(f"{env}={raw!r}: want a number") from None
            vals[f.name] = v
        return cls(**vals)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise UsageError(f"KV limit {f.name}={getattr(self, f.name)!r} must be > 0 "
                                 f"(P2PHUB_KV_{f.name.upper()})")


@dataclasses.dataclass(frozen=True)
class Secret:
    """The key and where it came from (for messages: never the key itself)."""

    key: bytes
    source: str
    configured: bool      # set for the deployment (not the per-user default)

    def __repr__(self) -> str:
        return f"Secret(from {self.source})"


# ------------------------------------------------------------------ the secret
def load_secret(value: bytes | str | None = None) -> Secret:
    """The secret: `value` when given, else ``P2PHUB_KV_SECRET``, else the file named by
    ``P2PHUB_KV_SECRET_FILE``, else the per-user one (made on first use)."""
    if value is not None:
        return Secret(_check_len(value.encode() if isinstance(value, str) else bytes(value),
                                 "the secret argument"), "the secret argument", True)
    env, path = os.environ.get(ENV_SECRET), os.environ.get(ENV_SECRET_FILE)
    if env and path:
        raise UsageError(f"both {ENV_SECRET} and {ENV_SECRET_FILE} are set: set one")
    if env:
        return Secret(_check_len(env.encode(), ENV_SECRET), ENV_SECRET, True)
    if path:
        return Secret(_read_secret_file(path, f"{ENV_SECRET_FILE}={path}"),
                      f"{ENV_SECRET_FILE}={path}", True)
    return _user_secret()


def _check_len(key: bytes, what: str) -> bytes:
    if len(key) < MIN_SECRET:
        raise UsageError(f"{what} is {len(key)} bytes; a KV secret needs at least {MIN_SECRET} "
                         "(e.g. `openssl rand -hex 32`)")
    return key


def _check_private(st: os.stat_result, what: str, allow_root: bool) -> None:
    uid = os.geteuid()
    if st.st_uid != uid and not (allow_root and st.st_uid == 0):
        raise KVAuthError(f"{what} is owned by uid {st.st_uid}, not by this user ({uid}): refused")
    if st.st_mode & 0o077:
        raise KVAuthError(f"{what} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may "
                          "use it; refused (chmod 0600 a file, 0700 a directory)")


def _read_secret_file(path: str, what: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise KVAuthError(f"{what}: cannot open it: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KVAuthError(f"{what} is not a regular file")
        _check_private(st, what, allow_root=True)
        key = os.read(fd, MAX_SECRET + 1)
    finally:
        os.close(fd)
    if len(key) > MAX_SECRET:
        raise KVAuthError(f"{what} is longer than {MAX_SECRET} bytes")
    return _check_len(key.strip(), what)


def user_secret_dir() -> str:
    """Where the per-user secret lives: $XDG_RUNTIME_DIR/p2phub where that directory is this
    user's and private, else /tmp/p2phub-<uid> (made 0700, or checked to be)."""
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        try:
            st = os.stat(run)
            if not stat.S_ISDIR(st.st_mode):
                raise KVAuthError(f"{run} is not a directory")
            _check_private(st, f"the runtime directory {run}", allow_root=False)
            return os.path.join(run, "p2phub")
        except (OSError, KVAuthError) as exc:   # e.g. another user's, kept across sudo
            log.info("XDG_RUNTIME_DIR=%s is not this user's private directory (%s); the "
                     "per-user KV secret goes under /tmp", run, exc)
    return os.path.join("/tmp", f"p2phub-{os.geteuid()}")


def _private_dir(d: str) -> None:
    """Make `d` (mode 0700) or check that it is this user's own private directory."""
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode):
        raise KVAuthError(f"{d} is not a directory (a symlink?): refused")
    _check_private(st, d, allow_root=False)


_user_lock = threading.Lock()
_user_cache: dict[str, Secret] = {}


def _user_secret() -> Secret:
    d = user_secret_dir()
    path = os.path.join(d, "kv-secret")
    with _user_lock:
        got = _user_cache.get(path)
        if got is not None:
            return got
        _private_dir(d)
        if not os.path.lexists(path):
            # written whole to a private temporary file, then linked in: a reader never
            # sees half a key, and of two processes creating it at once one link wins
            fd, tmp = tempfile.mkstemp(prefix=".kv-secret.", dir=d)
            try:
                os.write(fd, secrets.token_hex(32).encode() + b"\n")
                os.fsync(fd)
                os.close(fd)
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    pass
            finally:
                os.unlink(tmp)
        what = f"the per-user KV secret {path}"
        s = Secret(_read_secret_file(path, what), what, False)
        _user_cache[path] = s
        return s


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------ the handshake
def _nodelay(sock: socket.socket) -> None:
    """The proof and the HELLO behind it go out at once (no Nagle wait for an ACK)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _mac(key: bytes, role: bytes, cnonce: bytes, snonce: bytes, cname: str, sname: str) -> bytes:
    parts = [PROTOCOL, role, cnonce, snonce, cname.encode(), sname.encode()]
    msg = b"".join(struct.pack("<I", len(p)) + p for p in parts)
    return hmac.new(key, msg, hashlib.sha256).digest()


def _send(sock: socket.socket, body: dict) -> None:
    from .transport import AUTH, HDR, MAGIC
    raw = json.dumps(body).encode()
    sock.sendall(HDR.pack(MAGIC, AUTH, 0, 0, 0, 0, len(raw), 0) + raw)


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str, limit: str) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVAuthError(f"{what}: the handshake took longer than {limit}", "timeout")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except socket.timeout:
            raise KVAuthError(f"{what}: the handshake took longer than {limit}",
                              "timeout") from None
        except OSError as exc:
            raise KVAuthError(f"{what}: {exc.strerror or exc}", "no_proof") from None
        if not chunk:
            raise KVAuthError(f"{what}: the peer closed the connection", "no_proof")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, deadline: float, what: str, limit: str) -> dict:
    """One AUTH message: the header checked (type, size at most MAX_AUTH) before its body
    is read."""
    from .transport import AUTH, HDR, MAGIC
    magic, type_, _f, _x, _r, _l, n, nb = HDR.unpack(_recv_exact(sock, HDR.size, deadline, what, limit))
    if magic != MAGIC:
        raise KVAuthError(f"{what}: not a p2phub KV peer (magic {magic:#x})", "malformed")
    if type_ != AUTH:
        raise KVAuthError(f"{what}: message type {type_} before the peer proved the KV secret "
                          "(an agent without authentication?)", "malformed")
    if n > MAX_AUTH or nb:
        raise KVAuthError(f"{what}: an AUTH message of {n} bytes (at most {MAX_AUTH})",
                          "malformed")
    try:
        body = json.loads(_recv_exact(sock, n, deadline, what, limit))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KVAuthError(f"{what}: malformed AUTH message: {exc}", "malformed") from None
    if not isinstance(body, dict):
        raise KVAuthError(f"{what}: malformed AUTH message", "malformed")
    return body


def _field_hex(body: dict, key: str, size: int, what: str) -> bytes:
    try:
        v = bytes.fromhex(body[key])
    except (KeyError, TypeError, ValueError):
        v = b""
    if len(v) != size:
        raise KVAuthError(f"{what}: AUTH message without a valid {key!r}", "malformed")
    return v


def _field_name(body: dict, what: str) -> str:
    name = body.get("name")
    if not isinstance(name, str) or not name or len(name.encode()) > MAX_NAME:
        raise KVAuthError(f"{what}: AUTH message without a valid agent name", "malformed")
    return name


def client_handshake(sock: socket.socket, secret: Secret, name: str, timeout: float,
                     where: str) -> str:
    """Prove the secret to the agent at the other end of `sock` and have it prove it back.
    Returns the name the peer proved. Raises KVAuthError naming the failure."""
    deadline = time.monotonic() + timeout
    what = f"handshake with {where}"
    _nodelay(sock)
    cnonce = secrets.token_bytes(NONCE)
    _send(sock, {"v": 1, "name": name, "nonce": cnonce.hex()})
    body = _recv(sock, deadline, what, f"{timeout} s")
    sname = _field_name(body, what)
    snonce = _field_hex(body, "nonce", NONCE, what)
    mac = _field_hex(body, "mac", 32, what)
    if not hmac.compare_digest(mac, _mac(secret.key, b"server", cnonce, snonce, name, sname)):
        log.warning("kv %s: %s (claims %r) did not prove the KV secret (this agent's is %s)",
                    name, where, sname, secret.source)
        from .. import metrics
        metrics.kv_auth_failed(name, "bad_proof")
        raise KVAuthError(f"{what} (claims {sname!r}): it did not prove the KV secret; the two "
                          f"hold different secrets (this one's: {secret.source}; set the same "
                          f"{ENV_SECRET} or {ENV_SECRET_FILE} on both)", "bad_proof")
    _send(sock, {"mac": _mac(secret.key, b"client", cnonce, snonce, name, sname).hex()})
    return sname


def server_handshake(sock: socket.socket, secret: Secret, name: str, timeout: float,
                     where: str) -> str:
    """The accepting side: have the client prove the secret within `timeout` seconds of
    now; returns the name it proved. Raises KVAuthError."""
    deadline = time.monotonic() + timeout
    limit = f"auth_timeout={timeout} s (P2PHUB_KV_AUTH_TIMEOUT)"
    what = f"connection from {where}"
    _nodelay(sock)
    body = _recv(sock, deadline, what, limit)
    cname = _field_name(body, what)
    cnonce = _field_hex(body, "nonce", NONCE, what)
    snonce = secrets.token_bytes(NONCE)
    _send(sock, {"name": name, "nonce": snonce.hex(),
                 "mac": _mac(secret.key, b"server", cnonce, snonce, cname, name).hex()})
    what = f"connection from {where} (claims {cname!r})"
    try:
        body = _recv(sock, deadline, what, limit)
    except KVAuthError as exc:
        if exc.reason == "no_proof":
            raise KVAuthError(f"{what}: closed before proving the KV secret (it holds another "
                              "one, or none)", "no_proof") from None
        raise
    mac = _field_hex(body, "mac", 32, what)
    if not hmac.compare_digest(mac, _mac(secret.key, b"client", cnonce, snonce, cname, name)):
        raise KVAuthError(f"{what}: its proof does not match the KV secret ({secret.source})",
                          "bad_proof")
    return cname
