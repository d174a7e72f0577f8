"""The memory contract: what every registration is, whichever way its bytes move.

``hub.register(...)`` and ``hub.alloc_host(...)`` return a `Memory`: a
`p2phub.hub.Registration` (pinned by p2phub.ko, peer-to-peer) or a
`p2phub.staged.StagedRegistration` (no kernel pin; bytes bounce through pinned
host memory). Every engine (NVMe, RDMA, ordering, KV) takes a Memory and
uses only what is written here:

- what it is: ``length``, ``what``, ``source``, ``mode`` ("p2p" or "staged"),
  ``gpu`` (the GPU range behind it, None for host memory), ``info()``,
  ``mmap()`` (a CPU mapping of host memory);
- who uses it: ``add_user`` / ``remove_user`` / ``users`` (quiesced before it is
  released), ``add_dependent`` / ``live_dependents`` (closed first, e.g. MRs);
- its order: ``ordering`` and ``gpu_access(...)`` (p2phub.ordering);
- what a copy engine needs: ``copy_target()`` (the address its bytes start at, the copy
  operations that reach them, the device ordinal) and ``hold()`` / ``unhold()`` around a
  transfer in flight (close() refuses with EBUSY while one is held; forced, the accesses
  in flight fail at once, and the memory is freed by the last unhold, since an engine may
  still reach it);
- how it reaches a device: ``path(device)`` says which path a device would take
  and why (`MemPath`), ``bind(device)`` takes it (`Binding`: the kernel handle a
  device maps, or the staged lane), and refuses with an error naming why. The
  path is chosen by the Hub's policy (p2phub.policy) the first time a
  (memory, device) pair is bound, from the capability facts of p2phub.capabilities;
  ``hub.paths()`` lists every binding and its path.

Two Memory objects of the same pinned memory (the Hub's cache hands out several)
share one `MemoryShare`: users, dependents, ordering and paths.
"""

from __future__ import annotations

import enum
import errno
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Union

from ._resource import Resource
from .errors import P2PHubOSError, StagedModeError, UsageError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import mmap

    from .backend import GpuRange

__all__ = ["Memory", "MemoryShare", "MemPath", "PathKind", "Binding", "NicTarget", "MemoryInfo",
           "CopyTarget", "DRAIN_TIMEOUT_S", "device_key"]

DRAIN_TIMEOUT_S = 30.0  # how long close() waits for a memory's users by default


class PathKind(enum.Enum):
    """The path a device's access to memory takes."""

    P2P_SWITCH = "P2P through a PCIe switch"
    P2P_HOST_BRIDGE = "P2P through a host bridge"
    P2P = "P2P"                           # route unknown (or the GPU itself)
    HOST_DMA = "DMA to host memory"
    DMABUF_MR = "dma-buf MR"
    PEERMEM_MR = "peer-memory MR"
    HOST_VA_MR = "CPU VA MR"
    STAGED = "staged"

    @property
    def direct(self) -> bool:
        """The device reaches the memory itself (no bounce through host memory)."""
        return self is not PathKind.STAGED


@dataclass(frozen=True)
class NicTarget:
    """An RDMA device as a bind() target, with the facts its MR paths depend on."""

    name: str
    dmabuf_mr: bool           # ibv_reg_dmabuf_mr works here (p2phub.rdma.probe)
    evidence: str             # the probe's words
    peermem: bool             # nvidia_peermem is loaded

    def __str__(self) -> str:
        return f"rdma:{self.name}"


Device = Union[str, NicTarget, Any]  # a PCI address (str or PciAddress) or a NicTarget


def device_key(device: Device) -> str:
    """The name a device goes by in path tables: a lower-case PCI address or rdma:NAME."""
    return str(device).lower() if not isinstance(device, NicTarget) else str(device)


@dataclass(frozen=True)
class MemPath:
    """The path `device` takes to one memory, and why (from the capability facts)."""

    memory: str
    device: str
    kind: PathKind
    reason: str

    def __str__(self) -> str:
        return f"{self.memory} -> {self.device}: {self.kind.value} ({self.reason})"


