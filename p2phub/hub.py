"""Hub and Registration: pin memory once in p2phub.ko, hand its DMA pages to devices.

    with Hub() as hub, hub.register(fd, device="0000:00:04.0") as reg:
        addrs = reg.dma_pages("0000:00:04.0")     # IOVAs when an IOMMU is on
        nic_fd = reg.dmabuf_fd                     # for ibv_reg_dmabuf_mr

A Registration is valid until its owner revokes the memory (a dma-buf exporter's
move_notify, the NVIDIA free callback): from then on every use raises
RevokedError, and close() still releases it. Closing the Hub (or the process
dying) releases every registration it made.

Registering memory that is registered already (the same dma-buf range, the same
GPU allocation range) while that registration is open returns a new handle on
the same pin, from a cache, without a system call into p2phub.ko; the pin is
released when its last handle closes. A revoked pin is never handed out again.

Before a pin is released, everything that may still make a device write into it
is drained: its users (an NVMe controller with commands in flight on it, an
ordering fence not yet signalled; see `Registration.add_user`) are asked to
quiesce, and close() raises instead of releasing when one cannot within the
timeout. Objects of a Hub refuse every use in a forked child, whose close()
releases nothing of the parent's.
"""

from __future__ import annotations

import array
import ctypes
import enum
import errno
import fcntl
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Protocol

from . import _resource, batch, capabilities, hostmem, sources, staged, uapi
from ._resource import Resource
from .backend import GpuRange
from .device import Device, ModuleInfo, ioctl_error
from .errors import P2PHubOSError, RevokedError, UsageError
from .files import StorageFile
from .memory import DRAIN_TIMEOUT_S, Device as BindTarget, Memory, MemoryShare, MemPath
from .pci import PciAddress
from .policy import PathPolicy

__all__ = ["Hub", "Registration", "RegInfo", "PciAddress", "Provider", "RegState",
           "RegistrationUser", "DRAIN_TIMEOUT_S"]

log = logging.getLogger(__name__)
_said: set[tuple[str, str]] = set()   # (mode, reason) lines logged by this process


class Provider(enum.IntEnum):
    DMABUF = uapi.PROVIDER_DMABUF
    NVIDIA = uapi.PROVIDER_NVIDIA


class RegState(enum.IntEnum):
    LIVE = uapi.REG_STATE_LIVE
    REVOKED = uapi.REG_STATE_REVOKED


_PROVIDERS = {int(p): p for p in Provider}
_set = ctypes.Structure.__setattr__


def _args(cls: type, **fields: int) -> Any:
    """A UAPI argument struct for the registration fast path, filled without uapi's per-field
    range checks: every value here was checked by sources/PciAddress already."""
    a = cls()
    _set(a, "argsz", ctypes.sizeof(cls))
    for name, value in fields.items():
        _set(a, name, value)
    return a


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
    flags: int = 0

    @property
    def revoked(self) -> bool:
        return self.state == RegState.REVOKED

    @property
    def read_only(self) -> bool:
        """The memory came in through an fd not open for writing: devices may only read it."""
        return bool(self.flags & uapi.REG_INFO_F_READ_ONLY)

    @property
    def revocable(self) -> bool:
        """Its owner may take it back (a revoking dma-buf exporter, NVIDIA P2P)."""
        return bool(self.flags & uapi.REG_INFO_F_REVOCABLE)


class RegistrationUser(Protocol):
    """Something that may make devices write into a registration (an NVMe controller, a fence).

    Added with ``reg.add_user(user)``; before the registration is released, close() calls
    ``user.quiesce_registration(reg, timeout)``, which returns once nothing of the user's
    is outstanding on `reg` (completed or cancelled, with the device stopped) and lets go
    of it; if that cannot happen within `timeout` seconds it returns False or raises
    (P2PHubOSError EBUSY, TimeoutError), and close() releases nothing.
    """

    def quiesce_registration(self, reg: "Registration", timeout: float) -> bool | None: ...


