"""Batches of scattered transfers between storage and registered memory, in one call.

``hub.load_batch(entries)`` reads, and ``hub.save_batch(entries)`` writes, many
(storage, offset, length, memory, memory offset) entries at once:

    fence = hub.load_batch([(path, 0, 4096, reg, 8192), (path, 1 << 20, 65536, reg2, 0)])
    fence.wait()

or, for many entries, as columns (numpy arrays or any sequences of ints):

    fence = hub.load_batch(storage=path, offsets=offs, lengths=4096, memory=reg,
                           mem_offsets=dst_offs, per_entry=True)

``storage`` is a file or block device path, an open file, an fd, or (P2P mode) a p2phub
NVMe Namespace; in the column form ``storage`` and ``memory`` may be lists indexed by
``storage_index`` / ``memory_index`` arrays. ``memory`` is a registration from
``hub.register`` (GPU memory or, in staged mode, a host buffer) or, in P2P mode, a dma-buf
or host registration (``register_dmabuf``, ``alloc_host``). Every entry is checked
before anything is submitted: a bad one (a range outside its file or registration, an
unaligned write to an O_DIRECT fd, a closed registration, an fd that is not open) refuses
the whole batch with a UsageError (or P2PHubOSError) naming the entry's index.

The batch returns one fence (``BatchFence``: wait, done, exception, add_done_callback,
await, on_stream); with ``per_entry=True``, ``fence.entries`` holds one fence per entry.
``fence.results`` gives each entry's bytes moved, or -errno; ``fence.stats`` the engine's
figures and, per file, whether it was read with O_DIRECT or through the page cache (by
default, ``direct="auto"``, every read is O_DIRECT where the file system has it;
``configure_batch(buffered_from=N)`` sends entries of N bytes and up through the page cache).
A read batch of one or two small entries (``configure_batch(request_entries=)``) is checked
the same way and then queued as single requests, as hub.load's are: its ``fence.stats`` has
``requests`` and no engine figures.

Files go through p2phub's staged I/O engine (p2phub.staged_io): io_uring in C, a deep
queue, staging slots registered with the ring (fixed buffers) and reused. A load into GPU
memory batches the host-to-GPU copies of each reaped round (``cuMemcpyBatchAsync``) on the
same thread that keeps the ring full (``configure_batch(io_thread=True)`` reads on a second
thread instead: slower on the H200 measured); into host memory, an O_DIRECT read whose offset, length and address are 4 KiB-aligned
lands in place (``fence.stats["in_place"]``), the others are copied out of a slot. A staged
host registration that a load lands in is registered with the engine's ring on that first
load and stays so while it is open (``fence.stats["fixed_mem"]``: reads in place that did not
pin pages): the kernel pins, and so faults in, the whole registration then, as a P2P hub's
registration does when it is made.

Namespace entries go to the NVMe engine in one ``Namespace.submit`` per namespace, which
declares each request's range to the registration's ordering: the SSD DMAs straight into the
registration (peer-to-peer for GPU memory). A namespace the kernel nvme driver keeps is a
block device (``/dev/nvme0n1``): its entries go through the block layer like any file
(O_DIRECT io_uring into the staging slots) and reach a dma-buf registration through the
registration's CPU mapping (``Registration.mmap``); a registration without one is refused by
entry. DMA from the kernel's block layer straight into device memory would need the kernel's
PCI P2PDMA (the user mapping backed by pages of a P2PDMA provider, CONFIG_PCI_P2PDMA), which
Debian's 6.1 and 6.12 kernels are built without: p2phub does not attempt it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from . import staged
from .backend import check_range
from .errors import P2PHubOSError, UsageError
from .memory import CopyTarget, Memory
from .ordering.core import FencedAccess
from .ordering.errors import FenceTimeout
from .ordering.tracker import AccessKind, next_seq
from .files import StorageFile
from .staged import ALIGN, MODE_STAGED, Fence, HostOps, Stager
from ._resource import Resource

if TYPE_CHECKING:
    from .hub import Hub

__all__ = ["BatchFence", "Engines", "load", "save", "load_batch", "save_batch", "configure_batch"]

log = logging.getLogger(__name__)

DEFAULT_DEPTH = 128
DEFAULT_SLOT = 512 << 10
DEFAULT_SLOTS = 256
# direct="auto" reads entries of this size and up through the page cache (0: none). Off: on the
# H200's virtio disk O_DIRECT reads of 1-16 MiB ran 1.0x-1.3x buffered ones, and 2-5x on the
# development host (docs/benchmarks.md, "Large reads O_DIRECT by default")
DEFAULT_BUFFERED_FROM = 0
# A read batch of at most this many entries (and _REQUEST_BYTES) goes to the engine thread as
# single requests: no planned hand-over. On an H100 machine a one-entry 4 KiB batch then took
# 96-139 us at p50 (median 123) against 125-134 (133) planned (docs/benchmarks.md, "Small
# batches as requests"); at 4 entries and more the planned batch is level or ahead
DEFAULT_REQUEST_ENTRIES = 2
_OPT_NO_FIXED, _OPT_NO_IO_THREAD, _OPT_POLL = 1, 2, 4   # SIO_OPT_* of staged_io/_sio.h
_MAX_REQUEST_ENTRIES = 64   # configure_batch(request_entries=) at most
_REQUEST_BYTES = 256 << 10  # ... and a batch of more bytes is planned (its time is the disk's)
_MAX_OPEN_FILES = 64     # paths whose open file the engines keep for per-request loads
_now = time.perf_counter


class BatchFence(Fence):
    """Completion of a whole batch. ``entries``: one Fence per entry (per_entry=True) or
    None; ``results``: per entry, the bytes moved or -errno, once complete."""

    _job: "_Job | None" = None   # its run, while neither the worker nor a waiter took it
    _last: "RequestFence | None" = None   # a small batch sent as single requests: its last

    def __init__(self, what: str, nbytes: int, count: int) -> None:
        super().__init__(what, nbytes)
        self.count = count
        self.entries: list[Fence] | None = None
        self.results: Any = None

    def set_run(self, job: "_Job | None") -> None:
        """The queued run that completes this fence, for a waiting thread to take; None
        once someone took it."""
        self._job = job

    def set_requests(self, last: "RequestFence | None") -> None:
        """Sent as single requests, of which `last` was queued last (None: not sent)."""
        self._last = last

    def complete(self, err: BaseException | None) -> None:
        """Complete the entries' fences by their results, then this one with `err`."""
        res = self.results
        if self.entries is not None:
            for i, ef in enumerate(self.entries):
                moved = int(res[i])
                why: BaseException | None = None
                if moved < 0:
                    why = P2PHubOSError(-moved, f"{ef.what}")
                elif moved != ef.nbytes:    # never run (the batch failed), or short
                    why = err or P2PHubOSError(errno.EIO,
                                               f"{ef.what}: {moved} of {ef.nbytes} bytes moved")
                ef._finish(why)
        self._finish(err)

    def _block(self, timeout: float | None) -> None:
        # A thread that waits with no limit runs the batch itself when the worker has not
        # begun it: two thread hand-overs fewer on the path of a batch waited on at once.
        # Not before its engines exist: making one binds a device to the calling thread.
        # Never the worker itself (waiting from inside a batch): it runs batches in order.
        job = self._job
        if (job is not None and timeout is None and threading.current_thread() is not job.worker.t
                and job.started() and job.claim()):
            job.run()
        last = self._last
        if last is not None and not self._done:
            # sent as requests: collect their results here, as a request's waiter does (the
            # engine thread completes them in queue order: the last one, all of them)
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                last.exception(timeout)
            except FenceTimeout:
                return
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic())
        super()._block(timeout)


# ------------------------------------------------------------------ entries


@dataclass
class _File:
    """One storage target of the batch (a file or block device) and how it is open."""
    target: Any
    fd: int = -1
    owned: bool = False
    direct: bool = False
    fd_buffered: int = -1     # direct="auto": a second, buffered fd for the large reads
    size: int = 0
    name: str = ""
    regular: bool = True
    # a hub.open() file read through its own fd (borrowed: a small batch's requests are
    # queued behind its close's mark); a planned batch takes a duplicate (_own_borrowed)
    storage: Any = None


@dataclass
class _Mem:
    reg: Any
    ptr: int
    length: int
    cuda: bool
    ops: Any
    device: int
    cpu_map: Any = None    # file entries into a dma-buf registration: its CPU mapping
    cpu_view: Any = None


@dataclass
class _Plan:
    n: int
    off: Any
    length: Any
    moff: Any
    sidx: Any
    midx: Any
    files: list[_File] = field(default_factory=list)
    mems: list[_Mem] = field(default_factory=list)
    namespaces: dict[int, Any] = field(default_factory=dict)   # storage index -> Namespace
    buffered_from: int = DEFAULT_BUFFERED_FROM
    total: int = 0          # the lengths' sum


def _np() -> Any:
    try:
        import numpy
        return numpy
    except ImportError:  # pragma: no cover - numpy is on every machine p2phub targets
        raise UsageError("hub.load_batch/save_batch need numpy") from None


_CONST: dict[tuple[int, int], Any] = {}     # (n, value) -> a read-only column of it
_CONST_KEEP = 16


def _const(np: Any, n: int, value: int) -> Any:
    """A read-only int64 column of n x value, shared by the batches that give that scalar
    (every batch of a size reads the same lengths; making the array each time is a numpy call
    on a thread that may just have woken up)."""
    col = _CONST.get((n, value))
    if col is None:
        col = np.full(n, value, dtype=np.int64)
        col.flags.writeable = False
        if len(_CONST) >= _CONST_KEEP:
            _CONST.clear()
        _CONST[(n, value)] = col
    return col


def _column(np: Any, name: str, value: Any, n: int | None) -> Any:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if n is None:
            raise UsageError(f"{name}: a single value needs another column that sets the count")
        return _const(np, n, int(value))
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{name}: not a sequence of integers ({exc})") from None
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise UsageError(f"{name}: want a 1-D sequence of integers, got {arr.dtype} shape {arr.shape}")
    if n is not None and arr.size != n:
        raise UsageError(f"{name}: {arr.size} values for {n} entries")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > (1 << 62):
        raise UsageError(f"{name}: entry {int(arr.argmax())}: {int(arr.max())} is out of range")
    return arr.astype(np.int64, copy=False)


