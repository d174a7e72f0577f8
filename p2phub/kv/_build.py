"""The KV transfer hot path (_kvhot.h, _kvhot.c) compiled: the module built with the wheel, or the
developer fallback's build of the same sources (p2phub._cffi_build says how each is chosen and
checked)."""

from __future__ import annotations

from types import ModuleType

from .._cffi_build import KV


def load() -> ModuleType:
    """The compiled module (attributes ``ffi`` and ``lib``), built if needed."""
    return KV.load()


_hot: ModuleType | None = None


def hot() -> ModuleType:
    """The compiled module, loaded once per process."""
    global _hot
    if _hot is None:
        _hot = load()
    return _hot
