"""The kernel side of one controller: the controller fd p2phub.ko hands out.

:class:`ControllerFile` is everything the engine asks of the kernel: BAR0
(registers and doorbells, mapped only up to ``out_bar0_mmap_size``), the
read-only status page, DMA-coherent memory, registrations held for the
controller (``P2PHUB_NVME_MAP_REG``/``UNMAP_REG``), ``RESUME`` after a fence,
and the interrupt and request eventfds. The engine talks to it through this
interface only, so the unit tests hand the controller a fake of it
(tests/unit/nvme_fake.py) and drive it with no kernel module.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from dataclasses import dataclass
from typing import Any

from .. import uapi
from .._resource import Resource
from ..device import Device
from ..errors import P2PHubOSError, RevokedError
from ..pci import PciAddress, normalize


@dataclass(eq=False)
class DmaMemory(Resource):
    """One P2PHUB_NVME_DMA_ALLOC buffer, mapped: ``cptr`` for C, ``view`` for Python."""

    id: int
    size: int
    dma_addr: int
    cptr: Any
    view: memoryview
    _map: Any = None
    _cbuf: Any = None

    def _close(self) -> None:
        """Unmap (the memory itself is freed when the controller fd is released)."""
        if self._map is None:
            return
        self.view.release()
        self._cbuf = None
        self.cptr = None
        try:
            self._map.close()
        except BufferError:
            return  # someone still holds a view; the mapping goes with it
        self._map = None



@dataclass(frozen=True)
class RegMapInfo:
    """What P2PHUB_NVME_MAP_REG reports for a held registration."""

    total: int       # entries of page_size in the whole registration
    generation: int  # what reg_gen[slot] reads while it is live
    slot: int        # index into the status page's reg_gen


class ControllerFile(Resource):
    """An open controller fd (``P2PHUB_NVME_OPEN``) and its mappings."""

    def __init__(self, bdf: str, hot: Any, device: Device | None = None) -> None:
        self.bdf = normalize(bdf)
        self.hot = hot
        self._own_device = device is None
        self.device = device if device is not None else Device()
        self.fd = -1
        self._bar: mmap.mmap | None = None
        self._status_map: mmap.mmap | None = None
        self._bar_c: Any = None
        self._st_c: Any = None
        self.regs: Any = None     # uint32_t * over BAR0
        self.status: Any = None   # struct p2h_status * (read only)
        self._mems: list[DmaMemory] = []
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- open
    def _open(self) -> None:
        arg = uapi.NvmeOpen.new(**PciAddress.parse(self.bdf).fields())
        try:
            self.fd = fcntl.ioctl(self.device.fd, uapi.NVME_OPEN, arg, True)
        except OSError as exc:
            hint = {errno.ENXIO: "not bound to p2phub-nvme (p2phub nvme bind)",
                    errno.EBUSY: "another process owns it, or it is being unbound",
                    errno.EXDEV: "no IOMMU confines it (see docs/security.md; "
                                 "p2phub.ko allow_unsafe_noiommu=1 taints the kernel)",
                    errno.EPERM: "needs CAP_SYS_RAWIO and a kernel not locked down"}.get(exc.errno or 0, "")
            raise P2PHubOSError(exc.errno or errno.EIO, f"P2PHUB_NVME_OPEN {self.bdf}", hint) from None
        self.nr_irqs = arg.out_nr_irqs
        self.bar0_size = arg.out_bar0_size
        # Only what the kernel lets us map: registers and doorbells, up to the MSI-X table.
        size = arg.out_bar0_mmap_size or min(arg.out_bar0_size, 0x2000)
        size = min(size, 0x4000) if size >= 0x2000 else size  # registers + doorbells suffice
        size &= ~(mmap.PAGESIZE - 1)
        if size < 0x1000 + 8:
            raise P2PHubOSError(errno.ENODEV, f"{self.bdf}: BAR0 maps only {size} bytes, no doorbells")
        self._bar = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                              offset=uapi.NVME_MMAP_BAR0)
        ffi = self.hot.ffi
        self._bar_c = ffi.from_buffer(self._bar)
        self.regs = ffi.cast("uint32_t *", self._bar_c)
        self.bar_len = size
        self._status_map = mmap.mmap(self.fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ,
                                     offset=uapi.NVME_MMAP_STATUS)
        self._st_c = ffi.from_buffer(self._status_map)
        self.status = ffi.cast("struct p2h_status *", self._st_c)
        if self.status.abi != uapi.NVME_STATUS_ABI:
            raise P2PHubOSError(errno.EPROTO, f"{self.bdf}: status page ABI {self.status.abi}, "
                                              f"this engine knows {uapi.NVME_STATUS_ABI}")

    # ---------------------------------------------------------------- ioctls
    def _ioctl(self, request: int, arg: ctypes.Structure, what: str) -> None:
        try:
            fcntl.ioctl(self.fd, request, arg, True)
        except OSError as exc:
            raise P2PHubOSError(exc.errno or errno.EIO, what) from None

    def alloc_dma(self, size: int, name: str) -> DmaMemory:
        arg = uapi.NvmeDmaAlloc.new(size=size)
        self._ioctl(uapi.NVME_DMA_ALLOC, arg, f"P2PHUB_NVME_DMA_ALLOC({size}) for {name}")
        m = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                      offset=arg.out_mmap_offset)
        cbuf = self.hot.ffi.from_buffer(m)
        mem = DmaMemory(arg.out_id, size, arg.out_dma_addr, self.hot.ffi.cast("void *", cbuf),
                        memoryview(m), m, cbuf)
        self._mems.append(mem)
        return mem

    def map_reg(self, handle: int, addrs: Any, first: int, count: int, page_size: int) -> RegMapInfo:
        """Hold registration `handle` for the controller; copy `count` addresses into `addrs`."""
        arg = uapi.NvmeMapReg.new(handle=handle, addrs=int(self.hot.ffi.cast("uintptr_t", addrs)),
                                  first=first, count=count, page_size=page_size)
        try:
            fcntl.ioctl(self.fd, uapi.NVME_MAP_REG, arg, True)
        except OSError as exc:
            if exc.errno == errno.ESTALE:
                raise RevokedError(f"registration {handle} was revoked by its owner (ESTALE from "
                                   "P2PHUB_NVME_MAP_REG); register the memory again") from None
            raise P2PHubOSError(exc.errno or errno.EIO, f"P2PHUB_NVME_MAP_REG handle {handle} on {self.bdf}") from None
        return RegMapInfo(arg.out_total, arg.out_generation, arg.out_slot)

    def unmap_reg(self, handle: int) -> None:
        self._ioctl(uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg.new(handle=handle),
                    f"P2PHUB_NVME_UNMAP_REG handle {handle} on {self.bdf}")

    def resume(self) -> None:
        self._ioctl(uapi.NVME_RESUME, uapi.NvmeResume.new(), f"P2PHUB_NVME_RESUME {self.bdf}")

    def irq_set(self, vector: int, eventfd: int) -> None:
        self._ioctl(uapi.NVME_IRQ_SET, uapi.NvmeIrqSet.new(vector=vector, eventfd=eventfd),
                    f"P2PHUB_NVME_IRQ_SET vector {vector}")

    def req_set(self, eventfd: int) -> None:
        self._ioctl(uapi.NVME_REQ_SET, uapi.NvmeReqSet.new(eventfd=eventfd), f"P2PHUB_NVME_REQ_SET {self.bdf}")

    # ---------------------------------------------------------------- lifetime
    @property
    def closed(self) -> bool:
        return self.fd < 0

    def _close(self) -> None:
        """Unmap everything and close the fd: the kernel disables the controller (CC.EN = 0,
        bus mastering off) once the last mapping is gone, then frees its memory."""
        for mem in self._mems:
            mem.close()
        self._mems = []
        self.regs = None
        self.status = None
        self._bar_c = None
        self._st_c = None
        for m in (self._bar, self._status_map):
            if m is not None:
                try:
                    m.close()
                except BufferError:
                    pass
        self._bar = self._status_map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._own_device:
            self.device.close()
