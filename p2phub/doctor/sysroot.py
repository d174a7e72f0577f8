"""One object through which the doctor reads the system, recording what it read.

Every read goes through :class:`SysRoot`. Each read is logged as an :class:`Evidence` entry (the path,
the value found, or the reason it could not be read), so a check can cite exactly the files behind its
verdict. The root may be "/" (the live system) or a directory holding a captured subset of /sys, /proc,
/boot and /dev (made by ``p2phub doctor --capture DIR``). A capture carries ``p2phub-capture.json`` with facts that a
plain file tree cannot hold: uname, the capturing user's euid, and the stat() of device nodes.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import stat as _stat
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# Keeps an empty directory of a captured tree in git (which stores no empty directories);
# an empty holders/ or lib/modules/ means something. Never a sysfs name.
KEEP_MARKER = ".p2phub-keep"

CAPTURE_META = "p2phub-capture.json"
MAX_TEXT = 1 << 20  # a sysfs attribute is at most a page; procfs files we read are small too


@dataclass
class Evidence:
    path: str
    value: str | None = None
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"path": self.path}
        if self.error is not None:
            d["error"] = self.error
        else:
            d["value"] = self.value
        return d


@dataclass
class StatInfo:
    mode: int
    uid: int
    gid: int
    rdev: int = 0

    @property
    def is_chr(self) -> bool:
        return _stat.S_ISCHR(self.mode)

    @property
    def perms(self) -> str:
        return oct(self.mode & 0o7777)


def _reason(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied (needs root)"
    if exc.errno == errno.ENOENT:
        return "absent"
    return f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc.strerror}"


def _read_chunked(path: str, limit: int) -> bytes:
    """Read up to ``limit`` bytes in page-sized reads (sysctl files refuse huge single reads)."""
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while len(out) < limit:
            chunk = f.read(min(65536, limit - len(out)))
            if not chunk:
                break
            out += chunk
    return bytes(out)


def walk_links(path: str, islink: Callable[[str], bool], readlink: Callable[[str], str],
               on_link: Callable[[str, str], None] | None = None, max_hops: int = 40) -> str:
    """Resolve ``path`` (absolute) component by component, following symlinks as realpath() does.

    ``islink``/``readlink`` answer for a path of the tree being walked; ``on_link(path, target)`` is
    told of every symlink met on the way (the capture reproduces them). Stops after ``max_hops``
    links (a loop) and returns the path resolved so far.
    """
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    hops = 0
    while parts:
        p = parts.pop(0)
        if p == ".":
            continue
        if p == "..":
            if done:
                done.pop()
            continue
        cand = "/" + "/".join(done + [p])
        if islink(cand):
            hops += 1
            if hops > max_hops:
                break
            target = readlink(cand)
            if on_link is not None:
                on_link(cand, target)
            if target.startswith("/"):
                done = []
            parts = [t for t in target.split("/") if t] + parts
            continue
        done.append(p)
    return "/" + "/".join(done)


@dataclass
class SysRoot:
    """Reads files under ``root`` as if it were "/"; records every read in ``log``."""

    root: str = "/"
    log: dict[str, Evidence] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = os.path.abspath(self.root)
        self.live = self.root == "/"
        if not self.live:
            mp = os.path.join(self.root, CAPTURE_META)
            try:
                with open(mp, encoding="utf-8") as f:
                    self.meta = json.load(f)
            except (OSError, ValueError):
                self.meta = {}

    # -- paths -------------------------------------------------------------------------------
    def host(self, path: str) -> str:
        """The host path of ``path`` (an absolute path inside the root)."""
        if self.live:
            return path
        return os.path.join(self.root, path.lstrip("/"))

    def resolve(self, path: str) -> str:
        """realpath() of ``path`` inside the root; absolute symlinks are rebased onto the root."""
        if self.live:
            return os.path.realpath(path)
        return walk_links(path, lambda p: os.path.islink(self.host(p)), lambda p: os.readlink(self.host(p)))

    # -- reads ---------------------------------------------------------------------------------
    def _record(self, path: str, value: str | None, error: str | None) -> None:
        self.log[path] = Evidence(path, value, error)

    def evidence(self, path: str) -> Evidence:
        return self.log.get(path) or Evidence(path, error="not read")

    def exists(self, path: str) -> bool:
        return os.path.lexists(self.host(path))

    def isdir(self, path: str) -> bool:
        return os.path.isdir(self.host(path))

    def read_bytes(self, path: str, limit: int = 1 << 22) -> tuple[bytes | None, str | None]:
        """(data, None) or (None, reason)."""
        try:
            data = _read_chunked(self.host(path), limit)
        except OSError as exc:
            reason = _reason(exc)
            self._record(path, None, reason)
            return None, reason
        self._record(path, f"<{len(data)} bytes>", None)
        return data, None

    def read(self, path: str, default: str | None = None) -> str | None:
        """The stripped text of a file, or ``default`` when it cannot be read (reason logged)."""
        try:
            raw = _read_chunked(self.host(path), MAX_TEXT)
        except OSError as exc:
            self._record(path, None, _reason(exc))
            return default
        text = raw.decode("utf-8", "replace").strip()
        self._record(path, text if len(text) <= 400 else text[:400] + "...", None)
        return text

    def read_reason(self, path: str) -> str | None:
        ev = self.log.get(path)
        return ev.error if ev else None

    def read_int(self, path: str, base: int = 0) -> int | None:
        t = self.read(path)
        if t is None:
            return None
        try:
            return int(t.split()[0], base)
        except (ValueError, IndexError):
            return None

    def read_gz(self, path: str) -> str | None:
        data, _ = self.read_bytes(path, 1 << 24)
        if data is None:
            return None
        try:
            return gzip.decompress(data).decode("utf-8", "replace")
        except (OSError, EOFError, ValueError):
            self._record(path, None, "not a gzip file")
            return None

    def grep(self, path: str, needles: Iterable[str], limit: int = 20) -> list[str] | None:
        """Lines of a (possibly large) file containing any needle; None when unreadable."""
        needles = list(needles)
        out: list[str] = []
        try:
            with open(self.host(path), "rb") as f:
                for raw in f:
                    line = raw.decode("utf-8", "replace").rstrip("\n")
                    if any(n in line for n in needles):
                        out.append(line)
                        if len(out) >= limit:
                            break
        except OSError as exc:
            self._record(path, None, _reason(exc))
            return None
        self._record(path, f"{len(out)} line(s) matching {needles}: " + "; ".join(out[:5]), None)
        return out

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.host(path)) if n != KEEP_MARKER)
        except OSError:
            return []

    def readlink_name(self, path: str) -> str | None:
        """Basename of a symlink's target (e.g. a device's ``driver``), or None."""
        try:
            target = os.readlink(self.host(path))
        except OSError:
            return None
        name = os.path.basename(target.rstrip("/"))
        self._record(path, f"-> {name}", None)
        return name

    def stat(self, path: str) -> tuple[StatInfo | None, str | None]:
        """stat() of a path; in a capture, device nodes come from the capture's metadata."""
        if not self.live:
            st = (self.meta.get("stat") or {}).get(path)
            if st is None:
                if self.exists(path):
                    s = os.lstat(self.host(path))
                    return StatInfo(s.st_mode, s.st_uid, s.st_gid, 0), None
                self._record(path, None, "absent")
                return None, "absent"
            info = StatInfo(int(st["mode"]), int(st.get("uid", 0)), int(st.get("gid", 0)), int(st.get("rdev", 0)))
            self._record(path, f"mode {oct(info.mode)} uid {info.uid} gid {info.gid}", None)
            return info, None
        try:
            s = os.stat(path)
        except OSError as exc:
            reason = _reason(exc)
            self._record(path, None, reason)
            return None, reason
        info = StatInfo(s.st_mode, s.st_uid, s.st_gid, s.st_rdev)
        self._record(path, f"mode {oct(info.mode)} uid {info.uid} gid {info.gid}", None)
        return info, None

    # -- facts that are not files --------------------------------------------------------------
    @property
    def euid(self) -> int:
        if self.live:
            return os.geteuid()
        return int(self.meta.get("euid", -1))

    def uname(self) -> dict[str, str]:
        if self.live:
            u = os.uname()
            return {"sysname": u.sysname, "release": u.release, "version": u.version, "machine": u.machine}
        u = dict(self.meta.get("uname") or {})
        if "release" not in u:
            rel = self.read("/proc/sys/kernel/osrelease")
            if rel:
                u["release"] = rel
        if "machine" not in u:
            arch = self.read("/proc/sys/kernel/arch")
            if arch:
                u["machine"] = arch
        return u

    def source(self) -> str:
        return "live" if self.live else f"capture:{self.root}"