@dataclass(frozen=True)
class Binding:
    """What a device needs to reach a memory: its path and, for a direct path, the
    p2phub.ko handle it maps (valid in ``device_file``, the /dev/p2phub it came from)."""

    memory: "Memory"
    path: MemPath
    handle: int = -1
    device_file: Any = None

    @property
    def staged(self) -> bool:
        return self.path.kind is PathKind.STAGED

    def require_direct(self, what: str) -> None:
        """Raise StagedModeError naming why when `what` needs the device to reach the memory
        itself and this binding is staged."""
        if self.staged:
            raise StagedModeError(f"{self.memory}: {what} needs peer-to-peer DMA; this memory "
                                  f"is staged ({self.path.reason})")


@dataclass(frozen=True)
class MemoryInfo:
    """What any Memory reports about itself (a Registration reports p2phub.hub.RegInfo)."""

    length: int
    mode: str
    revoked: bool = False
    read_only: bool = False
    revocable: bool = False


@dataclass(frozen=True)
class CopyTarget:
    """What a copy engine (staged lanes, the batch engine) needs to reach a memory's bytes:
    the address they start at, the copy operations of the runtime that owns them (a backend's,
    p2phub.staged.HostOps for host memory; None where no engine copies: a P2P hub's dma-buf or
    host registration, reached through its CPU mapping), the device ordinal, and whether the
    bytes are GPU memory."""

    ptr: int
    ops: Any
    ordinal: int
    gpu: bool


class MemoryOwner(Protocol):
    """What a Memory asks of the Hub that made it."""

    strict_ordering: bool
    foreign: bool

    def _ordering_for(self, mem: "Memory") -> Any: ...

    def _choose_path(self, mem: "Memory", device: Device) -> MemPath: ...

    def _check_owner(self) -> None: ...


