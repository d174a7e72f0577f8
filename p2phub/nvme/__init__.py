"""The user-space NVMe queue engine: SSD <-> registered memory without the block layer.

    import p2phub.nvme
    with p2phub.nvme.open("0000:00:05.0") as ctrl:
        ns = ctrl.namespace(1)
        buf = ctrl.alloc_dma(1 << 20)
        ns.read(buf, lba=0, nbytes=1 << 20)
"""

from .controller import Controller, DmaBuffer, Namespace, Op, ReadOp, WriteOp, open
from .errors import ControllerBusyError, ControllerResetError, NvmeError, NvmeStatusError, NvmeTimeoutError
from .queue import CommandFuture

__all__ = [
    "CommandFuture", "Controller", "ControllerBusyError", "ControllerResetError", "DmaBuffer",
    "Namespace", "NvmeError", "NvmeStatusError", "NvmeTimeoutError", "Op", "ReadOp", "WriteOp", "open",
]
