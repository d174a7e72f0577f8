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
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Protocol

from . import sources, uapi
from ._resource import Resource
from .device import Device, ModuleInfo, ioctl_error
from .errors import P2PHubOSError, RevokedError, UsageError
from .pci import PciAddress

__all__ = ["Hub", "Registration", "RegInfo", "PciAddress", "Provider", "RegState",
           "RegistrationUser", "DRAIN_TIMEOUT_S"]

DRAIN_TIMEOUT_S = 30.0  # how long close() waits for a registration's users by default


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


class _Pin:
    """One kernel registration (a handle in p2phub.ko), shared by every Registration of it."""

    def __init__(self, hub: "Hub", a: uapi.Register, src: sources.Source) -> None:
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
        self.released = False
        # made on first use: most registrations never get either
        self.dependents: "weakref.WeakSet[Any] | None" = None  # MRs: closed first
        self.users: "weakref.WeakKeyDictionary[Any, Registration] | None" = None
        self.ordering: Any = None  # p2phub.ordering.Ordering, made on first use
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

    def drain(self, timeout: float | None, force: bool = False) -> None:
        """Ask every user to quiesce its I/O on this pin; raise if one cannot in time.
        With `force`, a user that can abandon what it has in flight (the ordering's fences)
        is told to."""
        if not self.users:
            return
        deadline = time.monotonic() + (DRAIN_TIMEOUT_S if timeout is None else timeout)
        for user, view in list(self.users.items()):
            if user.quiesce_registration(view, max(0.0, deadline - time.monotonic())) is False:
                if force and hasattr(user, "abandon_registration"):
                    user.abandon_registration(view)
                    continue
                raise P2PHubOSError(errno.EBUSY, f"close {self.what}",
                                    f"{user!r} still has I/O outstanding on it; nothing was released")

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
        live = [d for d in self.dependents if not d.closed] if self.dependents else []
        if live and not force:
            raise P2PHubOSError(errno.EBUSY, f"close {self.what}",
                                f"{len(live)} RDMA memory region(s) or other dependents still use "
                                "it; close them or call close(force=True)")
        for d in live:
            d.close()  # an MR must not outlive the pin it maps
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


class Registration(Resource):
    """Memory pinned by p2phub.ko: per-device DMA page lists and a dma-buf export.

    Each ``hub.register()`` returns its own Registration; two of the same memory share
    one pin (same ``handle``), released when the last of them closes.
    """

    path = "p2p"  # a staged registration (p2phub.staged) says "staged"

    def __init__(self, pin: _Pin) -> None:
        self._pin = pin
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

    def mr(self, pd: Any, access: int | None = None) -> Any:  # -> p2phub.rdma.MemoryRegion
        """Sugar for ``pd.reg_mr(self, access)`` (see p2phub.rdma.ProtectionDomain.reg_mr)."""
        reg_mr = getattr(pd, "reg_mr", None)
        if reg_mr is None:
            raise UsageError(f"pd must be a p2phub.rdma.ProtectionDomain, not {type(pd).__name__}")
        return reg_mr(self, access)

    # ----------------------------------------------------------- ordering

    @property
    def ordering(self) -> Any:  # -> p2phub.ordering.Ordering
        """The live accesses of this memory and their order (see p2phub.ordering).

        Shared by every Registration of the same pin; a user of the pin like any other, so
        close() waits for (or, forced, fails) the accesses still in flight."""
        pin = self._pin
        if pin.ordering is None:
            from .ordering import for_registration
            self._check_open()
            pin.ordering = for_registration(self, strict=pin.hub.strict_ordering)
            self.add_user(pin.ordering)
        return pin.ordering

    def gpu_access(self, offset: int, length: int, kind: Any, stream: Any) -> Any:
        """Declare GPU work on [offset, offset + length) on `stream` (p2phub.ordering.GpuAccess)."""
        return self.ordering.gpu_access(offset, length, kind, stream)

    # ----------------------------------------------------------- what depends on it

    def add_dependent(self, obj: Any) -> None:
        """`obj` (with close() and closed) maps this memory: closed before the pin goes
        (close(force=True)), else close() refuses with EBUSY while it is open."""
        self._check_open()
        if self._pin.dependents is None:
            self._pin.dependents = weakref.WeakSet()
        self._pin.dependents.add(obj)

    def add_user(self, user: RegistrationUser) -> None:
        """`user` may have device I/O on this memory: it is asked to quiesce before release."""
        self._check_open()
        if self._pin.users is None:
            self._pin.users = weakref.WeakKeyDictionary()
        self._pin.users[user] = self

    def remove_user(self, user: RegistrationUser) -> None:
        if self._pin.users is not None:
            self._pin.users.pop(user, None)

    @property
    def users(self) -> list[Any]:
        return list(self._pin.users.keys()) if self._pin.users else []

    @property
    def live_mrs(self) -> int:
        """Open dependents (RDMA memory regions) of this registration's pin."""
        return sum(1 for d in self._pin.dependents or () if not d.closed)

    # ----------------------------------------------------------- lifetime

    def close(self, force: bool = False, timeout: float | None = None) -> None:
        """Release this handle; the last handle of a pin unregisters it.

        Before that, the pin's users are asked to quiesce (up to `timeout` seconds,
        default DRAIN_TIMEOUT_S): one that cannot makes close() raise and release
        nothing. Raises P2PHubOSError(EBUSY) while an importer is attached to an export,
        or while RDMA memory regions of it are alive (with force=True they are closed first).
        """
        if self._closed:
            return
        pin = self._pin
        hub = pin.hub
        with hub._lock:
            last = pin.refs == 1 and not pin.released
            if last:
                hub._uncache(pin)   # no new handle on a pin on its way out
            else:
                pin.refs -= 1       # another handle still holds the pin
                self._closed = True
                return
        try:
            if hub.foreign:
                pin.abandon()       # a forked child never releases the parent's memory
            else:
                pin.release(kernel=True, force=force, timeout=timeout)
        except BaseException:
            with hub._lock:         # still registered: findable again
                if pin.key is not None and not pin.revoked:
                    hub._cache.setdefault(pin.key, pin)
            raise
        pin.refs -= 1
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed or self._pin.released

    def __repr__(self) -> str:
        return (f"<Registration {self.handle} {self.what} {self.length} bytes "
                f"{self.provider.name.lower()} pages of {self.page_size}>")

    __str__ = __repr__


