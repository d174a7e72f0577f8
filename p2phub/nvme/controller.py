"""The NVMe controller, driven from user space through p2phub.ko.

    with Hub() as hub, hub.nvme("0000:00:05.0") as ctrl:   # or nvme.open(bdf, hub=hub)
        ns = ctrl.namespace(1)
        reg = hub.alloc_host(1 << 20, device=ctrl.bdf)
        ns.write(reg, lba=0, nbytes=1 << 20)
        fut = ns.read_batch(reg, lbas=range(0, 256, 8), offsets=range(0, 128 << 12, 4096), nbytes=4096)
        fut.result()

:meth:`Controller.open` binds the controller to p2phub-nvme if it is not
already (refusing one whose namespaces are in use), opens its controller fd
(:class:`~p2phub.nvme.kdev.ControllerFile`) and calls :meth:`Controller.start`:
reset and enable honouring CAP, identify it and every usable namespace, ask
for I/O queues and create as many as granted. ``Controller(kfile)`` itself
does no I/O: it takes any object with the ControllerFile interface (the unit
tests give it a fake device).

Thread rules: each thread gets an I/O queue pair of its own (round robin when
there are more threads than queues; a shared queue pair is locked). Admin
commands serialise on the admin queue.
"""

from __future__ import annotations

import itertools
import os
import select
import threading
import time
import weakref
from typing import Any, Callable

from .. import metrics
from .._resource import Resource
from ..errors import P2PHubError, UsageError
from ..memory import Memory
from ..pci import normalize
from . import bind as _bind
from . import prp, spec
from .buffers import DmaBuffer, Mappings, RegMapping
from .errors import ControllerResetError, NvmeError
from .namespace import Namespace, NamespaceContext
from .queue import CommandFuture, QueueHooks, QueuePair
from .recovery import ControllerState, Recovery

DEFAULT_IO_QUEUES = 4
DEFAULT_QUEUE_DEPTH = 256
ADMIN_DEPTH = 64
MAX_TRANSFER_CAP = 1 << 20  # when MDTS is 0 (no limit): what one command moves at most

_live: "weakref.WeakSet[Controller]" = weakref.WeakSet()