def _columns(entries: Any, storage: Any, offsets: Any, lengths: Any, memory: Any,
             mem_offsets: Any, storage_index: Any, memory_index: Any) -> tuple[Any, ...]:
    """(storages, memories, off, length, moff, sidx, midx) from either form."""
    np = _np()
    if entries is not None:
        if any(v is not None for v in (storage, offsets, lengths, memory, mem_offsets)):
            raise UsageError("give entries, or the columns (storage=, offsets=, ...), not both")
        entries = list(entries)
        if not entries:
            raise UsageError("an empty batch")
        storages: list[Any] = []
        memories: list[Any] = []
        skeys: dict[Any, int] = {}
        mkeys: dict[int, int] = {}
        n = len(entries)
        off = np.empty(n, np.int64)
        ln = np.empty(n, np.int64)
        mo = np.empty(n, np.int64)
        si = np.empty(n, np.int64)
        mi = np.empty(n, np.int64)
        for i, e in enumerate(entries):
            try:
                st, o, l_, m, moff = e
            except (TypeError, ValueError):
                raise UsageError(f"entry {i}: want (storage, offset, length, memory, memory "
                                 f"offset), got {e!r}") from None
            for what, v in (("offset", o), ("length", l_), ("memory offset", moff)):
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                    raise UsageError(f"entry {i}: {what} {v!r} is not an integer")
            key = os.fspath(st) if isinstance(st, (str, os.PathLike)) else id(st)
            if key not in skeys:
                skeys[key] = len(storages)
                storages.append(st)
            if id(m) not in mkeys:
                mkeys[id(m)] = len(memories)
                memories.append(m)
            off[i], ln[i], mo[i], si[i], mi[i] = o, l_, moff, skeys[key], mkeys[id(m)]
        return storages, memories, off, ln, mo, si, mi
    if storage is None or memory is None or offsets is None:
        raise UsageError("a batch needs entries, or storage=, offsets=, lengths=, memory=")
    off = _column(np, "offsets", offsets, None)
    n = off.size
    if n == 0:
        raise UsageError("an empty batch")
    ln = _column(np, "lengths", lengths, n)
    mo = _column(np, "mem_offsets", 0 if mem_offsets is None else mem_offsets, n)
    storages = list(storage) if isinstance(storage, (list, tuple)) else [storage]
    memories = list(memory) if isinstance(memory, (list, tuple)) else [memory]
    si = _column(np, "storage_index", 0 if storage_index is None else storage_index, n)
    mi = _column(np, "memory_index", 0 if memory_index is None else memory_index, n)
    for name, idx, pool, given in (("storage_index", si, storages, storage_index),
                                   ("memory_index", mi, memories, memory_index)):
        if given is None and pool:
            continue        # every entry the first: there is one
        bad = np.flatnonzero((idx < 0) | (idx >= len(pool)))
        if bad.size:
            i = int(bad[0])
            raise UsageError(f"entry {i}: {name} {int(idx[i])} is not one of the {len(pool)} given")
    return storages, memories, off, ln, mo, si, mi


def _scan(off: Any, ln: Any, mo: Any) -> Any:
    """The planner's one pass over the int64 columns (staged_io's sio_scan)."""
    mod = _sio()
    ffi = mod.ffi
    out = ffi.new("struct sio_scan *")
    mod.lib.sio_scan(off.size, _longs(ffi, off), _longs(ffi, ln), _longs(ffi, mo), out)
    return out


def _longs(ffi: Any, col: Any) -> Any:
    """An int64 column as C's long long[] (a contiguous copy where it is a strided view)."""
    return ffi.from_buffer("long long[]", col if col.flags.c_contiguous else col.copy())


def _first(np: Any, mask: Any) -> int | None:
    bad = np.flatnonzero(mask)
    return int(bad[0]) if bad.size else None


def _memory(hub: "Hub", reg: Any, i: int) -> _Mem:
    if not isinstance(reg, Memory):
        raise UsageError(f"entry {i}: {type(reg).__name__} is not a registration of this hub "
                         "(use hub.register())")
    if reg.closed:
        raise UsageError(f"entry {i}: {reg} is closed")
    if reg.mode == MODE_STAGED and reg.hub is not hub:
        raise UsageError(f"entry {i}: {reg} belongs to another hub")
    # ops None: a P2P hub's host or dma-buf memory, reached by NVMe entries or its CPU mapping
    t = reg.copy_target()
    return _Mem(reg, t.ptr, reg.length, t.gpu or t.ops is None, t.ops, t.ordinal)


