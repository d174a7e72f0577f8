"""Staged mode: the same Hub API where peer-to-peer DMA cannot run.

Where p2phub.ko is absent (a signed-only kernel, a cloud VM, no root) or where
the caller asks for it, ``Hub()`` opens in staged mode: ``hub.mode == "staged"``
and ``hub.mode_reason`` says why in one line that names the doctor's check ids
(from p2phub.capabilities; logged once). ``hub.register(tensor)`` then returns a
``StagedRegistration`` (``reg.mode == "staged"``), which keeps the whole memory
contract (p2phub.memory: users, ordering, ``gpu_access``, paths), and ``hub.load(source, reg)`` / ``hub.save(reg, dest)`` move the
bytes between storage and GPU memory through pinned host bounce buffers:

    storage --(kernel I/O: O_DIRECT preads, several in flight)--> pinned chunk
            --(cuMemcpyHtoDAsync on the lane's stream)--> GPU memory

Loads and saves into host memory and CUDA memory run on the Hub's batch engine
(p2phub.batch: io_uring, reused staging slots, batched copies), one request or
many. Memory of other backends (ROCm) goes through this module's lanes: each
lane (one thread) owns a stream and two pinned chunks, so while one chunk's copy
runs on the stream the lane already reads the next one; with several lanes the
disk sees a deep queue and PCIe runs at the same time. Saving runs the other way
(D2H copy, then O_DIRECT pwrite). Files and block devices both work; file
systems without O_DIRECT (tmpfs) fall back to buffered I/O.

The same calls work in peer-to-peer mode (files always go through the kernel;
an NVMe namespace owned by p2phub goes straight to the SSD), and both return a
fence: ``wait(timeout)``, ``done()``, ``exception()``, ``add_done_callback``,
``await fence`` and ``on_stream(stream)``.
"""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import stat
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

from . import capabilities
from ._resource import Resource
from .backend import GpuRange, check_range, describe, find_backend
from .errors import ModuleNotLoadedError, P2PHubOSError, StagedModeError, UsageError
from .hostmem import PinnedHost
from .memory import CopyTarget, Memory, MemoryInfo, MemoryShare
from .ordering.tracker import AccessKind

if TYPE_CHECKING:
    from .hub import Hub

__all__ = ["StagedRegistration", "StagedModeError", "Fence", "Stager", "Staging", "choose_mode",
           "HostOps", "DirectStorage", "load", "save", "register", "register_host", "configure"]

MODE_P2P = "p2p"
MODE_STAGED = "staged"
MODES = ("auto", MODE_P2P, MODE_STAGED)

ALIGN = 4096
DEFAULT_CHUNK = 16 << 20
DEFAULT_LANES = 8


class NoDeviceError(StagedModeError, ModuleNotLoadedError):
    """A staged hub was asked for a /dev/p2phub call, and there is no /dev/p2phub: what
    callers that need P2P caught as ModuleNotLoadedError before staged mode existed."""


# ------------------------------------------------------------------ mode


def choose_mode(path: str, mode: str) -> tuple[str, str]:
    """(mode, reason) for Hub(path, mode): the reason names the doctor check behind it."""
    if mode not in MODES:
        raise UsageError(f"mode={mode!r}: want one of {', '.join(MODES)}")
    if mode == MODE_STAGED:
        return MODE_STAGED, "asked for: Hub(mode='staged')"
    if mode == MODE_P2P:
        return MODE_P2P, "asked for: Hub(mode='p2p')"
    why = capabilities.staged_reason(capabilities.kmod_facts(path))
    if why is None:
        return MODE_P2P, f"{path} is open (kmod.devnode PASS)"
    return MODE_STAGED, why


