"""The lab's stand-in GPU (kmod/p2phub_fakegpu.ko beside this package) from Python.

`FakeGpu` drives /dev/p2phub_fakegpu: export BAR ranges as dma-bufs, revoke
them, fire NVIDIA P2P free callbacks (FREE), count what is outstanding
(QUERY), and map the BAR (the GPU's own view of its memory). `GpuFile` reads
and writes the host file behind the BAR, the independent side for data
checks. The ctypes structs mirror kmod/p2phub_fakegpu.h, the one Python
mirror of it; the unit tests compare them with the header.

`GpuMemory` (``FakeGpu.memory(offset, length)``) is a range of the stand-in's
memory as an application holds it: p2phub reaches it through this package's
backend plugin (p2phub_fakegpu.backend, entry point ``p2phub.backends``), the
way it reaches a vendor's GPU memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import subprocess
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

from p2phub.errors import P2PHubOSError

MODULE = "p2phub_fakegpu"
DEVICE_PATH = "/dev/p2phub_fakegpu"

IOCTL_TYPE = 0xBA
IOCTL_BASE = 0x40
VA_BASE = 0x7FE000000000
GPU_PAGE_SIZE = 0x10000
EXPORT_ALIGN = 0x1000


def _io(nr: int) -> int:
    return (IOCTL_TYPE << 8) | nr


QUERY = _io(IOCTL_BASE + 0)
EXPORT_DMABUF = _io(IOCTL_BASE + 1)
REVOKE = _io(IOCTL_BASE + 2)
FREE = _io(IOCTL_BASE + 3)

# python name -> C macro, checked against the header.
CONSTANTS: dict[str, str] = {
    "IOCTL_TYPE": "P2PHUB_FAKEGPU_IOCTL_TYPE",
    "IOCTL_BASE": "P2PHUB_FAKEGPU_IOCTL_BASE",
    "VA_BASE": "P2PHUB_FAKEGPU_VA_BASE",
    "GPU_PAGE_SIZE": "P2PHUB_FAKEGPU_GPU_PAGE_SIZE",
    "EXPORT_ALIGN": "P2PHUB_FAKEGPU_EXPORT_ALIGN",
    "QUERY": "P2PHUB_FAKEGPU_QUERY",
    "EXPORT_DMABUF": "P2PHUB_FAKEGPU_EXPORT_DMABUF",
    "REVOKE": "P2PHUB_FAKEGPU_REVOKE",
    "FREE": "P2PHUB_FAKEGPU_FREE",
}


class _Struct(ctypes.Structure):
    _c_name_ = ""

    @classmethod
    def new(cls, **values: int) -> "_Struct":
        s = cls(**values)
        s.argsz = ctypes.sizeof(cls)
        return s


class QueryArgs(_Struct):
    _c_name_ = "p2phub_fakegpu_query"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("bar_size", ctypes.c_uint64),
        ("bar_addr", ctypes.c_uint64),
        ("va_base", ctypes.c_uint64),
        ("bufs", ctypes.c_uint32),
        ("bufs_revoked", ctypes.c_uint32),
        ("attachments", ctypes.c_uint32),
        ("mappings", ctypes.c_uint32),
        ("pins", ctypes.c_uint32),
        ("attach_refused", ctypes.c_uint32),
        ("page_tables", ctypes.c_uint32),
        ("dma_mappings", ctypes.c_uint32),
        ("callbacks", ctypes.c_uint32),
        ("callbacks_unacked", ctypes.c_uint32),
        ("late_calls", ctypes.c_uint32),
        ("misuse", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 4),
    ]


class ExportArgs(_Struct):
    _c_name_ = "p2phub_fakegpu_export"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("offset", ctypes.c_uint64),
        ("length", ctypes.c_uint64),
        ("fd", ctypes.c_int32),
        ("reserved", ctypes.c_uint32),
    ]


class RevokeArgs(_Struct):
    _c_name_ = "p2phub_fakegpu_revoke"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("fd", ctypes.c_int32),
        ("mappings_left", ctypes.c_uint32),
        ("pins_left", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class FreeArgs(_Struct):
    _c_name_ = "p2phub_fakegpu_free"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("va", ctypes.c_uint64),
        ("length", ctypes.c_uint64),
        ("callbacks", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


STRUCTS: list[type[_Struct]] = [QueryArgs, ExportArgs, RevokeArgs, FreeArgs]


@dataclass(frozen=True)
class Counts:
    """What QUERY reports: the BAR and every outstanding object."""

    bar_size: int
    bar_addr: int
    va_base: int
    bufs: int
    bufs_revoked: int
    attachments: int
    mappings: int
    pins: int
    attach_refused: int
    page_tables: int
    dma_mappings: int
    callbacks: int
    callbacks_unacked: int
    late_calls: int
    misuse: int

    @classmethod
    def from_args(cls, q: QueryArgs) -> "Counts":
        return cls(**{f.name: int(getattr(q, f.name)) for f in fields(cls)})


@dataclass(frozen=True)
class Revoked:
    mappings_left: int
    pins_left: int


class FakeGpu:
    """An open /dev/p2phub_fakegpu (the module must be loaded: see `loaded`)."""

    def __init__(self, path: str = DEVICE_PATH) -> None:
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise P2PHubOSError(exc.errno or errno.EIO, f"open {path}",
                                f"is {MODULE}.ko loaded and bound to the ivshmem device?") from None
        self.path = path

    def _ioctl(self, request: int, arg: ctypes.Structure, what: str) -> None:
        try:
            fcntl.ioctl(self.fd, request, arg, True)
        except OSError as exc:
            raise P2PHubOSError(exc.errno or errno.EIO, what) from None

    def query(self) -> Counts:
        q = QueryArgs.new()
        self._ioctl(QUERY, q, "P2PHUB_FAKEGPU_QUERY")
        return Counts.from_args(q)

    def export_dmabuf(self, offset: int, length: int) -> int:
        """A new dma-buf fd (O_CLOEXEC) of BAR2 bytes [offset, offset + length); the caller closes it."""
        a = ExportArgs.new(offset=offset, length=length, fd=-1)
        self._ioctl(EXPORT_DMABUF, a, f"P2PHUB_FAKEGPU_EXPORT_DMABUF [{offset:#x}, +{length:#x})")
        return int(a.fd)

    def revoke(self, dmabuf_fd: int) -> Revoked:
        a = RevokeArgs.new(fd=dmabuf_fd)
        self._ioctl(REVOKE, a, f"P2PHUB_FAKEGPU_REVOKE fd {dmabuf_fd}")
        return Revoked(int(a.mappings_left), int(a.pins_left))

    def free_va(self, va: int, length: int) -> int:
        """Simulate cudaFree(): run the free callbacks of the page tables over the range; returns how many."""
        a = FreeArgs.new(va=va, length=length)
        self._ioctl(FREE, a, f"P2PHUB_FAKEGPU_FREE [{va:#x}, +{length:#x})")
        return int(a.callbacks)

    def map_bar(self, offset: int = 0, length: int | None = None) -> mmap.mmap:
        """BAR2 bytes [offset, offset + length) through the GPU's own mapping (uncached)."""
        if length is None:
            length = self.query().bar_size - offset
        return mmap.mmap(self.fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                         offset=offset)

    @staticmethod
    def va(offset: int) -> int:
        """The fake GPU VA of BAR2 offset `offset` (what nvidia_p2p_get_pages takes)."""
        return VA_BASE + offset

    def memory(self, offset: int, length: int) -> "GpuMemory":
        """BAR2 bytes [offset, offset + length) as an allocation `hub.register()` accepts."""
        if offset < 0 or length <= 0:
            raise ValueError(f"stand-in memory [{offset:#x}, +{length:#x}): bad range")
        return GpuMemory(self, offset, length)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def __enter__(self) -> "FakeGpu":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self.close()