def _open_file(target: Any, write: bool, direct: bool, i: int,
               engines: "Engines | None" = None) -> _File:
    """Open (or look at) one storage target; entry i is the first that uses it. A path read
    from takes the engines' open file for it (as a per-request load does: one stat where an
    open, an fstat and a close were), which stays open until the engines close."""
    f = _File(target)
    if engines is not None and not write and type(target) is str:
        cached = engines.open_file(target, False, direct)
        if cached is not None:
            f.fd, f.direct, f.size = cached
            f.name = target
            return f
    if isinstance(target, (str, os.PathLike)):
        f.name = os.fspath(target)
        flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
        flags |= os.O_CLOEXEC
        f.owned = True
        if direct:
            try:
                f.fd, f.direct = os.open(f.name, flags | os.O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise P2PHubOSError(exc.errno or errno.EIO, f"entry {i}: open {f.name}") from None
        if f.fd < 0:
            try:
                f.fd = os.open(f.name, flags, 0o644)
            except OSError as exc:
                raise P2PHubOSError(exc.errno or errno.EIO, f"entry {i}: open {f.name}") from None
    elif isinstance(target, StorageFile):
        # a hub.open() file: the batch reads a duplicate, so the file's close never waits for
        # (or races) the batch's planning
        if (write and not target.writable) or (not write and not target.readable):
            raise P2PHubOSError(errno.EBADF, f"entry {i}: {target.name}",
                                f"open for {'reading' if write else 'writing'} only")
        buffered = target.direct and not direct     # an unaligned write, or direct=False
        if write or buffered:
            f.fd, f.owned = target.dup(buffered), True
        else:
            if target.closing:
                raise UsageError(f"entry {i}: {target!r} is closed")
            f.fd, f.storage = target.fileno(), target
        f.name = target.name
        f.direct = target.direct and not buffered
    else:
        if isinstance(target, int) and not isinstance(target, bool):
            f.fd, f.name = target, f"fd {target}"
        elif hasattr(target, "fileno"):
            try:
                f.fd = target.fileno()
            except (OSError, ValueError) as exc:
                raise UsageError(f"entry {i}: {target!r} has no usable fd ({exc})") from None
            f.name = str(getattr(target, "name", f"fd {f.fd}"))
        else:
            raise UsageError(f"entry {i}: {type(target).__name__} is not a path, an open file, "
                             "an fd or an NVMe Namespace")
        try:
            fl = fcntl.fcntl(f.fd, fcntl.F_GETFL)
        except OSError as exc:
            raise P2PHubOSError(exc.errno or errno.EBADF, f"entry {i}: {f.name}",
                                "not an open file descriptor") from None
        acc = fl & os.O_ACCMODE
        if (write and acc == os.O_RDONLY) or (not write and acc == os.O_WRONLY):
            raise P2PHubOSError(errno.EBADF, f"entry {i}: {f.name}",
                                f"open for {'reading' if write else 'writing'} only")
        f.direct = bool(fl & os.O_DIRECT)
    try:
        st = os.fstat(f.fd)
        f.regular = stat.S_ISREG(st.st_mode)
        f.size = st.st_size if f.regular else os.lseek(f.fd, 0, os.SEEK_END)
    except OSError as exc:
        _close_files([f])
        raise P2PHubOSError(exc.errno or errno.EIO, f"entry {i}: {f.name}") from None
    if not f.regular and not stat.S_ISBLK(st.st_mode):
        _close_files([f])
        raise UsageError(f"entry {i}: {f.name} is not a regular file or a block device")
    return f


def _map_for_files(m: _Mem, i: int) -> None:
    """File entries into memory that no GPU engine copies to (a dma-buf or host registration
    of a P2P hub: vgem, udmabuf, p2phub's own host memory) go through its CPU mapping: read
    into the staging slots, then memcpy. Entry i is the first such entry."""
    import ctypes
    try:
        mm = m.reg.mmap()
    except (UsageError, P2PHubOSError) as exc:
        raise UsageError(f"entry {i}: {m.reg} has no CPU mapping, which file entries need "
                         f"({exc})") from None
    if len(mm) < m.length:
        mm.close()
        raise UsageError(f"entry {i}: the CPU mapping of {m.reg} is shorter than it")
    m.cpu_map, m.cpu_view = mm, (ctypes.c_char * m.length).from_buffer(mm)
    m.ptr, m.cuda, m.ops, m.device = ctypes.addressof(m.cpu_view), False, HostOps(), 0


def _unmap(mems: list[_Mem]) -> None:
    for m in mems:
        if m is not None and m.cpu_map is not None:
            m.cpu_view = None
            m.cpu_map.close()
            m.cpu_map = None


def _close_plan(p: "_Plan") -> None:
    _close_files(p.files)
    _unmap(p.mems)


def _close_files(files: list[_File]) -> None:
    for f in files:
        if f.owned and f.fd >= 0:
            os.close(f.fd)
            f.fd = -1
        if f.fd_buffered >= 0:
            os.close(f.fd_buffered)
            f.fd_buffered = -1


def _io_name(f: _File, big: int) -> str:
    if f.fd_buffered >= 0:
        return f"O_DIRECT below {big} bytes, buffered from {big}"
    return "O_DIRECT" if f.direct else "buffered"


def _plan(hub: "Hub", write: bool, direct: bool | str, cols: tuple[Any, ...]) -> _Plan:
    """Every check of the batch, before anything is submitted. Opens the files it names."""
    np = _np()
    storages, memories, off, ln, mo, si, mi = cols
    n = off.size
    p = _Plan(n, off, ln, mo, si, mi)
    p.buffered_from = hub.engines.batch_opts["buffered_from"]
    if direct not in (True, False, "auto"):
        raise UsageError(f"direct={direct!r}: want True, False or 'auto'")
    first_of = lambda idx, k: int(np.argmax(idx == k))  # noqa: E731
    # One pass in C for what every batch checks, masks only to name a bad entry: most
    # batches are good, and each numpy call counts (a batch is planned by a thread that just
    # woke up, where a first numpy reduction costs ~80 us).
    sc = _scan(off, ln, mo)
    p.total = int(sc.total)
    if sc.min_off < 0:
        i = _first(np, off < 0)
        raise UsageError(f"entry {i}: offset {int(off[i])} is negative")
    if sc.min_len <= 0:
        i = _first(np, ln <= 0)
        raise UsageError(f"entry {i}: length {int(ln[i])} is not positive")
    if sc.min_moff < 0:
        i = _first(np, mo < 0)
        raise UsageError(f"entry {i}: memory offset {int(mo[i])} is negative")
    one_mem = len(memories) == 1
    mend = None if one_mem else mo + ln
    for k, reg in enumerate(memories):
        used = None if one_mem else mi == k
        if used is not None and not used.any():
            p.mems.append(None)  # type: ignore[arg-type]
            continue
        m = _memory(hub, reg, 0 if one_mem else first_of(mi, k))
        if used is None:
            bad = sc.max_mend > m.length or sc.min_mend < 0     # (< 0: the sum wrapped)
        else:
            top = np.where(used, mend, 0)
            bad = int(top.max()) > m.length or int(top.min()) < 0
        if bad:
            top = mo + ln if used is None else top
            i = _first(np, (top > m.length) | (top < 0))
            raise UsageError(f"entry {i}: memory range {int(mo[i])}+{int(ln[i])} is outside "
                             f"{reg} ({m.length} bytes)")
        p.mems.append(m)
    direct_storage = [staged.is_direct_storage(t) for t in storages]
    nvme_rows = None
    if any(direct_storage):
        nvme_rows = np.zeros(n, bool)
        for k, is_ns in enumerate(direct_storage):
            if is_ns:
                nvme_rows |= si == k
    one_sto = len(storages) == 1
    fend = None if one_sto else off + ln
    try:
        for k, m in enumerate(p.mems):
            if m is not None and m.ops is None:
                rows = mi == k if nvme_rows is None else (mi == k) & ~nvme_rows
                if (i := _first(np, rows)) is not None:
                    _map_for_files(m, i)
        for k, target in enumerate(storages):
            used = None if one_sto else si == k
            if used is not None and not used.any():
                p.files.append(_File(None))
                continue
            i0 = 0 if one_sto else first_of(si, k)
            if direct_storage[k]:
                p.files.append(_File(target))
                p.namespaces[k] = target
                _check_namespace(np, p, k, target, np.ones(n, bool) if used is None else used,
                                 write)
                continue
            if used is None:
                aligned = not sc.odd
            else:
                aligned = not bool(((off | ln) % ALIGN != 0)[used].any())
            f = _open_file(target, write, bool(direct) and (aligned or not write), i0,
                           hub.engines)
            p.files.append(f)
            if (direct == "auto" and p.buffered_from and not write and f.direct
                    and isinstance(target, (str, os.PathLike))
                    and bool(((ln >= p.buffered_from) if used is None
                              else used & (ln >= p.buffered_from)).any())):
                try:
                    f.fd_buffered = os.open(f.name, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as exc:
                    raise P2PHubOSError(exc.errno or errno.EIO, f"entry {i0}: open {f.name}") from None
            if write and f.direct and not aligned:
                odd = (off | ln) % ALIGN != 0
                i = _first(np, odd if used is None else odd & used)
                raise UsageError(f"entry {i}: {f.name} is open with O_DIRECT and the write "
                                 f"{int(off[i])}+{int(ln[i])} is not aligned to {ALIGN} bytes")
            if not write or not f.regular:
                if used is None:
                    bad = sc.max_fend > f.size or sc.min_fend < 0
                else:
                    top = np.where(used, fend, 0)
                    bad = int(top.max()) > f.size or int(top.min()) < 0
                if bad:
                    top = off + ln if used is None else top
                    i = _first(np, (top > f.size) | (top < 0))
                    raise UsageError(f"entry {i}: range {int(off[i])}+{int(ln[i])} is past the "
                                     f"end of {f.name} ({f.size} bytes)")
    except BaseException:
        _close_plan(p)
        raise
    return p


def _check_namespace(np: Any, p: _Plan, k: int, ns: Any, used: Any, write: bool) -> None:
    lba = ns.lba_size
    if (i := _first(np, used & (((p.off | p.length) % lba) != 0))) is not None:
        raise UsageError(f"entry {i}: {int(p.off[i])}+{int(p.length[i])} is not a multiple of "
                         f"{ns}'s {lba}-byte LBA")
    end = p.off + p.length                  # (< 0: the sum wrapped)
    if (i := _first(np, used & ((end > ns.blocks * lba) | (end < 0)))) is not None:
        raise UsageError(f"entry {i}: range {int(p.off[i])}+{int(p.length[i])} is past the end "
                         f"of {ns} ({ns.blocks * lba} bytes)")
    for i in np.flatnonzero(used):
        m = p.mems[int(p.midx[i])]
        if m.reg.mode == MODE_STAGED:
            raise UsageError(f"entry {int(i)}: an NVMe {'write' if write else 'read'} straight "
                             f"into {m.reg} needs peer-to-peer mode ({m.reg.reason})")


# ------------------------------------------------------------------ the engine


class _Engine(Resource):
    """One staged I/O engine (p2phub.staged_io) and its staging memory, for one copy engine
    and device of a hub; batches on it run one at a time on the engine thread, each handed
    over there by the worker or by a thread waiting for it."""

    def __init__(self, ops: Any, device: int, depth: int, slot: int, slots: int,
                 options: int = 0, split: int | None = None,
                 inflight: int | None = None) -> None:
        self.mod = _sio()
        self.ops, self.device = ops, device
        self.depth, self.slot, self.slots = depth, slot, slots
        self.options = options
        self.split = split          # None: the engine's default
        self.inflight = inflight    # None: the engine's default
        self.path, self.path_reason = "", ""
        self.lock = threading.Lock()
        self.cuda = getattr(ops, "name", "") != "host"
        self._eng = None
        self._stage = None
        self._stream = 0
        self._closed = False
        self._mem: dict[int, int] = {}    # host ranges registered with the ring: ptr -> bytes
        self._unsettled: dict[int, str] = {}  # of those, ones the ring's thread has yet to take

    def _ensure(self) -> Any:
        if self._eng is None:
            ffi, lib = self.mod.ffi, self.mod.lib
            self.ops.bind_thread(self.device)
            self._stage = self.ops.pinned(self.slot * self.slots)
            if self.cuda:
                self._stream = self.ops.stream_create()
            err = ffi.new("char[]", 256)
            eng = lib.sio_open(self.depth, self.slot, self.slots, ffi.cast("void *", self._stage.ptr),
                               self._stream, self.options, err, 256)
            if eng == ffi.NULL:
                self._free()
                raise P2PHubOSError(errno.EIO, "staged I/O engine", ffi.string(err).decode())
            reason = ffi.new("char[]", 160)
            self.path = "aio" if lib.sio_submit_path(eng, reason, 160) else "io_uring"
            self.path_reason = ffi.string(reason).decode()
            log.info("staged I/O engine (device %d): %s (%s)", self.device, self.path,
                     self.path_reason)
            if self.split is not None:
                lib.sio_set_split(eng, self.split)
            if self.inflight is not None:
                lib.sio_set_inflight(eng, self.inflight)
            self._eng = eng
        return self._eng

    def _free(self) -> None:
        if self._stream:
            self.ops.stream_destroy(self._stream)
            self._stream = 0
        if self._stage is not None:
            self._stage.close()
            self._stage = None

    def handle(self) -> Any:
        """The C engine, opened on first use (on the calling thread, whose CUDA context the
        engine keeps for its copies)."""
        eng = self._eng
        if eng is not None:
            return eng
        with self.lock:
            if self._closed:
                raise UsageError("the hub's staged I/O engine is closed")
            self.ops.bind_thread(self.device)
            return self._ensure()

    @property
    def opened(self) -> bool:
        """Its engine and staging exist (the first batch or request made them)."""
        return self._eng is not None

    def run(self, place: "_Reservation", write: bool, fd: Any, off: Any, ln: Any, mem: Any,
            flags: Any, result: Any, last: bool) -> tuple[int, dict[str, Any]]:
        """One batch, run on the engine thread at its reservation `place`; `last`: the
        reservation is released as the run ends (saving the thread a wake-up for it)."""
        ffi, lib = self.mod.ffi, self.mod.lib
        eng = self.handle()
        with self.lock:
            if self._closed:
                raise UsageError("the hub's staged I/O engine is closed")
        # Not under the lock: runs of other threads wait on the engine thread for their turn
        # while this one waits for its own, and the engine is closed only once every run has
        # let go of its reservation (Engines._quiesce, Engines._close).
        st = ffi.new("struct sio_stats *")
        err = ffi.new("char[]", 256)
        if last:
            place.held = False      # the thread releases it, whatever the run's result
        rc = lib.sio_queue_run(place.queue.q, place.ticket, int(last), eng, int(write), len(off),
                               ffi.from_buffer("int[]", fd),
                               ffi.from_buffer("unsigned long long[]", off),
                               ffi.from_buffer("unsigned long long[]", ln),
                               ffi.from_buffer("unsigned long long[]", mem),
                               ffi.from_buffer("unsigned char[]", flags),
                               ffi.from_buffer("long long[]", result, require_writable=True),
                               st, err, 256)
        with self.lock:
            stats = {k: int(getattr(st, k)) for k in ("pieces", "bytes", "copy_calls", "copies",
                                                       "merged", "slot_waits", "max_inflight",
                                                       "in_place", "fixed_mem")}
            stats["batch_copy_api"] = bool(st.batch_api)
            stats["fixed_buffers"] = bool(st.fixed)
            stats["io_thread"] = bool(st.io_thread)
            stats["poll"] = bool(self.options & _OPT_POLL)
            stats["submit_path"] = self.path
            stats["submit_path_reason"] = self.path_reason
            stats["split_bytes"] = int(st.split)
            stats["split_entries"] = int(st.split_entries)
            stats["inflight_bytes"] = int(st.inflight_bytes)
            stats["max_inflight_bytes"] = int(st.max_inflight_bytes)
            # the staging carved for this run: larger, fewer slots for large entries
            stats["slot_bytes"], stats["slots"] = int(st.slot_bytes), int(st.slots)
            if self._unsettled:
                self._settle(eng)
            if rc < 0:
                raise P2PHubOSError(errno.EIO, "staged I/O engine", ffi.string(err).decode())
            return rc, stats

    def register_memory(self, ptr: int, length: int, what: str) -> None:
        """Register host memory that reads land in with the ring, once: its reads in place
        then skip pinning its pages (``fence.stats["fixed_mem"]``). The engine keeps it until
        forget_memory (the registration's close). Where the ring cannot take it (Linux AIO, an
        older kernel, a full table, memory the kernel will not pin for long) reads go on as
        before."""
        if ptr in self._mem:
            return
        eng = self.handle()
        with self.lock:
            if self._closed or ptr in self._mem:
                return
            self._mem[ptr] = length
            self._unsettled[ptr] = what
            self._settle(eng)

    def _settle(self, eng: Any) -> None:
        """Log how each range asked for stands, once the ring's thread installed or refused it
        (at once, or at the engine's next batch). Call with the lock held."""
        ffi, lib = self.mod.ffi, self.mod.lib
        for ptr, what in list(self._unsettled.items()):
            rc = lib.sio_register_mem(eng, ffi.cast("void *", ptr), self._mem[ptr])
            if rc > 0:
                continue        # waits for the engine thread's next batch
            del self._unsettled[ptr]
            if rc == 0:
                log.debug("staged I/O engine (device %d): %s registered with the ring",
                          self.device, what)
                continue
            # no table at all (Linux AIO, an older kernel) is the path's reason, logged once
            level = logging.DEBUG if rc == -errno.EOPNOTSUPP and self.path == "aio" \
                else logging.INFO
            log.log(level, "staged I/O engine (device %d): %s not registered with the ring "
                    "(%s): its reads pin their pages each time", self.device, what,
                    os.strerror(-rc))

    def forget_memory(self, ptr: int, length: int) -> None:
        """The memory at [ptr, ptr + length) goes away: no read lands in it through the ring's
        table from now on; the kernel lets go of its pages at the engine's next batch or close."""
        with self.lock:
            for p in [p for p in self._mem if ptr <= p < ptr + length]:
                del self._mem[p]
                self._unsettled.pop(p, None)
                if self._eng is not None:
                    self.mod.lib.sio_unregister_mem(self._eng, self.mod.ffi.cast("void *", p),
                                                    length - (p - ptr))

    def mem_table(self) -> dict[str, int]:
        """The ring's table of host memory: ``live`` entries the kernel holds, ``pending``
        ones to install or remove at the next batch, ``refused_errno``."""
        ffi, lib = self.mod.ffi, self.mod.lib
        with self.lock:
            if self._eng is None:
                return {"table": 0, "live": 0, "pending": 0, "refused_errno": 0}
            live, pending, why = ffi.new("unsigned *"), ffi.new("unsigned *"), ffi.new("int *")
            table = lib.sio_mem_table(self._eng, live, pending, why)
            return {"table": int(table), "live": int(live[0]), "pending": int(pending[0]),
                    "refused_errno": int(why[0])}

    def _close(self) -> None:
        """Only once nothing queued on the engine thread refers to it (Engines._quiesce)."""
        with self.lock:
            self._closed = True
            if self._eng is not None:
                self.ops.bind_thread(self.device)
                self.mod.lib.sio_close(self._eng)
                self._eng = None
            self._free()
            self._mem.clear()
            self._unsettled.clear()


def configure_batch(hub: "Hub", depth: int = DEFAULT_DEPTH, slot: int = DEFAULT_SLOT,
                    slots: int = DEFAULT_SLOTS,
                    buffered_from: int = DEFAULT_BUFFERED_FROM, *,
                    fixed_buffers: bool = True, io_thread: bool = False,
                    split: int | None = None, inflight: int | None = None,
                    poll: bool = False,
                    request_entries: int = DEFAULT_REQUEST_ENTRIES) -> None:
    """The batch engine's settings: `depth` I/Os in flight, `slots` staging slots of `slot`
    bytes (slot x slots bytes of pinned memory, allocated on the first batch; an entry larger
    than a slot is read in slot-sized pieces; a run whose entries average twice a slot or more
    gets fewer, larger slots of the same memory, up to 2 MiB: ``fence.stats["slot_bytes"]``,
    ``["slots"]``); with direct="auto", reads of `buffered_from`
    bytes and up go through the page cache (0, the default: none; for a disk whose page cache
    reads large ranges faster than O_DIRECT). For measurement: `fixed_buffers=False` stops the
    engine registering its staging memory and the host memory loads land in with io_uring
    (nothing is pinned beyond what a read is in flight on); `io_thread=True` reads on a second
    thread while the calling one issues the GPU copies of a load (slower than one thread on the
    H200 measured in docs/benchmarks.md, so off by default; ``fence.stats`` says which ran).
    `split`: O_DIRECT reads through the staging slots of twice this and up go in pieces of it
    (0: slot-sized pieces only; the default 128 KiB), ``fence.stats["split_bytes"]`` and
    ``["split_entries"]``; `inflight`: O_DIRECT reads through the slots keep at most this
    many bytes in flight (0: only `depth` bounds them; the default 8 MiB),
    ``fence.stats["inflight_bytes"]`` and ``["max_inflight_bytes"]``. Large reads then reach
    the disk as many small requests without filling its queue with megabytes (faster on the
    virtio disks measured in docs/benchmarks.md). Reads in place into host memory and reads
    through the page cache are neither cut nor counted.
    `poll=True`: the engine polls for completions instead of sleeping (a busy host's wake-up
    latency is not paid, a CPU is spent while the disk works).
    `request_entries`: a load_batch of at most this many entries into host or CUDA memory
    (paths or fds, no NVMe namespace) is queued as that many single requests, which the
    engine thread runs together as hub.load's are; ``fence.stats["requests"]`` counts them,
    the engine's own figures are not collected for it (0: every batch is planned)."""
    hub._check_open()
    hub.engines.configure_batch(depth, slot, slots, buffered_from, fixed_buffers=fixed_buffers,
                                io_thread=io_thread, split=split, inflight=inflight,
                                poll=poll, request_entries=request_entries)


class Engines(Resource):
    """A Hub's I/O engines and their settings, in one place: the batch engines (one per copy
    engine and device), the thread that runs them, the staging lanes (p2phub.staged.Stager)
    of memory the batch engine does not copy to. Hub.close() closes them: the queued work
    runs to its end, then the thread ends and the rings, pinned memory and streams go."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.batch_opts: dict[str, int] = {"depth": DEFAULT_DEPTH, "slot": DEFAULT_SLOT,
                                           "slots": DEFAULT_SLOTS,
                                           "buffered_from": DEFAULT_BUFFERED_FROM,
                                           "options": _OPT_NO_IO_THREAD,
                                           "request_entries": DEFAULT_REQUEST_ENTRIES}
        self.batch_split: int | None = None
        self.batch_inflight: int | None = None
        self.staged_opts: dict[str, int] = {}
        self._batch: dict[tuple[str, int], _Engine] = {}
        self._stagers: dict[tuple[str, int], Stager] = {}
        self._worker: _Worker | None = None
        self._queue: _Queue | None = None
        self._stopping = False
        # (copy ops, device) -> (C engine, its submission path): a request's engine in one
        # lookup; emptied with the engine table
        self._routes: dict[tuple[Any, int], tuple[Any, str]] = {}
        # per-request loads and saves by path reuse one open file per (path, direction,
        # O_DIRECT) while the path names the same inode: a stat per request instead of an
        # open, an fstat and a close (fds replaced by a rename are closed with the engines)
        self._files: dict[tuple[str, bool, bool], tuple[int, int, int, bool, bytes]] = {}
        self._file_same: Any = None     # staged_io's sio_file_same, once a file is open
        self._stale_fds: list[int] = []
        # hub.open()'s files, closed with the engines (after the queued work that reads them)
        self._storage_files: set[StorageFile] = set()
        self._drained = threading.Event()   # the engines closed: nothing queued runs any more

    def configure_batch(self, depth: int, slot: int, slots: int, buffered_from: int, *,
                        fixed_buffers: bool, io_thread: bool, split: int | None = None,
                        inflight: int | None = None, poll: bool = False,
                        request_entries: int = DEFAULT_REQUEST_ENTRIES) -> None:
        if not 1 <= depth <= 4096:
            raise UsageError(f"depth={depth}: want 1..4096")
        if slot <= 0 or slot % ALIGN:
            raise UsageError(f"slot={slot} must be a positive multiple of {ALIGN}")
        if slots < 1:
            raise UsageError(f"slots={slots} must be positive")
        if buffered_from < 0:
            raise UsageError(f"buffered_from={buffered_from} must be 0 (never) or positive")
        if split is not None and (split < 0 or split % ALIGN):
            raise UsageError(f"split={split} must be 0 or a positive multiple of {ALIGN}")
        if inflight is not None and inflight < 0:
            raise UsageError(f"inflight={inflight} must be 0 (no bound) or positive")
        if not 0 <= request_entries <= _MAX_REQUEST_ENTRIES:
            raise UsageError(f"request_entries={request_entries}: want 0..{_MAX_REQUEST_ENTRIES}")
        with self._lock:
            engines, self._batch, self._routes = list(self._batch.values()), {}, {}
            self.batch_opts = {"depth": depth, "slot": slot, "slots": slots,
                               "buffered_from": buffered_from,
                               "options": (0 if fixed_buffers else _OPT_NO_FIXED)
                               | (0 if io_thread else _OPT_NO_IO_THREAD)
                               | (_OPT_POLL if poll else 0),
                               "request_entries": request_entries}
            self.batch_split = split
            self.batch_inflight = inflight
            mark = self._queue.reserve() if self._queue is not None and engines else None
        self._quiesce(mark, engines)

    def configure_staged(self, chunk: int, lanes: int) -> None:
        Stager(HostOps(), 0, chunk, lanes)   # validates
        with self._lock:
            stagers, self._stagers = list(self._stagers.values()), {}
            self.staged_opts = {"chunk": chunk, "lanes": lanes}
        _close_each(stagers)

    def _quiesce(self, mark: int | None, engines: list["_Engine"]) -> None:
        """Close `engines` once everything queued before reservation `mark` (taken with the
        engines already out of the table, so nothing after it refers to them) has run."""
        q = self._queue
        with contextlib.nullcontext() if mark is None or q is None else q.reached(mark):
            _close_each(engines)

    def _engine_locked(self, ops: Any, device: int) -> "_Engine":
        self._check_open()
        key = (getattr(ops, "name", type(ops).__name__), device)
        eng = self._batch.get(key)
        if eng is None:
            o = self.batch_opts
            eng = self._batch[key] = _Engine(ops, device, o["depth"], o["slot"], o["slots"],
                                             o["options"], self.batch_split,
                                             self.batch_inflight)
        return eng

    def started(self, ops: Any, device: int) -> bool:
        """The batch engine for (ops, device) exists and has been opened."""
        eng = self._batch.get((getattr(ops, "name", type(ops).__name__), device))
        return eng is not None and eng.opened

    def batch_engine(self, ops: Any, device: int) -> "_Engine":
        with self._lock:
            return self._engine_locked(ops, device)

    def push(self, req: "RequestFence", target: CopyTarget,
             file: StorageFile | None = None) -> None:
        """Queue one load or save on the engine thread. The engine is looked up and the
        request queued under the table's lock, so configure_batch() closes no engine a
        queued request still refers to, and a `file` from hub.open() that began to close
        (its close reserves its mark under this lock) takes no request queued after it."""
        with self._lock:
            self._check_push_locked((file,) if file is not None else ())
            route = self._route_locked(target.ops, target.ordinal)
            req.submit_path = route[1]
            (self._queue or self._open_queue()).push(route[0], req)

    def push_many(self, reqs: list["RequestFence"], mems: list["_Mem"],
                  files: list[StorageFile]) -> None:
        """Queue requests back to back (reqs[i] into mems[i]) under one hold of the lock, so
        the engine thread takes them in one run; nothing is queued if the first cannot be.
        `files`: the hub.open() files they read (as for push, none may have begun to close)."""
        with self._lock:
            self._check_push_locked(files)
            routes = [self._route_locked(m.ops, m.device) for m in mems]
            q = self._queue or self._open_queue()
            for req, route in zip(reqs, routes):
                req.submit_path = route[1]
                q.push(route[0], req)

    def _check_push_locked(self, files: Sequence[StorageFile]) -> None:
        """A push is taken: the engines are open and none of the hub.open() `files` it reads
        began to close (its close reserves its mark under the lock)."""
        if self._stopping or self._closed:
            self._check_taking()
        for f in files:
            if f.closing:
                raise UsageError(f"{f!r} is closed")

    def _route_locked(self, ops: Any, device: int) -> tuple[Any, str]:
        """(engine handle, submission path) of the batch engine for (ops, device), made on
        first use."""
        route = self._routes.get((ops, device))
        if route is None:
            eng = self._engine_locked(ops, device)
            route = self._routes[(ops, device)] = (eng.handle(), eng.path)
        return route

    def enqueue_batch(self, job: tuple[Any, ...]) -> None:
        """Queue a batch: its place on the engine thread is reserved now (so requests queued
        after it run after it); the worker thread, or a thread waiting for the batch that gets
        there first (BatchFence._block), hands its engine runs over there. Reserving and
        queueing for the worker happen under one lock, so the worker meets reservations in
        their order."""
        with self._lock:
            self._check_taking()
            q = self._queue or self._open_queue()
            ticket = q.reserve()
            try:
                worker = self.worker_locked()
                j = _Job(q, ticket, job, worker)
                job[5].set_run(j)
                worker.put(j)
            except BaseException:
                job[5].set_run(None)
                q.release(ticket)
                raise

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A block during which the engine thread runs nothing queued after its start (what
        was queued before has run by the time it begins)."""
        with self._lock:
            self._check_taking()
            q = self._queue or self._open_queue()
            mark = q.reserve()
        with q.reached(mark):
            yield

    def _check_taking(self) -> None:
        self._check_open()
        if self._stopping:
            raise UsageError("the hub is closing: its I/O engines take no new work")

    def _open_queue(self) -> "_Queue":
        from .staged_io import load as load_sio
        self._queue = _Queue(load_sio())
        return self._queue

    def forget_memory(self, ptr: int, length: int) -> None:
        """Host memory at [ptr, ptr + length) goes away: every batch engine gives it up."""
        with self._lock:
            engines = list(self._batch.values())
        for eng in engines:
            eng.forget_memory(ptr, length)

    def stager(self, ops: Any, device: int) -> Stager:
        key = (ops.name, device)
        with self._lock:
            self._check_open()
            st = self._stagers.get(key)
            if st is None:
                st = self._stagers[key] = Stager(ops, device, **self.staged_opts)
            return st

    def open_file(self, name: str, write: bool, direct: bool) -> tuple[int, bool, int] | None:
        """(fd, O_DIRECT in use, size) of a regular file `name` from the engines' open files,
        opened on first use; None where the caller should open it itself (not a regular file
        yet, or the table is full)."""
        key = (name, write, direct)
        ent = self._files.get(key)
        if ent is not None:
            size = self._file_same(ent[4], ent[1], ent[2])   # one stat, in C
            if size >= 0:
                return ent[0], ent[3], size
        try:
            st = os.stat(name)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        if ent is None and len(self._files) >= _MAX_OPEN_FILES:
            return None
        fd, is_direct, _owned, _ = staged.open_target(name, write, direct)
        fst = os.fstat(fd)
        with self._lock:
            if self._closed:
                os.close(fd)
                self._check_open()
            old = self._files.get(key)
            if old is not None:
                self._stale_fds.append(old[0])   # requests in flight may still read it
            if self._file_same is None:     # before the entry: readers take no lock
                from .staged_io import load as load_sio
                self._file_same = load_sio().lib.sio_file_same
            self._files[key] = (fd, fst.st_dev, fst.st_ino, is_direct, os.fsencode(name))
        return fd, is_direct, fst.st_size

    def open_storage(self, path: "str | os.PathLike[str]", mode: str,
                     direct: bool) -> StorageFile:
        """hub.open(): a StorageFile of this hub, closed with its engines at the latest."""
        with self._lock:
            self._check_taking()
        f = StorageFile(self, path, mode, direct=direct)
        with self._lock:
            if not self._stopping:
                self._storage_files.add(f)
                return f
        f.close()
        self._check_taking()    # raises: the hub closed meanwhile
        return f    # pragma: no cover

    def forget(self, f: StorageFile) -> None:
        with self._lock:
            self._storage_files.discard(f)

    def wait_queued(self) -> None:
        """Return once every load, save and batch queued on the engine thread before the call
        has run (at once where nothing was ever queued; when the engines are closing, once
        they closed)."""
        with self._lock:
            stopping, q = self._stopping, self._queue
            mark = q.reserve() if q is not None and not stopping else None
        if stopping:
            self._drained.wait()
            return
        if q is not None and mark is not None:
            with q.reached(mark):
                pass

    def worker_locked(self) -> "_Worker":
        if self._worker is None:
            self._worker = _Worker()
        return self._worker

    def _close(self) -> None:
        with self._lock:
            self._stopping = True   # no new requests or batches from here on
            worker, self._worker = self._worker, None
            queue = self._queue
        try:
            if worker is not None:
                worker.close()      # plans and runs the batches queued, ends the thread
            if queue is not None:
                queue.close()       # runs the requests queued, delivers every result
        finally:
            self._drained.set()
        with self._lock:
            owned: list[Resource] = [*self._batch.values(), *self._stagers.values(),
                                     *self._storage_files]
            self._batch, self._stagers, self._routes = {}, {}, {}
            self._storage_files = set()
            fds = [e[0] for e in self._files.values()] + self._stale_fds
            self._files, self._stale_fds = {}, []
        _close_each(owned)
        for fd in fds:
            os.close(fd)


def _close_each(objs: list[Any]) -> None:
    for o in objs:
        o.close()


def _engine(hub: "Hub", ops: Any, device: int) -> _Engine:
    return hub.engines.batch_engine(ops, device)


# ------------------------------------------------------------------ load / save


def load_batch(hub: "Hub", entries: Sequence[Any] | None = None, *, storage: Any = None,
               offsets: Any = None, lengths: Any = None, memory: Any = None,
               mem_offsets: Any = None, storage_index: Any = None, memory_index: Any = None,
               per_entry: bool = False, direct: bool | str = "auto") -> BatchFence:
    """Read every entry's `length` bytes at `offset` of its storage into its memory at the
    memory offset. See the module's doc for the forms; returns one BatchFence. direct: True
    reads with O_DIRECT where the file system has it, False through the page cache, "auto"
    (default) O_DIRECT, except entries of configure_batch's `buffered_from` bytes and up when
    it is set, through the page cache (two fds on a path; an fd given is used as it is)."""
    return _batch(hub, False, entries, storage, offsets, lengths, memory, mem_offsets,
                  storage_index, memory_index, per_entry, direct, False)


def save_batch(hub: "Hub", entries: Sequence[Any] | None = None, *, storage: Any = None,
               offsets: Any = None, lengths: Any = None, memory: Any = None,
               mem_offsets: Any = None, storage_index: Any = None, memory_index: Any = None,
               per_entry: bool = False, direct: bool = True, sync: bool = True) -> BatchFence:
    """Write every entry's `length` bytes of its memory (at the memory offset) to `offset`
    of its storage; with `sync`, the files are fsynced before the fence completes."""
    return _batch(hub, True, entries, storage, offsets, lengths, memory, mem_offsets,
                  storage_index, memory_index, per_entry, direct, sync)


def _batch(hub: "Hub", write: bool, entries: Any, storage: Any, offsets: Any, lengths: Any,
           memory: Any, mem_offsets: Any, storage_index: Any, memory_index: Any,
           per_entry: bool, direct: bool | str, sync: bool) -> BatchFence:
    hub._check_open()
    np = _np()
    cols = _columns(entries, storage, offsets, lengths, memory, mem_offsets, storage_index,
                    memory_index)
    p = _plan(hub, write, direct, cols)
    verb = "save" if write else "load"
    fence = BatchFence(f"{verb}_batch of {p.n} entries", p.total, p.n)
    if per_entry:
        fence.entries = [Fence(f"{verb}_batch entry {i}", int(p.length[i])) for i in range(p.n)]
    fence.stats["io"] = {f.name: _io_name(f, p.buffered_from) for f in p.files if f.fd >= 0}
    if (not write and p.n <= hub.engines.batch_opts["request_entries"]
            and p.total <= _REQUEST_BYTES and _as_requests(p)):
        return _send_requests(hub, p, fence)
    _own_borrowed(p)
    fence.results = np.zeros(p.n, np.int64)
    held: list[Memory] = []
    try:
        for m in p.mems:
            if m is not None:
                m.reg.hold()
                held.append(m.reg)
    except BaseException:
        _release(held, p)
        raise
    parts: list[Any] = []
    if p.namespaces:
        is_ns = np.isin(p.sidx, np.fromiter(p.namespaces, np.int64, len(p.namespaces)))
        try:
            parts += _namespace_parts(p, write, is_ns, fence)
        except BaseException:
            _release(held, p)
            raise
        file_rows = np.flatnonzero(~is_ns)
    else:
        file_rows = np.arange(p.n)
    try:
        hub.engines.enqueue_batch((hub, write, p, file_rows, parts, fence, held, sync))
    except BaseException:
        _release(held, p)
        raise
    return fence


def _own_borrowed(p: _Plan) -> None:
    """A planned batch reads a duplicate of each hub.open() file's fd, so that the file's
    close never waits for (or races) the batch's planning and run."""
    try:
        for f in p.files:
            if f.storage is not None:
                f.fd, f.owned, f.storage = f.storage.dup(), True, None
    except BaseException:
        _close_plan(p)      # (the duplicates made so far)
        raise


def _as_requests(p: _Plan) -> bool:
    """The planned read batch can go to the engine thread as single requests: files the
    batch does not own (the engines' open files, hub.open() files, fds given), one fd each,
    memory the engine copies to itself, no NVMe namespace."""
    if p.namespaces:
        return False
    for f in p.files:
        if f.owned or f.fd_buffered >= 0:
            return False
    for m in p.mems:
        if m is not None and (m.cpu_map is not None or not _engine_copies(m.ops)):
            return False
    return True


def _send_requests(hub: "Hub", p: _Plan, fence: BatchFence) -> BatchFence:
    """Queue a small read batch's entries as single requests, back to back (the engine
    thread runs them as one submission, with whatever else is queued); the fence completes
    with the last of them. Like any batch, the entries are not ordered accesses of the
    memory (hub.load's are)."""
    t0 = _now()
    off, ln, mo = p.off.tolist(), p.length.tolist(), p.moff.tolist()
    si, mi = p.sidx.tolist(), p.midx.tolist()
    reqs: list[RequestFence] = []
    mems: list[_Mem] = []
    for i in range(p.n):
        f, m = p.files[si[i]], p.mems[mi[i]]
        reqs.append(RequestFence(f.name, False, m.reg, None, f.fd, False, off[i], mo[i],
                                 m.ptr + mo[i], ln[i], (1 if f.direct else 0) | (2 if m.cuda else 0),
                                 None, False))
        mems.append(m)
    held: list[Memory] = []
    try:
        for m in p.mems:
            if m is not None and not m.cuda and m.reg.mode == MODE_STAGED:
                hub.engines.batch_engine(m.ops, m.device).register_memory(m.ptr, m.length,
                                                                         m.reg.what)
        for r in reqs:
            r.reg.hold()
            held.append(r.reg)
        left = [p.n]
        lock = threading.Lock()

        def one_done(_req: Any) -> None:
            with lock:      # (completions may come on two threads at once)
                left[0] -= 1
                if left[0]:
                    return
            _requests_done(p, reqs, fence, t0)

        for r in reqs:
            r.add_done_callback(one_done)
        fence.set_requests(reqs[-1])
        opened = [f.storage for f in p.files if f.storage is not None]
        hub.engines.push_many(reqs, mems, opened)
    except BaseException:
        fence.set_requests(None)
        for reg in held:
            reg.unhold()
        raise
    return fence


def _requests_done(p: _Plan, reqs: list[RequestFence], fence: BatchFence, t0: float) -> None:
    """A batch sent as requests: every request completed."""
    import numpy as np
    excs = [r.exception(0) for r in reqs]
    res = [r.nbytes if e is None else -(getattr(e, "errno", None) or errno.EIO)
           for r, e in zip(reqs, excs)]
    fence.results = np.array(res, np.int64)
    err: BaseException | None = None
    bad = [i for i, v in enumerate(res) if v < 0]
    if bad:
        i = bad[0]
        more = f" (and {len(bad) - 1} more entries)" if len(bad) > 1 else ""
        f = p.files[int(p.sidx[i])]
        err = P2PHubOSError(-res[i], f"entry {i}: read {f.name or f.target}"
                            f"[{int(p.off[i])}:+{int(p.length[i])}]{more}")
        err.__cause__ = excs[i]
    dt = _now() - t0
    fence.stats.update(seconds=dt, gbps=(fence.nbytes / dt / 1e9) if dt > 0 else 0.0,
                       entries=p.n, per_s=(p.n / dt) if dt > 0 else 0.0, requests=p.n,
                       submit_path=reqs[0].submit_path)
    fence.complete(err)


class _Job:
    """One queued batch: its reservation on the engine thread and what _run needs. Run once,
    by the worker or by a thread waiting for the batch's fence, whichever claims it first."""

    __slots__ = ("queue", "ticket", "args", "taken", "worker")

    def __init__(self, queue: "_Queue", ticket: int, args: tuple[Any, ...],
                 worker: "_Worker") -> None:
        self.queue, self.ticket, self.args, self.worker = queue, ticket, args, worker
        self.taken = threading.Lock()

    def started(self) -> bool:
        """Every engine the batch runs on exists already."""
        hub, p = self.args[0], self.args[2]
        return all(hub.engines.started(m.ops, m.device) for m in p.mems if m is not None)

    def claim(self) -> bool:
        return self.taken.acquire(blocking=False)

    def run(self) -> None:
        self.args[5].set_run(None)
        try:
            _run(*self.args, queue=self.queue, ticket=self.ticket)
        except BaseException:  # noqa: BLE001 - _run reports through the fence
            log.exception("batch run")


class _Reservation:
    """A batch's place on the engine thread, let go of once: by the batch's last engine run,
    which releases it as it ends, or by release()."""

    __slots__ = ("queue", "ticket", "held")

    def __init__(self, queue: "_Queue", ticket: int) -> None:
        self.queue, self.ticket, self.held = queue, ticket, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.queue.release(self.ticket)


class _Worker(Resource):
    """The thread that plans and finishes batches, in the order they were queued: each one
    runs on the engine thread at the place it reserved there (see _Queue), and its fence
    completes here, unless a thread waiting for it took it first (BatchFence._block)."""

    def __init__(self) -> None:
        import queue
        self.q: Any = queue.SimpleQueue()
        self.t = threading.Thread(target=self._loop, name="p2phub-batch", daemon=True)
        self.t.start()

    def _loop(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            if job.claim():
                job.run()

    def put(self, job: Any) -> None:
        self.q.put(job)

    def _close(self) -> None:
        """Runs the batches already queued, then ends the thread."""
        self.q.put(None)
        if self.t is not threading.current_thread():
            self.t.join()


# ------------------------------------------------------------------ the engine thread


_QUEUE_CAPACITY = 1 << 16     # requests queued or uncollected at most; a push waits beyond
_REAP_MAX = 4096


class _Queue(Resource):
    """The Hub's engine thread (staged_io/_sio_queue.c): single loads and saves are queued
    on it without the GIL and run in back-to-back runs as one submission each; batches run at
    their reservations. Results are collected in bulk, by whichever thread waits for one
    (Fence.wait) or else by a collector thread, which completes the fences."""

    def __init__(self, mod: Any) -> None:
        import numpy as np
        self.ffi, self.lib = mod.ffi, mod.lib
        err = self.ffi.new("char[]", 256)
        q = self.lib.sio_queue_open(_QUEUE_CAPACITY, err, 256)
        if q == self.ffi.NULL:
            raise P2PHubOSError(errno.EIO, "the I/O engine thread", self.ffi.string(err).decode())
        self.q = q
        # Requests queued and not yet collected, by ticket. Every push and reservation of
        # this queue happens under Engines._lock, so a push's ticket is known before it (the
        # next one): the request is filed first and a collector finds it whenever its result
        # comes, with no lock between the two (one dict operation each, under the GIL).
        self._pending: dict[int, Any] = {}
        self._next = 0
        self._rlock = threading.Lock()                 # one collector at a time (shared arrays)
        self._first = self.ffi.new("unsigned long long *")
        self._res = np.empty(_REAP_MAX, np.int64)
        self._runs = np.empty(_REAP_MAX, np.uint32)
        self._res_c = self.ffi.from_buffer("long long[]", self._res, require_writable=True)
        self._runs_c = self.ffi.from_buffer("unsigned[]", self._runs, require_writable=True)
        self._collector = threading.Thread(target=self._collect, name="p2phub-io-done",
                                           daemon=True)
        self._collector.start()

    # -------------------------------------------------------------- queueing
    def push(self, eng: Any, req: "RequestFence") -> None:
        """Queue a request (under Engines._lock)."""
        t = self._next
        req.ticket = t
        req.queue = self
        self._pending[t] = req
        got = self.lib.sio_queue_push(self.q, eng, req.write, req.fd, req.offset, req.nbytes,
                                      req.mem, req.flags, req.sync)
        if got != t:
            del self._pending[t]
            if got < 0:
                req.queue = None
                raise UsageError("the hub's I/O engine is closed")
            # queued after all (something pushed without the engines' lock: a bug): filed
            # under the ticket it got, as the request runs and its memory stays held
            log.error("I/O engine ticket %d where %d was expected: a push without the "
                      "engines' lock", got, t)
            t = req.ticket = got
            self._pending[t] = req
        self._next = t + 1

    def reserve(self) -> int:
        """A place in the queue (under Engines._lock)."""
        t = self.lib.sio_queue_reserve(self.q)
        if t < 0:
            raise UsageError("the hub's I/O engine is closed")
        self._next = t + 1
        return t

    @contextlib.contextmanager
    def reached(self, ticket: int) -> Iterator[None]:
        """A block run once the engine thread stands at reservation `ticket` (everything
        queued before it has run, nothing after it runs meanwhile); the reservation is
        released when the block ends, or if the wait fails."""
        try:
            self.lib.sio_queue_wait_reached(self.q, ticket)
            yield
        finally:
            self.release(ticket)

    def release(self, ticket: int) -> None:
        self.lib.sio_queue_release(self.q, ticket)

    # -------------------------------------------------------------- results
    def reap(self) -> int:
        """Collect every result ready and complete those requests' fences."""
        with self._rlock:
            n = self.lib.sio_queue_reap(self.q, self._first, self._res_c, self._runs_c,
                                        _REAP_MAX)
            if not n:
                return 0
            first = self._first[0]
            res = self._res[:n].tolist()
            runs = self._runs[:n].tolist()
        done = []
        pop = self._pending.pop
        for k in range(n):
            if runs[k]:                         # (0: a reservation's place, nothing to complete)
                req = pop(first + k, None)
                if req is not None:
                    done.append((req, res[k], runs[k]))
        _settle(done)
        for req, moved, run in done:
            req.finish(moved, run, self._why(moved) if moved < 0 else "", True)
        return n

    def wait(self, ticket: int, timeout: float | None) -> bool:
        """Block (without the GIL) until request `ticket` has completed on the engine thread."""
        ns = -1 if timeout is None else max(0, int(timeout * 1e9))
        return bool(self.lib.sio_queue_wait(self.q, ticket, ns))

    def _why(self, moved: int) -> str:
        if moved != -errno.EIO:
            return ""
        return self.stats()["error"]

    def stats(self) -> dict[str, Any]:
        runs = self.ffi.new("unsigned long long *")
        reqs = self.ffi.new("unsigned long long *")
        big = self.ffi.new("unsigned long long *")
        wakes = self.ffi.new("unsigned long long *")
        err = self.ffi.new("char[]", 256)
        self.lib.sio_queue_stats(self.q, runs, reqs, big, wakes, err, 256)
        return {"runs": int(runs[0]), "requests": int(reqs[0]), "longest_run": int(big[0]),
                "wakes": int(wakes[0]), "error": self.ffi.string(err).decode(errors="replace")}

    def _collect(self) -> None:
        while True:
            ready = self.lib.sio_queue_wait_results(self.q, 100_000_000)
            if ready < 0:
                return
            if ready:
                try:
                    self.reap()
                except BaseException:  # noqa: BLE001 - keep collecting
                    log.exception("I/O engine results")

    def _close(self) -> None:
        """Runs what is queued (reservations released by their owners), delivers every
        result, ends both threads."""
        self.lib.sio_queue_close(self.q)
        self._collector.join()
        while self.reap():
            pass
        self.lib.sio_queue_free(self.q)
        self.q = self.ffi.NULL


# ------------------------------------------------------------------ single requests


_LOAD_KIND, _SAVE_KIND = AccessKind.NVME_READ, AccessKind.NVME_WRITE
# one lock for every request: a fence's critical sections are a few assignments and never
# nest, and a lock per request is one more object for the cycle collector to walk
_SHARED_LOCK = threading.Lock()


class RequestFence(Fence, FencedAccess):
    """One hub.load / hub.save queued on the engine thread, its fence and its ordered access
    of the memory, in one object (the fewer objects a request leaves for the cycle collector,
    the less its passes cost): completes when the engine thread's result for it is collected;
    a thread that waits collects results itself rather than wake a collector."""

    shared_lock = _SHARED_LOCK
    queue: "_Queue | None"
    ticket: int
    submit_path: str

    def __init__(self, name: str, write: bool, reg: Memory, ordering: Any, fd: int,
                 owned: bool, offset: int, reg_offset: int, mem: int, nbytes: int, flags: int,
                 progress: Any, sync: bool) -> None:
        # the fields of Fence and staged.Fence, set in this one frame (it runs once per
        # request; tests/unit/test_request_ordering.py checks that none is missing)
        # (one statement each: an assignment of more than three names builds a tuple)
        self._lock = _SHARED_LOCK
        self._done = False
        self._ev = None
        self._exc = None
        self._callbacks = None
        self._words = ()
        self.nbytes = nbytes
        self._secs = 0.0
        self._run = -1
        self.t0 = _now()
        self.name = name
        self.write = write
        self.reg = reg
        self.fd = fd
        self.owned = owned
        self.offset = offset
        self.mem = mem
        self.flags = flags
        self.progress = progress
        self.sync = sync
        # every attribute set later exists from here, in one order, and there are fewer than
        # 30: the instances then share one key table and none grows a dict of its own (one
        # object more for the cycle collector)
        self.ticket = -1
        self.queue = None
        self.submit_path = ""
        # its access of the memory (FencedAccess.acquire's fields): a load fills the range
        # (producer), a save reads it (consumer); Ordering.admit enters it
        self.kind = _SAVE_KIND if write else _LOAD_KIND
        self.start = reg_offset
        self.end = reg_offset + nbytes
        self.seq = next_seq()
        self._ordering = ordering

    @property
    def direct(self) -> bool:
        return bool(self.flags & 1)

    @property
    def ordered(self) -> bool:
        """An ordered access of its memory (a batch's entries sent as requests are not),
        until it completes."""
        return self._ordering is not None

    @property  # type: ignore[override]
    def stats(self) -> dict[str, Any]:
        """Once complete: its seconds, the length of the engine run it went in (`requests`),
        O_DIRECT and the submission path; made when asked for ({} before)."""
        if self._run < 0:
            return {}
        return {"seconds": self._secs, "requests": self._run, "direct": self.direct,
                "submit_path": self.submit_path}

    @property  # type: ignore[override]
    def what(self) -> str:
        """The request in words, made when asked for (an error, a repr), not per request."""
        return _words(self.write, self.name, self.offset, self.nbytes, self.reg)

    @what.setter
    def what(self, _value: str) -> None:
        pass

    def finish(self, moved: int, run: int, why: str, settled: bool = False) -> None:
        """Complete with the engine's result; `settled`: its range and its hold on the memory
        were already released (_settle, for a batch of results at once)."""
        self._secs = _now() - self.t0
        self._run = run
        if settled and moved == self.nbytes and not self.owned and self.progress is None:
            self._ordering = None       # the usual request: nothing to close, call or report
            super(FencedAccess, self)._complete(None)
            return
        err: BaseException | None = None
        if moved < 0 or moved < self.nbytes:
            err = P2PHubOSError(-moved if moved < 0 else errno.EIO, self.what,
                                why or self._short_why())
        if settled:
            self._ordering = None
        try:
            if not settled:
                self.reg.unhold()
            if self.owned:
                os.close(self.fd)
            if err is None and self.progress is not None:
                self.progress(self.nbytes)
        except BaseException as exc:  # noqa: BLE001 - delivered through the fence
            err = err or exc
        self.progress = None
        self._secs = _now() - self.t0
        if settled:     # nothing left to retire: complete it as the plain fence it now is
            super(FencedAccess, self)._complete(err)
        else:
            self._finish(err)

    def _short_why(self) -> str:
        """Why a read came up short: the file ends before the range (it shrank)."""
        if self.write:
            return ""
        try:
            size = staged.size_of(self.fd)
        except OSError:
            return ""
        end = self.offset + self.nbytes
        return f"the source ends at byte {size}, before {end}" if size < end else ""

    def _block(self, timeout: float | None) -> None:
        q = self.queue
        if q is None:
            self._sleep(timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            q.reap()
            if self._done:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if q.wait(self.ticket, left):
                q.reap()
                if not self._done:      # another thread collected it and completes it now
                    self._sleep(left)


def _words(write: bool, name: str, offset: int, nbytes: int, reg: Memory) -> str:
    """A single load or save, in words."""
    span = f"{name}[{offset}:+{nbytes}]"
    return f"save {reg.what} -> {span}" if write else f"load {span} -> {reg.what}"


def _settle(done: list[tuple[Any, int, int]]) -> None:
    """For results collected together: release each memory's ranges under one hold of its
    ordering's lock and drop its holds at once (per request, both would be a lock round each)."""
    groups: dict[int, tuple[Memory, list[RequestFence]]] = {}
    reg, reqs = None, None       # the last one's group: results mostly come in runs of one memory
    for req, _moved, _run in done:
        if req.reg is not reg:
            reg = req.reg
            g = groups.get(id(reg))
            if g is None:
                g = groups[id(reg)] = (reg, [])
            reqs = g[1]
        reqs.append(req)    # type: ignore[union-attr]
    for reg, reqs in groups.values():
        # (a batch's entries sent as requests are no ordered access: no range to retire)
        reg.ordering.retire_all([r for r in reqs if r.ordered])
        reg.unhold(len(reqs))


def _engine_copies(ops: Any) -> bool:
    """The batch engine issues this copy engine's copies itself (memcpy, the CUDA driver)."""
    return getattr(ops, "name", "") in ("host", "cuda")


def load(hub: "Hub", source: Any, dest: Any, offset: int = 0, nbytes: int | None = None,
         dest_offset: int = 0, *, direct: bool = True,
         progress: Any = None) -> Fence:
    """Read `nbytes` at byte `offset` of `source` (a file or block device path, an open file,
    an fd, or in P2P mode a p2phub NVMe Namespace) into registration `dest` at `dest_offset`;
    a fence. The read is queued on the hub's engine thread with whatever else is queued (see
    _Worker); `progress(nbytes)` is called once the bytes are in. A hub.open() file goes to
    load_open instead (Hub.load sends it there)."""
    reg = staged.check_memory(dest, "the destination")
    if type(source) is not str and staged.is_direct_storage(source):
        return staged.namespace_io(hub, "read", source, reg, offset, nbytes, dest_offset)
    tgt = staged.copy_target(reg)
    engine = _engine_copies(tgt.ops)
    cached = None
    if engine and type(source) is str:
        cached = hub.engines.open_file(source, False, direct)
    if cached is not None:
        fd, is_direct, total = cached
        owned, name = False, source
    else:
        fd, is_direct, owned, name = staged.open_target(source, False, direct)
    try:
        if cached is None:
            total = staged.size_of(fd, name)
        if nbytes is None:
            nbytes = total - offset
        if offset < 0 or nbytes <= 0 or offset + nbytes > total:
            raise UsageError(f"{name}: range offset={offset} nbytes={nbytes} is not inside its "
                             f"{total} bytes")
        if dest_offset < 0 or dest_offset + nbytes > reg.length:
            check_range(dest_offset, nbytes, reg.length, reg)   # type: ignore[arg-type]
    except BaseException:
        if owned:
            os.close(fd)
        raise
    return _dispatch(hub, False, engine, reg, tgt, fd, owned, is_direct, offset, dest_offset,
                     nbytes, name, progress, True)


def save(hub: "Hub", source: Any, dest: Any, offset: int = 0, nbytes: int | None = None,
         source_offset: int = 0, *, direct: bool = True, sync: bool = True,
         progress: Any = None) -> Fence:
    """Write `nbytes` of registration `source` (from `source_offset`) to byte `offset` of
    `dest` (a path, an open file, an fd, or in P2P mode a p2phub NVMe Namespace); with `sync`
    the file is fsynced before the fence completes. A hub.open() file goes to save_open
    instead (Hub.save sends it there)."""
    reg = staged.check_memory(source, "the source")
    if staged.is_direct_storage(dest):
        return staged.namespace_io(hub, "write", dest, reg, offset, nbytes, source_offset)
    if nbytes is None:
        nbytes = reg.length - source_offset
    source_offset, nbytes = check_range(source_offset, nbytes, reg.length, reg)  # type: ignore[arg-type]
    if offset < 0:
        raise UsageError(f"offset={offset} is negative")
    tgt = staged.copy_target(reg)
    use_direct = direct and offset % ALIGN == 0 and nbytes % ALIGN == 0
    fd, is_direct, owned, name = staged.open_target(dest, True, use_direct)
    return _dispatch(hub, True, _engine_copies(tgt.ops), reg, tgt, fd, owned, is_direct, offset,
                     source_offset, nbytes, name, progress, sync)


def load_open(hub: "Hub", f: StorageFile, dest: Any, offset: int, nbytes: int | None,
              dest_offset: int, progress: Any) -> Fence:
    """hub.load of a hub.open() file: no system call before the engine's read."""
    reg = staged.check_memory(dest, "the destination")
    if f.engines is not hub.engines:
        raise UsageError(f"{f!r} was opened by another hub")
    nbytes = f.read_range(offset, nbytes)
    if dest_offset < 0 or dest_offset + nbytes > reg.length:
        check_range(dest_offset, nbytes, reg.length, reg)   # type: ignore[arg-type]
    tgt = reg.copy_target()
    if tgt.ops is None:
        staged.copy_target(reg)     # raises, naming why no engine copies to it
    if _engine_copies(tgt.ops):
        return _dispatch(hub, False, True, reg, tgt, f.fd, False, f.direct, offset,
                         dest_offset, nbytes, f.name, progress, True, f)
    # the staging lanes run outside the engine queue that f.close() waits for: their own fd
    return _dispatch(hub, False, False, reg, tgt, f.dup(), True, f.direct, offset,
                     dest_offset, nbytes, f.name, progress, True)


def save_open(hub: "Hub", source: Any, f: StorageFile, offset: int, nbytes: int | None,
              source_offset: int, sync: bool, progress: Any) -> Fence:
    """hub.save to a hub.open() file (opened "r+", "w" or "a")."""
    reg = staged.check_memory(source, "the source")
    if f.engines is not hub.engines:
        raise UsageError(f"{f!r} was opened by another hub")
    if nbytes is None:
        nbytes = reg.length - source_offset
    source_offset, nbytes = check_range(source_offset, nbytes, reg.length, reg)  # type: ignore[arg-type]
    fd, direct = f.write_fd(offset, nbytes)
    tgt = staged.copy_target(reg)
    if _engine_copies(tgt.ops):
        return _dispatch(hub, True, True, reg, tgt, fd, False, direct, offset, source_offset,
                         nbytes, f.name, progress, sync, f)
    # the lanes: their own fd, as for a load
    return _dispatch(hub, True, False, reg, tgt, f.dup(buffered=f.direct and not direct), True,
                     direct, offset, source_offset, nbytes, f.name, progress, sync)


def _dispatch(hub: "Hub", write: bool, engine: bool, reg: Memory, tgt: CopyTarget, fd: int,
              owned: bool, direct: bool, offset: int, reg_offset: int, nbytes: int, name: str,
              progress: Any, sync: bool, file: StorageFile | None = None) -> Fence:
    """One checked load or save onto what copies this memory: the Hub's engine thread for host
    and CUDA memory (`engine`), the staging lanes for a backend's own copies; an fd we opened
    is closed if it never gets there."""
    try:
        if not engine:
            return staged.on_lanes(hub, "save" if write else "load", reg, tgt, fd, owned,
                                   direct, offset, reg_offset, nbytes,
                                   _words(write, name, offset, nbytes, reg), progress, sync=sync)
        ordering = reg.ordering
        fence = RequestFence(name, write, reg, ordering, fd, owned, offset, reg_offset,
                             tgt.ptr + reg_offset, nbytes, direct | (tgt.gpu << 1), progress,
                             sync)
        # the request is an ordered access of the memory: it waits here for the earlier
        # accesses it conflicts with, and its completion releases the range
        ordering.admit(fence)
        try:
            reg.hold()
        except BaseException as exc:
            fence.cancel(exc)
            raise
        try:
            hub.engines.push(fence, tgt, file)
        except BaseException as exc:
            reg.unhold()
            fence.cancel(exc)
            raise
        return fence
    except BaseException:
        if owned:
            os.close(fd)
        raise


def _register_host(eng: _Engine, mems: list[_Mem]) -> None:
    """Host registrations a load lands in, registered with the engine's ring once (a
    dma-buf's CPU mapping is not: it lives for one batch)."""
    for m in mems:
        if not m.cuda and m.cpu_map is None and m.reg.mode == MODE_STAGED:
            eng.register_memory(m.ptr, m.length, m.reg.what)


def _release(held: list[Memory], p: _Plan) -> None:
    for reg in held:
        reg.unhold()
    _close_plan(p)


def _namespace_parts(p: _Plan, write: bool, is_ns: Any, fence: BatchFence) -> list[Any]:
    """One Namespace.submit per namespace: (rows, futures) pairs."""
    from .nvme.namespace import Op
    import numpy as np
    kind = "write" if write else "read"
    out = []
    for k, ns in p.namespaces.items():
        rows = np.flatnonzero(p.sidx == k)
        lba = ns.lba_size
        ops = [Op(kind, p.mems[int(p.midx[i])].reg, int(p.off[i]) // lba, int(p.length[i]),
                  int(p.moff[i])) for i in rows]
        out.append((rows, ns.submit(ops)))
    return out


_tls = threading.local()


def _scratch(np: Any, n: int) -> tuple[Any, Any, Any]:
    """This thread's fd, flag and address arrays for a run of n entries, reused by its next
    run: a thread runs one batch at a time and the engine is done with them when the run
    returns (_run)."""
    arrs = getattr(_tls, "targets", None)
    if arrs is None or arrs[0].size != n:
        arrs = _tls.targets = (np.empty(n, np.int32), np.empty(n, np.uint8),
                               np.empty(n, np.uint64))
    return arrs


_SIO: Any = None


def _sio() -> Any:
    """The compiled engine module (looked up once: the planner asks for it per batch)."""
    global _SIO
    if _SIO is None:
        from .staged_io import load as load_sio
        _SIO = load_sio()
    return _SIO


def _row_targets(np: Any, p: _Plan, sidx: Any, midx: Any, moff: Any,
                 length: Any) -> tuple[Any, Any, Any]:
    """Per file entry (the columns given, those entries' own): its fd, flags (1 O_DIRECT,
    2 CUDA memory) and memory address, looked up by storage and memory index (no mask per
    file or memory)."""
    files, mems = p.files, p.mems
    if len(files) == 1 and len(mems) == 1:
        # the common batch: one pass in C into this thread's reused arrays
        f, m = files[0], mems[0]
        fds, flags, mem = _scratch(np, sidx.size)
        mod = _sio()
        ffi = mod.ffi
        mod.lib.sio_targets(sidx.size, _longs(ffi, moff), m.ptr, f.fd,
                            (1 if f.direct else 0) | (2 if m.cuda else 0),
                            ffi.from_buffer("int[]", fds),
                            ffi.from_buffer("unsigned char[]", flags),
                            ffi.from_buffer("unsigned long long[]", mem))
    else:
        if len(files) == 1:
            f = files[0]
            fds = np.full(sidx.size, f.fd, np.int32)
            flags = np.full(sidx.size, 1 if f.direct else 0, np.uint8)
        else:
            fds = np.array([f.fd for f in files], np.int32)[sidx]
            flags = np.array([1 if f.direct else 0 for f in files], np.uint8)[sidx]
        if len(mems) == 1:
            m = mems[0]
            mem = moff.astype(np.uint64) + np.uint64(m.ptr)
            if m.cuda:
                flags |= 2
        else:
            ptrs = np.array([m.ptr if m is not None else 0 for m in mems], np.uint64)
            mem = ptrs[midx] + moff.astype(np.uint64)
            cuda = np.array([bool(m is not None and m.cuda) for m in mems], bool)[midx]
            flags[cuda] |= 2
    if any(f.fd_buffered >= 0 for f in files):
        # large reads of a file opened twice go through its page-cache fd
        alt = np.array([f.fd_buffered for f in files], np.int32)[sidx]
        big = (alt >= 0) & (length >= p.buffered_from)
        fds = np.where(big, alt, fds)
        flags[big] &= ~np.uint8(1)
    return fds, flags, mem


def _groups(np: Any, p: _Plan, midx: Any, every: bool) -> list[tuple[Any, int, Any, list[_Mem]]]:
    """(ops, device, mask over the file entries or None for all, memories) per engine the
    file entries (memory indexes `midx`) run on."""
    # every memory the plan kept is used by some entry; with NVMe entries left out, only
    # those the file entries use count (an NVMe-only one has no copy engine)
    used = None if every else set(np.unique(midx).tolist())
    keys: dict[tuple[str, int], list[Any]] = {}
    for k, m in enumerate(p.mems):
        if m is not None and (used is None or k in used):
            key = (getattr(m.ops, "name", type(m.ops).__name__), m.device)
            keys.setdefault(key, [m.ops, m.device, [], []])
            keys[key][2].append(k)
            keys[key][3].append(m)
    if len(keys) == 1:
        ops, dev, _ks, gmems = next(iter(keys.values()))
        return [(ops, dev, None, gmems)]
    return [(ops, dev, np.isin(midx, ks), gmems) for ops, dev, ks, gmems in keys.values()]


def _run(hub: "Hub", write: bool, p: _Plan, rows: Any, parts: list[Any], fence: BatchFence,
         held: list[Any], sync: bool, *, queue: _Queue, ticket: int) -> None:
    """Run one queued batch at its reservation `ticket` (released here, whatever happens)
    and complete its fences."""
    t0 = time.perf_counter()
    err: BaseException | None = None
    res = fence.results
    failed = 0          # entries the engine runs failed (their counts: no scan when none)
    place = _Reservation(queue, ticket)
    try:
        import numpy as np
        if rows.size:
            every = rows.size == p.n        # no NVMe entries: the columns as they are
            cols = (p.sidx, p.midx, p.moff, p.off, p.length)
            sidx, midx, moff, off, length = cols if every else [c[rows] for c in cols]
            fds, flags, mem = _row_targets(np, p, sidx, midx, moff, length)
            stats: dict[str, Any] = {}
            groups = _groups(np, p, midx, every)
            for g, (ops, dev, sel, gmems) in enumerate(groups):
                eng = _engine(hub, ops, dev)
                if not write:
                    _register_host(eng, gmems)
                if sel is None:             # one engine takes every row: no copies
                    sub, out = rows, (res if every else np.zeros(rows.size, np.int64))
                    g_fd, g_mem, g_fl, g_off, g_len = fds, mem, flags, off, length
                else:
                    sub = rows[sel]
                    out = np.zeros(sub.size, np.int64)
                    g_fd, g_mem, g_fl = fds[sel], mem[sel], flags[sel]
                    g_off, g_len = off[sel], length[sel]
                # the last run lets the reservation go as it ends, unless an fsync of this
                # batch's files must come first
                rc, st = eng.run(
                    place, write, np.ascontiguousarray(g_fd),
                    np.ascontiguousarray(g_off).view(np.uint64),
                    np.ascontiguousarray(g_len).view(np.uint64),
                    np.ascontiguousarray(g_mem), np.ascontiguousarray(g_fl), out,
                    last=g == len(groups) - 1 and not (write and sync))
                failed += rc
                if out is not res:
                    res[sub] = out
                for key, v in st.items():
                    stats[key] = v if isinstance(v, (bool, str)) else stats.get(key, 0) + v
            fence.stats.update(stats)
            if write and sync:
                for f in p.files:
                    if f.fd >= 0:
                        os.fsync(f.fd)
        for nrows, futs in parts:
            for i, fut in zip(nrows, futs):
                exc = fut.exception()
                res[i] = -(getattr(exc, "errno", None) or errno.EIO) if exc else p.length[i]
        # (a scan of every result only when some entry failed: on a thread that just woke,
        # each numpy call costs tens of microseconds). An entry is done only when all of its
        # bytes moved: a short one is a failure too.
        bad = np.flatnonzero(res != p.length) if failed or parts else ()
        if len(bad):
            i = int(bad[0])
            more = f" (and {bad.size - 1} more entries)" if bad.size > 1 else ""
            f = p.files[int(p.sidx[i])]
            code = int(-res[i]) if res[i] < 0 else errno.EIO
            err = P2PHubOSError(code, f"entry {i}: {'write' if write else 'read'} "
                                f"{f.name or f.target}[{int(p.off[i])}:+{int(p.length[i])}]{more}")
    except BaseException as exc:  # noqa: BLE001 - delivered through the fence
        err = exc
    finally:
        # The engine thread moves on before the fences complete: a callback of this batch
        # may wait for a later one.
        place.release()
        dt = time.perf_counter() - t0
        fence.stats.update(seconds=dt, gbps=(fence.nbytes / dt / 1e9) if dt > 0 else 0.0,
                           entries=p.n, per_s=(p.n / dt) if dt > 0 else 0.0)
        try:
            _release(held, p)
        except BaseException as exc:  # noqa: BLE001
            err = err or exc
        fence.complete(err)