class NoDevice(Resource):
    """Stands in for the /dev/p2phub Device in staged mode: every ioctl is refused clearly."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self._reason = reason
        self.fd = -1

    def _error(self, what: str) -> StagedModeError:
        cls = StagedModeError if os.path.exists(self.path) else NoDeviceError
        return cls(f"{what}: the hub is in staged mode, there is no {self.path} "
                   f"({self._reason})")

    def ioctl(self, request: int, arg: object, what: str) -> None:
        raise self._error(what)

    def info(self):
        raise self._error("P2PHUB_GET_INFO")

    def _close(self) -> None:
        pass   # holds nothing


# ------------------------------------------------------------------ fences


class _LocalFence:
    """The fence interface where p2phub.ordering is not installed: completed once by
    ``_complete(exc)``; the same contract as p2phub.ordering.fence.Fence."""

    def __init__(self, what: str = "") -> None:
        self.what = what
        self._fut: Future = Future()

    def _complete(self, exc: BaseException | None = None) -> bool:
        if self._fut.done():
            return False
        if exc is None:
            self._fut.set_result(None)
        else:
            self._fut.set_exception(exc)
        return True

    def done(self) -> bool:
        return self._fut.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; raise the failure, or TimeoutError."""
        try:
            self._fut.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"{self}: not complete after {timeout} s") from None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        try:
            return self._fut.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(f"{self}: not complete after {timeout} s") from None

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        self._fut.add_done_callback(lambda _f: fn(self))

    def __await__(self):
        return asyncio.wrap_future(self._fut).__await__()

    def on_stream(self, stream: Any, ops: Any = None) -> None:
        """Without p2phub.ordering's completion words a pending fence is waited for here."""
        self.wait()


try:
    from .ordering.fence import Fence as _FenceBase  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the ordering layer being present
    _FenceBase = _LocalFence  # type: ignore[misc,assignment]


class Fence(_FenceBase):  # type: ignore[misc,valid-type]
    """Completion of one load or save (p2phub's fence interface: wait, done, exception,
    add_done_callback, await, on_stream). A load completes only once its host-to-device
    copies have finished on the GPU, so on_stream orders GPU work after the bytes
    arrived. ``stats`` holds the transfer's seconds, GB/s and settings."""

    path = MODE_STAGED

    def __init__(self, what: str, nbytes: int) -> None:
        super().__init__(what)
        self.nbytes = nbytes
        self.stats: dict[str, Any] = {}

    def _finish(self, exc: BaseException | None = None) -> None:
        self._complete(exc)

    def on_stream(self, stream: Any, ops: Any = None) -> None:
        """`stream` waits for this fence on the GPU (a completion word, through the
        ordering layer's stream ops); where no stream ops serve `stream`, the CPU waits."""
        if _FenceBase is _LocalFence:
            return _LocalFence.on_stream(self, stream, ops)
        try:
            super().on_stream(stream, ops)
        except UsageError:
            self.wait()


class FutureFence(Fence):
    """A fence over futures from another engine (p2phub's NVMe engine in P2P mode)."""

    path = MODE_P2P

    def __init__(self, what: str, nbytes: int, futures: list[Any]) -> None:
        super().__init__(what, nbytes)
        self._left = len(futures)
        self._count_lock = threading.Lock()
        if not futures:
            self._finish()
        for f in futures:
            f.add_done_callback(self._one)

    def _one(self, f: Any) -> None:
        exc = f.exception()
        with self._count_lock:
            self._left -= 1
            last = self._left == 0
        if exc is not None:
            self._finish(exc)
        elif last:
            self._finish()


# ------------------------------------------------------------------ copy engines


@dataclass
class HostBuf(Resource):
    ptr: int
    size: int
    view: memoryview
    mapping: Any = None     # the hostmem.HugeMapping the bytes live in

    def _close(self) -> None:
        self.view.release()
        if self.mapping is not None:
            self.mapping.close()


class HostOps:
    """The staging operations over plain host memory (no GPU runtime): copies are memmove,
    streams and events complete at once. Staged registrations of host buffers use it,
    and it is the reference the GPU engines are tested against."""

    name = "host"

    def bind_thread(self, ordinal: int = 0) -> None:
        pass

    def pinned(self, size: int) -> HostBuf:
        from .hostmem import HugeMapping
        m = HugeMapping(size)   # huge pages: an O_DIRECT read into a slot is few segments
        return HostBuf(m.ptr, size, m.view(), m)

    def stream_create(self) -> int:
        return 0

    def stream_destroy(self, stream: int) -> None:
        pass

    def copy_h2d(self, dst: int, src: int, n: int, stream: int) -> None:
        import ctypes
        ctypes.memmove(dst, src, n)

    copy_d2h = copy_h2d

    def event_create(self) -> int:
        return 0

    def event_destroy(self, ev: int) -> None:
        pass

    def event_record(self, ev: int, stream: Any) -> None:
        pass

    def event_synchronize(self, ev: int) -> None:
        pass

    def stream_wait_event(self, stream: Any, ev: int) -> None:
        pass


