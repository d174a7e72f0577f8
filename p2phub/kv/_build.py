"""Build and load the KV transfer hot path (_kvhot.c) through cffi, in API mode.

The extension is compiled on first use into a directory keyed by a hash of
the C sources and the Python ABI, so a changed source or another interpreter
never loads a stale binary. The default directory is ``build/cffi`` in the
checkout (the lab VM shares the checkout, so one build serves host and VM),
else ``$XDG_CACHE_HOME/p2phub``; ``P2PHUB_CFFI_DIR`` overrides both.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "_kvhot.h", HERE / "_kvhot.c")

_loaded: ModuleType | None = None


def _cdef() -> str:
    """The declarations of _kvhot.h, stripped to what cffi's parser takes."""
    text = (HERE / "_kvhot.h").read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return text


def _build_dir() -> Path:
    env = os.environ.get("P2PHUB_CFFI_DIR")
    if env:
        return Path(env)
    top = HERE.parent.parent
    if (top / "pyproject.toml").exists() and os.access(top, os.W_OK):
        return top / "build" / "cffi"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "p2phub" / "cffi"


def _tag() -> str:
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    h.update((sysconfig.get_config_var("EXT_SUFFIX") or "").encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def load() -> ModuleType:
    """The compiled module (attributes ``ffi`` and ``lib``), built if needed."""
    global _loaded
    if _loaded is not None:
        return _loaded
    name = f"_p2phub_kv_hot_{_tag()}"
    out = _build_dir() / name
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = sorted(out.glob(f"{name}*.so"))
        if not found:
            _compile(name, out)
            found = sorted(out.glob(f"{name}*.so"))
    loader = importlib.machinery.ExtensionFileLoader(name, str(found[0]))
    spec = importlib.util.spec_from_file_location(name, found[0], loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    _loaded = mod
    return mod


def _compile(name: str, out: Path) -> None:
    import cffi  # only needed to build

    ffi = cffi.FFI()
    ffi.cdef(_cdef())
    # _kvhot.c includes _kvhot.h and the system headers it needs.
    ffi.set_source(
        name,
        '#include "_kvhot.c"\n',
        include_dirs=[str(HERE)],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    )
    ffi.compile(tmpdir=str(out), verbose=False)
