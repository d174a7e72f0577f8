"""Load the C hot path (_hot.c), compiled through cffi in API mode.

An installed wheel carries it compiled (``p2phub.nvme._hotlib``, built by
setuptools from ``_hot_build.py``); that module is used when it was built
from the sources beside it. Otherwise (a developer checkout, ``_hot.c`` just
edited) the same definition is compiled on first use into a directory keyed
by a hash of the C sources and the Python ABI, so a changed source or another
interpreter never loads a stale binary. The default directory is ``build/cffi`` in the
checkout (the lab VM shares the checkout, so one build serves host and VM),
else ``$XDG_CACHE_HOME/p2phub``; ``P2PHUB_CFFI_DIR`` overrides both.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from . import _hot_build

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "_hot.h", HERE / "_hot.c")

_loaded: ModuleType | None = None


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
    built = _prebuilt()
    if built is not None:
        _loaded = built
        return built
    name = f"_p2phub_nvme_hot_{_tag()}"
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


def _prebuilt() -> ModuleType | None:
    """The module compiled with the wheel, when it matches the sources beside it."""
    try:
        from . import _hotlib  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        current = _hot_build.sources_tag()
    except OSError:  # sources not installed: the compiled module is all there is
        return _hotlib
    built = _hotlib.ffi.string(_hotlib.lib.p2phub_hot_tag()).decode()
    return _hotlib if built == current else None


def _compile(name: str, out: Path) -> None:
    _hot_build.make_ffi(name).compile(tmpdir=str(out), verbose=False)
