"""hub.register(obj): one call for every kind of memory p2phub can pin.

- an int: a dma-buf fd (ROCm, CUDA's own export, udmabuf, vgem, any exporter);
- a host buffer made by p2phub.hostmem (udmabuf where the kernel has it, else vgem);
- GPU memory of a runtime backend (p2phub_cuda: (ptr, nbytes), torch tensors,
  __cuda_array_interface__, DLPack): exported as a dma-buf of exactly that range,
  or pinned through the NVIDIA P2P API where dma-buf export is not available.

The Registration keeps the source object alive (``reg.source``) until it is closed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import hostmem, uapi
from .backend import describe, find_backend
from .errors import P2PHubError, P2PHubOSError, UsageError

if TYPE_CHECKING:
    from .hub import Hub, PciAddress, Registration


def dmabuf_exporter(fd: int) -> str | None:
    """The exporter name of dma-buf `fd`, or None when `fd` is not a dma-buf."""
    try:
        text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("exp_name:"):
            return line.split(":", 1)[1].strip()
    return None


def register(hub: "Hub", obj: Any, offset: int = 0, length: int | None = None,
             device: "str | PciAddress | None" = None) -> "Registration":
    if isinstance(obj, bool) or obj is None:
        raise UsageError(f"cannot register {obj!r}")
    if isinstance(obj, int):
        if obj < 0:
            raise UsageError(f"fd={obj} is not a file descriptor")
        try:
            os.fstat(obj)
        except OSError:
            raise UsageError(f"fd={obj} is not an open file descriptor") from None
        if dmabuf_exporter(obj) is None:
            raise UsageError(f"fd={obj} is not a dma-buf (no exp_name in /proc/self/fdinfo/{obj})")
        return hub.register_dmabuf(obj, offset, length, device)

    if isinstance(obj, hostmem._HostBuffer):
        if obj.closed:
            raise UsageError(f"{describe(obj)} is closed")
        reg = hub.register_dmabuf(obj.fd, offset, length, device)
        reg.source = obj
        return reg

    be = find_backend(obj)
    if be is None:
        if isinstance(obj, (bytes, bytearray, memoryview)) or hasattr(obj, "__array_interface__"):
            raise UsageError(f"{describe(obj)}: plain host memory cannot be pinned by p2phub; "
                             "allocate it with hub.alloc_host(size)")
        raise UsageError(f"{describe(obj)}: not memory p2phub knows (a dma-buf fd, hub.alloc_host "
                         "memory, or GPU memory of an installed backend: p2phub_cuda)")
    caps = hub.info().caps
    rng = be.resolve(obj, offset, length, export_dmabuf=bool(caps & uapi.Cap.DMABUF_IMPORT))
    try:
        if rng.dmabuf_fd >= 0:
            reg = hub.register_dmabuf(rng.dmabuf_fd, 0, rng.length, device)
        elif caps & uapi.Cap.NVIDIA_P2P_LIVE and rng.nvidia_p2p_ok:
            reg = hub.register_nvidia(rng.ptr, rng.length, device)
        else:
            raise P2PHubError(f"{describe(obj)}: p2phub.ko can pin neither a dma-buf nor through "
                              "the NVIDIA P2P API here (see `p2phub doctor`, check kmod.caps)")
    finally:
        rng.close()  # the registration holds its own reference to the dma-buf
    reg.source = rng
    return reg


def alloc_host(hub: "Hub", size: int, device: "str | PciAddress | None" = None) -> "Registration":
    if size <= 0 or size % 4096:
        raise UsageError(f"size={size} must be a positive multiple of 4096")
    if Path("/dev/udmabuf").exists():
        buf: hostmem._HostBuffer = hostmem.Udmabuf(size)
    else:
        try:
            buf = hostmem.VgemBuffer(size)
        except (P2PHubOSError, UsageError, OSError) as exc:
            raise P2PHubError(f"no host dma-buf exporter: /dev/udmabuf is missing and vgem "
                              f"failed ({exc}); load udmabuf or vgem") from None
    try:
        reg = hub.register_dmabuf(buf.fd, 0, size, device)
    except BaseException:
        buf.close()
        raise
    reg.source = buf
    reg._owns_source = True
    return reg
