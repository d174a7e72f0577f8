"""Host memory as dma-bufs, for machines without a GPU and for tests.

- ``Udmabuf``: a memfd turned into a dma-buf by /dev/udmabuf (Linux 5.x+, where
  CONFIG_UDMABUF is on); the CPU side is the memfd itself, so the very same
  pages can also be given to ``ibv_reg_mr``.
- ``VgemBuffer``: a DRM dumb buffer of the vgem driver exported through PRIME.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from pathlib import Path

from ._resource import Resource
from .errors import P2PHubOSError, UsageError

__all__ = ["Udmabuf", "VgemBuffer", "PinnedHost", "HugeMapping", "vgem_card"]

HUGE_PAGE = 2 << 20


def _iowr(typ: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (typ << 8) | nr


def _iow(typ: int, nr: int, size: int) -> int:
    return (1 << 30) | (size << 16) | (typ << 8) | nr


class HugeMapping(Resource):
    """Private anonymous memory at a 2 MiB boundary that asks for transparent huge pages
    (MADV_HUGEPAGE): the staging memory disks read into. An O_DIRECT read is one segment
    per physically contiguous run of its memory; a disk with a segment limit (virtio-blk's
    254, NVMe's often 127) takes a 2 MiB read into 4 KiB pages (512 segments) as several
    requests, and into one huge page as one. On the development host's virtio disk, 512 KiB
    and 2 MiB reads into it ran 2.0x, 16 MiB ones 1.4x, those into 4 KiB pages
    (tools/odirect-hugepages, docs/benchmarks.md). Where the kernel gives no huge pages (THP
    off) it is plain memory. ``ptr`` and ``size``; ``huge``: whether the kernel took the
    advice; close() unmaps."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise UsageError(f"a mapping of {size} bytes")
        self.size = size
        self.length = -(-size // HUGE_PAGE) * HUGE_PAGE
        # one huge page more, to start at a 2 MiB boundary inside it
        self._map = mmap.mmap(-1, self.length + HUGE_PAGE,
                              flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        probe = ctypes.c_char.from_buffer(self._map)
        base = ctypes.addressof(probe)
        del probe                       # no export left: close() may unmap
        skip = -base % HUGE_PAGE
        self.ptr = base + skip
        try:
            self._map.madvise(mmap.MADV_HUGEPAGE, skip, self.length)
            self.huge = True
        except (AttributeError, OSError):   # no THP in this kernel
            self.huge = False

    def view(self) -> memoryview:
        """The bytes as a writable memoryview (valid until close)."""
        return memoryview((ctypes.c_char * self.size).from_address(self.ptr)).cast("B")

    def _close(self) -> None:
        self._map.close()


class _HostBuffer(Resource):
    fd: int = -1
    size: int = 0

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def closed(self) -> bool:
        return self._closed or self.fd < 0

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self.close()


# ------------------------------------------------------------------ udmabuf


class _UdmabufCreate(ctypes.Structure):
    _fields_ = [("memfd", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("offset", ctypes.c_uint64), ("size", ctypes.c_uint64)]


UDMABUF_CREATE = _iow(ord("u"), 0x42, ctypes.sizeof(_UdmabufCreate))
UDMABUF_FLAGS_CLOEXEC = 0x01
F_ADD_SEALS = 1033
F_SEAL_SHRINK = 0x0002


class Udmabuf(_HostBuffer):
    """`size` bytes of memfd pages, as a dma-buf (``fd``) and as a memfd (``memfd``)."""

    def __init__(self, size: int, path: str = "/dev/udmabuf") -> None:
        if size <= 0 or size % mmap.PAGESIZE:
            raise UsageError(f"udmabuf size {size} must be a positive multiple of {mmap.PAGESIZE}")
        self.size = size
        self.memfd = os.memfd_create("p2phub-udmabuf", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.memfd, size)
            fcntl.fcntl(self.memfd, F_ADD_SEALS, F_SEAL_SHRINK)
            dev = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                arg = _UdmabufCreate(self.memfd, UDMABUF_FLAGS_CLOEXEC, 0, size)
                self.fd = fcntl.ioctl(dev, UDMABUF_CREATE, arg, True)
            finally:
                os.close(dev)
        except OSError as exc:
            os.close(self.memfd)
            self.memfd = -1
            raise P2PHubOSError(exc.errno or errno.EIO, f"udmabuf of {size} bytes") from None

    def mmap(self) -> mmap.mmap:
        """The same pages, mapped shared through the memfd."""
        return mmap.mmap(self.memfd, self.size, mmap.MAP_SHARED,
                         mmap.PROT_READ | mmap.PROT_WRITE)

    def _close(self) -> None:
        super()._close()
        if getattr(self, "memfd", -1) >= 0:
            os.close(self.memfd)
            self.memfd = -1


# --------------------------------------------------------------------- vgem


class _CreateDumb(ctypes.Structure):
    _fields_ = [("height", ctypes.c_uint32), ("width", ctypes.c_uint32),
                ("bpp", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("handle", ctypes.c_uint32), ("pitch", ctypes.c_uint32),
                ("size", ctypes.c_uint64)]


class _PrimeHandle(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("fd", ctypes.c_int32)]


class _GemClose(ctypes.Structure):
    _fields_ = [("handle", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


DRM_IOCTL_MODE_CREATE_DUMB = _iowr(ord("d"), 0xB2, ctypes.sizeof(_CreateDumb))
DRM_IOCTL_PRIME_HANDLE_TO_FD = _iowr(ord("d"), 0x2D, ctypes.sizeof(_PrimeHandle))
DRM_IOCTL_GEM_CLOSE = _iow(ord("d"), 0x09, ctypes.sizeof(_GemClose))
DRM_CLOEXEC = os.O_CLOEXEC
DRM_RDWR = os.O_RDWR


def vgem_card() -> str:
    """The /dev/dri/card* node of the vgem driver (modprobe vgem)."""
    for card in sorted(Path("/sys/class/drm").glob("card[0-9]*")):
        if "-" in card.name:
            continue
        # vgem's platform device has no driver bound: go by the device's name.
        dev = (card / "device").resolve()
        drv = card / "device" / "driver"
        if dev.name == "vgem" or (drv.exists() and drv.resolve().name == "vgem"):
            return f"/dev/dri/{card.name}"
    raise P2PHubOSError(errno.ENODEV, "find vgem", "no DRM card of driver vgem (modprobe vgem)")


class VgemBuffer(_HostBuffer):
    """A vgem dumb buffer of `size` bytes (rounded up to a page), as a dma-buf ``fd``."""

    def __init__(self, size: int, card: str | None = None) -> None:
        if size <= 0:
            raise UsageError(f"vgem buffer size {size} must be positive")
        card = card or vgem_card()
        dev = os.open(card, os.O_RDWR | os.O_CLOEXEC)
        try:
            # One row of `size` bytes would overflow pitch limits: use 4 KiB rows.
            rows = -(-size // 4096)
            dumb = _CreateDumb(height=rows, width=1024, bpp=32)
            fcntl.ioctl(dev, DRM_IOCTL_MODE_CREATE_DUMB, dumb, True)
            try:
                prime = _PrimeHandle(handle=dumb.handle, flags=DRM_CLOEXEC | DRM_RDWR, fd=-1)
                fcntl.ioctl(dev, DRM_IOCTL_PRIME_HANDLE_TO_FD, prime, True)
            finally:
                fcntl.ioctl(dev, DRM_IOCTL_GEM_CLOSE, _GemClose(dumb.handle, 0), True)
        except OSError as exc:
            raise P2PHubOSError(exc.errno or errno.EIO, f"vgem buffer of {size} bytes on {card}") from None
        finally:
            os.close(dev)
        self.fd = prime.fd
        self.size = int(dumb.size)


# --------------------------------------------------------------------- pinned host memory


_libc = None


def _mlock(addr: int, size: int) -> int:
    """mlock(2) of [addr, addr + size): 0, or the errno (RLIMIT_MEMLOCK, no privilege)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return 0 if _libc.mlock(addr, size) == 0 else ctypes.get_errno()


class PinnedHost(Resource):
    """`size` bytes of host memory in a memfd, mapped once and locked in RAM (mlock), where no
    dma-buf exporter is needed or available: staged memory, CPU VA MRs. ``ptr`` is the first
    byte of the locked mapping, ``view`` a memoryview of it, ``mmap()`` maps the same pages
    again. ``locked`` is False (with ``lock_error``) where RLIMIT_MEMLOCK refused the lock:
    the memory still works, the kernel may page it out."""

    def __init__(self, size: int) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or size % mmap.PAGESIZE:
            raise UsageError(f"size={size!r} must be a positive multiple of {mmap.PAGESIZE}")
        self.size = size
        self.memfd = os.memfd_create("p2phub-host", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.memfd, size)
            self._map = self.mmap()
        except OSError as exc:
            os.close(self.memfd)
            self.memfd = -1
            raise P2PHubOSError(exc.errno or errno.EIO, f"host memory of {size} bytes") from None
        self.view = memoryview(self._map)
        self.ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        err = _mlock(self.ptr, size)
        self.locked = err == 0
        self.lock_error = "" if self.locked else \
            f"mlock: {errno.errorcode.get(err, err)} ({os.strerror(err)}; see ulimit -l)"

    def mmap(self) -> mmap.mmap:
        """The same pages, mapped shared through the memfd (the caller closes it)."""
        if self.memfd < 0:
            raise UsageError("the host memory is closed")
        return mmap.mmap(self.memfd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def _close(self) -> None:
        self.view.release()
        self._map.close()   # unmapping drops the lock
        os.close(self.memfd)
        self.memfd = -1

    def __repr__(self) -> str:
        return f"<PinnedHost {self.size} bytes{' locked' if self.locked else ''}>"
