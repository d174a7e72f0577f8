"""Hub and Registration: pin memory once in p2phub.ko, hand its DMA pages to devices.

    with Hub() as hub, hub.register_dmabuf(fd, device="0000:00:04.0") as reg:
        addrs = reg.dma_pages("0000:00:04.0")     # IOVAs when an IOMMU is on
        nic_fd = reg.dmabuf_fd                     # for ibv_reg_dmabuf_mr

A Registration is valid until its owner revokes the memory (a dma-buf exporter's
move_notify, the NVIDIA free callback): from then on every use raises
RevokedError, and close() still releases it. Closing the Hub (or the process
dying) releases every registration it made.
"""

from __future__ import annotations

import array
import ctypes
import enum
import errno
import fcntl
import os
import re
import weakref
from dataclasses import dataclass

from . import uapi
from .device import Device
from .errors import P2PHubOSError, RevokedError, UsageError

__all__ = ["Hub", "Registration", "RegInfo", "PciAddress", "Provider", "RegState"]


class Provider(enum.IntEnum):
    DMABUF = uapi.PROVIDER_DMABUF
    NVIDIA = uapi.PROVIDER_NVIDIA


class RegState(enum.IntEnum):
    LIVE = uapi.REG_STATE_LIVE
    REVOKED = uapi.REG_STATE_REVOKED


_BDF = re.compile(r"^(?:([0-9a-fA-F]{1,4}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


@dataclass(frozen=True)
class PciAddress:
    """A PCI function, domain:bus:device.function (``0000:00:04.0``)."""

    domain: int
    bus: int
    devfn: int

    @classmethod
    def parse(cls, value: "str | PciAddress") -> "PciAddress":
        if isinstance(value, PciAddress):
            return value
        m = _BDF.match(value.strip())
        if not m:
            raise UsageError(f"not a PCI address: {value!r} (want DDDD:BB:DD.F)")
        dom, bus, dev, fn = m.groups()
        if int(dev, 16) > 31:
            raise UsageError(f"not a PCI address: {value!r} (device above 0x1f)")
        return cls(int(dom or "0", 16), int(bus, 16), (int(dev, 16) << 3) | int(fn))

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.devfn >> 3:02x}.{self.devfn & 7}"


@dataclass(frozen=True)
class RegInfo:
    """What P2PHUB_REG_INFO reports about one registration."""

    handle: int
    state: RegState
    provider: Provider
    generation: int
    length: int
    page_size: int
    nr_devices: int
    nr_exports: int
    nr_attached: int
    io_holds: int

    @property
    def revoked(self) -> bool:
        return self.state == RegState.REVOKED


