"""FILE memory under NIXL's API: the storage plugins' names, their parameters, file
registrations (fd mode and path mode) and the transfers between registered DRAM / VRAM and
files, run as one ``hub.load_batch`` / ``hub.save_batch`` per transfer.

NIXL's layout: a FILE registration is ``(offset, length, fd, meta)``; a meta of the form
``"ro|rw[,direct|sync|noatime|create]:/path"`` (path mode) makes the backend open the file
itself (the third field is then any id unique among path-mode registrations) and close it
at deregistration. Transfer descriptors are ``(file_offset, length, fd or that id)``.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import logging
import threading
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import P2PHubError
from .errors import (
    nixlBackendError, nixlInvalidParamError, nixlNotFoundError,
)

logger = logging.getLogger(__name__)

NETWORK = ("P2PHUB", "UCX")               # names served by the KV agent (TCP / RDMA)
STORAGE = ("P2PHUB", "POSIX", "GDS", "GDS_MT")  # names served by the batch engine


@dataclass(frozen=True)
class Plugin:
    """What one plugin name offers: its memory types, its parameters and their defaults
    (NIXL's own for that plugin), and a line saying what serves it here."""
    mems: tuple[str, ...]
    params: dict[str, str]
    serves: str


_BOOL = ("true", "false", "1", "0", "yes", "no", "on", "off")

PLUGINS: dict[str, Plugin] = {
    "P2PHUB": Plugin(("DRAM", "VRAM", "FILE"), {"stall_timeout": "10.0"},
                     "the KV agent (TCP, or RDMA over the NICs it is told) for peers; "
                     "the batch engine (hub.load_batch / hub.save_batch) for FILE"),
    "UCX": Plugin(("DRAM", "VRAM"), {"num_workers": "1", "ucx_devices": "",
                                     "ucx_error_handling_mode": "peer"},
                  "the KV agent (TCP, or RDMA over the NICs it is told)"),
    "POSIX": Plugin(("DRAM", "FILE"), {"use_aio": "false", "use_uring": "false",
                                       "use_posix_aio": "false", "ios_pool_size": "65536",
                                       "kernel_queue_size": "256"},
                    "the batch engine (io_uring, staged through pinned slots)"),
    "GDS": Plugin(("DRAM", "VRAM", "FILE"), {"batch_pool_size": "16", "batch_limit": "128",
                                             "max_request_size": str(16 << 20)},
                  "the batch engine (io_uring; VRAM through pinned slots and batched "
                  "host-to-GPU copies, no cuFile / nvidia-fs needed)"),
    "GDS_MT": Plugin(("DRAM", "VRAM", "FILE"), {"thread_count": str(max(1, (os.cpu_count() or 2) // 2))},
                     "the batch engine (io_uring; VRAM through pinned slots and batched "
                     "host-to-GPU copies, no cuFile / nvidia-fs needed)"),
}
_INT_PARAMS = {"ios_pool_size", "kernel_queue_size", "batch_pool_size", "batch_limit",
               "max_request_size", "thread_count", "num_workers"}


def check_params(name: str, params: dict[str, Any]) -> dict[str, str]:
    """The plugin's parameters with `params` applied. A bad value is refused by name; an
    unknown name is logged and ignored, as NIXL's own plugins do (a stack passes one config
    to several backends), or refused with P2PHUB_NIXL_STRICT_PARAMS=1."""
    spec = PLUGINS[name]
    out = dict(spec.params)
    strict = os.environ.get("P2PHUB_NIXL_STRICT_PARAMS") == "1"
    for k, v in params.items():
        if k not in spec.params:
            what = (f"{name} takes no parameter {k!r} (its parameters: "
                    f"{', '.join(sorted(spec.params))})")
            if strict:
                raise nixlInvalidParamError(f"{what}; P2PHUB_NIXL_STRICT_PARAMS=1")
            logger.warning("%s: ignored", what)
            continue
        s = str(v).strip()
        if k in _INT_PARAMS:
            if not s.isdigit() or int(s) <= 0:
                raise nixlInvalidParamError(f"{name}: {k}={v!r} must be a positive integer")
        elif k.startswith("use_") and s.lower() not in _BOOL:
            raise nixlInvalidParamError(f"{name}: {k}={v!r} must be true or false")
        elif k == "stall_timeout":
            try:
                ok = float(s) > 0
            except ValueError:
                ok = False
            if not ok:
                raise nixlInvalidParamError(f"stall_timeout={v!r} must be a number of seconds > 0")
        elif k == "ucx_error_handling_mode" and s not in ("none", "peer"):
            raise nixlInvalidParamError(f"{name}: {k}={v!r}: want 'none' or 'peer'")
        out[k] = s
    return out


# ---------------------------------------------------------------------------- path mode
# The grammar, the open and the size check are the engine's (p2phub/staged_io/_sio_file.c),
# which the NIXL plugin compiles too: one definition for both routes.
_PATH_MAX = 4096


def _sio() -> Any:
    from ..staged_io import load
    return load()


def parse_path_meta(meta: bytes | str) -> Optional[tuple[str, int]]:
    """(path, open flags) of a path-mode meta ``"ro|rw[,direct|sync|noatime|create]:/path"``,
    or None where `meta` is not one (then the registration's third field is the caller's
    fd). A meta that starts like one (``ro:`` / ``rw,``...) but names an unknown flag or no
    path is refused."""
    raw = meta if isinstance(meta, bytes) else str(meta).encode()
    mod = _sio()
    ffi, lib = mod.ffi, mod.lib
    path, flags, err = ffi.new("char[]", _PATH_MAX), ffi.new("int *"), ffi.new("char[]", 256)
    rc = lib.sio_file_meta(raw, path, _PATH_MAX, flags, err, 256)
    if rc < 0:
        raise nixlInvalidParamError(ffi.string(err).decode(errors="replace"))
    if rc == 0:
        return None
    return os.fsdecode(ffi.string(path)), int(flags[0])


def open_path(path: str, flags: int) -> int:
    """Open a path-mode FILE registration's file: created 0600 (KV caches hold users'
    prompts), never through a symbolic link, and only a regular file or a block device."""
    mod = _sio()
    err = mod.ffi.new("char[]", 256)
    fd = mod.lib.sio_file_open(os.fsencode(path), flags, err, 256)
    if fd < 0:
        raise nixlBackendError("FILE registration: " +
                               mod.ffi.string(err).decode(errors="replace"))
    return int(fd)


# How long a FILE deregistration waits for the transfers still using the file.
DEREGISTER_WAIT_S = 60.0


# ---------------------------------------------------------------------------- registrations
@dataclass(eq=False)
class FileReg:
    """One FILE registration row and the open file it moves through: its own descriptor
    (path mode: the file it opened; fd mode: a duplicate of the caller's fd, made at
    registration), so a transfer reaches this file whatever becomes of the caller's fd
    number. `busy`: transfers posted on it and not yet complete (under Storage's lock)."""
    dev: int                     # the descriptor's third field: the fd, or a path-mode id
    fd: int
    offset: int
    length: int
    meta: bytes
    path: str = ""               # path mode: the file the backend opened
    busy: int = 0
    released: bool = False

    @property
    def owned(self) -> bool:
        """Path mode: the backend opened the file itself."""
        return bool(self.path)


@dataclass
class Span:
    """Registered DRAM or VRAM ranges that follow one another (a pool registered page by
    page is one span), and its one registration with the storage engine's hub, made when a
    FILE transfer first touches it."""
    addr: int
    length: int
    vram: bool
    device: int
    alloc: Optional[int] = None     # VRAM: the allocation's base (ranges merge only within one)
    hubreg: Any = None


@dataclass
class FileXfer:
    """A FILE transfer's plan, as the batch engine's columns: per descriptor pair, the
    memory (index into `mems`) and offset in it, the file (index into `files`) and offset
    in it, and the length."""
    write: bool
    backend: str
    mems: list[Span]
    midx: Any
    moff: Any
    files: list[FileReg]
    fidx: Any
    foff: Any
    lens: Any
    fence: Any = None
    error: Optional[BaseException] = None


# One staged Hub per process for every agent's FILE transfers (its engine thread and pinned
# staging are the process's, however many agents a stack makes), closed with the last agent.
# Staged: the engine reads into pinned slots and copies into the caller's memory, which
# p2phub.ko need not pin (DRAM of any allocator, VRAM of any installed backend).
_shared_lock = threading.Lock()
_shared: dict[int, list[Any]] = {}     # pid -> [hub, users]


def _shared_hub_acquire() -> Any:
    with _shared_lock:
        got = _shared.get(os.getpid())
        if got is None or got[0].closed:
            from ..hub import Hub
            got = _shared[os.getpid()] = [Hub(mode="staged"), 0]
        got[1] += 1
        return got[0]


def _shared_hub_release(hub: Any) -> None:
    with _shared_lock:
        got = _shared.get(os.getpid())
        if got is None or got[0] is not hub:
            return
        got[1] -= 1
        if got[1] > 0:
            return
        del _shared[os.getpid()]
    hub.close()


def _allocation(addr: int, length: int) -> Optional[int]:
    """The base of the GPU allocation that holds VRAM [addr, addr + length), from the
    installed backend that claims it; None where none can say (the range is checked again,
    with its reason, when a FILE transfer first registers it)."""
    from ..backend import find_backend
    be = find_backend((addr, length))
    if be is None:
        return None
    try:
        rng = be.resolve((addr, length), export_dmabuf=False)
    except Exception:  # noqa: BLE001 - no runtime, not GPU memory: the registration says why
        return None
    try:
        return int(rng.alloc_base)
    finally:
        rng.close()


class Storage:
    """The FILE side of one agent: its FILE registrations, the DRAM / VRAM ranges FILE
    transfers touch, and a staged-mode Hub whose batch engine carries the transfers."""

    def __init__(self) -> None:
        self.files: list[FileReg] = []
        # (addr, len) -> (vram, device, allocation base of VRAM or None)
        self.mems: dict[tuple[int, int], tuple[bool, int, Optional[int]]] = {}
        self.spans: list[Span] = []
        self.generation = 0      # bumped when the spans change (prepared columns are redone)
        self._hub: Any = None
        self._lock = threading.Lock()        # the hub's creation
        self._reg_lock = threading.Lock()    # the spans' hub registrations (transfers on threads)
        # the FILE registrations' busy counts and releases: a deregistration waits here for
        # the transfers still using its file before it closes the descriptor
        self._files_cv = threading.Condition()

    # -- the engine
    @property
    def hub(self) -> Any:
        with self._lock:
            if self._hub is None:
                self._hub = _shared_hub_acquire()
            return self._hub

    def close(self) -> None:
        files, self.files = self.files, []
        self._release_files(files)
        for sp in self.spans:
            if sp.hubreg is not None:
                sp.hubreg.close(force=True)
        self.spans, self.mems = [], {}
        if self._hub is not None:
            _shared_hub_release(self._hub)
            self._hub = None

    # -- memory
    def add_mems(self, ranges: list[tuple[int, int]], vram: bool, device: int) -> None:
        """Add DRAM / VRAM ranges (one respan for all of them: a pool registered page by
        page costs one merge, not one per page)."""
        new = False
        for addr, length in ranges:
            if (addr, length) not in self.mems:
                self.mems[(addr, length)] = (vram, device,
                                             _allocation(addr, length) if vram else None)
                new = True
        if new:
            self._respan()

    def drop_mems(self, ranges: list[tuple[int, int]]) -> None:
        gone = False
        for addr, length in ranges:
            gone = self.mems.pop((addr, length), None) is not None or gone
        if gone:
            self._respan()

    def _respan(self) -> None:
        """Merge the registered ranges into spans; a span that stays as it was keeps its
        hub registration, the others' are closed (refused while a transfer uses one)."""
        merged: list[Span] = []
        for (a, n), (vram, dev, alloc) in sorted(self.mems.items()):
            last = merged[-1] if merged else None
            # Ranges that follow one another merge within one allocation: two cudaMalloc
            # buffers may sit back to back, and no registration spans both.
            if last is not None and last.addr + last.length == a and \
                    (last.vram, last.device, last.alloc) == (vram, dev, alloc):
                last.length += n
            elif last is not None and a < last.addr + last.length:
                last.length = max(last.length, a + n - last.addr)   # overlapping registrations
            else:
                merged.append(Span(a, n, vram, dev, alloc))
        old = {(sp.addr, sp.length, sp.vram, sp.device): sp for sp in self.spans}
        keep = []
        for sp in merged:
            prev = old.pop((sp.addr, sp.length, sp.vram, sp.device), None)
            keep.append(prev if prev is not None else sp)
        for sp in old.values():
            if sp.hubreg is not None:
                try:
                    sp.hubreg.close()
                except P2PHubError as exc:
                    raise nixlBackendError(f"{sp.addr:#x}+{sp.length}: a FILE transfer still "
                                           f"uses it ({exc})") from None
        self.spans = keep
        self.generation += 1

    def _hubreg(self, sp: Span) -> Any:
        with self._reg_lock:
            return self._hubreg_locked(sp)

    def _hubreg_locked(self, sp: Span) -> Any:
        if sp.hubreg is None:
            obj: Any = (sp.addr, sp.length) if sp.vram else \
                (ctypes.c_char * sp.length).from_address(sp.addr)
            try:
                sp.hubreg = self.hub.register(obj)
            except P2PHubError as exc:
                raise nixlBackendError(f"{'VRAM' if sp.vram else 'DRAM'} {sp.addr:#x}+{sp.length}: "
                                       f"the storage engine cannot reach it: {exc}") from None
        return sp.hubreg

    # -- files
    def register(self, rows: list[tuple[int, int, int, bytes]]) -> None:
        """Register FILE rows (all or none)."""
        added: list[FileReg] = []
        try:
            for off, n, dev, meta in rows:
                added.append(self._one(off, n, dev, meta, added))
        except BaseException:
            for f in added:
                os.close(f.fd)
            raise
        with self._files_cv:
            self.files.extend(added)

    def _one(self, off: int, n: int, dev: int, meta: bytes, pending: list[FileReg]) -> FileReg:
        spec = parse_path_meta(meta)
        if spec is None:
            if not isinstance(dev, int) or not 0 <= dev < 1 << 31:
                raise nixlBackendError(f"FILE registration: {dev!r} is not a file descriptor")
            try:
                # the registration's own reference to the file: the caller may close (and
                # reuse) its fd number while a transfer is in flight
                fd = fcntl.fcntl(dev, fcntl.F_DUPFD_CLOEXEC, 0)
            except OSError:
                raise nixlBackendError(f"FILE registration: fd {dev} is not an open file "
                                       "descriptor (or give a path: \"rw:/path\")") from None
            return FileReg(dev, fd, off, n, meta)
        path, flags = spec
        if any(f.owned and f.dev == dev for f in self.files + pending):
            raise nixlBackendError(f"FILE registration of {path!r}: id {dev} is already a "
                                   "path-mode registration (each file needs its own id)")
        return FileReg(dev, open_path(path, flags), off, n, meta, path)

    def deregister(self, rows: list[tuple[int, int, int, bytes]],
                   timeout: float = DEREGISTER_WAIT_S) -> None:
        """Deregister FILE rows (all or none). A transfer still using one of their files is
        waited for (up to `timeout` seconds, then nixlBackendError and nothing changes); the
        file is closed only once none does."""
        with self._files_cv:
            gone: list[FileReg] = []
            for off, n, dev, meta in rows:
                f = next((f for f in self.files if f not in gone and (f.dev, f.offset, f.length,
                                                                      f.meta) == (dev, off, n, meta)),
                         None)
                if f is None:
                    raise nixlNotFoundError(f"deregister_memory: FILE {off}+{n} of {dev} is not "
                                            "registered")
                gone.append(f)
            if not self._files_cv.wait_for(lambda: not any(f.busy for f in gone), timeout):
                busy = next(f for f in gone if f.busy)
                raise nixlBackendError(
                    f"deregister_memory: FILE {busy.path or busy.dev}: {busy.busy} transfer(s) "
                    f"still use it after {timeout:g} s (wait for them, then deregister)")
            drop = set(map(id, gone))
            self.files = [f for f in self.files if id(f) not in drop]
        self._release_files(gone)

    def _release_files(self, files: list[FileReg]) -> None:
        with self._files_cv:
            for f in files:
                f.released = True
                self._close_if_idle(f)      # else its last transfer closes it

    @staticmethod
    def _close_if_idle(f: FileReg) -> None:
        """Close a released registration's file once no transfer uses it (under _files_cv)."""
        if f.released and not f.busy and f.fd >= 0:
            os.close(f.fd)
            f.fd = -1

    def _hold_files(self, files: list[FileReg]) -> None:
        with self._files_cv:
            for f in files:
                if f.released:
                    raise nixlNotFoundError(f"FILE {f.path or f.dev}: its registration was "
                                            "released")
            for f in files:
                f.busy += 1

    def _unhold_files(self, files: list[FileReg]) -> None:
        with self._files_cv:
            for f in files:
                f.busy -= 1
                self._close_if_idle(f)
            self._files_cv.notify_all()

    def mem_cols(self, rows: list[tuple[int, int, int]], what: str) -> tuple[list[Span], Any, Any]:
        """The spans holding `rows` (addr, len, dev), and per row the index of its span and
        its offset in it."""
        import numpy as np
        a = np.fromiter((r[0] for r in rows), np.int64, len(rows))
        n = np.fromiter((r[1] for r in rows), np.int64, len(rows))
        starts = np.fromiter((sp.addr for sp in self.spans), np.int64, len(self.spans))
        ends = np.fromiter((sp.addr + sp.length for sp in self.spans), np.int64, len(self.spans))
        k = np.searchsorted(starts, a, side="right") - 1
        ok = (k >= 0) & (a + n <= ends[np.maximum(k, 0)]) if len(self.spans) else np.zeros(len(rows), bool)
        bad = np.flatnonzero(~ok)
        if bad.size:
            i = int(bad[0])
            raise nixlNotFoundError(f"{what}: descriptor {i} ({int(a[i]):#x}+{int(n[i])}) is not "
                                    "inside registered memory")
        return list(self.spans), k, a - starts[k]

    def file_cols(self, rows: list[tuple[int, int, int]], what: str) -> tuple[list[FileReg], Any, Any]:
        """The FILE registrations holding `rows` (file offset, len, fd or id), and per row
        the index of its registration and its file offset."""
        import numpy as np
        by_dev: dict[int, list[FileReg]] = {}
        for f in self.files:
            by_dev.setdefault(f.dev, []).append(f)
        files: list[FileReg] = []
        seen: dict[int, int] = {}
        idx = np.empty(len(rows), np.int64)
        off = np.empty(len(rows), np.int64)
        for i, (o, n, dev) in enumerate(rows):
            f = next((f for f in by_dev.get(dev, ()) if f.offset <= o and o + n <= f.offset + f.length),
                     None)
            if f is None:
                raise nixlNotFoundError(f"{what}: FILE descriptor {i} ({o}+{n} of {dev}) is not "
                                        "inside a FILE registration")
            k = seen.get(id(f))
            if k is None:
                k = seen[id(f)] = len(files)
                files.append(f)
            idx[i], off[i] = k, o
        return files, idx, off

    @staticmethod
    def query(metas: list[bytes]) -> list[Optional[dict[str, str]]]:
        """Per FILE descriptor: None where its meta names no file, else its size, mode and
        mtime (as NIXL's file plugins answer: the meta is the file's name)."""
        out: list[Optional[dict[str, str]]] = []
        for meta in metas:
            path = meta.decode(errors="replace") if isinstance(meta, bytes) else str(meta)
            try:
                st = os.stat(path) if path else None
            except OSError:
                st = None
            out.append(None if st is None else {"size": str(st.st_size), "mode": str(st.st_mode),
                                                "mtime": str(int(st.st_mtime))})
        return out

    # -- transfers
    def post(self, x: FileXfer) -> Any:
        """Submit the transfer as one batch; returns its fence. A batch the engine refuses
        (a range past the end of a file, a write not aligned for O_DIRECT, a file open the
        wrong way) raises, with nothing moved."""
        files = x.files
        self._hold_files(files)     # each file stays open (and registered) until it is done
        try:
            regs = [self._hubreg(m) for m in x.mems]
            kw = dict(storage=[f.fd for f in files], storage_index=x.fidx, offsets=x.foff,
                      lengths=x.lens, memory=regs, memory_index=x.midx, mem_offsets=x.moff)
            fence = self.hub.save_batch(sync=False, **kw) if x.write else self.hub.load_batch(**kw)
        except BaseException:
            self._unhold_files(files)
            raise
        fence.add_done_callback(lambda _f: self._unhold_files(files))
        return fence