class MemoryShare:
    """What every handle of one memory shares: users, dependents, ordering, paths."""

    def __init__(self) -> None:
        # made on first use: most memory never gets any
        self.dependents: "weakref.WeakSet[Any] | None" = None   # MRs: closed first
        self.users: "weakref.WeakKeyDictionary[Any, Memory] | None" = None
        self.ordering: Any = None       # p2phub.ordering.Ordering, made on first use
        self.paths: dict[str, MemPath] = {}
        self.released = False
        self.holds = 0                  # transfers in flight (Memory.hold)
        self.hold_lock = threading.Lock()
        # a close forced past transfers in flight: their fences failed at once, but an engine
        # may still read into the memory, so the last unhold frees it
        self.free_when_idle: Any = None

    @property
    def what(self) -> str:
        return "memory"

    def drain(self, timeout: float | None, force: bool = False) -> None:
        """Ask every user to quiesce its I/O on this memory; raise if one cannot in time.
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

    def check_holds(self, what: str) -> None:
        """Raise EBUSY while a transfer holds the memory (call with hold_lock held)."""
        if self.holds:
            raise P2PHubOSError(errno.EBUSY, f"close {what}",
                                f"{self.holds} load/save transfer(s) still use it")

    def close_dependents(self, force: bool) -> None:
        live = [d for d in self.dependents if not d.closed] if self.dependents else []
        if live and not force:
            raise P2PHubOSError(errno.EBUSY, f"close {self.what}",
                                f"{len(live)} RDMA memory region(s) or other dependents still use "
                                "it; close them or call close(force=True)")
        for d in live:
            d.close()  # an MR must not outlive the memory it maps


class Memory(Resource):
    """The contract every registration keeps (see the module's docstring)."""

    mode: str = ""           # "p2p" or "staged"
    _share: MemoryShare
    _owner: MemoryOwner

    # ------------------------------------------------------------------ what it is
    # Subclasses provide: length, what, source, gpu, handle, info(), mmap(), close().

    length: int
    what: str

    @property
    def source(self) -> Any:
        raise NotImplementedError

    @property
    def gpu(self) -> "GpuRange | None":
        """The GPU memory behind it (backend, device ordinal, PCI address), None for host memory."""
        raise NotImplementedError

    @property
    def hub(self) -> Any:
        """The Hub that made it."""
        return self._owner

    @property
    def handle(self) -> int:
        """The p2phub.ko registration handle (-1 where the kernel holds nothing)."""
        return -1

    @property
    def pin_provider(self) -> str:
        """How p2phub.ko pinned it: "dmabuf", "nvidia", or "" where the kernel holds nothing."""
        return ""

    @property
    def reason(self) -> str:
        """Why this memory is staged ("" for memory pinned by p2phub.ko)."""
        return ""

    @property
    def device_file(self) -> Any:
        """The /dev/p2phub Device in which ``handle`` is valid (None where there is none)."""
        return None

    def info(self) -> Any:
        raise NotImplementedError

    def mmap(self) -> "mmap.mmap":
        """A CPU mapping of host memory (the caller closes it); UsageError for GPU memory."""
        raise NotImplementedError

    def same_memory(self, other: object) -> bool:
        """Two handles of the same memory (the Hub's cache hands out several)."""
        return other is self or (isinstance(other, Memory) and other._share is self._share)

    def copy_target(self) -> CopyTarget:
        """Where a copy engine finds the bytes (see CopyTarget): GPU memory through its
        backend's copies; host memory a P2P hub pinned has no copy engine (ops None)."""
        from .backend import get_backend
        gpu = self.gpu
        if gpu is not None:
            return CopyTarget(gpu.ptr, get_backend(gpu.backend), max(gpu.device, 0), True)
        return CopyTarget(int(getattr(self.source, "ptr", 0) or 0), None, 0, False)

    # ------------------------------------------------------------------ transfers in flight

    def hold(self, n: int = 1) -> None:
        """A transfer that reads or writes this memory starts: close() refuses (EBUSY, unless
        forced) until the matching unhold(). UsageError once the memory is closed."""
        share = self._share
        with share.hold_lock:
            if self.closed:
                raise UsageError(f"{self} is closed")
            share.holds += n

    def unhold(self, n: int = 1) -> None:
        share = self._share
        with share.hold_lock:
            share.holds -= n
            free = None
            if share.holds == 0 and share.free_when_idle is not None:
                free, share.free_when_idle = share.free_when_idle, None
        if free is not None:
            try:
                free()
            except Exception:  # noqa: BLE001 - the transfer's own completion must go on
                log.exception("freeing %s after its last transfer", self)

    @property
    def holds(self) -> int:
        """Transfers in flight on this memory (every handle of it)."""
        return self._share.holds

    # ------------------------------------------------------------------ users and dependents

    def add_dependent(self, obj: Any) -> None:
        """`obj` (with close() and closed) maps this memory: closed before the memory goes
        (close(force=True)), else close() refuses with EBUSY while it is open."""
        self._check_open()
        if self._share.dependents is None:
            self._share.dependents = weakref.WeakSet()
        self._share.dependents.add(obj)

    @property
    def live_dependents(self) -> int:
        """Open dependents (RDMA memory regions) of this memory."""
        return sum(1 for d in self._share.dependents or () if not d.closed)

    live_mrs = live_dependents

    def add_user(self, user: Any) -> None:
        """`user` (a p2phub.hub.RegistrationUser) may have device I/O on this memory: it is
        asked to quiesce before release."""
        self._check_open()
        if self._share.users is None:
            self._share.users = weakref.WeakKeyDictionary()
        self._share.users[user] = self

    def remove_user(self, user: Any) -> None:
        if self._share.users is not None:
            self._share.users.pop(user, None)

    @property
    def users(self) -> list[Any]:
        return list(self._share.users.keys()) if self._share.users else []

    # ------------------------------------------------------------------ ordering

    @property
    def ordering(self) -> Any:  # -> p2phub.ordering.Ordering
        """The live accesses of this memory and their order (see p2phub.ordering).

        Shared by every handle of the same memory; a user of it like any other, so close()
        waits for (or, forced, fails) the accesses still in flight."""
        share = self._share
        if share.ordering is None:
            self._check_open()
            share.ordering = self._owner._ordering_for(self)
            self.add_user(share.ordering)
        return share.ordering

    def gpu_access(self, offset: int, length: int, kind: Any, stream: Any, what: str = "",
                   ops: Any = None) -> Any:
        """Declare GPU work on [offset, offset + length) on `stream` (p2phub.ordering.GpuAccess);
        `ops`: the stream ops of the stream's runtime (found from the stream by default)."""
        return self.ordering.gpu_access(offset, length, kind, stream, what, ops)

    def mr(self, pd: Any, access: int | None = None) -> Any:  # -> p2phub.rdma.MemoryRegion
        """Sugar for ``pd.reg_mr(self, access)`` (see p2phub.rdma.ProtectionDomain.reg_mr)."""
        reg_mr = getattr(pd, "reg_mr", None)
        if reg_mr is None:
            raise UsageError(f"pd must be a p2phub.rdma.ProtectionDomain, not {type(pd).__name__}")
        return reg_mr(self, access)

    # ------------------------------------------------------------------ paths

    def path(self, device: Device) -> MemPath:
        """The path `device` (a PCI address, or a NicTarget) takes to this memory, and why."""
        self._check_open()
        key = device_key(device)
        got = self._share.paths.get(key)
        if got is None:
            got = self._owner._choose_path(self, device)
            self._share.paths[key] = got
        return got

    def bind(self, device: Device) -> Binding:
        """What `device` needs to reach this memory (the path, the handle it maps), chosen
        once per device by the Hub's policy and listed by ``hub.paths()``. Raises an error
        naming why where no path exists."""
        return Binding(self, self.path(device), self.handle, self.device_file)

    def paths(self) -> list[MemPath]:
        """Every device this memory was bound to, with the path it takes."""
        return list(self._share.paths.values())

    # ------------------------------------------------------------------ lifetime

    def close(self, force: bool = False, timeout: float | None = None) -> None:  # type: ignore[override]
        """Release this handle of the memory, once. Its users are asked to quiesce first (up to
        `timeout` seconds, default DRAIN_TIMEOUT_S), its dependents (MRs) must be closed (closed
        here with force=True), and no transfer may hold it (EBUSY unless forced); on a refusal
        nothing is released and close() may be called again. In a forked child nothing of the
        parent's is released."""
        if self.closed:
            return
        if self._detach():
            self._closed = True
            return
        try:
            if self.foreign or self._owner.foreign:   # a forked child of the hub's process
                self._abandon()
            else:
                self._release(force, timeout)
        except BaseException:
            self._reattach()
            raise
        self._closed = True

    # The variations of close(), per kind of memory:

    def _detach(self) -> bool:
        """True when other handles keep the memory alive: this one just goes."""
        return False

    def _release(self, force: bool, timeout: float | None) -> None:
        """Drain users, close dependents, check holds, then free what this memory holds."""
        share = self._share
        share.drain(timeout, force)
        share.close_dependents(force)
        with share.hold_lock:
            if not force:
                share.check_holds(str(self))
            self._closed = True     # no new hold from here on
            deferred = share.holds > 0
            if deferred:
                share.free_when_idle = self._free
        share.released = True
        if deferred:
            log.info("%s: closed with %d transfer(s) in flight; freed when the last ends",
                     self, share.holds)
        else:
            self._free()

    def _free(self) -> None:
        """Free what this memory holds (after _release's checks)."""

    def _abandon(self) -> None:
        """In a forked child: let go without touching the parent's state."""

    def _reattach(self) -> None:
        """A refused release: make the memory findable again."""

    def _check_open(self) -> None:
        if self.closed:
            raise UsageError(f"{self} is closed")
        self._owner._check_owner()