@dataclass(frozen=True, eq=False)
class GpuMemory:
    """A range of the stand-in GPU's memory, as a tensor or a cuMemAlloc'd pointer is on a GPU."""

    gpu: FakeGpu
    offset: int
    length: int

    @property
    def va(self) -> int:
        return VA_BASE + self.offset


class GpuFile:
    """The host file behind BAR2, seen through the shared filesystem: the independent side.

    Reads bypass the guest's page cache (the file changes under it, written by
    QEMU on behalf of device DMA), so every read sees what the device wrote.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def read(self, offset: int, length: int) -> bytes:
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            return os.pread(fd, length, offset)
        finally:
            os.close(fd)

    def write(self, offset: int, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            if os.pwrite(fd, data, offset) != len(data):
                raise P2PHubOSError(errno.EIO, f"short write to {self.path}")
            os.fsync(fd)
            os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def fill(self, offset: int, length: int, pattern: bytes) -> bytes:
        data = (pattern * (length // len(pattern) + 1))[:length]
        self.write(offset, data)
        return data


def loaded() -> bool:
    return Path(f"/sys/module/{MODULE}").exists()


def insmod(modules_dir: str | os.PathLike[str]) -> None:
    ko = Path(modules_dir) / f"{MODULE}.ko"
    res = subprocess.run(["insmod", str(ko)], capture_output=True, text=True)
    if res.returncode != 0:
        raise P2PHubOSError(errno.ENOEXEC, f"insmod {ko}", res.stderr.strip())


def ensure_loaded(modules_dir: str | os.PathLike[str]) -> None:
    """Load p2phub_fakegpu.ko unless it is loaded (and leave it loaded)."""
    if not loaded():
        insmod(modules_dir)


def rmmod() -> None:
    res = subprocess.run(["rmmod", MODULE], capture_output=True, text=True)
    if res.returncode != 0:
        raise P2PHubOSError(errno.EBUSY, f"rmmod {MODULE}", res.stderr.strip())


@contextlib.contextmanager
def loaded_module(modules_dir: str | os.PathLike[str]) -> Iterator[None]:
    """p2phub_fakegpu.ko loaded for the duration; unloaded after only if this loaded it.

    Unloading fails (P2PHubOSError EBUSY) while anything still holds the module:
    a dma-buf it exported, an open /dev/p2phub_fakegpu, or a module using its
    nvidia_p2p_* symbols. That is a leak in the code under test.
    """
    mine = not loaded()
    if mine:
        insmod(modules_dir)
    try:
        yield
    finally:
        if mine:
            rmmod()


def dmabuf_info(fd: int) -> dict[str, str]:
    """The line of /sys/kernel/debug/dma_buf/bufinfo describing dma-buf `fd`, as fields."""
    ino = os.fstat(fd).st_ino
    text = Path("/sys/kernel/debug/dma_buf/bufinfo").read_text()
    for line in _bufinfo_rows(text):
        cols = line.split()
        # size flags mode count exp_name ino name
        if len(cols) >= 6 and cols[5].isdigit() and int(cols[5]) == ino:
            return {"size": cols[0], "flags": cols[1], "mode": cols[2], "count": cols[3],
                    "exp_name": cols[4], "ino": cols[5]}
    raise LookupError(f"dma-buf ino {ino} not in bufinfo")


def _bufinfo_rows(text: str) -> Iterator[str]:
    for line in text.splitlines():
        if line and line[0].isdigit():
            yield line
