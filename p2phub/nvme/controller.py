"""The NVMe controller, driven from user space through p2phub.ko.

    with p2phub.nvme.open("0000:00:05.0") as ctrl:
        ns = ctrl.namespace(1)
        ns.write(buf, lba=0, nbytes=1 << 20)
        futs = ns.submit([ReadOp(buf, lba=i * 8, nbytes=4096, offset=i * 4096) for i in range(32)])

`open()` binds the controller to p2phub-nvme if it is not already (refusing
one whose namespaces are in use), opens its controller fd, maps BAR0, resets
and enables it honouring CAP, identifies it and every active namespace, asks
for I/O queues and creates as many as it grants (up to what was asked).

Thread rules: each thread gets an I/O queue pair of its own (round robin when
there are more threads than queues; a shared queue pair is locked). Admin
commands serialise on the admin queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ctypes
import errno
import fcntl
import itertools
import mmap
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable

from .. import uapi
from ..device import Device
from ..errors import P2PHubError, P2PHubOSError, RevokedError, UsageError
from . import bind as _bind
from . import prp, spec
from .errors import ControllerResetError, NvmeError
from .queue import CommandFuture, QueuePair, reset_error, timeout_error

DEFAULT_IO_QUEUES = 4
DEFAULT_QUEUE_DEPTH = 256
ADMIN_DEPTH = 64
MAX_TRANSFER_CAP = 1 << 20  # when MDTS is 0 (no limit): what one command moves at most


class DmaBuffer:
    """DMA-coherent host memory made by p2phub.ko for this controller.

    Usable wherever a registration is: ``ns.read(buf, ...)``. ``view`` is a
    writable memoryview of it.
    """

    def __init__(self, ctrl: "Controller", size: int, name: str) -> None:
        arg = uapi.NvmeDmaAlloc.new(size=size)
        ctrl._hioctl(uapi.NVME_DMA_ALLOC, arg, f"P2PHUB_NVME_DMA_ALLOC({size}) for {name}")
        self.ctrl = ctrl
        self.id = arg.out_id
        self.size = size
        self.name = name
        self.dma_addr = arg.out_dma_addr
        self._map = mmap.mmap(ctrl._hfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE,
                              offset=arg.out_mmap_offset)
        ffi = ctrl.hot.ffi
        self._cbuf = ffi.from_buffer(self._map)
        self.cptr = ffi.cast("void *", self._cbuf)
        self.view = memoryview(self._map)
        self._pages: prp.PageList | None = None

    @property
    def nbytes(self) -> int:
        return self.size

    def page_list(self) -> prp.PageList:
        if self._pages is None:
            n = self.size // spec.PAGE
            addrs = self.ctrl.hot.ffi.new("uint64_t[]", [self.dma_addr + i * spec.PAGE for i in range(n)])
            self._pages = prp.PageList(addrs, n, self.size, check=self._check, owner=self,
                                       name=f"DMA buffer {self.name}")
        return self._pages

    def _check(self) -> None:
        if self._map is None or self.ctrl.closed:
            raise UsageError(f"DMA buffer {self.name} is closed")

    def close(self) -> None:
        """Unmap; the memory itself is freed when the controller closes."""
        if self._map is not None:
            self.view.release()
            del self._cbuf
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None

    @property
    def closed(self) -> bool:
        return self._map is None


@dataclass
class Op:
    """One request of a batch: ``kind`` is "read", "write", "flush" or "write_zeroes"."""

    kind: str
    buf: Any = None
    lba: int = 0
    nbytes: int = 0
    offset: int = 0
    nblocks: int = 0  # write_zeroes only


def ReadOp(buf: Any, lba: int, nbytes: int, offset: int = 0) -> Op:  # noqa: N802
    return Op("read", buf, lba, nbytes, offset)


def WriteOp(buf: Any, lba: int, nbytes: int, offset: int = 0) -> Op:  # noqa: N802
    return Op("write", buf, lba, nbytes, offset)


class Namespace:
    """One active namespace: block I/O between its LBAs and registered memory."""

    def __init__(self, ctrl: "Controller", ident: spec.IdentifyNamespace) -> None:
        self.ctrl = ctrl
        self.ident = ident
        self.nsid = ident.nsid
        self.lba_size = ident.lba_size
        self.blocks = ident.nsze

    def __repr__(self) -> str:
        return f"<Namespace {self.ctrl.bdf} nsid={self.nsid} {self.blocks}x{self.lba_size}B>"

    # ---------------------------------------------------------------- blocking
    def read(self, buf: Any, lba: int, nbytes: int, offset: int = 0, *, timeout: float | None = None) -> None:
        """Read nbytes from lba into buf[offset:offset+nbytes] (buf: registration or DmaBuffer)."""
        self.submit([Op("read", buf, lba, nbytes, offset)])[0].result(timeout)

    def write(self, buf: Any, lba: int, nbytes: int, offset: int = 0, *, timeout: float | None = None) -> None:
        """Write buf[offset:offset+nbytes] to lba."""
        self.submit([Op("write", buf, lba, nbytes, offset)])[0].result(timeout)

    def flush(self, *, timeout: float | None = None) -> None:
        self.submit([Op("flush")])[0].result(timeout)

    def write_zeroes(self, lba: int, nblocks: int, *, timeout: float | None = None) -> None:
        self.submit([Op("write_zeroes", lba=lba, nblocks=nblocks)])[0].result(timeout)

    # ---------------------------------------------------------------- batch
    def submit(self, ops: Iterable[Op], *, qpair: QueuePair | None = None) -> list[CommandFuture]:
        """Submit a batch: every op is validated first, then all go out with one doorbell
        (per queue-full round). Returns one future per op."""
        from ..ordering import nvme as ordering  # accesses to registrations are ordered

        qp = qpair or self.ctrl.io_qpair()
        ops = list(ops)
        ios, piece_futs, op_futs = self._prepare(ops, qp)
        declared = ordering.declare(ops, [f.what for f in op_futs])
        try:
            self.ctrl._submit_prepared(qp, ios, piece_futs)
        except BaseException as exc:
            ordering.abandon(declared, op_futs, exc)
            raise
        ordering.bind(declared, op_futs)
        return op_futs

    # ---------------------------------------------------------------- asyncio
    async def read_async(self, buf: Any, lba: int, nbytes: int, offset: int = 0) -> None:
        await self._aio(Op("read", buf, lba, nbytes, offset))

    async def write_async(self, buf: Any, lba: int, nbytes: int, offset: int = 0) -> None:
        await self._aio(Op("write", buf, lba, nbytes, offset))

    async def _aio(self, op: Op) -> None:
        fut = self.submit([op])[0]
        loop = asyncio.get_running_loop()
        # The wait drives the queue (polling or eventfd sleep) off the event loop.
        await loop.run_in_executor(None, fut.result)

    # ---------------------------------------------------------------- helpers
    def _prepare(self, ops: list[Op], qp: QueuePair) -> tuple[Any, list[CommandFuture], list[CommandFuture]]:
        """Validate every op, split by MDTS; (p2h_io array, future per piece, future per op)."""
        ffi = self.ctrl.hot.ffi
        pieces: list[tuple[int, int, int, int, int, prp.PageList | None, int]] = []
        futs: list[CommandFuture] = []
        checked: set[int] = set()
        opcodes = {"read": spec.OPC_READ, "write": spec.OPC_WRITE, "flush": spec.OPC_FLUSH,
                   "write_zeroes": spec.OPC_WRITE_ZEROES}
        for op in ops:
            if op.kind not in opcodes:
                raise UsageError(f"unknown op kind {op.kind!r}")
            opc = opcodes[op.kind]
            what = f"{op.kind} nsid={self.nsid} lba={op.lba}"
            if op.kind == "flush":
                parts = [(0, 0, 0, 0, 0, None)]
            elif op.kind == "write_zeroes":
                self._check_lba(op.lba, op.nblocks)
                parts = [(op.lba + i, min(0x10000, op.nblocks - i), 0, 0, 0, None)
                         for i in range(0, op.nblocks, 0x10000)]
            else:
                pl = self.ctrl.page_list(op.buf)
                if op.nbytes <= 0 or op.nbytes % self.lba_size:
                    raise UsageError(f"{what}: nbytes={op.nbytes} is not a positive multiple of "
                                     f"the LBA size {self.lba_size}")
                self._check_lba(op.lba, op.nbytes // self.lba_size)
                pl.validate_range(op.offset, op.nbytes)
                if id(pl.addrs) not in checked:
                    pl.check()  # closed / revoked: once per buffer per batch
                    checked.add(id(pl.addrs))
                parts = [(lba, n // self.lba_size, n, off, 0, pl)
                         for lba, n, off in prp.split(op.lba, op.nbytes, op.offset, self.lba_size,
                                                      self.ctrl.max_transfer)]
            fut = CommandFuture(qp, opc, len(parts), keep=[p[5] for p in parts], what=what)
            futs.append(fut)
            for lba, nlb, nbytes, off, _x, pl in parts:
                pieces.append((opc, lba, nlb, nbytes, off, pl, len(futs) - 1))
        ios = ffi.new("struct p2h_io[]", len(pieces))
        for i, (opc, lba, nlb, nbytes, off, pl, k) in enumerate(pieces):
            io = ios[i]
            io.opc = opc
            io.nsid = self.nsid
            io.slba = lba
            io.nlb = nlb
            io.nbytes = nbytes
            io.buf_off = off
            if pl is not None:
                io.pages = pl.addrs
                io.npages = pl.npages
            io.tag = next(self.ctrl._tags)
        return ios, [futs[p[6]] for p in pieces], futs

    def _check_lba(self, lba: int, nblocks: int) -> None:
        if lba < 0 or nblocks <= 0 or lba + nblocks > self.blocks:
            raise UsageError(f"LBA range lba={lba} nblocks={nblocks} is outside namespace {self.nsid} "
                             f"of {self.blocks} blocks")


class Controller:
    """An NVMe controller owned by this process through p2phub.ko."""

    def __init__(self, bdf: str, *, io_queues: int = DEFAULT_IO_QUEUES,
                 queue_depth: int = DEFAULT_QUEUE_DEPTH, interrupts: bool = False,
                 io_timeout: float = 5.0, admin_timeout: float = 5.0, bind: bool = True) -> None:
        from . import _build

        self.bdf = _bind.normalize_bdf(bdf)
        self.hot = _build.load()
        self.io_timeout_s = io_timeout
        self.admin_timeout_s = admin_timeout
        self.interrupts = interrupts
        self._tags = itertools.count(1 << 48)
        self._hfd = -1
        self._bar: mmap.mmap | None = None
        self._bufs: list[DmaBuffer] = []
        self.io_qps: list[QueuePair] = []
        self.admin: QueuePair | None = None
        self.namespaces: dict[int, Namespace] = {}
        self._state = "init"
        self._recovering = threading.local()
        self._reset_lock = threading.RLock()
        self._thread_qp = threading.local()
        self._rr = itertools.count()
        self.resets = 0
        self.aborts = 0
        self._vector_fds: dict[int, int] = {}
        self._reg_pages: "weakref.WeakKeyDictionary[Any, prp.PageList]" = weakref.WeakKeyDictionary()
        try:
            if bind:
                _bind.bind(self.bdf)
            self._open()
            self._bring_up(io_queues, queue_depth)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- kernel side
    def _open(self) -> None:
        dom, bus, devfn = _bind.split_bdf(self.bdf)
        arg = uapi.NvmeOpen.new(domain=dom, bus=bus, devfn=devfn)
        with Device() as dev:
            try:
                self._hfd = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, arg, True)
            except OSError as exc:
                hint = {errno.ENXIO: "not bound to p2phub-nvme (p2phub nvme bind)",
                        errno.EBUSY: "another process owns it"}.get(exc.errno or 0, "")
                raise P2PHubOSError(exc.errno or errno.EIO, f"P2PHUB_NVME_OPEN {self.bdf}", hint) from None
        self.nr_irqs = arg.out_nr_irqs
        self.bar0_size = arg.out_bar0_size
        size = (self.bar0_size + mmap.PAGESIZE - 1) & ~(mmap.PAGESIZE - 1)
        size = min(size, 0x4000) if size >= 0x2000 else size  # registers + doorbells suffice
        self._bar = mmap.mmap(self._hfd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        ffi = self.hot.ffi
        self._bar_c = ffi.from_buffer(self._bar)
        self._regs32 = ffi.cast("uint32_t *", self._bar_c)
        self._bar_len = size

    def _hioctl(self, request: int, arg: ctypes.Structure, what: str) -> None:
        try:
            fcntl.ioctl(self._hfd, request, arg, True)
        except OSError as exc:
            raise P2PHubOSError(exc.errno or errno.EIO, what) from None

    def alloc_dma(self, size: int, name: str = "buffer") -> DmaBuffer:
        """DMA-coherent memory for this controller (rounded up to whole pages, <= 4 MiB)."""
        size = (size + mmap.PAGESIZE - 1) & ~(mmap.PAGESIZE - 1)
        buf = DmaBuffer(self, size, name)
        self._bufs.append(buf)
        return buf

    def doorbell_ptr(self, offset: int) -> Any:
        if offset + 4 > self._bar_len:
            raise P2PHubError(f"doorbell at 0x{offset:x} is beyond the mapped BAR0 (0x{self._bar_len:x})")
        return self._regs32 + offset // 4

    def rd32(self, off: int) -> int:
        return int(self._regs32[off // 4])

    def wr32(self, off: int, val: int) -> None:
        self._regs32[off // 4] = val & 0xFFFFFFFF

    def rd64(self, off: int) -> int:
        return self.rd32(off) | (self.rd32(off + 4) << 32)

    def wr64(self, off: int, val: int) -> None:
        self.wr32(off, val & 0xFFFFFFFF)
        self.wr32(off + 4, val >> 32)

    # ---------------------------------------------------------------- bring-up
    def _bring_up(self, io_queues: int, queue_depth: int) -> None:
        self.cap = spec.Cap(self.rd64(spec.REG_CAP))
        if not self.cap.nvm_css:
            raise NvmeError(f"{self.bdf}: controller does not support the NVM command set")
        if self.cap.mpsmin > spec.PAGE or self.cap.mpsmax < spec.PAGE:
            raise NvmeError(f"{self.bdf}: memory page size {spec.PAGE} outside CAP.MPSMIN..MPSMAX "
                            f"({self.cap.mpsmin}..{self.cap.mpsmax})")
        self.version = self.rd32(spec.REG_VS)
        self._disable()
        self.admin = QueuePair(self, 0, min(ADMIN_DEPTH, self.cap.mqes), prp_stride=0,
                               vector=0 if self.interrupts else None)
        self._enable()
        self._setup_irq(self.admin)
        self._state = "live"
        ident = self.identify_buffer = self.alloc_dma(spec.PAGE, "identify")
        self.admin_cmd(spec.command(spec.ADM_IDENTIFY, prp1=ident.dma_addr, cdw10=spec.CNS_CONTROLLER),
                       what="Identify Controller")
        self.ident = spec.IdentifyController.parse(bytes(ident.view[:spec.PAGE]))
        mdts = (self.cap.mpsmin << self.ident.mdts) if self.ident.mdts else MAX_TRANSFER_CAP
        self.max_transfer = min(mdts, MAX_TRANSFER_CAP)
        self._prp_stride = max(64, 1 << ((self.max_transfer // spec.PAGE) * 8 - 1).bit_length())
        self._identify_namespaces()
        want = max(1, io_queues)
        dw0 = self.admin_cmd(spec.command(spec.ADM_SET_FEATURES, cdw10=spec.FEAT_NUMBER_OF_QUEUES,
                                          cdw11=((want - 1) << 16) | (want - 1)),
                             what="Set Features (Number of Queues)")
        self.queues_granted = min(dw0 & 0xFFFF, dw0 >> 16) + 1
        depth = max(2, min(queue_depth, self.cap.mqes))
        for qid in range(1, min(want, self.queues_granted) + 1):
            vector = (qid % self.nr_irqs if self.nr_irqs > 1 else 0) if self.interrupts else None
            qp = QueuePair(self, qid, depth, prp_stride=self._prp_stride, vector=vector)
            self.io_qps.append(qp)
            self._create_io_queue(qp)
            self._setup_irq(qp)

    def _identify_namespaces(self) -> None:
        ident = self.identify_buffer
        nsids: list[int] = []
        if self.version >= 0x10100:
            self.admin_cmd(spec.command(spec.ADM_IDENTIFY, prp1=ident.dma_addr, cdw10=spec.CNS_ACTIVE_NSIDS),
                           what="Identify Active Namespace IDs")
            raw = bytes(ident.view[:spec.PAGE])
            for i in range(0, spec.PAGE, 4):
                nsid = int.from_bytes(raw[i:i + 4], "little")
                if not nsid:
                    break
                nsids.append(nsid)
        else:
            nsids = list(range(1, self.ident.nn + 1))
        for nsid in nsids:
            self.admin_cmd(spec.command(spec.ADM_IDENTIFY, nsid=nsid, prp1=ident.dma_addr,
                                        cdw10=spec.CNS_NAMESPACE), what=f"Identify Namespace {nsid}")
            ns = spec.IdentifyNamespace.parse(nsid, bytes(ident.view[:spec.PAGE]))
            if ns.nsze:
                self.namespaces[nsid] = Namespace(self, ns)

    def _create_io_queue(self, qp: QueuePair) -> None:
        ien = 0 if qp.vector is None else 1
        iv = qp.vector or 0
        self.admin_cmd(spec.command(spec.ADM_CREATE_CQ, prp1=qp.cq_buf.dma_addr,
                                    cdw10=((qp.depth - 1) << 16) | qp.qid,
                                    cdw11=(iv << 16) | (ien << 1) | 1),
                       what=f"Create I/O CQ {qp.qid}")
        self.admin_cmd(spec.command(spec.ADM_CREATE_SQ, prp1=qp.sq_buf.dma_addr,
                                    cdw10=((qp.depth - 1) << 16) | qp.qid,
                                    cdw11=(qp.qid << 16) | 1),
                       what=f"Create I/O SQ {qp.qid}")

    def _setup_irq(self, qp: QueuePair) -> None:
        if qp.vector is None:
            return
        if qp.vector in self._vector_fds:
            qp.eventfd = self._vector_fds[qp.vector]  # queues sharing a vector share its eventfd
            return
        qp.eventfd = self._vector_fds[qp.vector] = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        arg = uapi.NvmeIrqSet.new(vector=qp.vector, eventfd=qp.eventfd)
        self._hioctl(uapi.NVME_IRQ_SET, arg, f"P2PHUB_NVME_IRQ_SET vector {qp.vector}")

    def _disable(self) -> None:
        cc = self.rd32(spec.REG_CC)
        if cc & spec.CC_EN:
            self.wr32(spec.REG_CC, cc & ~spec.CC_EN)
        self._wait_ready(False)

    def _enable(self) -> None:
        assert self.admin is not None
        d = self.admin.depth
        self.wr32(spec.REG_AQA, ((d - 1) << 16) | (d - 1))
        self.wr64(spec.REG_ASQ, self.admin.sq_buf.dma_addr)
        self.wr64(spec.REG_ACQ, self.admin.cq_buf.dma_addr)
        cc = ((spec.CQE_SIZE_LOG2 << spec.CC_IOCQES_SHIFT) | (spec.SQE_SIZE_LOG2 << spec.CC_IOSQES_SHIFT)
              | (0 << spec.CC_MPS_SHIFT) | (0 << spec.CC_CSS_SHIFT))
        self.wr32(spec.REG_CC, cc)
        self.wr32(spec.REG_CC, cc | spec.CC_EN)
        self._wait_ready(True)

    def _wait_ready(self, ready: bool) -> None:
        timeout = max(self.cap.timeout_s, 0.5)
        deadline = time.monotonic() + timeout
        while True:
            csts = self.rd32(spec.REG_CSTS)
            if csts == 0xFFFFFFFF:
                raise NvmeError(f"{self.bdf}: CSTS reads all ones: the controller is gone")
            if bool(csts & spec.CSTS_RDY) == ready:
                if ready and csts & spec.CSTS_CFS:
                    raise NvmeError(f"{self.bdf}: controller fatal status (CSTS 0x{csts:x})")
                return
            if time.monotonic() > deadline:
                raise NvmeError(f"{self.bdf}: CSTS.RDY did not become {int(ready)} within CAP.TO "
                                f"{timeout:g} s (CSTS 0x{csts:x})")
            time.sleep(0.001)

    # ---------------------------------------------------------------- admin
    def admin_submit(self, cmd: list[int], what: str = "") -> CommandFuture:
        assert self.admin is not None
        fut = CommandFuture(self.admin, cmd[0] & 0xFF, 1, what=what)
        if self.admin.submit_raw([cmd], [fut]) != 1:
            raise NvmeError(f"admin queue full submitting {what or spec.opcode_name(True, cmd[0] & 0xFF)}")
        return fut

    def admin_cmd(self, cmd: list[int], what: str = "", timeout: float | None = None) -> int:
        """Run one admin command; returns CQE DW0; raises NvmeStatusError/NvmeTimeoutError."""
        return self.admin_submit(cmd, what).result(timeout)

    # ---------------------------------------------------------------- I/O plumbing
    def namespace(self, nsid: int) -> Namespace:
        try:
            return self.namespaces[nsid]
        except KeyError:
            raise UsageError(f"{self.bdf} has no active namespace {nsid} "
                             f"(active: {sorted(self.namespaces)})") from None

    def io_qpair(self) -> QueuePair:
        """This thread's I/O queue pair."""
        qp = getattr(self._thread_qp, "qp", None)
        if qp is None or qp not in self.io_qps:
            if not self.io_qps:
                raise NvmeError(f"{self.bdf}: no I/O queues")
            qp = self.io_qps[next(self._rr) % len(self.io_qps)]
            self._thread_qp.qp = qp
        return qp

    def page_list(self, buf: Any) -> prp.PageList:
        """The page list of buf for this controller (a DmaBuffer, a PageList or a registration)."""
        if isinstance(buf, prp.PageList):
            return buf
        if isinstance(buf, DmaBuffer):
            if buf.ctrl is not self:
                raise UsageError(f"DMA buffer {buf.name} belongs to another controller")
            if buf.closed:
                raise UsageError(f"DMA buffer {buf.name} is closed")
            return buf.page_list()
        if getattr(buf, "dma_pages", None) is None:
            raise UsageError(f"{type(buf).__name__} is not a registration or DMA buffer")
        if buf.closed:
            raise UsageError(f"{buf!r} is closed")
        return registration_page_list(self, buf)

    def _submit_prepared(self, qp: QueuePair, ios: Any, futs: list[CommandFuture]) -> None:
        n = len(futs)
        done = 0
        while done < n:
            got = qp.submit_io(ios + done, n - done, futs[done:])
            done += got
            if done < n:
                # Ring full: make room by reaping (and drive timeouts), then go on.
                qp.process()
                if got == 0:
                    self._check_timeouts(qp)
                    time.sleep(0)

    def _check_usable(self) -> None:
        if self._state != "live":
            if self._state == "resetting":
                raise ControllerResetError(f"{self.bdf} is being reset; retry")
            raise NvmeError(f"{self.bdf}: controller is {self._state}")

    # ---------------------------------------------------------------- timeouts and recovery
    def _check_timeouts(self, qp: QueuePair) -> None:
        if getattr(self._recovering, "on", False):
            return
        expired = qp.outstanding(qp.timeout_s)
        if not expired:
            return
        qp.process()  # a completion we simply had not reaped yet?
        expired = [e for e in qp.outstanding(qp.timeout_s) if e[1] is not None]
        if expired:
            self._recover(qp, expired)

    def _recover(self, qp: QueuePair, expired: list[tuple[int, CommandFuture | None, int, float]]) -> None:
        """Abort each expired command once; reset the controller if that does not end it."""
        self._recovering.on = True
        try:
            with self._reset_lock:
                need_reset = False
                for cid, fut, _opc, age in expired:
                    assert fut is not None
                    if fut.done():
                        continue
                    fut._timeout_exc = timeout_error(fut, cid, "abort", age)
                    try:
                        dw0 = self.admin_submit(
                            spec.command(spec.ADM_ABORT, cdw10=(cid << 16) | qp.qid),
                            what=f"Abort cid 0x{cid:04x} on queue {qp.qid}").result(self.admin_timeout_s)
                        self.aborts += 1
                    except (NvmeError, TimeoutError):
                        need_reset = True
                        break
                    if dw0 & 1:  # "command not aborted"
                        need_reset = True
                        continue
                    deadline = time.monotonic() + min(1.0, qp.timeout_s)
                    while not fut.done() and time.monotonic() < deadline:
                        qp.process()
                        time.sleep(0.001)
                    if not fut.done():
                        need_reset = True
                if need_reset:
                    for cid, fut, _opc, age in expired:
                        if fut is not None and not fut.done():
                            fut._timeout_exc = timeout_error(fut, cid, "reset", age)
                    self.reset()
        finally:
            self._recovering.on = False

    def reset(self) -> None:
        """Reset the controller: every outstanding command fails, queues are rebuilt."""
        with self._reset_lock:
            self._state = "resetting"
            self.resets += 1
            try:
                self._disable()
            except NvmeError:
                pass  # enable below reports what is wrong
            for q in [self.admin, *self.io_qps]:
                if q is not None:
                    q.fail_all(lambda opc, cid, _q=q: reset_error(_q.qid, opc, cid))
            self._enable()
            self._state = "live"
            n = len(self.io_qps)
            self.admin_cmd(spec.command(spec.ADM_SET_FEATURES, cdw10=spec.FEAT_NUMBER_OF_QUEUES,
                                        cdw11=((n - 1) << 16) | (n - 1)), what="Set Features (Number of Queues)")
            for q in self.io_qps:
                self._create_io_queue(q)

    # ---------------------------------------------------------------- lifetime
    def stats(self) -> dict:
        return {"resets": self.resets, "aborts": self.aborts,
                "queues": [q.stats() for q in ([self.admin] if self.admin else []) + self.io_qps]}

    def info(self) -> dict:
        return {"bdf": self.bdf, "controller": self.ident.as_dict(),
                "cap": {"mqes": self.cap.mqes, "dstrd": self.cap.dstrd, "timeout_s": self.cap.timeout_s,
                        "mpsmin": self.cap.mpsmin, "mpsmax": self.cap.mpsmax},
                "max_transfer": self.max_transfer, "io_queues": len(self.io_qps),
                "queues_granted": self.queues_granted,
                "queue_depth": self.io_qps[0].depth if self.io_qps else 0,
                "msix_vectors": self.nr_irqs, "interrupts": self.interrupts,
                "namespaces": [ns.ident.as_dict() for ns in self.namespaces.values()]}

    @property
    def closed(self) -> bool:
        return self._hfd < 0

    def close(self) -> None:
        """Release everything; the kernel disables the controller and frees its memory."""
        if self._hfd < 0:
            return
        self._state = "closed"
        for q in [self.admin, *self.io_qps]:
            if q is not None:
                q.eventfd = -1  # owned by _vector_fds
                q.close()
        for fd in self._vector_fds.values():
            os.close(fd)
        self._vector_fds = {}
        self.io_qps = []
        self.admin = None
        for b in self._bufs:
            b.close()
        self._bufs = []
        if self._bar is not None:
            self._regs32 = None
            del self._bar_c
            self._bar.close()
            self._bar = None
        os.close(self._hfd)
        self._hfd = -1

    def __enter__(self) -> "Controller":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def registration_page_list(ctrl: Controller, reg: Any) -> prp.PageList:
    """Page list of a p2phub Registration for this controller's PCI device.

    The addresses come from P2PHUB_DMA_PAGES for this controller (IOVAs when an
    IOMMU translates for it), in 4 KiB entries. Each submission re-checks the
    registration: closed raises UsageError, revoked raises RevokedError.
    """
    cached = ctrl._reg_pages.get(reg)
    if cached is not None:
        return dataclasses.replace(cached, owner=reg)
    pages = reg.dma_pages(ctrl.bdf, page_size=spec.PAGE)

    def check() -> None:
        if reg.closed:
            raise UsageError(f"{reg!r} is closed")
        if reg.info().revoked:
            raise RevokedError(f"{reg!r} was revoked by its owner; register the memory again")

    # The cached copy must not hold reg: it is the key of a weak dictionary.
    pl = prp.PageList(ctrl.hot.ffi.new("uint64_t[]", pages), len(pages), int(reg.length),
                      check=check, owner=None, name=f"registration {reg.handle}")
    ctrl._reg_pages[reg] = pl
    return dataclasses.replace(pl, owner=reg)


def open(bdf: str, **kw: Any) -> Controller:  # noqa: A001
    """Bind (if needed) and bring up the controller at bdf."""
    return Controller(bdf, **kw)
