"""The small interface through which GPU allocations reach p2phub.

The core never imports a vendor runtime. A backend (``p2phub_cuda``,
``p2phub_rocm``) recognises the objects of its runtime (raw pointers, tensors,
``__cuda_array_interface__``, DLPack), validates the byte range, and hands the
core something p2phub.ko can pin: a dma-buf fd of exactly that range, or, for
the NVIDIA P2P path, a 64 KiB aligned GPU virtual address range.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import UsageError

# Where each vendor backend lives; imported only when an object needs it.
BACKENDS = ("p2phub_cuda", "p2phub_rocm")

NVIDIA_P2P_ALIGN = 64 << 10


@dataclass
class GpuRange:
    """A validated range of GPU memory, ready to register."""

    backend: str             # "cuda", "rocm"
    device: int              # runtime device ordinal
    ptr: int                 # first byte (GPU virtual address)
    length: int              # bytes
    alloc_base: int          # the allocation that holds the range
    alloc_size: int
    pci_bus_id: str = ""     # the GPU's PCI address, when the runtime knows it
    dmabuf_fd: int = -1      # a dma-buf of exactly [ptr, ptr + length), owned by this object
    keepalive: list[Any] = field(default_factory=list)  # the caller's object, kept alive

    def close(self) -> None:
        if self.dmabuf_fd >= 0:
            os.close(self.dmabuf_fd)
            self.dmabuf_fd = -1

    @property
    def nvidia_p2p_ok(self) -> bool:
        return self.ptr % NVIDIA_P2P_ALIGN == 0 and self.length % NVIDIA_P2P_ALIGN == 0


class Backend(Protocol):
    name: str

    def claims(self, obj: Any) -> bool:
        """True when `obj` is memory of this runtime (never raises)."""

    def resolve(self, obj: Any, offset: int = 0, length: int | None = None,
                export_dmabuf: bool = True) -> GpuRange:
        """Validate `obj`'s byte range [offset, offset + length) and describe it.

        Raises UsageError for memory p2phub cannot pin (host or managed memory,
        a freed pointer, a range spanning two allocations, misalignment)."""


def _load(modname: str) -> Backend | None:
    try:
        mod = importlib.import_module(modname)
    except ImportError:
        return None
    return mod.backend()


def find_backend(obj: Any) -> Backend | None:
    for modname in BACKENDS:
        be = _load(modname)
        if be is not None and be.claims(obj):
            return be
    return None


def describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_range(offset: int, length: int | None, total: int, what: str) -> tuple[int, int]:
    """Resolve and validate a byte range inside an object of `total` bytes."""
    if offset < 0:
        raise UsageError(f"{what}: offset={offset} is negative")
    if length is None:
        length = total - offset
    if length <= 0:
        raise UsageError(f"{what}: length={length} must be positive")
    if offset + length > total:
        raise UsageError(f"{what}: range offset={offset} length={length} ends past its "
                         f"{total} bytes")
    return offset, length
