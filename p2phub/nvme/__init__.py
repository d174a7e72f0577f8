"""The user-space NVMe queue engine: SSD <-> registered memory without the block layer.

    from p2phub.hub import Hub
    with Hub() as hub, hub.nvme("0000:00:05.0") as ctrl:
        ns = ctrl.namespace(1)
        reg = hub.alloc_host(1 << 20, device=ctrl.bdf)
        ns.read(reg, lba=0, nbytes=1 << 20)
        ns.read_batch(reg, lbas=[0, 8, 16], offsets=[0, 4096, 8192], nbytes=4096).result()
"""

from .buffers import DmaBuffer
from .controller import Controller, controllers_holding, open, quiesce_registration
from .errors import (ControllerBusyError, ControllerDeadError, ControllerRemovedError, ControllerResetError,
                     NvmeError, NvmeStatusError, NvmeTimeoutError, RegistrationRevokedError)
from .namespace import AccessHook, Namespace, NamespaceContext, Op, ReadOp, WriteOp
from .queue import BatchFuture, CommandFuture, OpFuture
from .recovery import ControllerState

__all__ = [
    "AccessHook", "BatchFuture", "CommandFuture", "Controller", "ControllerBusyError", "ControllerDeadError",
    "ControllerRemovedError", "ControllerResetError", "ControllerState", "DmaBuffer", "Namespace",
    "NamespaceContext", "NvmeError", "NvmeStatusError", "NvmeTimeoutError", "Op", "OpFuture", "ReadOp",
    "RegistrationRevokedError", "WriteOp", "controllers_holding", "open", "quiesce_registration",
]