class _Pin(MemoryShare):
    """One kernel registration (a handle in p2phub.ko), shared by every Registration of it."""

    def __init__(self, hub: "Hub", a: uapi.Register, src: sources.Source) -> None:
        super().__init__()
        self.hub = hub
        self.handle = int(a.out_handle)
        self.length = int(a.length)
        self.page_size = int(a.out_page_size)
        self.provider = _PROVIDERS.get(a.out_provider) or Provider(a.out_provider)
        self._src = src
        self.source = src.keep
        self.owns_source = src.owned
        self.key = src.key
        self.refs = 0
        self.dmabuf_fd = -1
        self.revoked = False
        self._info_arg: bytes | None = None  # REG_INFO's input, outputs zero

    @property
    def what(self) -> str:
        return self._src.what

    def ioctl(self, request: int, arg: ctypes.Structure, what: str) -> None:
        try:
            fcntl.ioctl(self.hub.device.fd, request, arg, True)
        except OSError as exc:
            err = exc.errno or errno.EIO
            if err == errno.ESTALE:
                self.mark_revoked()
                raise RevokedError(
                    f"{self.what}: the memory was revoked by its owner (ESTALE during {what}); "
                    "close() the registration and register the memory again") from None
            raise ioctl_error(exc, request, what) from None

    def mark_revoked(self) -> None:
        self.revoked = True
        self.hub._uncache(self)

    def check_live(self) -> bool:
        """True while the memory is not revoked: one P2PHUB_REG_INFO (the cache's check)."""
        if self.revoked:
            return False
        if self._info_arg is None:
            self._info_arg = bytes(_args(uapi.RegInfo, handle=self.handle))
        buf = bytearray(self._info_arg)  # outputs must come in as 0: a fresh copy each call
        try:
            fcntl.ioctl(self.hub.device.fd, uapi.REG_INFO, buf, True)
        except OSError:
            self.mark_revoked()
            return False
        if uapi.RegInfo.from_buffer(buf).out_state != uapi.REG_STATE_LIVE:
            self.mark_revoked()
            return False
        return True

    def release(self, *, kernel: bool, force: bool, timeout: float | None,
                drained: bool = False) -> None:
        """The one way out: drain users, close dependents, UNREGISTER, close an owned source.

        Raises (releasing nothing) while a user cannot quiesce, or while dependents live
        and not `force`. With kernel=False the UNREGISTER is left to closing /dev/p2phub.
        """
        if self.released:
            return
        if not drained:
            self.drain(timeout, force)
        self.close_dependents(force)
        with self.hold_lock:
            if not force:
                self.check_holds(self.what)
        if self.dmabuf_fd >= 0:
            os.close(self.dmabuf_fd)
            self.dmabuf_fd = -1
        if kernel and not self.hub.device.closed:
            try:
                fcntl.ioctl(self.hub.device.fd, uapi.UNREGISTER,
                            _args(uapi.Unregister, handle=self.handle), True)
            except OSError as exc:
                raise P2PHubOSError(exc.errno or errno.EIO,
                                    f"P2PHUB_UNREGISTER handle {self.handle}") from None
        self.released = True
        self.hub._forget(self)
        if self.owns_source and hasattr(self.source, "close"):
            self.source.close()

    def abandon(self) -> None:
        """In a forked child: forget the pin without touching the parent's kernel state."""
        self.released = True
        if self.dmabuf_fd >= 0:  # the child's own copy of the fd
            os.close(self.dmabuf_fd)
            self.dmabuf_fd = -1


