"""p2phub's C hot paths, compiled through cffi in API mode: one definition each, one loader.

- the NVMe engine: ``p2phub/nvme/_hot.h`` + ``_hot.c``, compiled as ``p2phub.nvme._hotlib``;
- the KV transfer path: ``p2phub/kv/_kvhot.h`` + ``_kvhot.c``, compiled as ``p2phub.kv._kvhotlib``.

Each definition has two users:

- the wheel build: ``setup.py`` loads this file by path (so it imports nothing from the package),
  has cffi write the C source of every module in `HOT_PATHS`, and setuptools compiles them into
  the wheel (an editable install compiles them in place);
- `HotPath.load()` at run time. It takes the compiled module when it was built from the sources
  beside it: each module answers ``p2phub<stem>_tag()``, a hash of its sources, so a stale
  build is never loaded. Otherwise (a developer checkout whose C was just edited, or one never
  built) it compiles the same definition on first use, into a directory keyed by a hash of the
  sources and the Python ABI, so another interpreter never loads it either. That directory is
  ``build/cffi`` in a writable checkout (the lab VM shares the checkout, so one build serves host
  and VM), else ``$XDG_CACHE_HOME/p2phub/cffi``; ``P2PHUB_CFFI_DIR`` overrides both.

The fallback compiles and loads code from that directory, so it must be one no other user can
change: root running another user's checkout (or keeping their XDG_CACHE_HOME) would otherwise
run a `.so` that user placed there. The directory, every directory above it, and the `.so` must
be owned by the effective user or root and not writable by group or others (a root-owned sticky
directory such as /tmp is allowed above it); anything else is refused with PermissionError
naming the path and its owner.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import pwd
import re
import stat
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = Path(__file__).resolve().parent   # p2phub/
COMPILE_ARGS = ["-O2", "-std=gnu11", "-Wall"]


class HotPath:
    """One C hot path: ``<stem>.h`` (the declarations cffi parses) and ``<stem>.c`` in
    ``p2phub/<subpackage>/``, compiled as ``p2phub.<subpackage>.<stem>lib``."""

    def __init__(self, subpackage: str, stem: str, parts: tuple[str, ...] = ()) -> None:
        self.dir = PACKAGE / subpackage
        # the header, the .c, and the files the .c includes (hashed with them)
        self.sources = (self.dir / f"{stem}.h", self.dir / f"{stem}.c",
                        *(self.dir / p for p in parts))
        self.module = f"p2phub.{subpackage}.{stem}lib"
        self.tag_fn = f"p2phub{stem}_tag"
        self.fallback_name = f"_p2phub_{subpackage}{stem}"
        self._loaded: ModuleType | None = None

    # ------------------------------------------------------------ the definition

    def sources_tag(self) -> str:
        """A hash of the C sources and the compiler flags (OSError where they are not
        installed): a module built otherwise is rebuilt."""
        h = hashlib.sha256(" ".join(COMPILE_ARGS).encode())
        for src in self.sources:
            h.update(src.read_bytes())
        return h.hexdigest()[:16]

    def cdef(self) -> str:
        """The header's declarations, stripped of comments (cffi's parser takes no comments),
        and the tag function every build answers."""
        text = re.sub(r"/\*.*?\*/", "", self.sources[0].read_text(), flags=re.S)
        return f"{text}\nconst char *{self.tag_fn}(void);\n"

    def make_ffi(self, module_name: str) -> Any:  # -> cffi.FFI
        import cffi  # a build-time (and developer-fallback) dependency only

        ffi = cffi.FFI()
        ffi.cdef(self.cdef())
        # the .c file includes its header and the system headers it needs
        ffi.set_source(
            module_name,
            f'#include "{self.sources[1].name}"\n'
            f'const char *{self.tag_fn}(void) {{ return "{self.sources_tag()}"; }}\n',
            include_dirs=[str(self.dir)],
            extra_compile_args=COMPILE_ARGS,
            extra_link_args=["-pthread"],
        )
        return ffi

    # ------------------------------------------------------------ loading

    def load(self) -> ModuleType:
        """The compiled module (attributes ``ffi`` and ``lib``), built here if none matches."""
        if self._loaded is None:
            self._loaded = self.prebuilt() or self._fallback()
        return self._loaded

    def prebuilt(self) -> ModuleType | None:
        """The module compiled at build time, when it matches the sources beside it."""
        try:
            mod = importlib.import_module(self.module)
        except ImportError:
            return None
        try:
            current = self.sources_tag()
        except OSError:  # sources not installed: the compiled module is all there is
            return mod
        built = mod.ffi.string(getattr(mod.lib, self.tag_fn)()).decode()
        return mod if built == current else None

    def _fallback(self) -> ModuleType:
        abi = hashlib.sha256(f"{self.sources_tag()} {sysconfig.get_config_var('EXT_SUFFIX')} "
                             f"{sys.version}".encode()).hexdigest()[:16]
        name = f"{self.fallback_name}_{abi}"
        out = build_dir().resolve() / name
        _make_private_dirs(out)
        with open(out / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one compiler per directory, across processes
            found = sorted(out.glob(f"{name}*.so"))
            if not found:
                self.make_ffi(name).compile(tmpdir=str(out), verbose=False)
                found = sorted(out.glob(f"{name}*.so"))
                # the linker honours the umask; under 002 the new file would fail the check
                os.chmod(found[0], os.stat(found[0]).st_mode & ~0o022)
        check_private(found[0])
        loader = importlib.machinery.ExtensionFileLoader(name, str(found[0]))
        spec = importlib.util.spec_from_file_location(name, found[0], loader=loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        return mod


def _owner(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def check_private(path: Path) -> None:
    """Refuse `path` unless no user but this one (or root) can change what it holds: it and
    every directory above it owned by the effective uid or root, and none writable by group
    or others, except a root-owned sticky directory above it (/tmp), whose entries only their
    owners can rename."""
    euid = os.geteuid()
    for p in (path, *path.parents):
        st = os.stat(p)
        if st.st_uid not in (euid, 0):
            raise PermissionError(
                errno.EPERM, f"p2phub will not load compiled code from {path}: {p} is owned by "
                f"{_owner(st.st_uid)}, not by this user ({_owner(euid)}) or root; set "
                "P2PHUB_CFFI_DIR to a directory of your own, or install the p2phub wheel")
        sticky_root = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_uid == 0
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (p != path and sticky_root):
            raise PermissionError(
                errno.EPERM, f"p2phub will not load compiled code from {path}: {p} (owner "
                f"{_owner(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):o}) is writable by its "
                "group or others; remove their write permission or set P2PHUB_CFFI_DIR to a "
                "directory of your own")


def _make_private_dirs(path: Path) -> None:
    """mkdir -p, each new directory mode 755 (Path.mkdir gives parents the umask's mode, and a
    group-writable one would fail the check), nothing made under a directory that fails it."""
    missing = []
    for p in (path, *path.parents):
        if p.exists():
            check_private(p)
            break
        missing.append(p)
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o755)
        except FileExistsError:  # another process made it first
            pass
    check_private(path)


def build_dir() -> Path:
    """Where the developer fallback compiles."""
    env = os.environ.get("P2PHUB_CFFI_DIR")
    if env:
        return Path(env)
    top = PACKAGE.parent
    if (top / "pyproject.toml").exists() and os.access(top, os.W_OK):
        return top / "build" / "cffi"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "p2phub" / "cffi"


NVME = HotPath("nvme", "_hot")
KV = HotPath("kv", "_kvhot")
SIO = HotPath("staged_io", "_sio", ("_sio_queue.c", "_sio_file.c"))   # the staged I/O engine (p2phub.batch)
HOT_PATHS = (NVME, KV, SIO)
