"""The staged I/O engine (_sio.h, _sio.c) compiled: io_uring batches between files and
host or CUDA memory through reused staging slots (p2phub.batch drives it). The module built
with the wheel, or the developer fallback's build of the same sources (p2phub._cffi_build)."""

from __future__ import annotations

from types import ModuleType

from .._cffi_build import SIO


def load() -> ModuleType:
    """The compiled module (attributes ``ffi`` and ``lib``), built if needed."""
    return SIO.load()
