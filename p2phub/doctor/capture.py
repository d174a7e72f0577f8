"""`p2phub doctor --capture DIR`: copy what the doctor reads on this machine into a tree that
`p2phub doctor --root DIR` reads the same way.

The path list is the doctor's own: the doctor runs once on the live system through a
:class:`RecordingSysRoot`, which notes every path a check or discovery touched and how (read, grep,
listdir, readlink, exists, stat, resolve). The capture then copies exactly those, reproducing every
symlink met on the way with its original target (through :func:`sysroot.walk_links`, the walker of
``SysRoot.resolve``), so realpath() inside the capture gives the same PCI hierarchy. ``/proc/kallsyms``
keeps only the lines the doctor looks for and ``/proc/cpuinfo`` only its first CPU. Facts that are not
files go into ``p2phub-capture.json``: uname, euid, the stat() of device nodes, the CUDA / RDMA /
p2phub.ko probes. Serial numbers and addresses are not read by the doctor, so they are not captured.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import socket
import stat as _stat
import subprocess
import tarfile
from dataclasses import dataclass, field
from typing import Any, Iterable

from . import probes
from .sysroot import CAPTURE_META, KEEP_MARKER, SysRoot, walk_links

SCHEMA = "p2phub.capture/1"
MAX_COPY = 1 << 24


@dataclass
class RecordingSysRoot(SysRoot):
    """The live SysRoot, noting every path it was asked about (for the capture)."""

    touched: dict[str, set[str]] = field(default_factory=dict)   # path -> {"read", "list", ...}
    needles: dict[str, list[str]] = field(default_factory=dict)  # path -> grep needles

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.live:
            raise ValueError("a capture records the live system")

    def _note(self, path: str, how: str) -> None:
        self.touched.setdefault(path, set()).add(how)

    def resolve(self, path: str) -> str:
        self._note(path, "resolve")
        return super().resolve(path)

    def exists(self, path: str) -> bool:
        self._note(path, "exists")
        return super().exists(path)

    def isdir(self, path: str) -> bool:
        self._note(path, "exists")
        return super().isdir(path)

    def read_bytes(self, path: str, limit: int = 1 << 22) -> tuple[bytes | None, str | None]:
        self._note(path, "read")
        return super().read_bytes(path, limit)

    def read(self, path: str, default: str | None = None) -> str | None:
        self._note(path, "read")
        return super().read(path, default)

    def grep(self, path: str, needles: Iterable[str], limit: int = 20) -> list[str] | None:
        needles = list(needles)
        self._note(path, "grep")
        self.needles.setdefault(path, [])
        self.needles[path] += [n for n in needles if n not in self.needles[path]]
        return super().grep(path, needles, limit)

    def listdir(self, path: str) -> list[str]:
        self._note(path, "list")
        return super().listdir(path)

    def readlink_name(self, path: str) -> str | None:
        self._note(path, "link")
        return super().readlink_name(path)

    def stat(self, path: str) -> tuple[Any, str | None]:
        self._note(path, "stat")
        return super().stat(path)


class _Writer:
    """Copies live paths into ``out``, reproducing the symlinks along each one."""

    def __init__(self, out: str) -> None:
        self.out = os.path.abspath(out)
        self.unreadable: dict[str, str] = {}

    def dst(self, path: str) -> str:
        return os.path.join(self.out, path.lstrip("/"))

    def _link(self, path: str, target: str) -> None:
        d = self.dst(path)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        if not os.path.lexists(d):
            os.symlink(target, d)

    def walk(self, path: str) -> str:
        """The live real path of ``path``, with every symlink on the way reproduced."""
        return walk_links(path, os.path.islink, os.readlink, on_link=self._link)

    def parent(self, path: str) -> str:
        """``path`` with its parent resolved (the path itself may be a symlink to keep)."""
        return os.path.join(self.walk(os.path.dirname(path)), os.path.basename(path))

    def mkdir(self, real: str) -> None:
        os.makedirs(self.dst(real), exist_ok=True)

    def write(self, real: str, data: bytes) -> None:
        d = self.dst(real)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        with open(d, "wb") as f:
            f.write(data)

    def copy_file(self, path: str, transform: Any = None) -> None:
        real = self.walk(path)
        if not os.path.lexists(real):
            return
        if os.path.isdir(real):
            self.mkdir(real)
            return
        st = os.stat(real)
        if not _stat.S_ISREG(st.st_mode):   # a device node: its existence only (stat is in the metadata)
            self.write(real, b"")
            return
        try:
            with open(real, "rb", buffering=0) as f:   # page-sized reads: sysctl files refuse huge ones
                buf = bytearray()
                while len(buf) < MAX_COPY:
                    chunk = f.read(65536)
                    if not chunk:
                        break
                    buf += chunk
        except OSError as exc:
            self.unreadable[path] = exc.strerror or str(exc)
            return
        data = bytes(buf)
        self.write(real, transform(data) if transform else data)

    def keep_path(self, path: str) -> None:
        """Make ``path`` exist in the capture as it does live (a link stays a link)."""
        full = self.parent(path)
        if os.path.islink(full):
            self._link(full, os.readlink(full))
        elif os.path.isdir(full):
            self.mkdir(full)
        elif os.path.lexists(full):
            self.copy_file(full)


def _first_cpu(data: bytes) -> bytes:
    return data.split(b"\n\n")[0] + b"\n"


def _grep_only(needles: list[str]):
    def pick(data: bytes) -> bytes:
        keep = [ln for ln in data.splitlines(keepends=True)
                if any(n.encode() in ln for n in needles)]
        return b"".join(keep)
    return pick


def _mark_empty_dirs(out: str) -> None:
    """An empty directory (holders/, lib/modules/) is evidence: keep it in archives and in git."""
    for d, subdirs, files in os.walk(out):
        if not subdirs and not files:
            open(os.path.join(d, KEEP_MARKER), "w").close()


def capture(out: str) -> dict[str, Any]:
    """Run the doctor on the live system and copy what it read into ``out`` (which must be empty)."""
    from .core import diagnose

    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty")
    os.makedirs(out, exist_ok=True)
    rec = RecordingSysRoot("/")
    diagnose(rec)
    w = _Writer(out)
    meta: dict[str, Any] = {"schema": SCHEMA, "captured_at": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                            "host": socket.gethostname(), "euid": os.geteuid(), "uname": rec.uname(),
                            "stat": {}, "probes": {}, "unreadable": w.unreadable}
    for path, hows in sorted(rec.touched.items()):
        if not os.path.lexists(path):
            if "resolve" in hows or "exists" in hows:
                w.walk(path)   # links on the way may exist even when the end does not
            continue
        if "stat" in hows:
            try:
                st = os.stat(path)
                meta["stat"][path] = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid, "rdev": st.st_rdev}
            except OSError:
                pass
        if "resolve" in hows:
            w.walk(path)
        if "link" in hows or "exists" in hows:
            w.keep_path(path)
        if "list" in hows:
            real = w.walk(path)
            if os.path.isdir(real):
                w.mkdir(real)
                for name in sorted(os.listdir(real)):
                    w.keep_path(os.path.join(real, name))
        if "grep" in hows:
            w.copy_file(path, _grep_only(rec.needles.get(path, [])))
        elif "read" in hows:
            w.copy_file(path, _first_cpu if path == "/proc/cpuinfo" else None)
    meta["probes"]["cuda_dmabuf"] = probes.cuda_dmabuf(rec)
    if os.path.isdir("/sys/class/infiniband"):
        meta["probes"]["ibv_dmabuf"] = probes.ibv_dmabuf(rec)
    meta["probes"]["kmod_info"] = probes.kmod_info(rec)
    meta["probes"]["kmod_signature"] = probes.kmod_signature(rec, rec.uname().get("release", ""))
    extra = {}
    for name, cmd in (("nvidia-smi-topo", ["nvidia-smi", "topo", "-m"]), ("lspci-tv", ["lspci", "-tvnn"])):
        if shutil.which(cmd[0]):
            try:
                extra[name] = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout[-20000:]
            except (OSError, subprocess.TimeoutExpired) as exc:
                extra[name] = f"failed: {exc}"
    meta["tool_outputs"] = extra   # for people reading the capture; the doctor does not use them
    _mark_empty_dirs(w.out)
    with open(os.path.join(w.out, CAPTURE_META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    return meta


def write_tarball(out: str) -> str:
    path = out.rstrip("/") + ".tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        tf.add(out, arcname=os.path.basename(out.rstrip("/")))
    return path