class Controller(Resource):
    """An NVMe controller owned by this process through p2phub.ko."""

    def __init__(self, kfile: Any, *, io_queues: int = DEFAULT_IO_QUEUES,
                 queue_depth: int = DEFAULT_QUEUE_DEPTH, interrupts: bool = False,
                 io_timeout: float = 5.0, admin_timeout: float = 5.0, hot: Any = None) -> None:
        """Take a controller fd (or a fake with the same interface); no I/O until start()."""
        if hot is None:
            from . import _build
            hot = _build.load()
        self.hot = hot
        self.kfile = kfile
        self.bdf = kfile.bdf
        self.io_timeout_s = io_timeout
        self.admin_timeout_s = admin_timeout
        self.interrupts = interrupts
        self._want_queues = max(1, io_queues)
        self._want_depth = queue_depth
        self.terminal_error: BaseException | None = None
        self.recovery = Recovery(self)
        self.mappings = Mappings(kfile, hot, getattr(kfile, "device", None), self.bdf)
        self.mappings.owner = self
        self.access_hooks: list[Any] = []  # AccessHook objects (p2phub.nvme.namespace)
        self.admin: QueuePair | None = None
        self.io_qps: list[QueuePair] = []
        self.namespaces: dict[int, Namespace] = {}
        self.skipped_namespaces: dict[int, str] = {}
        self._bufs: list[DmaBuffer] = []
        self._vector_fds: dict[int, int] = {}
        self._thread_qp = threading.local()
        self._rr = itertools.count()
        self._req_efd = -1
        self._watch: threading.Thread | None = None
        self._watch_stop = -1
        self._hooks = QueueHooks(check_usable=self._check_usable, tick=self.recovery.tick,
                                 state_changed=self.recovery.state_changed, refused=self._refused)
        _live.add(self)
        metrics.track_controller(self)

    @classmethod
    def open(cls, bdf: str, *, hub: Any = None, device: Any = None, bind: bool = True,
             **options: Any) -> "Controller":
        """Bind (if needed), open the controller fd on `hub`'s /dev/p2phub file (registrations
        of that Hub can then be used) or on `device`, or a file of its own, and start it."""
        from . import _build
        from .kdev import ControllerFile

        bdf = normalize(bdf)
        if bind:
            _bind.bind(bdf)
        if hub is not None:
            device = hub.device
        kfile = ControllerFile(bdf, _build.load(), device)
        try:
            ctrl = cls(kfile, **options)
        except BaseException:
            kfile.close()
            raise
        try:
            ctrl.start()
        except BaseException:
            ctrl.close()
            raise
        return ctrl

    @property
    def state(self) -> ControllerState:
        """Where the controller is in its life (owned by :class:`~p2phub.nvme.recovery.Recovery`)."""
        return self.recovery.state

    # ---------------------------------------------------------------- registers
    def rd32(self, off: int) -> int:
        regs = self.kfile.regs
        if regs is None:
            return 0xFFFFFFFF
        return int(regs[off // 4])

    def wr32(self, off: int, val: int) -> None:
        regs = self.kfile.regs
        if regs is not None:
            regs[off // 4] = val & 0xFFFFFFFF

    def rd64(self, off: int) -> int:
        return self.rd32(off) | (self.rd32(off + 4) << 32)

    def wr64(self, off: int, val: int) -> None:
        self.wr32(off, val & 0xFFFFFFFF)
        self.wr32(off + 4, val >> 32)

    def doorbell_ptr(self, offset: int) -> Any:
        if offset + 4 > self.kfile.bar_len:
            raise P2PHubError(f"doorbell at 0x{offset:x} is beyond the mapped BAR0 (0x{self.kfile.bar_len:x})")
        return self.kfile.regs + offset // 4

    @property
    def nr_irqs(self) -> int:
        """MSI-X vectors the kernel allocated for the controller."""
        return int(self.kfile.nr_irqs)

    def status_state(self) -> int:
        st = self.kfile.status
        return int(st.state) if st is not None else 0

    # ---------------------------------------------------------------- bring-up
    def start(self) -> "Controller":
        """Reset and enable the controller, identify it and its namespaces, create I/O queues."""
        if self.state is not ControllerState.NEW:
            raise UsageError(f"{self.bdf}: start() on a controller that is {self.state}")
        self.cap = spec.Cap(self.rd64(spec.REG_CAP))
        if self.cap.raw == (1 << 64) - 1:
            raise NvmeError(f"{self.bdf}: CAP reads all ones: the controller is gone")
        if not self.cap.nvm_css:
            raise NvmeError(f"{self.bdf}: controller does not support the NVM command set")
        if self.cap.mpsmin > spec.PAGE or self.cap.mpsmax < spec.PAGE:
            raise NvmeError(f"{self.bdf}: memory page size {spec.PAGE} outside CAP.MPSMIN..MPSMAX "
                            f"({self.cap.mpsmin}..{self.cap.mpsmax})")
        self.version = self.rd32(spec.REG_VS)
        self.disable()
        self.admin = self._make_qpair(0, min(ADMIN_DEPTH, self.cap.mqes), 0, 0 if self.interrupts else None)
        self._enable()
        self._setup_irq(self.admin)
        self.recovery.enter(ControllerState.LIVE, "enabled; admin queue up")
        ident = self.identify_buffer = self.alloc_dma(spec.PAGE, "identify")
        self.admin_cmd(spec.command(spec.ADM_IDENTIFY, prp1=ident.dma_addr, cdw10=spec.CNS_CONTROLLER),
                       what="Identify Controller")
        self.ident = spec.IdentifyController.parse(bytes(ident.view[:spec.PAGE]))
        mdts = (self.cap.mpsmin << self.ident.mdts) if self.ident.mdts else MAX_TRANSFER_CAP
        self.max_transfer = min(mdts, MAX_TRANSFER_CAP)
        self._prp_stride = max(64, 1 << ((self.max_transfer // spec.PAGE) * 8 - 1).bit_length())
        self._identify_namespaces()
        self.queues_granted = self._set_queue_count(self._want_queues)
        depth = max(2, min(self._want_depth, self.cap.mqes))
        for qid in range(1, min(self._want_queues, self.queues_granted) + 1):
            vector = (qid % self.kfile.nr_irqs if self.kfile.nr_irqs > 1 else 0) if self.interrupts else None
            qp = self._make_qpair(qid, depth, self._prp_stride, vector)
            self.io_qps.append(qp)
            self._create_io_queue(qp)
            self._setup_irq(qp)
        self._watch_requests()
        return self

    def _make_qpair(self, qid: int, depth: int, prp_stride: int, vector: int | None) -> QueuePair:
        ntrk = min(depth - 1, 4095)
        prp_mem = None
        if prp_stride:
            ntrk = min(ntrk, (4 << 20) // prp_stride)
            prp_mem = self.kfile.alloc_dma(_page(ntrk * prp_stride), f"prp{qid}")
        return QueuePair(self.hot, qid, depth, sq=self.kfile.alloc_dma(_page(depth * 64), f"sq{qid}"),
                         cq=self.kfile.alloc_dma(_page(depth * 16), f"cq{qid}"), prp=prp_mem,
                         prp_stride=prp_stride, ntrk=ntrk,
                         sq_db=self.doorbell_ptr(spec.sq_doorbell(qid, self.cap.dstrd)),
                         cq_db=self.doorbell_ptr(spec.cq_doorbell(qid, self.cap.dstrd)),
                         status=self.kfile.status,
                         timeout_s=self.io_timeout_s if qid else self.admin_timeout_s,
                         vector=vector, hooks=self._hooks)

    def _set_queue_count(self, want: int) -> int:
        dw0 = self.admin_cmd(spec.command(spec.ADM_SET_FEATURES, cdw10=spec.FEAT_NUMBER_OF_QUEUES,
                                          cdw11=((want - 1) << 16) | (want - 1)),
                             what="Set Features (Number of Queues)")
        return min(dw0 & 0xFFFF, dw0 >> 16) + 1

    def _identify_namespaces(self) -> None:
        ident = self.identify_buffer
        # What every namespace uses of this controller, handed over once (it never calls back).
        self._ns_context = NamespaceContext(name=self.bdf, hot=self.hot, max_transfer=self.max_transfer,
                                            qpair=self.io_qpair, resolve=self.resolve_buffer,
                                            access_hooks=self.access_hooks)
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
            if not ns.nsze:
                continue
            why = ns.unsupported()
            if why:
                self.skipped_namespaces[nsid] = why
                continue
            self.namespaces[nsid] = Namespace(ns, self._ns_context)

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
        self.kfile.irq_set(qp.vector, qp.eventfd)

    def _watch_requests(self) -> None:
        """Let go of the controller when the kernel asks (P2PHUB_NVME_REQ_SET eventfd)."""
        if not hasattr(self.kfile, "req_set"):
            return
        self._req_efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._watch_stop = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.kfile.req_set(self._req_efd)
        ref = weakref.ref(self)
        efd, stop = self._req_efd, self._watch_stop

        def watch() -> None:
            while True:
                r, _, _ = select.select([efd, stop], [], [])
                if stop in r:
                    return
                try:
                    os.eventfd_read(efd)
                except BlockingIOError:
                    continue
                ctrl = ref()
                if ctrl is None:
                    return
                # The kernel signals every change of state: act on what the status page says.
                ctrl.recovery.state_changed(None)
                if ctrl.state.terminal:
                    return
                del ctrl

        self._watch = threading.Thread(target=watch, name=f"p2phub-nvme-req {self.bdf}", daemon=True)
        self._watch.start()

    def disable(self) -> None:
        """CC.EN = 0 and wait for CSTS.RDY = 0 within CAP.TO (NvmeError if it does not)."""
        cc = self.rd32(spec.REG_CC)
        if cc == 0xFFFFFFFF:
            raise NvmeError(f"{self.bdf}: CC reads all ones: the controller is gone")
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
            if ready and csts & spec.CSTS_CFS:
                raise NvmeError(f"{self.bdf}: controller fatal status (CSTS 0x{csts:x})")
            if bool(csts & spec.CSTS_RDY) == ready:
                return
            if time.monotonic() > deadline:
                raise NvmeError(f"{self.bdf}: CSTS.RDY did not become {int(ready)} within CAP.TO "
                                f"{timeout:g} s (CSTS 0x{csts:x})")
            time.sleep(0.001)

    def reinitialise(self) -> None:
        """After a disable: admin queue, enable, Number of Queues, every I/O queue again."""
        self._enable()
        self.recovery.enter(ControllerState.LIVE, "enabled again; re-creating the I/O queues")
        self._set_queue_count(len(self.io_qps))
        for q in self.io_qps:
            self._create_io_queue(q)

    def fail_outstanding(self, exc_for: Callable[[int, int, Any, QueuePair], BaseException],
                         reset_rings: bool = True) -> int:
        """Fail every outstanding future (the controller must already be stopped)."""
        n = 0
        for q in [self.admin, *self.io_qps]:
            if q is not None:
                if not reset_rings:
                    q.set_dead()
                n += q.fail_all(lambda opc, cid, fut, _q=q: exc_for(opc, cid, fut, _q), reset_rings)
        return n

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
            if nsid in self.skipped_namespaces:
                raise UsageError(f"{self.bdf} namespace {nsid} is not usable by this engine: "
                                 f"{self.skipped_namespaces[nsid]}") from None
            raise UsageError(f"{self.bdf} has no active namespace {nsid} "
                             f"(active: {sorted(self.namespaces)})") from None

    def io_qpair(self) -> QueuePair:
        """This thread's I/O queue pair."""
        qp = getattr(self._thread_qp, "qp", None)
        if qp is None or qp not in self.io_qps:
            if not self.io_qps:
                self._check_usable()
                raise NvmeError(f"{self.bdf}: no I/O queues")
            qp = self.io_qps[next(self._rr) % len(self.io_qps)]
            self._thread_qp.qp = qp
        return qp

    def alloc_dma(self, size: int, name: str = "buffer") -> DmaBuffer:
        """DMA-coherent memory for this controller (rounded up to whole pages, <= 4 MiB)."""
        buf = DmaBuffer(self.kfile.alloc_dma(_page(size), name), name, self, self.hot)
        self._bufs.append(buf)
        return buf

    def resolve_buffer(self, buf: Any) -> tuple[prp.PageList, RegMapping | None]:
        """(page list, registration mapping or None) of buf: a DmaBuffer, a PageList or a registration."""
        self._settle_state()
        self._check_usable()
        if isinstance(buf, prp.PageList):
            return buf, None
        if isinstance(buf, DmaBuffer):
            if buf.owner is not self:
                raise UsageError(f"DMA buffer {buf.name} belongs to another controller")
            if buf.closed:
                raise UsageError(f"DMA buffer {buf.name} is closed")
            return buf.page_list(), None
        if not isinstance(buf, Memory):
            raise UsageError(f"{type(buf).__name__} is not a registration or DMA buffer")
        m = self.mappings.get(buf)
        self.mappings.check_live(m)
        return m.pages, m

    def _settle_state(self) -> None:
        """Before new work: let a recovery in progress (another thread's) finish, and act on
        news in the status page nobody has acted on yet (a plain load when there is none)."""
        st = self.recovery.state
        if st is ControllerState.LIVE:     # the usual case: one state read, one status load
            if not self.status_state():
                return
        elif not st.recovering:
            return
        with self.recovery.lock:
            pass
        if self.state is ControllerState.LIVE and self.status_state():
            self.recovery.state_changed(None)

    def _check_usable(self) -> None:
        if self.recovery.state is ControllerState.LIVE:
            return
        if self.state.recovering:
            raise ControllerResetError(f"{self.bdf} is being reset; retry")
        if self.terminal_error is not None:
            raise self.terminal_error
        raise UsageError(f"{self.bdf}: controller is {self.state}")

    def _refused(self, qp: QueuePair, err: int, io: Any) -> BaseException:
        """The exception for a submission the hot path refused."""
        import errno as _e

        if err == _e.ESTALE and io is not None:
            m = self.mappings.by_slot(int(io.slot))
            if m is not None:
                return self.mappings.revoked_error(m, f"{spec.opcode_name(False, int(io.opc))} lba={int(io.slba)}")
        if err in (_e.EIO, _e.ENODEV, _e.ESTALE):
            if self.terminal_error is not None:
                return self.terminal_error
            return ControllerResetError(f"{self.bdf}: submission refused: the controller is fenced, in "
                                        f"error or going away (status page state 0x{self.status_state():x})")
        return UsageError(f"queue {qp.qid}: malformed I/O request (PRP range outside its page list)")

    # ---------------------------------------------------------------- registrations (C1)
    def inflight(self, reg: Any) -> int:
        """Commands (batches count once) in flight on registration reg on this controller."""
        return self.mappings.inflight(reg)

    def holds(self, reg: Any) -> bool:
        """True while this controller holds reg (P2PHUB_NVME_MAP_REG), so UNREGISTER would fail EBUSY."""
        return self.mappings.holds(reg)

    def quiesce_registration(self, reg: Any, timeout: float | None = None) -> bool:
        """Wait until no command referencing reg is outstanding, then release the controller's hold.

        Drives the queues while it waits (outstanding commands complete, time out, or fail in a
        reset). Returns True once the controller no longer holds reg (P2PHUB_NVME_UNMAP_REG
        done, or it never held it), False if commands were still outstanding after `timeout`
        seconds (None: wait as long as it takes; the engine's own I/O timeouts bound that).
        """
        if self.kfile.closed:
            self.mappings.forget_all()
            return True

        def drive() -> None:
            for q in list(self.io_qps):
                q.process()
                if q.busy:
                    self.recovery.tick(q)
            time.sleep(0)

        return self.mappings.quiesce(reg, timeout, drive)

    # ---------------------------------------------------------------- lifetime
    def stats(self) -> dict:
        return {"resets": self.recovery.resets, "aborts": self.recovery.aborts,
                "fences": self.recovery.fences, "state": self.state.value,
                "queues": [q.stats() for q in ([self.admin] if self.admin else []) + self.io_qps
                           if q.c is not None]}

    @property
    def resets(self) -> int:
        return self.recovery.resets

    @property
    def aborts(self) -> int:
        return self.recovery.aborts

    def info(self) -> dict:
        return {"bdf": self.bdf, "controller": self.ident.as_dict(),
                "cap": {"mqes": self.cap.mqes, "dstrd": self.cap.dstrd, "timeout_s": self.cap.timeout_s,
                        "mpsmin": self.cap.mpsmin, "mpsmax": self.cap.mpsmax},
                "max_transfer": self.max_transfer, "io_queues": len(self.io_qps),
                "queues_granted": self.queues_granted,
                "queue_depth": self.io_qps[0].depth if self.io_qps else 0,
                "msix_vectors": self.kfile.nr_irqs, "interrupts": self.interrupts,
                "namespaces": [ns.ident.as_dict() for ns in self.namespaces.values()],
                "skipped_namespaces": {str(k): v for k, v in self.skipped_namespaces.items()}}

    def release_device(self) -> None:
        """Stop every queue's MMIO, then unmap and close the controller fd: the kernel disables
        the controller and turns bus mastering off. Futures are not touched."""
        for q in [self.admin, *self.io_qps]:
            if q is not None:
                q.set_dead()
        self._stop_watch()
        for b in self._bufs:
            b.close()
        self.kfile.close()
        self.mappings.forget_all()

    def _stop_watch(self) -> None:
        if self._watch_stop >= 0:
            os.eventfd_write(self._watch_stop, 1)
            if self._watch is not None and self._watch is not threading.current_thread():
                self._watch.join()
            self._watch = None
            os.close(self._watch_stop)
            self._watch_stop = -1
        if self._req_efd >= 0:
            os.close(self._req_efd)
            self._req_efd = -1

    def _close(self) -> None:
        """Release everything; the kernel disables the controller and frees its memory.

        Outstanding commands fail with ControllerResetError only after the fd is closed.
        """
        if self.state is ControllerState.CLOSED:
            return
        was = self.state
        self.recovery.enter(ControllerState.CLOSED, "closed by its owner")
        self.release_device()
        if not was.terminal:
            self.fail_outstanding(lambda opc, cid, fut, q: ControllerResetError(
                f"{fut.what or 'command'} was outstanding when {self.bdf} was closed"), reset_rings=False)
        for q in [self.admin, *self.io_qps]:
            if q is not None:
                q.close()
        for fd in self._vector_fds.values():
            os.close(fd)
        self._vector_fds = {}
        self.io_qps = []
        self.admin = None
        self._bufs = []
        _live.discard(self)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _page(n: int) -> int:
    return (n + spec.PAGE - 1) & ~(spec.PAGE - 1)


def open(bdf: str, **kw: Any) -> Controller:  # noqa: A001
    """Bind (if needed) and bring up the controller at bdf (see Controller.open)."""
    return Controller.open(bdf, **kw)


def controllers_holding(reg: Any) -> list[Controller]:
    """The live controllers of this process that hold registration reg."""
    return [c for c in list(_live) if c.state is not ControllerState.CLOSED and c.holds(reg)]


def quiesce_registration(reg: Any, timeout: float | None = None) -> bool:
    """For Registration.close() / Hub.close(): wait until no NVMe command of this process
    references reg, and release every controller's hold on it. True when none holds it any
    more; False if commands were still outstanding after `timeout` seconds on some controller.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    ok = True
    for c in controllers_holding(reg):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ok = c.quiesce_registration(reg, left) and ok
    return ok


__all__ = ["Controller", "ControllerState", "DmaBuffer", "Namespace", "controllers_holding", "open",
           "quiesce_registration"]