class Registration:
    """Memory pinned by p2phub.ko: per-device DMA page lists and a dma-buf export."""

    path = "p2p"   # a staged registration (p2phub.staged) says "staged"

    def __init__(self, hub: "Hub", handle: int, length: int, page_size: int,
                 provider: Provider, what: str) -> None:
        self._hub = hub
        self.handle = handle
        self.length = length
        self.page_size = page_size
        self.provider = provider
        self.what = what
        self._dmabuf_fd = -1
        self._closed = False
        self.source: object = None       # what was registered, kept alive until close()
        self._owns_source = False         # close() closes it too (hub.alloc_host)
        self._mrs: "weakref.WeakSet" = weakref.WeakSet()  # live p2phub.rdma.MemoryRegion

    # ----------------------------------------------------------- queries

    def _ioctl(self, request: int, arg: ctypes.Structure, what: str) -> None:
        if self._closed:
            raise UsageError(f"{self} is closed")
        try:
            self._hub.device.ioctl(request, arg, what)
        except P2PHubOSError as exc:
            if exc.errno == errno.ESTALE:
                raise RevokedError(
                    f"{self}: the memory was revoked by its owner (ESTALE during {what}); "
                    "close() the registration and register the memory again") from None
            raise

    def info(self) -> RegInfo:
        a = uapi.RegInfo.new(handle=self.handle)
        self._ioctl(uapi.REG_INFO, a, f"P2PHUB_REG_INFO handle {self.handle}")
        return RegInfo(self.handle, RegState(a.out_state), Provider(a.out_provider),
                       a.out_generation, a.out_length, a.out_page_size, a.out_nr_devices,
                       a.out_nr_exports, a.out_nr_attached, a.out_io_holds)

    def dma_pages(self, device: "str | PciAddress", page_size: int = 0) -> list[int]:
        """DMA addresses of every page, as `device` must use them (IOVAs under an IOMMU).

        Parameters
        ----------
        device : PCI address of the device that will do the DMA.
        page_size : bytes per entry; 0 means the registration's page size. A power of
            two from 4096 up to the registration's page size (e.g. 4096 for NVMe PRPs).
        """
        pci = PciAddress.parse(device)
        size = page_size or self.page_size
        total = self.length // size
        out: list[int] = []
        while len(out) < total:
            n = min(total - len(out), uapi.DMA_PAGES_MAX)
            buf = array.array("Q", bytes(8 * n))
            addr, _ = buf.buffer_info()
            a = uapi.DmaPages.new(handle=self.handle, domain=pci.domain, bus=pci.bus,
                                  devfn=pci.devfn, page_size=page_size, count=n,
                                  first=len(out), addrs=addr)
            self._ioctl(uapi.DMA_PAGES, a, f"P2PHUB_DMA_PAGES handle {self.handle} for {pci}")
            out.extend(buf[: a.count])
        return out

    def export(self) -> int:
        """A new dma-buf fd of this registration (p2phub as exporter); the caller closes it."""
        a = uapi.Export.new(handle=self.handle, flags=uapi.EXPORT_F_CLOEXEC)
        if self._closed:
            raise UsageError(f"{self} is closed")
        try:
            # With a mutable buffer, fcntl.ioctl returns the syscall's value: the fd.
            return int(fcntl.ioctl(self._hub.device.fd, uapi.EXPORT, a, True))
        except OSError as exc:
            err = exc.errno or errno.EIO
            if err == errno.ESTALE:
                raise RevokedError(f"{self}: revoked, cannot export (ESTALE)") from None
            raise P2PHubOSError(err, f"P2PHUB_EXPORT handle {self.handle}") from None

    @property
    def dmabuf_fd(self) -> int:
        """This registration as a dma-buf (made on first use, closed by close())."""
        if self._dmabuf_fd < 0:
            self._dmabuf_fd = self.export()
        return self._dmabuf_fd

    def mr(self, pd: object, access: int | None = None):  # -> p2phub.rdma.MemoryRegion
        """An RDMA memory region of this registration, by the best path the NIC supports.

        `pd` is a p2phub.rdma.ProtectionDomain; ``mr.path`` says which path was taken
        (dma-buf MR, peer-memory VA MR, CPU-mapped VA MR). The MR keeps this registration
        from closing until it is closed itself.
        """
        from .rdma.mr import register_mr
        if self._closed:
            raise UsageError(f"{self} is closed")
        mr = register_mr(self, pd, access)
        self._mrs.add(mr)
        return mr

    @property
    def live_mrs(self) -> int:
        return sum(1 for mr in self._mrs if not mr.closed)

    # ----------------------------------------------------------- lifetime

    def close(self, force: bool = False) -> None:
        """Unregister. Raises P2PHubOSError(EBUSY) while an importer is attached to an export,
        or while RDMA memory regions of it are alive (with force=True they are closed first).
        """
        if self._closed:
            return
        live = [mr for mr in self._mrs if not mr.closed]
        if live and not force:
            raise P2PHubOSError(errno.EBUSY, f"close {self}",
                                f"{len(live)} RDMA memory region(s) still use it; close them "
                                "or call close(force=True)")
        for mr in live:
            mr.close()
        if self._dmabuf_fd >= 0:
            os.close(self._dmabuf_fd)
            self._dmabuf_fd = -1
        a = uapi.Unregister.new(handle=self.handle)
        self._hub.device.ioctl(uapi.UNREGISTER, a, f"P2PHUB_UNREGISTER handle {self.handle}")
        self._closed = True
        self._hub._forget(self)
        if self._owns_source and hasattr(self.source, "close"):
            self.source.close()  # type: ignore[union-attr]

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Registration":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<Registration {self.handle} {self.what} {self.length} bytes "
                f"{self.provider.name.lower()} pages of {self.page_size}>")

    __str__ = __repr__