def _host_span(obj: Any) -> tuple[int, int]:
    """(address, bytes) of a writable contiguous host buffer (bytearray, mmap, numpy)."""
    import ctypes
    mv = memoryview(obj)
    if mv.readonly:
        raise UsageError(f"{describe(obj)}: read-only buffer")
    if not mv.contiguous:
        raise UsageError(f"{describe(obj)}: buffer is not contiguous")
    mv = mv.cast("B")
    if mv.nbytes == 0:
        raise UsageError(f"{describe(obj)}: empty buffer")
    return ctypes.addressof(ctypes.c_char.from_buffer(mv)), mv.nbytes


@dataclass
class _Lane:
    bufs: list[Any]
    stream: int
    events: list[int]
    pending: list[bool] = field(default_factory=lambda: [False, False])


class Stager(Resource):
    """Lanes of pinned chunks and streams for one copy engine and device, reused by every
    load and save (pinned memory is dear to allocate)."""

    def __init__(self, ops: Any, device: int = 0, chunk: int = DEFAULT_CHUNK,
                 lanes: int = DEFAULT_LANES) -> None:
        if chunk <= 0 or chunk % ALIGN:
            raise UsageError(f"chunk={chunk} must be a positive multiple of {ALIGN}")
        if lanes <= 0:
            raise UsageError(f"lanes={lanes} must be positive")
        self.ops = ops
        self.device = device
        self.chunk = chunk
        self.nlanes = lanes
        self._lanes: list[_Lane] = []
        self._in_use = threading.Lock()   # one transfer at a time uses the lanes

    def _ensure(self) -> list[_Lane]:
        if not self._lanes:
            self.ops.bind_thread(self.device)
            for _ in range(self.nlanes):
                self._lanes.append(_Lane(
                    [self.ops.pinned(self.chunk), self.ops.pinned(self.chunk)],
                    self.ops.stream_create(),
                    [self.ops.event_create(), self.ops.event_create()]))
        return self._lanes

    def _close(self) -> None:
        with self._in_use:
            for lane in self._lanes:
                for b in lane.bufs:
                    b.close()
                for e in lane.events:
                    self.ops.event_destroy(e)
                self.ops.stream_destroy(lane.stream)
            self._lanes.clear()

    # ------------------------------------------------------------- transfers

    def start(self, fence: Fence, direction: str, fd: int, direct: bool, file_offset: int,
              mem: int, nbytes: int, progress: Callable[[int], None] | None,
              on_done: Callable[[], None]) -> None:
        """Run a transfer on a coordinator thread; `fence` completes when it is over."""
        if self._closed:
            raise UsageError("the stager is closed")
        t = threading.Thread(target=self._run, name=f"p2phub-staged-{direction}", daemon=True,
                             args=(fence, direction, fd, direct, file_offset, mem, nbytes,
                                   progress, on_done))
        t.start()

    def _run(self, fence: Fence, direction: str, fd: int, direct: bool, file_offset: int,
             mem: int, nbytes: int, progress: Callable[[int], None] | None,
             on_done: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        err: BaseException | None = None
        try:
            with self._in_use:
                lanes = self._ensure()
                pieces = _pieces(file_offset, nbytes, self.chunk, direct)
                nxt = iter(range(len(pieces)))
                lock = threading.Lock()
                failed: list[BaseException] = []

                def take() -> tuple[int, int, int, int] | None:
                    with lock:
                        if failed:
                            return None
                        i = next(nxt, None)
                    return None if i is None else pieces[i]

                work = self._lane_load if direction == "load" else self._lane_save
                threads = [threading.Thread(target=_guard, daemon=True,
                                            args=(work, failed, lock, lane, take, fd, mem,
                                                  file_offset, progress))
                           for lane in lanes[:max(1, min(len(lanes), len(pieces)))]]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                if failed:
                    err = failed[0]
                elif direction == "save" and fence.stats.get("sync", True):
                    os.fsync(fd)
        except BaseException as exc:  # noqa: BLE001 - delivered through the fence
            err = exc
        finally:
            dt = time.perf_counter() - t0
            fence.stats.update(seconds=dt, gbps=(nbytes / dt / 1e9) if dt > 0 else 0.0,
                               direct=direct, lanes=self.nlanes, chunk=self.chunk)
            try:
                on_done()
            except BaseException as exc:  # noqa: BLE001
                err = err or exc
            fence._finish(err)

    def _lane_load(self, lane: _Lane, take: Callable, fd: int, mem: int, file_offset: int,
                   progress: Callable[[int], None] | None) -> None:
        ops = self.ops
        ops.bind_thread(self.device)
        k = 0
        try:
            while (piece := take()) is not None:
                start, length, skip, useful = piece
                buf, ev = lane.bufs[k], lane.events[k]
                if lane.pending[k]:
                    ops.event_synchronize(ev)
                    lane.pending[k] = False
                got = _pread_full(fd, buf.view, length, start)
                if got < skip + useful:
                    raise P2PHubOSError(errno.EIO, f"read at offset {start}",
                                        f"the source ends at byte {start + got}, before "
                                        f"{start + skip + useful}")
                dst = mem + (start + skip - file_offset)
                ops.copy_h2d(dst, buf.ptr + skip, useful, lane.stream)
                ops.event_record(ev, lane.stream)
                lane.pending[k] = True
                k ^= 1
                if progress:
                    progress(useful)
        finally:
            for j in (0, 1):
                if lane.pending[j]:
                    ops.event_synchronize(lane.events[j])
                    lane.pending[j] = False

    def _lane_save(self, lane: _Lane, take: Callable, fd: int, mem: int, file_offset: int,
                   progress: Callable[[int], None] | None) -> None:
        ops = self.ops
        ops.bind_thread(self.device)
        k = 0
        while (piece := take()) is not None:
            start, length, skip, useful = piece
            buf, ev = lane.bufs[k], lane.events[k]
            ops.copy_d2h(buf.ptr, mem + (start - file_offset), length, lane.stream)
            ops.event_record(ev, lane.stream)
            ops.event_synchronize(ev)
            _pwrite_full(fd, buf.view, length, start)
            k ^= 1
            if progress:
                progress(length)


def _guard(work: Callable, failed: list[BaseException], lock: threading.Lock, *args: Any) -> None:
    try:
        work(*args)
    except BaseException as exc:  # noqa: BLE001 - the coordinator raises it through the fence
        with lock:
            failed.append(exc)


def _pieces(offset: int, nbytes: int, chunk: int, direct: bool) -> list[tuple[int, int, int, int]]:
    """(file start, bytes to read, skip, useful) per chunk. With O_DIRECT the reads start
    on ALIGN boundaries and have ALIGN-multiple lengths (the last may pass the end of the
    file: the kernel returns a short read)."""
    out = []
    end = offset + nbytes
    pos = offset - offset % ALIGN if direct else offset
    while pos < end:
        length = min(chunk, end - pos)
        if direct and length % ALIGN:
            length += ALIGN - length % ALIGN
        skip = offset - pos if pos < offset else 0
        useful = min(pos + length, end) - pos - skip
        out.append((pos, length, skip, useful))
        pos += length
    return out


def _pread_full(fd: int, view: memoryview, length: int, offset: int) -> int:
    got = 0
    while got < length:
        n = os.preadv(fd, [view[got:length]], offset + got)
        if n == 0:
            break
        got += n
    return got


def _pwrite_full(fd: int, view: memoryview, length: int, offset: int) -> None:
    done = 0
    while done < length:
        n = os.pwritev(fd, [view[done:length]], offset + done)
        if n <= 0:
            raise P2PHubOSError(errno.EIO, f"write at offset {offset + done}", "wrote nothing")
        done += n


# ------------------------------------------------------------------ registrations


class StagedRegistration(Memory):
    """GPU (or host) memory registered in staged mode: loads and saves bounce through
    pinned host memory; no device can DMA into it directly (its path to a PCI device is
    PathKind.STAGED; host memory still gets a CPU VA MR). The memory contract in full."""

    mode = MODE_STAGED

    def __init__(self, hub: "Hub", rng: GpuRange, ops: Any, what: str,
                 reason: str | None = None, owned: Any = None) -> None:
        self._owner = hub
        self._share = MemoryShare()
        self._range = rng
        self._owned = owned         # a PinnedHost of hub.alloc_host(), closed with it
        self.ops = ops
        self.length = rng.length
        self.page_size = ALIGN
        self.what = what
        self._reason = reason
        self._target: CopyTarget | None = None
        self._mark_owner()

    @property
    def source(self) -> Any:
        """What was registered: the GPU range, or the host memory (PinnedHost or the GpuRange
        of a caller's buffer)."""
        return self._owned if self._owned is not None else self._range

    @property
    def gpu(self) -> GpuRange | None:
        return None if self._range.backend == "host" else self._range

    @property
    def ptr(self) -> int:
        return self._range.ptr

    @property
    def device_ordinal(self) -> int:
        return max(self._range.device, 0)

    @property
    def reason(self) -> str:
        """Why this registration is staged: the hub's reason, or what made it staged."""
        return self._reason or self._owner.mode_reason

    def info(self) -> MemoryInfo:
        self._check_open()
        return MemoryInfo(self.length, self.mode)

    def mmap(self) -> mmap.mmap:
        self._check_open()
        if self._owned is None:
            raise UsageError(f"{self}: a CPU mapping exists only of hub.alloc_host() memory "
                             "(a caller's buffer is its own CPU view)")
        return self._owned.mmap()

    def _refuse(self, what: str) -> StagedModeError:
        return StagedModeError(f"{self}: {what} needs peer-to-peer mode; this registration is "
                               f"staged ({self.reason})")

    def dma_pages(self, device: Any, page_size: int = 0) -> list[int]:
        raise self._refuse("dma_pages()")

    def export(self) -> int:
        raise self._refuse("a dma-buf export")

    @property
    def dmabuf_fd(self) -> int:
        raise self._refuse("a dma-buf export")

    def copy_target(self) -> CopyTarget:
        if self._target is None:    # asked once per request: made once
            self._target = CopyTarget(self._range.ptr, self.ops, self.device_ordinal,
                                      self.gpu is not None)
        return self._target

    def _free(self) -> None:
        """Memory.close's last step: the range and the host memory it owns go (host memory
        leaves the batch engines' rings first, while no other mapping can take its addresses)."""
        if self.gpu is None:
            self._owner.engines.forget_memory(self._range.ptr, self.length)
        self._range.close()
        if self._owned is not None:
            self._owned.close()
        self._owner._staging.forget(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<StagedRegistration {self.what} {self.length} bytes>"

    __str__ = __repr__


def register(hub: "Hub", obj: Any, offset: int = 0, length: int | None = None,
             device: Any = None, reason: str | None = None) -> StagedRegistration:
    """A staged registration of GPU memory (any installed backend) or a host buffer."""
    hub._check_open()
    if isinstance(obj, bool) or obj is None or isinstance(obj, int):
        raise UsageError(f"cannot register {obj!r} in staged mode: give GPU memory (a tensor, "
                         "(ptr, nbytes), __cuda_array_interface__, DLPack) or a host buffer")
    be = find_backend(obj)
    if be is not None:
        rng = be.resolve(obj, offset, length, export_dmabuf=False)
        ops: Any = be
    else:
        try:
            ptr, total = _host_span(obj)
        except TypeError:
            raise UsageError(f"{describe(obj)}: not memory p2phub knows (GPU memory of an "
                             "installed backend, or a writable host buffer)") from None
        offset, length = check_range(offset, length, total, describe(obj))
        rng = GpuRange("host", -1, ptr + offset, length, ptr, total, keepalive=[obj])
        ops = HostOps()
    reg = StagedRegistration(hub, rng, ops, f"{describe(obj)} {rng.ptr:#x}+{rng.length:#x}", reason)
    hub._staging.add(reg)
    if device is not None:
        reg.bind(device)
    return reg


def register_host(hub: "Hub", mem: PinnedHost, reason: str | None = None) -> StagedRegistration:
    """A staged registration of host memory made for it (hub.alloc_host); it owns `mem`."""
    rng = GpuRange("host", -1, mem.ptr, mem.size, mem.ptr, mem.size)
    lock = "" if mem.locked else f", not locked: {mem.lock_error}"
    reg = StagedRegistration(hub, rng, HostOps(), f"host memory {mem.ptr:#x}+{mem.size:#x}{lock}",
                             reason, owned=mem)
    hub._staging.add(reg)
    return reg


class Staging(Resource):
    """A Hub's open staged registrations (its engines, lanes included, are p2phub.batch.Engines)."""

    def __init__(self) -> None:
        self._regs: "weakref.WeakSet[StagedRegistration]" = weakref.WeakSet()

    def add(self, reg: StagedRegistration) -> None:
        self._regs.add(reg)

    def forget(self, reg: StagedRegistration) -> None:
        self._regs.discard(reg)

    def registrations(self) -> list[StagedRegistration]:
        return [r for r in list(self._regs) if not r.closed]

    def _close(self) -> None:
        """The Hub closes: every staged registration (forced)."""
        for reg in list(self._regs):
            reg.close(force=True)


# ------------------------------------------------------------------ load / save


def configure(hub: "Hub", chunk: int = DEFAULT_CHUNK, lanes: int = DEFAULT_LANES) -> None:
    """Set the hub's staging lanes: `lanes` I/Os in flight of `chunk` bytes each (2 x lanes x
    chunk bytes of pinned host memory, allocated on the first transfer). The lanes serve
    memory whose copy engine the batch engine does not drive (ROCm, other backends)."""
    hub.engines.configure_staged(chunk, lanes)


def copy_target(reg: Memory) -> CopyTarget:
    """The registration's copy target, refused where load/save cannot copy to it."""
    tgt = reg.copy_target()
    if tgt.ops is None:
        gpu = reg.gpu
        if gpu is not None:
            raise UsageError(f"{reg}: the {gpu.backend} backend that made it is not installed here")
        raise UsageError(f"{reg}: load/save needs GPU memory registered with hub.register(); "
                         "host registrations are reached through reg.mmap()")
    return tgt


def check_memory(reg: Any, role: str) -> Memory:
    if not isinstance(reg, Memory):
        raise UsageError(f"{role} must be memory registered with this hub (hub.register or "
                         f"hub.alloc_host), not {describe(reg)}")
    if reg.closed:
        raise UsageError(f"{reg} is closed")
    return reg


def open_path(name: str, flags: int, direct: bool) -> tuple[int, bool]:
    """(fd, O_DIRECT in use) of path `name` opened with `flags` (O_CLOEXEC added): with
    `direct`, O_DIRECT where the file system has it, else through the page cache."""
    flags |= os.O_CLOEXEC
    fd, is_direct = -1, False
    try:
        if direct:
            try:
                fd, is_direct = os.open(name, flags | os.O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:   # a file system without O_DIRECT: buffered
                    raise
        if fd < 0:
            fd = os.open(name, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.EISDIR:
            raise UsageError(f"{name} is a directory: want a file or a block device") from None
        raise P2PHubOSError(exc.errno or errno.EIO, f"open {name}") from None
    return fd, is_direct


def open_target(target: Any, write: bool, direct: bool) -> tuple[int, bool, bool, str]:
    """(fd, O_DIRECT in use, fd is ours, name) for a path, a file object or an fd."""
    if isinstance(target, (str, os.PathLike)):
        name = os.fspath(target)
        fd, is_direct = open_path(name, (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY,
                                  direct)
        return fd, is_direct, True, name
    if isinstance(target, int) and not isinstance(target, bool):
        return target, False, False, f"fd {target}"
    if hasattr(target, "fileno"):
        return target.fileno(), False, False, getattr(target, "name", describe(target))
    raise UsageError(f"{describe(target)}: not a path, an open file or an fd")


def size_of(fd: int, name: str = "") -> int:
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{name or f'fd {fd}'} is a directory: want a file or a block device")
    return os.lseek(fd, 0, os.SEEK_END)  # block devices


def is_direct_storage(obj: Any) -> bool:
    """A DirectStorage (an NVMe Namespace), the common file targets answered without the
    protocol's attribute walk (a class without ``submit`` cannot be one: a hub.open() file,
    an fd, a file object)."""
    return (not isinstance(obj, (str, os.PathLike, int)) and hasattr(type(obj), "submit")
            and isinstance(obj, DirectStorage))


@runtime_checkable
class DirectStorage(Protocol):
    """Storage with an engine of its own (p2phub's NVMe Namespace): a load or save of it is one
    ``submit`` of NVMe ops, the device reaching the memory itself."""

    nsid: int
    lba_size: int
    blocks: int

    def submit(self, ops: Any) -> list[Any]: ...


def load(hub: "Hub", source: Any, dest: Any, offset: int = 0, nbytes: int | None = None,
         dest_offset: int = 0, **kw: Any) -> Fence:
    """``hub.load`` (see p2phub.batch.load)."""
    return hub.load(source, dest, offset, nbytes, dest_offset, **kw)


def save(hub: "Hub", source: Any, dest: Any, offset: int = 0, nbytes: int | None = None,
         source_offset: int = 0, **kw: Any) -> Fence:
    """``hub.save`` (see p2phub.batch.save)."""
    return hub.save(source, dest, offset, nbytes, source_offset, **kw)


def on_lanes(hub: "Hub", direction: str, reg: Memory, tgt: CopyTarget, fd: int, owned: bool,
             direct: bool, offset: int, reg_offset: int, nbytes: int, what: str,
             progress: Callable[[int], None] | None, sync: bool = True) -> Fence:
    """One load or save on the staging lanes, for memory whose copies only its backend's
    Python operations can issue (the batch engine drives CUDA and host copies itself). An fd
    we own is closed when the transfer ends; if this raises, closing it is the caller's."""
    stager = hub.engines.stager(tgt.ops, tgt.ordinal)
    fence = Fence(what, nbytes)   # path "staged": the bytes bounce through host memory
    fence.stats["sync"] = sync
    # the transfer is an ordered access of the memory: a load fills it (producer), a save
    # reads it (consumer); it waits here for the earlier accesses it conflicts with
    kind = AccessKind.NVME_READ if direction == "load" else AccessKind.NVME_WRITE
    access = reg.ordering.acquire(reg_offset, nbytes, kind, what)
    try:
        reg.hold()
    except BaseException as exc:
        access.cancel(exc)
        raise

    def done() -> None:
        reg.unhold()
        if owned:
            os.close(fd)

    try:
        stager.start(fence, direction, fd, direct, offset, tgt.ptr + reg_offset, nbytes,
                     progress, done)
    except BaseException as exc:
        reg.unhold()        # the fd stays the caller's to close: the transfer never started
        access.cancel(exc)
        raise
    access.bind(fence)
    return fence


def namespace_io(hub: "Hub", op: str, ns: DirectStorage, reg: Memory, offset: int,
                 nbytes: int | None, reg_offset: int) -> Fence:
    if reg.mode == MODE_STAGED:
        raise StagedModeError(f"{reg}: an NVMe {op} straight into memory needs peer-to-peer "
                              f"mode; this registration is staged ({reg.reason})")
    from .nvme.namespace import Op
    lba_bytes = ns.lba_size
    if offset % lba_bytes:
        raise UsageError(f"offset={offset} is not a multiple of the namespace's {lba_bytes}-byte LBA")
    if nbytes is None:
        nbytes = reg.length - reg_offset
    futs = ns.submit([Op(op, reg, offset // lba_bytes, nbytes, reg_offset)])
    return FutureFence(f"nvme {op} nsid {ns.nsid} [{offset}:+{nbytes}]", nbytes, futs)
