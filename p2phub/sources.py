"""What an object is to p2phub.ko: the one place a registration's source is resolved.

``resolve(obj, ...)`` turns anything ``hub.register(obj)`` accepts into a
`Source` (a dma-buf fd range, or a GPU VA range for the NVIDIA P2P API); it
makes no p2phub ioctl and knows no Hub:

- an int: a dma-buf fd (ROCm, CUDA's own export, udmabuf, vgem, any exporter);
- a host buffer made by p2phub.hostmem (udmabuf where the kernel has it, else vgem);
- GPU memory of a backend plugin (p2phub_cuda: (ptr, nbytes), torch tensors,
  __cuda_array_interface__, DLPack): exported as a dma-buf of exactly that range,
  or pinned through the NVIDIA P2P API where dma-buf export is not available.

``cache_key(obj, ...)`` names the memory cheaply (no export, no pin), so a Hub
can hand back the live registration of memory that is registered already: a
dma-buf by its inode (the registration holds the dma-buf, so the inode cannot be
reused while the entry lives) plus offset and length, GPU memory by what its
backend says identifies the allocation (CUDA: the allocation's buffer id, which
a freed-and-reallocated range does not share).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable

from . import hostmem, uapi
from .backend import GpuRange, describe, find_backend
from .errors import P2PHubError, P2PHubOSError, UsageError

DMABUF = "dmabuf"
NVIDIA = "nvidia"
U64 = 1 << 64
S32_MAX = (1 << 31) - 1


class NoHostExporterError(P2PHubError):
    """Neither udmabuf nor vgem can make host memory into a dma-buf here."""


@dataclass
class Source:
    """Memory ready for P2PHUB_REGISTER."""

    kind: str                       # DMABUF or NVIDIA
    length: int
    label: str = ""                 # what the caller passed, for messages (a type name)
    fd: int = -1                    # DMABUF: the dma-buf
    offset: int = 0                 # DMABUF: first byte in it
    va: int = 0                     # NVIDIA: GPU virtual address
    keep: Any = None                # becomes reg.source: kept alive until the registration goes
    owned: bool = False             # the registration closes `keep` when it goes (hub.alloc_host)
    key: Hashable | None = None     # registration-cache key; None: never shared
    done: list[Callable[[], None]] = field(default_factory=list)  # run once REGISTER returned

    @property
    def what(self) -> str:
        """For messages: "dma-buf fd 5 [0x0, +0x10000)" (made only when needed)."""
        if self.kind == DMABUF:
            base = f"dma-buf fd {self.fd} [{self.offset:#x}, +{self.length:#x})"
        else:
            base = f"GPU VA {self.va:#x} +{self.length:#x}"
        return f"{self.label} ({base})" if self.label else base

    def finish(self) -> None:
        """Drop what was needed only to register (an exported fd: the kernel holds its own)."""
        for fn in self.done:
            fn()
        self.done.clear()


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


def _fd_key(fd: int, offset: int, length: int | None) -> Hashable | None:
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    # a dma-buf's inode carries the buffer's size; the default length runs to its end
    return (DMABUF, st.st_dev, st.st_ino, offset, st.st_size - offset if length is None else length)


def cache_key(obj: Any, offset: int = 0, length: int | None = None) -> Hashable | None:
    """A cheap name for the memory `obj` [offset, +length) stands for; None: not cacheable."""
    if isinstance(obj, bool) or obj is None:
        return None
    if isinstance(obj, int):
        return _fd_key(obj, offset, length) if obj >= 0 else None
    if isinstance(obj, hostmem._HostBuffer):
        return None if obj.closed else _fd_key(obj.fd, offset, length)
    be = find_backend(obj)
    hook = getattr(be, "cache_key", None) if be is not None else None
    if hook is None:
        return None
    try:
        key = hook(obj, offset, length)
    except P2PHubError:
        return None  # resolve() reports it properly
    return None if key is None else (be.name, key)  # type: ignore[union-attr]


_UNSET: Any = object()


def dmabuf(fd: int, offset: int = 0, length: int | None = None, keep: Any = None,
           key: Any = _UNSET) -> Source:
    if isinstance(fd, bool) or not isinstance(fd, int) or not 0 <= fd <= S32_MAX:
        raise UsageError(f"fd={fd!r} is not a file descriptor")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < U64:
        raise UsageError(f"dma-buf fd {fd}: offset={offset!r} is not a byte offset")
    if length is None:
        try:
            length = os.lseek(fd, 0, os.SEEK_END) - offset
        except OSError as exc:
            raise UsageError(f"fd={fd} is not an open dma-buf ({exc.strerror})") from None
    if isinstance(length, bool) or not isinstance(length, int) or not 0 < length < U64:
        raise UsageError(f"dma-buf fd {fd}: length={length!r} must be a positive byte count")
    return Source(DMABUF, length, fd=fd, offset=offset, keep=keep,
                  key=_fd_key(fd, offset, length) if key is _UNSET else key)


def nvidia(va: int, length: int, keep: Any = None) -> Source:
    for name, v in (("va", va), ("length", length)):
        if isinstance(v, bool) or not isinstance(v, int) or not 0 < v < U64:
            raise UsageError(f"GPU VA range: {name}={v!r} is not a positive 64-bit value")
    return Source(NVIDIA, length, va=va, keep=keep)


def resolve(obj: Any, offset: int = 0, length: int | None = None, caps: int = 0,
            key: Any = _UNSET) -> Source:
    """The Source of anything hub.register() accepts; `caps` is p2phub.ko's uapi.Cap mask.

    `key`: cache_key(obj, offset, length) when the caller has it already."""
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
        return dmabuf(obj, offset, length, key=key)

    if isinstance(obj, hostmem._HostBuffer):
        if obj.closed:
            raise UsageError(f"{describe(obj)} is closed")
        return dmabuf(obj.fd, offset, length, keep=obj, key=key)

    be = find_backend(obj)
    if be is None:
        if isinstance(obj, (bytes, bytearray, memoryview)) or hasattr(obj, "__array_interface__"):
            raise UsageError(f"{describe(obj)}: plain host memory cannot be pinned by p2phub; "
                             "allocate it with hub.alloc_host(size)")
        raise UsageError(f"{describe(obj)}: not memory p2phub knows (a dma-buf fd, hub.alloc_host "
                         "memory, or GPU memory of an installed backend plugin)")
    rng: GpuRange = be.resolve(obj, offset, length,
                               export_dmabuf=bool(caps & uapi.Cap.DMABUF_IMPORT))
    if rng.dmabuf_fd >= 0:
        src = dmabuf(rng.dmabuf_fd, 0, rng.length, keep=rng)
    elif caps & uapi.Cap.NVIDIA_P2P_LIVE and rng.nvidia_p2p_ok:
        src = nvidia(rng.ptr, rng.length, keep=rng)
    else:
        rng.close()
        raise P2PHubError(f"{describe(obj)}: p2phub.ko can pin neither a dma-buf nor through "
                          "the NVIDIA P2P API here (see `p2phub doctor`, check kmod.caps)")
    src.label = describe(obj)
    src.key = cache_key(obj, offset, length) if key is _UNSET else key
    src.done.append(rng.close)  # the registration holds its own reference to the dma-buf
    return src


def host(size: int) -> Source:
    """`size` bytes of new host memory as a dma-buf: a udmabuf, else a vgem buffer (owned)."""
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % 4096:
        raise UsageError(f"size={size!r} must be a positive multiple of 4096")
    if Path("/dev/udmabuf").exists():
        buf: hostmem._HostBuffer = hostmem.Udmabuf(size)
    else:
        try:
            buf = hostmem.VgemBuffer(size)
        except (P2PHubOSError, UsageError, OSError) as exc:
            raise NoHostExporterError(f"no host dma-buf exporter: /dev/udmabuf is missing and vgem "
                              f"failed ({exc}); load udmabuf or vgem") from None
    src = dmabuf(buf.fd, 0, size, keep=buf)
    src.owned = True
    return src
