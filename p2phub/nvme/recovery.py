"""Timeouts, resets, fences and removal: what happens when the controller does not answer.

The ladder, per waiting thread (QueueHooks.tick, every 50 ms at most):

1. CSTS: all ones -> the controller is gone: terminal ``removed``; CSTS.CFS
   -> reset at once (no waiting for timeouts).
2. Commands past their deadline: reap once, then one Abort each; a command
   still not done -> reset.
3. Reset: disable (CC.EN = 0, wait CSTS.RDY = 0 within CAP.TO). Only once
   the controller is disabled are the outstanding futures failed
   (``ControllerResetError``; the expired ones ``NvmeTimeoutError``). If it
   cannot be disabled, it is *dead*: the controller fd is closed first (the
   kernel clears bus mastering, so no DMA follows), then every future fails
   with ``ControllerDeadError``.

The status page (QueueHooks.state_changed, seen by the pump with a plain
load): ``FENCED``/``ERROR`` (the kernel turned bus mastering off: a held
registration was revoked, or a PCI error) -> disable, fail what was
outstanding (``RegistrationRevokedError`` for commands on a revoked
registration, ``ControllerResetError`` for the rest), release the revoked
registrations, ``P2PHUB_NVME_RESUME``, re-initialise; ``REMOVING`` (or the
request eventfd firing) -> close the fd, then fail everything with
``ControllerRemovedError``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from .. import uapi
from ..errors import P2PHubOSError
from . import spec
from .errors import ControllerDeadError, ControllerRemovedError, NvmeError
from .queue import QueuePair, reset_error, timeout_error

if TYPE_CHECKING:
    from .controller import Controller

log = logging.getLogger(__name__)


class ControllerState(enum.Enum):
    """Where a controller is in its life; changed only through :meth:`Recovery.enter`."""

    NEW = "new"              # Controller(kfile): no I/O yet
    LIVE = "live"            # enabled, queues created: I/O goes
    RESETTING = "resetting"  # disabling, failing what was outstanding, re-initialising
    FENCED = "fenced"        # the kernel turned bus mastering off; recovering from it
    DEAD = "dead"            # could not be disabled or reset: fd closed (terminal)
    REMOVED = "removed"      # gone, or the kernel asked for it back: fd closed (terminal)
    CLOSED = "closed"        # closed by its owner (terminal)

    @property
    def terminal(self) -> bool:
        """No way back: the controller fd is closed; open the controller again."""
        return self in (ControllerState.DEAD, ControllerState.REMOVED, ControllerState.CLOSED)

    @property
    def recovering(self) -> bool:
        return self in (ControllerState.RESETTING, ControllerState.FENCED)

    def __str__(self) -> str:
        return self.value


class Recovery:
    """The recovery state machine of one controller; it owns the controller's state."""

    def __init__(self, ctrl: "Controller") -> None:
        self.ctrl = ctrl
        self.lock = threading.RLock()
        self._busy = threading.local()
        self.state = ControllerState.NEW
        self.resets = 0
        self.aborts = 0
        self.fences = 0

    def enter(self, new: ControllerState, why: str) -> None:
        """Change the controller's state, and log the transition with its reason."""
        old = self.state
        if old is new:
            return
        self.state = new
        level = logging.WARNING if new in (ControllerState.RESETTING, ControllerState.FENCED,
                                           ControllerState.DEAD, ControllerState.REMOVED) else logging.INFO
        log.log(level, "%s: %s -> %s: %s", self.ctrl.bdf, old.value, new.value, why)

    # ---------------------------------------------------------------- ticks
    def tick(self, qp: QueuePair) -> None:
        """Called by a waiting thread: CSTS, then deadlines."""
        if getattr(self._busy, "on", False) or self.state is not ControllerState.LIVE:
            return
        if qp.busy:
            csts = self.ctrl.rd32(spec.REG_CSTS)
            if csts == 0xFFFFFFFF:
                self.remove("CSTS reads all ones: the controller is gone (surprise removal)")
                return
            if csts & spec.CSTS_CFS:
                self.reset(why=f"the controller reported a fatal status (CSTS 0x{csts:x})")
                return
        expired = qp.outstanding(qp.timeout_s)
        if not expired:
            return
        qp.process()  # a completion we simply had not reaped yet?
        expired = [e for e in qp.outstanding(qp.timeout_s) if e[1] is not None]
        if expired:
            self._recover(qp, expired)

    def _recover(self, qp: QueuePair, expired: list[tuple[int, Any, int, float]]) -> None:
        """Abort each expired command once; reset the controller if that does not end it."""
        self._busy.on = True
        try:
            with self.lock:
                need_reset = False
                for cid, fut, _opc, age in expired:
                    if fut.done():
                        continue
                    fut._timeout_exc = timeout_error(fut, cid, "abort", age)
                    try:
                        dw0 = self.ctrl.admin_cmd(spec.command(spec.ADM_ABORT, cdw10=(cid << 16) | qp.qid),
                                                  what=f"Abort cid 0x{cid:04x} on queue {qp.qid}",
                                                  timeout=self.ctrl.admin_timeout_s)
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
                        if not fut.done():
                            fut._timeout_exc = timeout_error(fut, cid, "reset", age)
                    self.reset()
        finally:
            self._busy.on = False

    # ---------------------------------------------------------------- reset
    def reset(self, why: str = "the controller was reset") -> None:
        """Disable, fail every outstanding command, re-initialise. Dead if it cannot be disabled."""
        ctrl = self.ctrl
        with self.lock:
            if self.state.terminal:
                return
            self.enter(ControllerState.RESETTING, why)
            self.resets += 1
            self._busy.on = True
            try:
                if not self._stop(why):
                    return
                ctrl.fail_outstanding(lambda opc, cid, fut, q: reset_error(q.qid, opc, cid, why))
                self._restart()
            finally:
                self._busy.on = False

    def _stop(self, why: str) -> bool:
        """Disable the controller; on failure it is dead (fd closed before futures fail)."""
        try:
            self.ctrl.disable()
        except NvmeError as exc:
            if "all ones" in str(exc):
                self.remove(f"{why}; then CSTS read all ones")
            else:
                self.die(f"{why}; then it could not be disabled ({exc})")
            return False
        return True

    def _restart(self) -> None:
        ctrl = self.ctrl
        try:
            ctrl.reinitialise()
        except NvmeError as exc:
            if "all ones" in str(exc):
                self.remove(f"re-initialising after a reset: {exc}")
            else:
                self.die(f"re-initialising after a reset failed: {exc}")
            return
        self.enter(ControllerState.LIVE, "re-initialised")

    # ---------------------------------------------------------------- the status page
    def state_changed(self, qp: QueuePair | None) -> None:
        """The status page's state is not 0 (seen by the pump, a refused submission, or the
        request eventfd): REMOVING -> let go; FENCED/ERROR -> fence recovery."""
        ctrl = self.ctrl
        if getattr(self._busy, "on", False):
            return
        with self.lock:
            st = ctrl.status_state()
            if not st or self.state.terminal:
                return
            if st & uapi.NVME_ST_REMOVING:
                self.remove("the kernel asked for the controller back (unbind or removal)")
                return
            self._busy.on = True
            try:
                self._fence(st)
            finally:
                self._busy.on = False

    def _fence(self, st: int) -> None:
        ctrl = self.ctrl
        self.fences += 1
        revoked = ctrl.mappings.revoked()
        names = ", ".join(str(m.handle) for m in revoked)
        if st & uapi.NVME_ST_FENCED:
            why = f"the kernel fenced the controller (registration {names or '?'} revoked by its owner)"
        else:
            why = "the kernel reported a PCI error and turned bus mastering off"
        self.enter(ControllerState.FENCED, why)
        # Bus mastering is off already: nothing outstanding can DMA. Stop the controller so
        # nothing queued before the fence runs again once RESUME turns it back on.
        if not self._stop(why):
            return
        revoked_ids = {id(m) for m in revoked}

        def exc_for(opc: int, cid: int, fut: Any, q: QueuePair) -> BaseException:
            m = getattr(fut, "mapping", None)
            if m is not None and id(m) in revoked_ids:
                return ctrl.mappings.revoked_error(m, fut.what)
            return reset_error(q.qid, opc, cid, why)

        ctrl.fail_outstanding(exc_for)
        try:
            ctrl.mappings.drop_idle_revoked()
            ctrl.kfile.resume()
        except P2PHubOSError as exc:
            self.remove(f"{why}; P2PHUB_NVME_RESUME failed: {exc}")
            return
        self._restart()

    # ---------------------------------------------------------------- terminal
    def die(self, why: str) -> None:
        self._terminal(ControllerState.DEAD, why, ControllerDeadError(f"{self.ctrl.bdf} is dead: {why}; its fd was closed, "
                                                   "so the kernel stopped its DMA. Open it again"))

    def remove(self, why: str) -> None:
        self._terminal(ControllerState.REMOVED, why, ControllerRemovedError(f"{self.ctrl.bdf} was removed: {why}; "
                                                         "its fd was closed"))

    def _terminal(self, state: ControllerState, why: str, exc: NvmeError) -> None:
        ctrl = self.ctrl
        with self.lock:
            if self.state.terminal:
                return
            self.enter(state, why)
            ctrl.terminal_error = exc
            # First the device stops: no more MMIO from any queue, fd closed (the kernel
            # disables the controller and clears bus mastering); only then are futures failed.
            ctrl.release_device()

            def exc_for(opc: int, cid: int, fut: Any, q: QueuePair) -> BaseException:
                fut._timeout_exc = None  # the terminal state is the news, not the timeout
                return exc

            ctrl.fail_outstanding(exc_for, reset_rings=False)
