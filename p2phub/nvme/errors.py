"""Exceptions of the NVMe engine; each carries what identifies the failure."""

from __future__ import annotations

from ..errors import P2PHubError, RevokedError, UsageError
from . import spec

__all__ = ["ControllerBusyError", "ControllerDeadError", "ControllerRemovedError", "ControllerResetError",
           "NvmeError", "NvmeStatusError", "NvmeTimeoutError", "RegistrationRevokedError", "UsageError"]


class NvmeError(P2PHubError):
    """Base class of NVMe engine failures."""


class NvmeStatusError(NvmeError):
    """The controller completed a command with an error status.

    ``status`` is the 15-bit status field; ``sct``, ``sc``, ``dnr`` and
    ``more`` are its parts, ``opcode``/``qid``/``cid`` name the command.
    """

    def __init__(self, status: int, *, opcode: int, admin: bool, qid: int, cid: int,
                 what: str = "") -> None:
        self.status = status
        self.sct, self.sc, self.dnr, self.more = spec.status_fields(status)
        self.opcode, self.admin, self.qid, self.cid = opcode, admin, qid, cid
        name = spec.opcode_name(admin, opcode)
        msg = f"{name} failed on queue {qid} (cid 0x{cid:04x}): {spec.status_str(status)}"
        if what:
            msg = f"{what}: {msg}"
        super().__init__(msg)


class NvmeTimeoutError(NvmeError):
    """A command did not complete before its deadline.

    ``recovery`` says what the engine did about it: ``"abort"`` (the
    controller aborted the command) or ``"reset"`` (the controller was reset;
    every command outstanding at that moment failed, and the engine is usable
    again).
    """

    def __init__(self, msg: str, *, opcode: int, admin: bool, qid: int, cid: int,
                 recovery: str) -> None:
        self.opcode, self.admin, self.qid, self.cid = opcode, admin, qid, cid
        self.recovery = recovery
        super().__init__(msg)


class ControllerResetError(NvmeError):
    """The command was outstanding when the controller was reset (it may or may not have run)."""


class ControllerBusyError(NvmeError):
    """The controller cannot be handed to p2phub: something uses its namespaces.

    ``reasons`` lists each finding ("/dev/nvme0n1p1 is mounted on /mnt", ...).
    """

    def __init__(self, bdf: str, reasons: list[str]) -> None:
        self.bdf = bdf
        self.reasons = reasons
        super().__init__(f"{bdf} is in use, refusing to take it from the kernel: " + "; ".join(reasons))


class ControllerDeadError(NvmeError):
    """The controller failed for good (CSTS.CFS that a reset does not clear, a disable that
    does not complete): the engine closed its fd, so the kernel stopped its DMA. Open it again."""


class ControllerRemovedError(ControllerDeadError):
    """The controller is gone (surprise removal: registers read all ones) or the kernel asked
    for it back (unbind, removal: P2PHUB_NVME_ST_REMOVING). The engine closed its fd."""


class RegistrationRevokedError(RevokedError, NvmeError):
    """A registration's owner took its memory back (its generation in the controller's status
    page changed): the command was not sent, or was cut off by the kernel's fence. ``handle``
    names the registration; register the memory again."""

    def __init__(self, msg: str, *, handle: int) -> None:
        self.handle = handle
        super().__init__(msg)