class Hub:
    """An open /dev/p2phub, or staged mode where there is none: the owner of every
    registration made through it.

    mode: "auto" (P2P when /dev/p2phub can be opened, else staged), "p2p" or "staged".
    ``hub.mode`` says which one it is in and ``hub.mode_reason`` why (doctor check ids);
    see p2phub.staged.
    """

    def __init__(self, path: str = uapi.DEVICE_PATH, mode: str = "auto") -> None:
        from . import staged
        self.mode, self._mode_reason = staged.choose_mode(path, mode)
        self._auto = mode == "auto"
        self.device = Device(path) if self.mode == "p2p" else \
            staged.NoDevice(path, lambda: self.mode_reason)  # type: ignore[assignment]
        self._regs: "weakref.WeakSet[Registration]" = weakref.WeakSet()

    @property
    def mode_reason(self) -> str:
        """One line: why the hub is in its mode, naming the doctor's check ids."""
        if self._mode_reason is None:
            from . import staged
            self._mode_reason = staged.doctor_reason(self.device.path)
        return self._mode_reason

    def load(self, source: object, dest: object, offset: int = 0, nbytes: int | None = None,
             dest_offset: int = 0, **kw: object):  # -> p2phub.staged.Fence
        """Read storage (file, block device, NVMe namespace) into a registration; a fence."""
        from . import staged
        return staged.load(self, source, dest, offset, nbytes, dest_offset, **kw)  # type: ignore[arg-type]

    def save(self, source: object, dest: object, offset: int = 0, nbytes: int | None = None,
             source_offset: int = 0, **kw: object):  # -> p2phub.staged.Fence
        """Write a registration to storage (file, block device, NVMe namespace); a fence."""
        from . import staged
        return staged.save(self, source, dest, offset, nbytes, source_offset, **kw)  # type: ignore[arg-type]

    def _register(self, a: uapi.Register, what: str) -> Registration:
        self.device.ioctl(uapi.REGISTER, a, f"P2PHUB_REGISTER {what}")
        reg = Registration(self, a.out_handle, a.length, a.out_page_size,
                           Provider(a.out_provider), what)
        self._regs.add(reg)
        return reg

    @staticmethod
    def _device_fields(device: "str | PciAddress | None") -> dict[str, int]:
        if device is None:
            return {}
        pci = PciAddress.parse(device)
        return {"domain": pci.domain, "bus": pci.bus, "devfn": pci.devfn}

    def register(self, obj: object, offset: int = 0, length: int | None = None,
                 device: "str | PciAddress | None" = None) -> Registration:
        """Register anything p2phub can pin, with one call (see p2phub.register); in
        staged mode, or for a pair the doctor rules out, a p2phub.staged registration."""
        from . import staged
        if self.mode == "staged":
            return staged.register(self, obj, offset, length, device)  # type: ignore[return-value]
        why = staged.pair_reason_for(self, obj, device) if self._auto and device is not None else None
        if why:
            return staged.register(self, obj, offset, length, device, reason=why)  # type: ignore[return-value]
        from .register import register
        return register(self, obj, offset, length, device)

    def alloc_host(self, size: int, device: "str | PciAddress | None" = None) -> Registration:
        """Allocate `size` bytes of host memory as a dma-buf and register it.

        The CPU view is ``reg.source.mmap()``; the same pages serve NVMe and RDMA.
        """
        from .register import alloc_host
        return alloc_host(self, size, device)

    def register_dmabuf(self, fd: int, offset: int = 0, length: int | None = None,
                        device: "str | PciAddress | None" = None) -> Registration:
        """Register bytes [offset, offset + length) of dma-buf `fd` (default: to its end).

        With `device`, the buffer is attached, pinned and mapped for that PCI device
        now (a dma-buf pins per attached device); otherwise on the first dma_pages().
        """
        if length is None:
            length = os.lseek(fd, 0, os.SEEK_END) - offset
        flags = uapi.REGISTER_F_DMABUF | (uapi.REGISTER_F_DEVICE if device is not None else 0)
        a = uapi.Register.new(flags=flags, fd=fd, offset=offset, length=length,
                              **self._device_fields(device))
        return self._register(a, f"dma-buf fd {fd} [{offset:#x}, +{length:#x})")

    def register_nvidia(self, va: int, length: int,
                        device: "str | PciAddress | None" = None) -> Registration:
        """Register a CUDA allocation by GPU virtual address (nvidia_p2p_get_pages, 64 KiB aligned)."""
        flags = uapi.REGISTER_F_NVIDIA | (uapi.REGISTER_F_DEVICE if device is not None else 0)
        a = uapi.Register.new(flags=flags, fd=-1, va=va, length=length,
                              **self._device_fields(device))
        return self._register(a, f"GPU VA {va:#x} +{length:#x}")

    def nvme(self, bdf: str, **kw: object):  # -> p2phub.nvme.Controller
        """Bind (if needed) and bring up the NVMe controller at `bdf` (see p2phub.nvme.Controller)."""
        from .nvme import controller
        return controller.open(bdf, **kw)  # type: ignore[arg-type]

    def _forget(self, reg: Registration) -> None:
        self._regs.discard(reg)

    def info(self):  # -> device.ModuleInfo
        return self.device.info()

    def close(self) -> None:
        """Close every registration still open, then /dev/p2phub (which releases the rest)."""
        if self.device.closed:
            return
        from . import staged
        staged.close_stagers(self)
        for reg in list(self._regs):
            for mr in list(reg._mrs):
                mr.close()  # an MR must not outlive the pin it maps
            if reg._dmabuf_fd >= 0:
                os.close(reg._dmabuf_fd)
                reg._dmabuf_fd = -1
            reg._closed = True
            if reg._owns_source and hasattr(reg.source, "close"):
                reg.source.close()  # type: ignore[union-attr]
        self._regs.clear()
        self.device.close()

    @property
    def closed(self) -> bool:
        return self.device.closed

    def __enter__(self) -> "Hub":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