class Hub(Resource):
    """An open /dev/p2phub: the owner of every registration and controller made through it."""

    def __init__(self, path: str = uapi.DEVICE_PATH, mode: str = "auto") -> None:
        """mode: "auto" (P2P when /dev/p2phub can be opened, else staged), "p2p" or "staged".
        ``hub.mode`` says which one it is in and ``hub.mode_reason`` why (doctor check ids);
        see p2phub.staged."""
        from . import staged
        self.mode, self._mode_reason = staged.choose_mode(path, mode)
        self._auto = mode == "auto"
        self.device = Device(path) if self.mode == "p2p" else \
            staged.NoDevice(path, lambda: self.mode_reason)  # type: ignore[assignment]
        self._staged: "weakref.WeakSet[Any]" = weakref.WeakSet()  # p2phub.staged registrations
        self._mark_owner()
        self._pins: set[_Pin] = set()
        self._cache: dict[Hashable, _Pin] = {}
        self._ctrls: list[Any] = []
        self._caps: int | None = None
        self._lock = threading.Lock()  # the cache and the pins' reference counts
        self.strict_ordering = False  # new registrations raise OrderingError on conflicts

    @property
    def mode_reason(self) -> str:
        """One line: why the hub is in its mode, naming the doctor's check ids."""
        if self._mode_reason is None:
            from . import staged
            self._mode_reason = staged.doctor_reason(self.device.path)
        return self._mode_reason

    def load(self, source: object, dest: object, offset: int = 0, nbytes: int | None = None,
             dest_offset: int = 0, **kw: object) -> Any:  # -> p2phub.staged fence
        """Read storage (file, block device, NVMe namespace) into a registration; a fence."""
        from . import staged
        return staged.load(self, source, dest, offset, nbytes, dest_offset, **kw)  # type: ignore[arg-type]

    def save(self, source: object, dest: object, offset: int = 0, nbytes: int | None = None,
             source_offset: int = 0, **kw: object) -> Any:  # -> p2phub.staged fence
        """Write a registration to storage (file, block device, NVMe namespace); a fence."""
        from . import staged
        return staged.save(self, source, dest, offset, nbytes, source_offset, **kw)  # type: ignore[arg-type]

    def load_batch(self, entries: Any = None, **kw: Any) -> Any:  # -> p2phub.batch.BatchFence
        """Many (storage, offset, length, memory, memory offset) reads in one call, checked
        before any is submitted; one fence (see p2phub.batch)."""
        from . import batch
        return batch.load_batch(self, entries, **kw)

    def save_batch(self, entries: Any = None, **kw: Any) -> Any:  # -> p2phub.batch.BatchFence
        """Many writes of registered memory to storage in one call (see p2phub.batch)."""
        from . import batch
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
                raise ioctl_error(exc, uapi.REGISTER, f"P2PHUB_REGISTER {src.what}") from None
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

        With `device`, the memory is attached, pinned and mapped for that PCI device now;
        otherwise on the first dma_pages(). Memory registered already (and not revoked)
        returns a new handle on the live pin. In staged mode, or for a pair the doctor rules
        out, a p2phub.staged registration (``reg.path == "staged"``).
        """
        from . import staged
        if self.mode == "staged":
            return staged.register(self, obj, offset, length, device)  # type: ignore[return-value]
        why = staged.pair_reason_for(self, obj, device) if self._auto and device is not None else None
        if why:
            return staged.register(self, obj, offset, length, device, reason=why)  # type: ignore[return-value]
        self._check_open()
        key = sources.cache_key(obj, offset, length)
        hit = self._cached(key)
        if hit is not None:
            return hit
        return self._register(sources.resolve(obj, offset, length, self.caps, key=key), device,
                              cached=False)

    def alloc_host(self, size: int, device: "str | PciAddress | None" = None) -> Registration:
        """Allocate `size` bytes of host memory as a dma-buf and register it.

        The CPU view is ``reg.source.mmap()``; the same pages serve NVMe and RDMA.
        """
        self._check_open()
        return self._register(sources.host(size), device)

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
        """Drain every registration's users (up to `timeout` seconds, default DRAIN_TIMEOUT_S;
        raising, with nothing released, when one cannot), close the controllers of
        Hub.nvme(), release every pin, then close /dev/p2phub (which releases in the kernel
        what is left)."""
        if self._closed:
            return
        self._close_all(timeout)
        self._closed = True

    def _close_all(self, timeout: float | None) -> None:
        from . import staged
        staged.close_stagers(self)
        for reg in list(self._staged):
            reg.close(force=True)
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
        return f"<Hub {self.device.path} {len(self._pins)} registrations>"


def _close_all(objs: Iterable[Any]) -> None:
    for o in objs:
        o.close()