class Registration(Memory):
    """Memory pinned by p2phub.ko: per-device DMA page lists and a dma-buf export.

    Each ``hub.register()`` returns its own Registration; two of the same memory share
    one pin (same ``handle``), released when the last of them closes. The memory
    contract (p2phub.memory.Memory) in full; a staged registration (p2phub.staged)
    keeps the same contract with ``mode == "staged"``.
    """

    mode = "p2p"

    def __init__(self, pin: _Pin) -> None:
        self._pin = pin
        self._share = pin
        self._owner = pin.hub
        pin.refs += 1

    # ----------------------------------------------------------- what it is

    handle = property(lambda self: self._pin.handle)
    length = property(lambda self: self._pin.length)
    page_size = property(lambda self: self._pin.page_size)
    provider = property(lambda self: self._pin.provider)
    what = property(lambda self: self._pin.what)

    @property
    def source(self) -> Any:
        """What was registered (kept alive until the pin is released)."""
        return self._pin.source

    @property
    def hub(self) -> "Hub":
        return self._pin.hub

    @property
    def gpu(self) -> GpuRange | None:
        src = self._pin.source
        return src if isinstance(src, GpuRange) else None

    @property
    def pin_provider(self) -> str:
        return self._pin.provider.name.lower()

    @property
    def device_file(self) -> Device:
        return self._pin.hub.device

    def mmap(self) -> mmap.mmap:
        """A CPU mapping of host memory: the source's own (a udmabuf's memfd), else a
        mapping of p2phub's dma-buf export (vgem and other dma-bufs with struct pages).
        The caller closes it."""
        self._check_open()
        if self.gpu is not None:
            raise UsageError(f"{self}: GPU memory has no CPU mapping here")
        src = self._pin.source
        if isinstance(src, hostmem.Udmabuf):
            return src.mmap()
        try:
            return mmap.mmap(self.dmabuf_fd, self.length, mmap.MAP_SHARED,
                             mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise P2PHubOSError(exc.errno or errno.EIO, f"mmap the dma-buf export of {self}",
                                "this memory has no CPU mapping p2phub can give (no struct "
                                "pages behind it)") from None

    @property
    def shared(self) -> int:
        """How many open Registrations hold this pin (1: only this one)."""
        return self._pin.refs

    # ----------------------------------------------------------- queries

    def _check_open(self) -> None:
        if self._closed or self._pin.released:
            raise UsageError(f"{self} is closed")
        self._pin.hub._check_owner()

    def info(self) -> RegInfo:
        self._check_open()
        a = uapi.RegInfo.new(handle=self.handle)
        self._pin.ioctl(uapi.REG_INFO, a, f"P2PHUB_REG_INFO handle {self.handle}")
        if a.out_state != uapi.REG_STATE_LIVE:
            self._pin.mark_revoked()
        return RegInfo(self.handle, RegState(a.out_state), Provider(a.out_provider),
                       a.out_generation, a.out_length, a.out_page_size, a.out_nr_devices,
                       a.out_nr_exports, a.out_nr_attached, a.out_io_holds, a.out_flags)

    def dma_pages(self, device: "str | PciAddress", page_size: int = 0) -> list[int]:
        """DMA addresses of every page, as `device` must use them (IOVAs under an IOMMU).

        Parameters
        ----------
        device : PCI address of the device that will do the DMA.
        page_size : bytes per entry; 0 means the registration's page size. A power of
            two from 4096 up to the registration's page size (e.g. 4096 for NVMe PRPs).
        """
        self._check_open()
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
            self._pin.ioctl(uapi.DMA_PAGES, a, f"P2PHUB_DMA_PAGES handle {self.handle} for {pci}")
            out.extend(buf[: a.count])
        return out

    def export(self) -> int:
        """A new dma-buf fd of this registration (p2phub as exporter); the caller closes it."""
        self._check_open()
        a = uapi.Export.new(handle=self.handle, flags=uapi.EXPORT_F_CLOEXEC)
        try:
            # With a mutable buffer, fcntl.ioctl returns the syscall's value: the fd.
            return int(fcntl.ioctl(self._pin.hub.device.fd, uapi.EXPORT, a, True))
        except OSError as exc:
            err = exc.errno or errno.EIO
            if err == errno.ESTALE:
                self._pin.mark_revoked()
                raise RevokedError(f"{self}: revoked, cannot export (ESTALE)") from None
            raise P2PHubOSError(err, f"P2PHUB_EXPORT handle {self.handle}") from None

    @property
    def dmabuf_fd(self) -> int:
        """This registration as a dma-buf (made on first use, closed with the pin)."""
        if self._pin.dmabuf_fd < 0:
            self._pin.dmabuf_fd = self.export()
        return self._pin.dmabuf_fd

    # ----------------------------------------------------------- lifetime

    # ----------------------------------------------------------- lifetime (Memory.close's hooks)
    # close(force, timeout): the last handle of a pin unregisters it. Raises P2PHubOSError(EBUSY)
    # while an importer is attached to an export, while RDMA memory regions of it are alive
    # (with force=True they are closed first), or while a transfer holds it.

    def _detach(self) -> bool:
        pin = self._pin
        with pin.hub._lock:
            if pin.refs == 1 and not pin.released:
                pin.hub._uncache(pin)   # no new handle on a pin on its way out
                return False
            pin.refs -= 1               # another handle still holds the pin
            return True

    def _abandon(self) -> None:
        self._pin.abandon()             # a forked child never releases the parent's memory
        self._pin.refs -= 1

    def _release(self, force: bool, timeout: float | None) -> None:
        self._pin.release(kernel=True, force=force, timeout=timeout)
        self._pin.refs -= 1

    def _reattach(self) -> None:
        pin = self._pin
        with pin.hub._lock:             # still registered: findable again
            if pin.key is not None and not pin.revoked:
                pin.hub._cache.setdefault(pin.key, pin)

    @property
    def closed(self) -> bool:
        return self._closed or self._pin.released

    def __repr__(self) -> str:
        return (f"<Registration {self.handle} {self.what} {self.length} bytes "
                f"{self.provider.name.lower()} pages of {self.page_size}>")

    __str__ = __repr__


class Hub(Resource):
    """An open /dev/p2phub: the owner of every registration and controller made through it."""

    _drain_timeout: float | None = None   # close(timeout)'s, for _close()

    def __init__(self, path: str = uapi.DEVICE_PATH, mode: str = "auto") -> None:
        """mode: "auto" (P2P when /dev/p2phub can be opened, else staged), "p2p" or "staged".
        ``hub.mode`` says which one it is in and ``hub.mode_reason`` why (doctor check ids);
        a staged hub logs that line once per process. See p2phub.staged."""
        self.mode, self.mode_reason = staged.choose_mode(path, mode)
        self.device = Device(path) if self.mode == "p2p" else \
            staged.NoDevice(path, self.mode_reason)  # type: ignore[assignment]
        self._staging = staged.Staging()   # the open staged registrations
        self.engines = batch.Engines()     # the I/O engines, their thread and settings
        self.policy = PathPolicy()         # chooses each (memory, device) pair's path
        if self.mode == "staged" and (self.mode, self.mode_reason) not in _said:
            _said.add((self.mode, self.mode_reason))
            (log.info if mode == "staged" else log.warning)(
                "p2phub hub in staged mode: %s", self.mode_reason)
        self._mark_owner()
        self._pins: set[_Pin] = set()
        self._cache: dict[Hashable, _Pin] = {}
        self._ctrls: list[Any] = []
        self._caps: int | None = None
        self._lock = threading.Lock()  # the cache and the pins' reference counts
        self.strict_ordering = False  # new registrations raise OrderingError on conflicts

    # ----------------------------------------------------------- the memory contract's owner

    def _ordering_for(self, mem: Memory) -> Any:
        from .ordering import for_registration
        return for_registration(mem, strict=self.strict_ordering)

    def _choose_path(self, mem: Memory, device: BindTarget) -> MemPath:
        path = self.policy.choose(mem, device)
        log.debug("path: %s", path)
        return path

    def paths(self) -> list[MemPath]:
        """Every (memory, device) binding of this Hub's open memory, with the path it took
        (P2P through a switch or a host bridge, DMA to host memory, an MR kind, staged) and
        why."""
        out = [path for pin in list(self._pins) for path in pin.paths.values()]
        return out + [path for reg in self._staging.registrations() for path in reg.paths()]

    def open(self, path: "str | os.PathLike[str]", mode: str = "r", *,
             direct: bool = True) -> "StorageFile":
        """A file or block device opened once for many load()/save() calls (and the batch
        calls): a request on it makes no open or stat of its own. mode "r" (read), "r+"
        (read and write), "w" (created or truncated), "a" (created if missing); `direct`:
        O_DIRECT where the file system has it. Close it (or leave it to hub.close()): the
        close waits for the requests queued on it. See p2phub.files."""
        self._check_open()
        return self.engines.open_storage(path, mode, direct)

    def load(self, source: object, dest: object, offset: int = 0, nbytes: int | None = None,
             dest_offset: int = 0, *, direct: bool = True,
             progress: Any = None) -> Any:  # -> p2phub.staged fence
        """Read storage (file, block device, NVMe namespace) into a registration; a fence.
        Queued on the same engine as load_batch, with every other request queued with it
        (see p2phub.batch.load for the arguments). On a hub.open() file `direct` is the
        file's own."""
        # _check_open() inline (once per request; the memory checks its own state)
        if self._closed or self._pid != _resource.this_pid:
            self._check_open()
        if type(source) is StorageFile:
            return batch.load_open(self, source, dest, offset, nbytes, dest_offset, progress)
        return batch.load(self, source, dest, offset, nbytes, dest_offset, direct=direct,
                          progress=progress)

    def save(self, source: object, dest: object, offset: int = 0, nbytes: int | None = None,
             source_offset: int = 0, *, direct: bool = True, sync: bool = True,
             progress: Any = None) -> Any:  # -> p2phub.staged fence
        """Write a registration to storage (file, block device, NVMe namespace); a fence
        (see p2phub.batch.save)."""
        if self._closed or self._pid != _resource.this_pid:
            self._check_open()
        if type(dest) is StorageFile:
            return batch.save_open(self, source, dest, offset, nbytes, source_offset, sync,
                                   progress)
        return batch.save(self, source, dest, offset, nbytes, source_offset, direct=direct,
                          sync=sync, progress=progress)

    def load_batch(self, entries: Any = None, **kw: Any) -> Any:  # -> p2phub.batch.BatchFence
        """Many (storage, offset, length, memory, memory offset) reads in one call, checked
        before any is submitted; one fence (see p2phub.batch)."""
        return batch.load_batch(self, entries, **kw)

    def save_batch(self, entries: Any = None, **kw: Any) -> Any:  # -> p2phub.batch.BatchFence
        """Many writes of registered memory to storage in one call (see p2phub.batch)."""
        return batch.save_batch(self, entries, **kw)

    # ----------------------------------------------------------- registering

    @property
    def caps(self) -> int:
        if self._caps is None:
            self._caps = int(self.info().caps)
        return self._caps

    def _check_open(self) -> None:
        if self._closed or self.device.closed:
            raise UsageError(f"{self!r} is closed")
        self._check_owner()

    def _check_p2p(self, what: str) -> None:
        """P2P-only calls: in staged mode the placeholder device refuses them, naming why."""
        self._check_open()
        if self.mode != "p2p":
            self.device.ioctl(0, None, what)  # type: ignore[arg-type]  # raises StagedModeError

    def _cached(self, key: Hashable | None) -> Registration | None:
        if key is None:
            return None
        with self._lock:
            pin = self._cache.get(key)
            if pin is None or not pin.check_live():
                return None
            return Registration(pin)

    def _register(self, src: sources.Source, device: "str | PciAddress | None",
                  cached: bool = True) -> Registration:
        """P2PHUB_REGISTER of a resolved source (or the live pin of the same memory)."""
        self._check_p2p(f"P2PHUB_REGISTER {src.what}")
        hit = self._cached(src.key) if cached else None
        if hit is not None:
            src.finish()
            if src.owned and hasattr(src.keep, "close"):
                src.keep.close()
            return hit
        flags = uapi.REGISTER_F_DMABUF if src.kind == sources.DMABUF else uapi.REGISTER_F_NVIDIA
        fields: dict[str, int] = {}
        if device is not None:
            pci = PciAddress.parse(device)
            flags |= uapi.REGISTER_F_DEVICE
            fields = {"domain": pci.domain, "bus": pci.bus, "devfn": pci.devfn}
        a = _args(uapi.Register, flags=flags, fd=src.fd, offset=src.offset, va=src.va,
                  length=src.length, **fields)
        try:
            fcntl.ioctl(self.device.fd, uapi.REGISTER, a, True)
        except BaseException as exc:
            src.finish()
            if src.owned and hasattr(src.keep, "close"):
                src.keep.close()
            if isinstance(exc, OSError):
                raise ioctl_error(exc, uapi.REGISTER, f"P2PHUB_REGISTER {src.what}",
                                  src.length) from None
            raise
        src.finish()
        pin = _Pin(self, a, src)
        with self._lock:
            self._pins.add(pin)
            if src.key is not None:
                self._cache.setdefault(src.key, pin)  # a racing registration of it stays uncached
            return Registration(pin)

    def register(self, obj: object, offset: int = 0, length: int | None = None,
                 device: "str | PciAddress | None" = None) -> Registration:
        """Register anything p2phub can pin, with one call (see p2phub.sources).

        With `device`, the memory is attached, pinned and mapped for that PCI device now
        and bound to it (``reg.path(device)``); otherwise on the first dma_pages(). Memory
        registered already (and not revoked) returns a new handle on the live pin. In staged
        mode, a p2phub.staged registration (``reg.mode == "staged"``).
        """
        if self.mode == "staged":
            return staged.register(self, obj, offset, length, device)  # type: ignore[return-value]
        self._check_open()
        key = sources.cache_key(obj, offset, length)
        hit = self._cached(key)
        if hit is None:
            hit = self._register(sources.resolve(obj, offset, length, self.caps, key=key), device,
                                 cached=False)
        if device is not None:
            hit.bind(device)
        return hit

    def alloc_host(self, size: int, device: "str | PciAddress | None" = None) -> Memory:
        """Allocate `size` bytes of host memory and register it; ``reg.mmap()`` is its CPU view.

        In P2P mode a dma-buf (udmabuf, else vgem) pinned by p2phub.ko: the same pages serve
        NVMe and RDMA. In staged mode (or with no host dma-buf exporter in auto mode), an
        anonymous memfd mapping locked in RAM (p2phub.hostmem.PinnedHost), staged.
        """
        self._check_open()
        reg: Memory
        if self.mode == "staged":
            reg = staged.register_host(self, hostmem.PinnedHost(size))
        else:
            try:
                src = sources.host(size)
            except sources.NoHostExporterError as exc:
                reg = staged.register_host(self, hostmem.PinnedHost(size), reason=str(exc))
            else:
                reg = self._register(src, device)
        if device is not None:
            reg.bind(device)
        return reg

    def register_dmabuf(self, fd: int, offset: int = 0, length: int | None = None,
                        device: "str | PciAddress | None" = None) -> Registration:
        """Register bytes [offset, offset + length) of dma-buf `fd` (default: to its end).

        With `device`, the buffer is attached, pinned and mapped for that PCI device
        now (a dma-buf pins per attached device); otherwise on the first dma_pages().
        """
        self._check_open()
        key = sources.cache_key(fd, offset, length)
        hit = self._cached(key)
        if hit is not None:
            return hit
        return self._register(sources.dmabuf(fd, offset, length, key=key), device, cached=False)

    def register_nvidia(self, va: int, length: int,
                        device: "str | PciAddress | None" = None) -> Registration:
        """Register a CUDA allocation by GPU virtual address (nvidia_p2p_get_pages, 64 KiB aligned).

        A raw address names no allocation, so this form is never served from the cache."""
        self._check_open()
        return self._register(sources.nvidia(va, length), device)

    def _uncache(self, pin: _Pin) -> None:
        if pin.key is not None and self._cache.get(pin.key) is pin:
            del self._cache[pin.key]

    def _forget(self, pin: _Pin) -> None:
        with self._lock:
            self._uncache(pin)
            self._pins.discard(pin)

    @property
    def registrations(self) -> int:
        """Pins this Hub holds in p2phub.ko."""
        return len(self._pins)

    # ----------------------------------------------------------- NVMe

    def nvme(self, bdf: str, **kw: Any) -> Any:  # -> p2phub.nvme.Controller
        """Bind (if needed) and bring up the NVMe controller at `bdf` (see p2phub.nvme.Controller).

        The Hub owns it: Hub.close() closes it, after draining the I/O of every registration.
        """
        self._check_open()
        from .nvme import controller
        self._ctrls = [c for c in self._ctrls if not c.closed]
        ctrl = controller.open(bdf, hub=self, **kw)  # type: ignore[arg-type]
        self._ctrls.append(ctrl)
        return ctrl

    # ----------------------------------------------------------- module

    def info(self) -> ModuleInfo:
        self._check_open()
        return self.device.info()

    def close(self, timeout: float | None = None) -> None:  # type: ignore[override]
        """Run what is queued on the engines and close them (their thread, rings, pinned
        memory), drain every registration's users (up to `timeout` seconds, default
        DRAIN_TIMEOUT_S; raising, with nothing released, when one cannot), close the
        controllers of Hub.nvme(), release every pin, then close /dev/p2phub (which releases
        in the kernel what is left)."""
        self._drain_timeout = timeout
        super().close()

    def _close(self) -> None:
        self._close_all(self._drain_timeout)

    def _close_all(self, timeout: float | None) -> None:
        self.engines.close()
        self._staging.close()
        if self.device.closed:
            return
        pins = list(self._pins)
        if self.foreign:
            # A forked child: the files are the parent's too. Release nothing, drop our copies.
            for pin in pins:
                pin.abandon()
            self._pins.clear()
            self._cache.clear()
            self._ctrls.clear()
            self.device.close()
            return
        deadline = time.monotonic() + (DRAIN_TIMEOUT_S if timeout is None else timeout)
        for pin in pins:  # 1. no device may still write into any of them
            pin.drain(max(0.0, deadline - time.monotonic()))
        _close_all(self._ctrls)  # 2. controllers: their fds hold pages in the kernel
        self._ctrls.clear()
        for pin in pins:  # 3. the one release path, the kernel side left to the close below
            pin.release(kernel=False, force=True, timeout=0.0, drained=True)
        self._cache.clear()
        self.device.close()

    @property
    def closed(self) -> bool:
        return self._closed or self.device.closed

    def __repr__(self) -> str:
        if self.mode == "staged":
            return (f"<Hub staged ({self.mode_reason}) "
                    f"{len(self._staging.registrations())} registrations>")
        return f"<Hub p2p {self.device.path} {len(self._pins)} registrations>"


def _close_all(objs: Iterable[Any]) -> None:
    for o in objs:
        o.close()
