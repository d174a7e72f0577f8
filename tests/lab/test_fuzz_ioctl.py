"""Stateful fuzzing of p2phub.ko's ioctls and mmaps (hypothesis RuleBasedStateMachine).

Sequences of every ioctl of kmod/uapi/p2phub.h (as mirrored in p2phub/uapi.py)
over several /dev/p2phub files and a controller fd: valid
calls on live objects, and the same calls with a short argsz, unknown flags,
nonzero reserved or out fields, huge and overflowing offsets and lengths,
unknown and foreign handles, closed fds and fds of the wrong type, plus bad
user pointers. Registrations come from udmabuf and vgem buffers and from
p2phub's own exports (re-imported); exports are mmapped and touched (in a
child process), registrations are unregistered while exported or mmapped, and
a few threads race UNREGISTER against DMA_PAGES and EXPORT on one handle.

What is asserted: every failure is an errno the header documents for that
call (ENOTTY for an ioctl a kernel does not implement yet), calls on live
objects that must work do, and when everything is closed p2phub.ko's leak
counters are back to zero. The kernel log is checked by the lab (this test's
share by tests/lab/conftest.py, the whole run by tools/lab): on the debug lab
kernel that is where KASAN, lockdep and DMA-API reports show up.

Most calls come in bursts: one rule issues P2PHUB_FUZZ_BURST (default 2000)
calls in a tight loop, each a valid argument of the current state (live
handles, the controller fd) with random bytes written over a random part of
it, or wholly random bytes, on a page of zeros (so any argsz up to a page
reads defined memory). Their errnos are checked like the others' (collected,
asserted after the budget so a finding does not cut the count short).

Budget: P2PHUB_FUZZ_SECONDS (default 90) of wall time, P2PHUB_FUZZ_EXAMPLES
(default 200) sequences at most. Figures (calls, burst calls, calls per
second, distinct ioctl/argument shapes, errnos, threads, duration) go to
build/fuzz/ioctl.json.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import json
import mmap
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant, precondition,
                                 rule, run_state_machine_as_test)

from p2phub import uapi
from p2phub.hostmem import Udmabuf, VgemBuffer
from p2phub.nvme import bind as nvbind

import regutil as ru

pytestmark = pytest.mark.fuzz

TOP = Path(__file__).resolve().parents[2]
OUT = TOP / "build" / "fuzz" / "ioctl.json"
BUDGET_S = float(os.environ.get("P2PHUB_FUZZ_SECONDS", "90"))
MAX_EXAMPLES = int(os.environ.get("P2PHUB_FUZZ_EXAMPLES", "200"))
ROUND_EXAMPLES = 20
BURST = int(os.environ.get("P2PHUB_FUZZ_BURST", "2000"))
KiB = 1 << 10
U64 = (1 << 64) - 1


def _io(nr: int) -> int:
    return (uapi.IOCTL_TYPE << 8) | nr


# name -> (request, struct, errnos the header documents besides success, fd kind)
IOCTLS: dict[str, tuple[int, type, set[int], str]] = {
    "GET_INFO": (uapi.GET_INFO, uapi.Info, {errno.EFAULT, errno.EINVAL}, "hub"),
    "REGISTER": (uapi.REGISTER, uapi.Register,
                 {errno.EINVAL, errno.EBADF, errno.EOVERFLOW, errno.ERANGE, errno.ENOSPC, errno.EOPNOTSUPP,
                  errno.ENXIO, errno.ENODEV, errno.ENOMEM, errno.EFAULT}, "hub"),
    "UNREGISTER": (uapi.UNREGISTER, uapi.Unregister, {errno.ENOENT, errno.EBUSY, errno.EINVAL, errno.EFAULT},
                   "hub"),
    "REG_INFO": (uapi.REG_INFO, uapi.RegInfo, {errno.ENOENT, errno.EINVAL, errno.EFAULT}, "hub"),
    "DMA_PAGES": (uapi.DMA_PAGES, uapi.DmaPages,
                  {errno.ENOENT, errno.ENODEV, errno.EINVAL, errno.E2BIG, errno.ERANGE, errno.ESTALE,
                   errno.ENOMEM, errno.EFAULT}, "hub"),
    "EXPORT": (uapi.EXPORT, uapi.Export,
               {errno.ENOENT, errno.ESTALE, errno.EINVAL, errno.ENOMEM, errno.EMFILE, errno.EFAULT}, "hub"),
    "NVME_OPEN": (uapi.NVME_OPEN, uapi.NvmeOpen,
                  {errno.ENODEV, errno.ENXIO, errno.EBUSY, errno.EPERM, errno.EXDEV, errno.EINVAL,
                   errno.ENOMEM, errno.EFAULT}, "hub"),
    "NVME_DMA_ALLOC": (uapi.NVME_DMA_ALLOC, uapi.NvmeDmaAlloc,
                       {errno.EINVAL, errno.ENOSPC, errno.ENOMEM, errno.EFAULT}, "ctrl"),
    "NVME_DMA_FREE": (uapi.NVME_DMA_FREE, uapi.NvmeDmaFree,
                      {errno.ENOENT, errno.EBUSY, errno.EINVAL, errno.EFAULT}, "ctrl"),
    "NVME_IRQ_SET": (uapi.NVME_IRQ_SET, uapi.NvmeIrqSet,
                     {errno.EINVAL, errno.EBADF, errno.EFAULT, errno.ENOMEM, errno.EBUSY, errno.ENOSPC},
                     "ctrl"),
    "NVME_MAP_REG": (uapi.NVME_MAP_REG, uapi.NvmeMapReg,
                     {errno.ENOENT, errno.ESTALE, errno.ENOSPC, errno.ERANGE, errno.E2BIG, errno.EIO,
                      errno.EINVAL, errno.EFAULT, errno.ENOTTY}, "ctrl"),
    "NVME_UNMAP_REG": (uapi.NVME_UNMAP_REG, uapi.NvmeUnmapReg,
                       {errno.ENOENT, errno.EINVAL, errno.EFAULT, errno.ENOTTY}, "ctrl"),
    "NVME_RESUME": (uapi.NVME_RESUME, uapi.NvmeResume,
                    {errno.EBUSY, errno.ENODEV, errno.EINVAL, errno.EFAULT, errno.ENOTTY}, "ctrl"),
    "NVME_REQ_SET": (uapi.NVME_REQ_SET, uapi.NvmeReqSet,
                     {errno.EBADF, errno.EINVAL, errno.EFAULT, errno.ENOTTY}, "ctrl"),
}
# An ioctl issued on the wrong kind of fd, or a number nobody defined.
WRONG_FD = {errno.ENOTTY, errno.EINVAL}
# Host memory the kernel offers: udmabuf exists on the 6.12 lab kernel, not on 6.1.
HOST_KINDS = ["udmabuf", "vgem"] if os.path.exists("/dev/udmabuf") else ["vgem"]

# Extra errnos an exporter (udmabuf, vgem, p2phub's own export) may return from attach/map.
EXPORTER = {errno.ENOMEM, errno.EINVAL, errno.EBUSY, errno.ENODEV, errno.EOPNOTSUPP, errno.EPERM}
# Fields a malformed call may set nonzero: they must be rejected with EINVAL.
# Fields the kernel checks as zero on the way in (the UAPI's rule): reserved ones, and every output
# (out_*, and GET_INFO's fields after flags).
CHECKED_FIELDS = ("reserved", "__reserved", "__reserved0", "__reserved1")
INFO_OUTPUTS = ("abi_version", "max_regs_per_file", "caps")
MODES = ("valid", "short_argsz", "zero_argsz", "long_argsz", "unknown_flags", "reserved", "bad_pointer",
         "null_pointer")


# --------------------------------------------------------------------------- figures

class Figures:
    def __init__(self) -> None:
        self.created = time.monotonic()
        self.t0: float | None = None  # the budget starts with the first rule, not with hypothesis' setup
        self.calls: collections.Counter[str] = collections.Counter()
        self.shapes: set[tuple] = set()
        self.errnos: collections.Counter[str] = collections.Counter()
        self.threads = 0
        self.max_threads = 0
        self.examples = 0
        self.rounds = 0
        self.mmaps = 0
        self.touches: collections.Counter[str] = collections.Counter()
        self.findings: list[str] = []
        self.burst_calls = 0
        self.bursts = 0
        self.odd: list[str] = []          # burst calls that ended in an undocumented errno
        self.lock = threading.RLock()
        self.last = ""
        self.dumped = 0.0

    def record(self, name: str, mode: str, shape: tuple, err: int) -> None:
        with self.lock:
            self.calls[name] += 1
            self.shapes.add((name, mode, *shape, err))
            self.errnos[f"{name}:{errno.errorcode.get(err, 'OK') if err else 'OK'}"] += 1
            self.last = f"{name} {mode} {shape} -> {errno.errorcode.get(err, 'OK') if err else 'OK'}"
            now = time.monotonic()
            if now - self.dumped > 5:
                # Progress on disk: if the kernel hangs or dies, the file says how far it got.
                self.dumped = now
                self.dump()

    def over(self) -> bool:
        if self.t0 is None:
            self.t0 = time.monotonic()
        return time.monotonic() - self.t0 > BUDGET_S

    def dump(self) -> dict:
        calls = sum(self.calls.values())
        duration = time.monotonic() - (self.t0 or self.created)
        d = {
            "schema": "p2phub.fuzz.ioctl/2",
            "kernel": os.uname().release,
            "budget_s": BUDGET_S,
            "duration_s": round(time.monotonic() - (self.t0 or self.created), 1),
            "setup_s": round((self.t0 or time.monotonic()) - self.created, 1),
            "examples": self.examples,
            "rounds": self.rounds,
            "calls": calls,
            "calls_per_s": round(calls / duration, 1) if duration > 0 else 0,
            "burst_size": BURST,
            "bursts": self.bursts,
            "burst_calls": self.burst_calls,
            "burst_undocumented": self.odd[:50],
            "calls_per_ioctl": dict(sorted(self.calls.items())),
            "distinct_shapes": len(self.shapes),
            "ioctls_covered": sorted(self.calls),
            "outcomes": dict(sorted(self.errnos.items())),
            "threads_started": self.threads,
            "max_concurrent_threads": self.max_threads,
            "export_mmaps": self.mmaps,
            "export_touches": dict(self.touches),
            "findings": self.findings,
            "last_call": self.last,
        }
        OUT.parent.mkdir(parents=True, exist_ok=True)
        OUT.write_text(json.dumps(d, indent=2) + "\n")
        return d


FIG: Figures | None = None


def _ioctl(fd: int, name: str, arg, mode: str = "valid", shape: tuple = ()) -> tuple[int, int]:
    """Issue one ioctl; (return value, errno) with errno 0 on success. Records the call."""
    req = IOCTLS[name][0]
    try:
        rv = fcntl.ioctl(fd, req, arg, True) if not isinstance(arg, int) else fcntl.ioctl(fd, req, arg)
        err = 0
    except OSError as exc:
        rv, err = -1, exc.errno or errno.EIO
    assert FIG is not None
    FIG.record(name, mode, shape, err)
    return rv, err


def _fill(cls: type, mode: str, fields: dict[str, int]) -> tuple[object, int | None]:
    """The argument for `mode`: a struct (with argsz set per mode), or an int pointer."""
    if mode == "bad_pointer":
        return 8, errno.EFAULT  # an unmapped user address
    if mode == "null_pointer":
        return 0, errno.EFAULT
    s = cls()
    for k, v in fields.items():
        if k == "reserved":
            for i, x in enumerate(v):
                s.reserved[i] = x
        else:
            setattr(s, k, v)
    s.argsz = ctypes.sizeof(cls)
    want = None
    if mode == "short_argsz":
        s.argsz = ctypes.sizeof(cls) - 8
        want = errno.EINVAL
    elif mode == "zero_argsz":
        s.argsz = 0
        want = errno.EINVAL
    elif mode == "long_argsz":
        s.argsz = ctypes.sizeof(cls) + 8  # newer user space: tolerated or EINVAL/E2BIG, never a crash
    elif mode == "unknown_flags":
        s.flags |= 1 << 30
        want = errno.EINVAL
    elif mode == "reserved":
        names = [f[0] for f in cls._fields_
                 if f[0] in CHECKED_FIELDS or f[0].startswith("out_")
                 or (cls is uapi.Info and f[0] in INFO_OUTPUTS)]
        n = names[(s.argsz + len(fields)) % len(names)]
        if n == "reserved":
            s.reserved[len(s.reserved) - 1] = 1
        else:
            setattr(s, n, 1)
        want = errno.EINVAL
    if mode == "long_argsz":
        # The kernel may read argsz bytes: give it room, zeroed.
        buf = ctypes.create_string_buffer(bytes(s) + bytes(8))
        return buf, None
    return s, want


# --------------------------------------------------------------------------- state machine

class Source:
    """Memory a registration can be made of."""

    def __init__(self, kind: str, fd: int, size: int, owner=None) -> None:
        self.kind, self.fd, self.size, self.owner = kind, fd, size, owner


class HubFd:
    """An open /dev/p2phub file. Closing it puts /dev/null on its number (dup2), so a later
    open can never reuse the number and turn a stale reference into some other file."""

    def __init__(self, fd: int) -> None:
        self.fd, self.closed = fd, False


class Reg:
    def __init__(self, hub: HubFd, handle: int, size: int) -> None:
        self.hub, self.handle, self.size = hub, handle, size
        self.gone = False


class Machine(RuleBasedStateMachine):
    lab: dict[str, str] = {}
    target = ""
    ctrl_ok = True

    hubs = Bundle("hubs")
    sources = Bundle("sources")
    regs = Bundle("regs")
    exports = Bundle("exports")

    def __init__(self) -> None:
        super().__init__()
        assert FIG is not None
        FIG.examples += 1
        self.fds: list[int] = []          # every fd we own, closed at teardown
        self.owned: list[object] = []     # Udmabuf/VgemBuffer objects
        self.maps: list[mmap.mmap] = []
        self.ctrl = -1
        self.dma_ids: list[int] = []
        # A number no open() here will reuse (the lowest free number is always taken first).
        self.closed_fd = 987
        try:
            os.fstat(self.closed_fd)
            raise AssertionError("fd 987 is open: the fuzzer needs it closed")
        except OSError:
            pass
        self.null = self._own(os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC))
        self.efd = self._own(os.eventfd(0, os.EFD_CLOEXEC))
        self.addrs = (ctypes.c_uint64 * 64)()

    # ------------------------------------------------------------ helpers
    def _own(self, fd: int) -> int:
        self.fds.append(fd)
        return fd

    def _bdf(self, which: str) -> tuple[int, int, int]:
        if which == "none":
            return 0, 0xFE, 0xFF
        bdf = self.lab["nvme_target"] if which == "target" else self.lab["gpu"]
        return nvbind.split_bdf(bdf)

    def _check(self, name: str, err: int, want: int | None, extra: set[int] = frozenset(),
               hub: HubFd | None = None) -> None:
        allowed = IOCTLS[name][2] | extra
        if hub is not None and hub.closed:
            # /dev/null sits where the file was (or, for a bad pointer, the same).
            assert err in WRONG_FD | {errno.EFAULT}, f"{name} on a closed hub: {errno.errorcode.get(err, err)}"
            return
        if want is not None:
            assert err == want, f"{name}: {errno.errorcode.get(err, err)} where {errno.errorcode[want]} was due"
        else:
            assert err == 0 or err in allowed, f"{name}: undocumented {errno.errorcode.get(err, err)}"

    def _fd_for(self, kind: str, hub: int) -> int:
        return {"hub": hub, "closed": self.closed_fd, "devnull": self.null, "ctrl": self.ctrl,
                "eventfd": self.efd}[kind]

    # ------------------------------------------------------------ objects
    @rule(target=hubs)
    def open_hub(self) -> HubFd:
        return HubFd(self._own(os.open(uapi.DEVICE_PATH, os.O_RDWR | os.O_CLOEXEC)))

    @rule(target=sources, kind=st.sampled_from(HOST_KINDS), pages=st.sampled_from([1, 2, 16, 64]))
    def make_source(self, kind: str, pages: int) -> Source:
        size = pages * 4096
        buf = Udmabuf(size) if kind == "udmabuf" else VgemBuffer(size)
        self.owned.append(buf)
        return Source(kind, buf.fd, buf.size, buf)

    @rule(target=regs, hub=hubs, src=sources, dev=st.sampled_from(["", "target", "gpu", "none"]),
          offset=st.sampled_from([0, 4096, 512, 1 << 63, U64 - 4095]),
          length=st.sampled_from([0, 4096, 8192, 4097, 64 * KiB, 1 << 40, U64 - 4095]),
          mode=st.sampled_from(MODES))
    def register(self, hub: HubFd, src: Source, dev: str, offset: int, length: int, mode: str):
        flags = uapi.REGISTER_F_DMABUF | (uapi.REGISTER_F_DEVICE if dev else 0)
        dom, bus, devfn = self._bdf(dev or "none")
        fields = dict(flags=flags, fd=src.fd, offset=offset, length=length)
        if dev:
            fields.update(domain=dom, bus=bus, devfn=devfn)
        arg, want = _fill(uapi.Register, mode, fields)
        _, err = _ioctl(hub.fd, "REGISTER", arg, mode, (src.kind, dev, offset, length))
        valid = (mode in ("valid", "long_argsz") and offset % 4096 == 0 and length % 4096 == 0 and length
                 and offset + length <= src.size and not hub.closed)
        if want is None and mode == "valid" and valid and err not in (0, errno.ENOSPC, errno.ENOMEM):
            # A documented failure is still wrong when the call was good (an exporter may refuse a device).
            assert err in EXPORTER, f"REGISTER of a good window failed: {errno.errorcode.get(err, err)}"
        self._check("REGISTER", err, want, EXPORTER, hub)
        if err == 0 and isinstance(arg, uapi.Register):
            assert arg.out_handle != 0 and arg.out_provider == uapi.PROVIDER_DMABUF
            return Reg(hub, arg.out_handle, length)
        if err == 0:
            handle = ctypes.c_uint64.from_buffer_copy(bytes(arg)[uapi.Register.out_handle.offset:][:8]).value
            return Reg(hub, handle, length)
        return Reg(hub, 0x7777_0000 + length % 97, 0)  # a handle nobody made

    @rule(target=sources, exp=exports)
    def reimport_export(self, exp: Source) -> Source:
        return Source("export", exp.fd, exp.size)

    @rule(target=exports, reg=regs, mode=st.sampled_from(["valid", "valid", "unknown_flags", "reserved",
                                                            "short_argsz", "bad_pointer"]),
          cloexec=st.booleans())
    def export(self, reg: Reg, mode: str, cloexec: bool):
        arg, want = _fill(uapi.Export, mode, dict(handle=reg.handle,
                                                  flags=uapi.EXPORT_F_CLOEXEC if cloexec else 0))
        rv, err = _ioctl(reg.hub.fd, "EXPORT", arg, mode, (cloexec,))
        self._check("EXPORT", err, want, hub=reg.hub)
        if mode == "valid" and reg.size and not reg.gone and not reg.hub.closed:
            assert err in (0, errno.ESTALE, errno.EMFILE, errno.ENOMEM), \
                f"EXPORT of a live registration: {errno.errorcode.get(err, err)}"
        if err == 0:
            self._own(rv)
            return Source("export", rv, reg.size)
        return Source("export", self.closed_fd, 0)

    # ------------------------------------------------------------ calls on registrations
    @rule(reg=regs, on=st.sampled_from(["own", "other"]), other=hubs, mode=st.sampled_from(MODES))
    def reg_info(self, reg: Reg, on: str, other: HubFd, mode: str) -> None:
        hub = reg.hub if on == "own" else other
        arg, want = _fill(uapi.RegInfo, mode, dict(handle=reg.handle))
        _, err = _ioctl(hub.fd, "REG_INFO", arg, mode, (on,))
        if want is None and mode == "valid" and on == "own" and reg.size and not reg.gone and not hub.closed:
            assert err == 0, f"REG_INFO of a live registration: {errno.errorcode.get(err, err)}"
        if on == "other" and other is not reg.hub and mode == "valid" and not hub.closed:
            assert err == errno.ENOENT, "another file's handle must be unknown here"
        self._check("REG_INFO", err, want, hub=hub)

    @rule(reg=regs, dev=st.sampled_from(["target", "gpu", "none"]),
          first=st.sampled_from([0, 1, 15, 16, 1 << 40, U64]),
          count=st.sampled_from([0, 1, 16, 64, uapi.DMA_PAGES_MAX + 1, 0xFFFFFFFF]),
          page_size=st.sampled_from([0, 4096, 8192, 3000, 1 << 31, 1 << 21]),
          addrs=st.sampled_from(["buf", "null", "bad"]), mode=st.sampled_from(MODES))
    def dma_pages(self, reg: Reg, dev: str, first: int, count: int, page_size: int, addrs: str,
                  mode: str) -> None:
        dom, bus, devfn = self._bdf(dev)
        ptr = {"buf": ctypes.addressof(self.addrs), "null": 0, "bad": 8}[addrs]
        if addrs == "buf":
            count = min(count, 64) if count <= uapi.DMA_PAGES_MAX else count
        arg, want = _fill(uapi.DmaPages, mode, dict(handle=reg.handle, domain=dom, bus=bus, devfn=devfn,
                                                    first=first, count=count, page_size=page_size, addrs=ptr))
        _, err = _ioctl(reg.hub.fd, "DMA_PAGES", arg, mode, (dev, first, count, page_size, addrs))
        self._check("DMA_PAGES", err, want, EXPORTER, reg.hub)

    @rule(reg=consumes(regs), mode=st.sampled_from(["valid", "valid", "valid"] + list(MODES)))
    def unregister(self, reg: Reg, mode: str) -> None:
        arg, want = _fill(uapi.Unregister, mode, dict(handle=reg.handle))
        _, err = _ioctl(reg.hub.fd, "UNREGISTER", arg, mode, ())
        self._check("UNREGISTER", err, want, hub=reg.hub)
        if err == 0:
            reg.gone = True

    @rule(name=st.sampled_from(["GET_INFO", "REGISTER", "UNREGISTER", "REG_INFO", "DMA_PAGES", "EXPORT",
                                "NVME_OPEN"]),
          on=st.sampled_from(["closed", "devnull", "eventfd"]), hub=hubs)
    def wrong_fd(self, name: str, on: str, hub: HubFd) -> None:
        """A p2phub ioctl on an fd that is not /dev/p2phub."""
        cls = IOCTLS[name][1]
        arg, _ = _fill(cls, "valid", {})
        _, err = _ioctl(self._fd_for(on, hub.fd), name, arg, "wrong_fd", (on,))
        want = {errno.EBADF} if on == "closed" else WRONG_FD
        assert err in want, f"{name} on {on}: {errno.errorcode.get(err, err)}"

    @rule(hub=hubs, nr=st.sampled_from([6, 15, 24, 31, 0x3F, 0xFF]), mode=st.sampled_from(MODES))
    def unknown_ioctl(self, hub: HubFd, nr: int, mode: str) -> None:
        arg, _ = _fill(uapi.Info, mode, {})
        try:
            fcntl.ioctl(hub.fd, _io(uapi.IOCTL_BASE + nr), arg, True) if not isinstance(arg, int) else \
                fcntl.ioctl(hub.fd, _io(uapi.IOCTL_BASE + nr), arg)
            err = 0
        except OSError as exc:
            err = exc.errno or errno.EIO
        FIG.record("UNKNOWN", mode, (nr,), err)
        assert err == errno.ENOTTY, f"ioctl base+{nr}: {errno.errorcode.get(err, err)}"

    @rule(hub=hubs, mode=st.sampled_from(MODES))
    def get_info(self, hub: HubFd, mode: str) -> None:
        arg, want = _fill(uapi.Info, mode, {})
        _, err = _ioctl(hub.fd, "GET_INFO", arg, mode, ())
        self._check("GET_INFO", err, want, hub=hub)
        if err == 0 and isinstance(arg, uapi.Info):
            assert arg.abi_version == uapi.ABI_VERSION

    # ------------------------------------------------------------ mmap of exports
    @rule(exp=exports, pages=st.sampled_from([1, 2, 1 << 20]), offset=st.sampled_from([0, 4096, 1 << 40]),
          touch=st.booleans())
    def mmap_export(self, exp: Source, pages: int, offset: int, touch: bool) -> None:
        if exp.fd == self.closed_fd:
            return
        try:
            m = mmap.mmap(exp.fd, pages * 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                          offset=offset)
            err = 0
        except OSError as exc:
            m, err = None, exc.errno or errno.EIO
        FIG.record("MMAP_EXPORT", "valid", (pages, offset), err)
        assert err in (0, errno.EINVAL, errno.ENODEV, errno.ENXIO, errno.ESTALE, errno.EACCES, errno.EPERM,
                       errno.ENOMEM, errno.EOVERFLOW), f"mmap of an export: {errno.errorcode.get(err, err)}"
        if m is None:
            return
        FIG.mmaps += 1
        self.maps.append(m)
        if touch:
            # In a child: a mapping of revoked memory may SIGBUS, which must not end the test.
            pid = os.fork()
            if pid == 0:
                try:
                    m[0:1] = m[0:1]
                finally:
                    os._exit(0)
            _, status = os.waitpid(pid, 0)
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            FIG.touches["ok" if not sig else signal.Signals(sig).name] += 1
            assert sig in (0, signal.SIGBUS), f"touching an export mapping killed the reader with {sig}"

    # ------------------------------------------------------------ races
    @rule(hubf=hubs, src=sources, nthreads=st.integers(2, 4), dev=st.sampled_from(["target", "gpu"]))
    def race_unregister(self, hubf: HubFd, src: Source, nthreads: int, dev: str) -> None:
        """Threads loop DMA_PAGES/EXPORT/REG_INFO on one handle while another UNREGISTERs it."""
        if hubf.closed or not src.size:
            return
        hub = hubf.fd
        size = min(src.size, 16 * 4096)
        arg = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF, fd=src.fd, offset=0, length=size)
        _, err = _ioctl(hub, "REGISTER", arg, "race", (src.kind,))
        if err:
            self._check("REGISTER", err, None, EXPORTER)
            return
        handle = arg.out_handle
        dom, bus, devfn = self._bdf(dev)
        stop = threading.Event()
        errors: list[str] = []

        def hammer(i: int) -> None:
            buf = (ctypes.c_uint64 * 16)()
            while not stop.is_set():
                if i % 3 == 0:
                    a = uapi.DmaPages.new(handle=handle, domain=dom, bus=bus, devfn=devfn, count=16,
                                          addrs=ctypes.addressof(buf))
                    name = "DMA_PAGES"
                elif i % 3 == 1:
                    a = uapi.Export.new(handle=handle, flags=uapi.EXPORT_F_CLOEXEC)
                    name = "EXPORT"
                else:
                    a = uapi.RegInfo.new(handle=handle)
                    name = "REG_INFO"
                rv, e = _ioctl(hub, name, a, "race", ())
                if name == "EXPORT" and e == 0:
                    os.close(rv)
                if e and e not in IOCTLS[name][2] | EXPORTER:
                    errors.append(f"{name}: {errno.errorcode.get(e, e)}")
                if e == errno.ENOENT:
                    return  # the handle is gone: done

        threads = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(nthreads)]
        with FIG.lock:
            FIG.threads += nthreads + 1
            FIG.max_threads = max(FIG.max_threads, nthreads + 1)
        for t in threads:
            t.start()
        time.sleep(0.01)
        deadline = time.monotonic() + 5
        while True:
            _, e = _ioctl(hub, "UNREGISTER", uapi.Unregister.new(handle=handle), "race", ())
            if e != errno.EBUSY or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        stop.set()
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads), "an ioctl hung after UNREGISTER"
        assert e in (0, errno.EBUSY), f"UNREGISTER during the race: {errno.errorcode.get(e, e)}"
        assert not errors, errors
        if e == errno.EBUSY:
            _ioctl(hub, "UNREGISTER", uapi.Unregister.new(handle=handle), "race", ())

    # ------------------------------------------------------------ bursts
    @rule(hub=hubs, reg=regs, seed=st.integers(0, (1 << 32) - 1))
    def burst(self, hub: HubFd, reg: Reg, seed: int) -> None:
        """BURST cheap calls with no per-call bookkeeping beyond a counter: the argument of a
        valid call on the current objects with random bytes over part of it, or all random."""
        if hub.closed:
            return
        rng = random.Random(seed)
        dom, bus, devfn = self._bdf("target")
        addrs = ctypes.addressof(self.addrs)
        # (name, fd, valid fields) for every ioctl the current state can reach.
        calls = [("GET_INFO", hub.fd, {}),
                 ("REG_INFO", reg.hub.fd, dict(handle=reg.handle)),
                 ("UNREGISTER", hub.fd, dict(handle=0x7777_7777)),
                 ("DMA_PAGES", reg.hub.fd, dict(handle=reg.handle, domain=dom, bus=bus, devfn=devfn,
                                                count=16, addrs=addrs)),
                 ("EXPORT", reg.hub.fd, dict(handle=reg.handle, flags=uapi.EXPORT_F_CLOEXEC)),
                 ("REGISTER", hub.fd, dict(flags=uapi.REGISTER_F_DMABUF, fd=self.null, length=4096)),
                 ("NVME_OPEN", hub.fd, dict(domain=0, bus=0xFE, devfn=0xFF))]
        if self.ctrl >= 0:
            calls += [("NVME_DMA_ALLOC", self.ctrl, dict(size=1 << 40)),
                      ("NVME_DMA_FREE", self.ctrl, dict(id=0xFFFF_FFF0)),
                      ("NVME_IRQ_SET", self.ctrl, dict(vector=31, eventfd=self.efd)),
                      ("NVME_MAP_REG", self.ctrl, dict(handle=reg.handle, addrs=addrs, count=16)),
                      ("NVME_UNMAP_REG", self.ctrl, dict(handle=0x7777_7777)),
                      ("NVME_RESUME", self.ctrl, {}),
                      ("NVME_REQ_SET", self.ctrl, dict(eventfd=-1))]
        page = 4096
        prepared = []
        for name, fd, fields in calls:
            req, cls, allowed, _ = IOCTLS[name]
            s, _ = _fill(cls, "valid", fields)
            base = bytes(s)
            # A user pointer the kernel writes through stays ours (or unmapped): random bytes
            # there could aim the kernel's writes at this process's own heap.
            ptr = cls.addrs.offset if hasattr(cls, "addrs") else -1
            allowed = allowed | EXPORTER | {errno.E2BIG, errno.EFAULT}
            if fd == reg.hub.fd and reg.hub.closed:
                allowed = allowed | WRONG_FD  # /dev/null sits where that file was
            prepared.append((name, fd, req, base, ptr, allowed))
        buf, zero = bytearray(page), bytes(page)
        counts: collections.Counter[str] = collections.Counter()
        shapes = set()
        odd = []
        for _ in range(BURST):
            name, fd, req, base, ptr, allowed = prepared[rng.randrange(len(prepared))]
            buf[:] = zero
            how = rng.randrange(4)
            if how == 3:                      # every byte random (argsz too)
                n = len(base)
                buf[:n] = rng.randbytes(n)
            else:
                buf[:len(base)] = base
                n = rng.randrange(1, 9) if how < 2 else rng.randrange(1, len(base))
                at = rng.randrange(len(base) - min(n, len(base) - 1))
                buf[at:at + n] = rng.randbytes(n)
                if how == 0:                  # keep the header: reach the per-ioctl checks
                    buf[:len(base)] = base[:8] + bytes(buf[8:len(base)])
            if ptr >= 0:
                buf[ptr:ptr + 8] = base[ptr:ptr + 8] if rng.randrange(4) else (8).to_bytes(8, "little")
            try:
                rv = fcntl.ioctl(fd, req, buf, True)
                err = 0
            except OSError as exc:
                rv, err = -1, exc.errno or errno.EIO
            counts[name] += 1
            shapes.add((name, "burst", how, err))
            if err == 0 and rv > 0 and name in ("EXPORT", "NVME_OPEN"):
                os.close(rv)                  # a new fd: not ours to keep
            elif err and err not in allowed:
                odd.append(f"{name} {bytes(buf[:len(base)]).hex()} -> {errno.errorcode.get(err, err)}")
        with FIG.lock:
            FIG.calls.update(counts)
            FIG.shapes |= shapes
            FIG.burst_calls += BURST
            FIG.bursts += 1
            FIG.odd += odd
            FIG.last = f"burst of {BURST} (seed {seed})"

    # ------------------------------------------------------------ closing things
    @rule(hub=consumes(hubs))
    def close_hub(self, hub: HubFd) -> None:
        """Closing a file releases its registrations (dup2 of /dev/null over it closes it)."""
        if not hub.closed:
            os.dup2(self.null, hub.fd)
            hub.closed = True

    @rule(exp=consumes(exports))
    def close_export(self, exp: Source) -> None:
        if exp.fd in self.fds and exp.kind == "export" and exp.size:
            os.dup2(self.null, exp.fd)  # closed, and its number stays taken
            exp.size = 0

    # ------------------------------------------------------------ the controller fd
    @precondition(lambda self: self.ctrl < 0 and Machine.ctrl_ok)
    @rule(hub=hubs, dev=st.sampled_from(["target", "target", "gpu", "none"]), mode=st.sampled_from(MODES))
    def nvme_open(self, hub: HubFd, dev: str, mode: str) -> None:
        self._nvme_open(hub, dev, mode)

    # Most NVME_OPEN calls above are malformed or aimed elsewhere: this one owns the target,
    # so that the controller fd's ioctls and mmaps get their share of every run.
    @precondition(lambda self: self.ctrl < 0 and Machine.ctrl_ok)
    @rule(hub=hubs)
    def nvme_open_target(self, hub: HubFd) -> None:
        self._nvme_open(hub, "target", "valid")

    def _nvme_open(self, hub: HubFd, dev: str, mode: str) -> None:
        dom, bus, devfn = self._bdf(dev)
        arg, want = _fill(uapi.NvmeOpen, mode, dict(domain=dom, bus=bus, devfn=devfn))
        rv, err = _ioctl(hub.fd, "NVME_OPEN", arg, mode, (dev,))
        self._check("NVME_OPEN", err, want, hub=hub)
        if dev == "gpu" and mode == "valid" and not hub.closed:
            assert err in (errno.ENXIO, errno.ENODEV), "a device not bound to p2phub-nvme must be refused"
        if err == 0:
            self.ctrl = self._own(rv)
            self.dma_ids = []

    @precondition(lambda self: self.ctrl >= 0)
    @rule(size=st.sampled_from([4096, 8192, 4 << 20, 0, 4095, (4 << 20) + 4096, U64 - 4095, 1 << 40]),
          mode=st.sampled_from(MODES))
    def nvme_dma_alloc(self, size: int, mode: str) -> None:
        arg, want = _fill(uapi.NvmeDmaAlloc, mode, dict(size=size))
        _, err = _ioctl(self.ctrl, "NVME_DMA_ALLOC", arg, mode, (size,))
        if mode == "valid" and (size == 0 or size % 4096 or size > uapi.NVME_DMA_MAX_BUF):
            want = errno.EINVAL
        self._check("NVME_DMA_ALLOC", err, want)
        if err == 0 and isinstance(arg, uapi.NvmeDmaAlloc):
            self.dma_ids.append(arg.out_id)
            if size <= 8192:
                m = mmap.mmap(self.ctrl, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                              offset=arg.out_mmap_offset)
                m[0:8] = b"p2phubfz"
                m.close()

    @precondition(lambda self: self.ctrl >= 0)
    @rule(which=st.sampled_from(["own", "unknown"]), mode=st.sampled_from(MODES))
    def nvme_dma_free(self, which: str, mode: str) -> None:
        ident = self.dma_ids[-1] if which == "own" and self.dma_ids else 0xFFFF_FFF0
        arg, want = _fill(uapi.NvmeDmaFree, mode, dict(id=ident))
        _, err = _ioctl(self.ctrl, "NVME_DMA_FREE", arg, mode, (which,))
        self._check("NVME_DMA_FREE", err, want)
        if err == 0 and ident in self.dma_ids:
            self.dma_ids.remove(ident)

    @precondition(lambda self: self.ctrl >= 0)
    @rule(vector=st.sampled_from([0, 1, 31, 32, 0xFFFFFFFF]), fd=st.sampled_from(["eventfd", "devnull",
                                                                                "closed", "detach"]),
          mode=st.sampled_from(MODES))
    def nvme_irq_set(self, vector: int, fd: str, mode: str) -> None:
        efd = -1 if fd == "detach" else self._fd_for(fd, -1)
        arg, want = _fill(uapi.NvmeIrqSet, mode, dict(vector=vector, eventfd=efd))
        _, err = _ioctl(self.ctrl, "NVME_IRQ_SET", arg, mode, (vector, fd))
        self._check("NVME_IRQ_SET", err, want, {errno.ENXIO, errno.ENODEV})

    @precondition(lambda self: self.ctrl >= 0)
    @rule(reg=regs, on=st.sampled_from(["own", "other"]), first=st.sampled_from([0, 1, 1 << 40]),
          count=st.sampled_from([0, 16, uapi.DMA_PAGES_MAX + 1]), page_size=st.sampled_from([0, 4096, 3000]),
          mode=st.sampled_from(MODES), unmap=st.booleans())
    def nvme_map_reg(self, reg: Reg, on: str, first: int, count: int, page_size: int, mode: str,
                     unmap: bool) -> None:
        cls = IOCTLS["NVME_MAP_REG"][1]
        arg, want = _fill(cls, mode, dict(handle=reg.handle, addrs=ctypes.addressof(self.addrs), first=first,
                                          count=min(count, 64) if count <= 64 else count,
                                          page_size=page_size))
        _, err = _ioctl(self.ctrl, "NVME_MAP_REG", arg, mode, (on, first, count, page_size))
        if err == errno.ENOTTY:
            return  # this kernel does not have it yet
        self._check("NVME_MAP_REG", err, want)
        if unmap:
            ua, uwant = _fill(IOCTLS["NVME_UNMAP_REG"][1], "valid", dict(handle=reg.handle))
            _, uerr = _ioctl(self.ctrl, "NVME_UNMAP_REG", ua, "valid", (err == 0,))
            self._check("NVME_UNMAP_REG", uerr, None)
            if err == 0:
                assert uerr == 0, "UNMAP_REG of a held registration"

    @precondition(lambda self: self.ctrl >= 0)
    @rule(mode=st.sampled_from(MODES), req=st.sampled_from(["eventfd", "devnull", "closed", "detach"]))
    def nvme_resume_and_req(self, mode: str, req: str) -> None:
        arg, want = _fill(IOCTLS["NVME_RESUME"][1], mode, {})
        _, err = _ioctl(self.ctrl, "NVME_RESUME", arg, mode, ())
        if err != errno.ENOTTY:
            self._check("NVME_RESUME", err, want)
        efd = -1 if req == "detach" else self._fd_for(req, -1)
        arg, want = _fill(IOCTLS["NVME_REQ_SET"][1], mode, dict(eventfd=efd))
        _, err = _ioctl(self.ctrl, "NVME_REQ_SET", arg, mode, (req,))
        if err != errno.ENOTTY:
            self._check("NVME_REQ_SET", err, want)

    @precondition(lambda self: self.ctrl >= 0)
    @rule(offset=st.sampled_from([0, 4096, uapi.NVME_MMAP_STATUS, 1 << 32, 1 << 40]),
          pages=st.sampled_from([1, 2, 1 << 16]), write=st.booleans())
    def nvme_mmap(self, offset: int, pages: int, write: bool) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if write else 0)
        try:
            m = mmap.mmap(self.ctrl, pages * 4096, mmap.MAP_SHARED, prot, offset=offset)
            err = 0
        except OSError as exc:
            m, err = None, exc.errno or errno.EIO
        FIG.record("MMAP_CTRL", "valid", (offset, pages, write), err)
        assert err in (0, errno.EINVAL, errno.ENOENT, errno.ENXIO, errno.EPERM, errno.EACCES, errno.ENOMEM,
                       errno.ENODEV, errno.EOVERFLOW), f"mmap of a controller fd: {errno.errorcode.get(err, err)}"
        if m is not None:
            if offset == 0:
                _ = m[0:4]  # CAP, read only: never ring a doorbell
            m.close()

    @rule(hub=hubs, mode=st.sampled_from(["valid"]))
    def ctrl_ioctl_on_hub(self, hub: HubFd, mode: str) -> None:
        """Controller ioctls on a /dev/p2phub fd, and registration ioctls on a controller fd."""
        for name in ("NVME_DMA_ALLOC", "NVME_DMA_FREE", "NVME_IRQ_SET", "NVME_MAP_REG", "NVME_RESUME"):
            arg, _ = _fill(IOCTLS[name][1], mode, {})
            _, err = _ioctl(hub.fd, name, arg, "wrong_fd", ("hub",))
            assert err in WRONG_FD, f"{name} on /dev/p2phub: {errno.errorcode.get(err, err)}"
        if self.ctrl >= 0:
            for name in ("REGISTER", "EXPORT", "NVME_OPEN"):
                arg, _ = _fill(IOCTLS[name][1], mode, {})
                _, err = _ioctl(self.ctrl, name, arg, "wrong_fd", ("ctrl",))
                assert err in WRONG_FD, f"{name} on a controller fd: {errno.errorcode.get(err, err)}"

    @precondition(lambda self: self.ctrl >= 0)
    @rule()
    def nvme_close(self) -> None:
        self.fds.remove(self.ctrl)
        os.close(self.ctrl)
        self.ctrl = -1

    def teardown(self) -> None:
        for m in self.maps:
            m.close()
        for fd in reversed(self.fds):
            try:
                os.close(fd)
            except OSError:
                pass
        for b in self.owned:
            b.close()
        self.fds, self.maps, self.owned = [], [], []
        leaks = ru.wait_no_leaks(10)
        assert leaks == {k: 0 for k in ru.LEAK_COUNTERS}, f"leaked after closing everything: {leaks}"


@pytest.fixture(scope="module")
def bound_target(lab: dict[str, str]):
    bdf = lab["nvme_target"]
    before = nvbind.bind(bdf)
    try:
        yield bdf
    finally:
        if before != nvbind.DRIVER:
            nvbind.unbind(bdf, driver=before or "nvme")


def test_fuzz_ioctls(lab: dict[str, str], bound_target: str) -> None:
    global FIG
    FIG = Figures()
    Machine.lab = lab
    # Rounds of a few sequences each until the time budget or the example budget is spent (a
    # time-dependent precondition would make hypothesis' data generation flaky).
    cfg = settings(max_examples=ROUND_EXAMPLES, stateful_step_count=30, deadline=None, database=None,
                   phases=[Phase.generate], suppress_health_check=list(HealthCheck), print_blob=True)
    try:
        while not FIG.over() and FIG.examples < MAX_EXAMPLES:
            run_state_machine_as_test(Machine, settings=cfg)
            FIG.rounds += 1
    except BaseException as exc:
        FIG.findings.append(f"{type(exc).__name__}: {str(exc)[:500]}")
        raise
    finally:
        d = FIG.dump()
        print(json.dumps({k: d[k] for k in ("duration_s", "examples", "calls", "calls_per_s",
                                            "burst_calls", "distinct_shapes", "threads_started")}))
    assert d["calls"] > 0
    assert not FIG.odd, f"{len(FIG.odd)} burst calls ended in an undocumented errno: {FIG.odd[:10]}"
