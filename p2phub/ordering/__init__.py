"""Producer/consumer ordering on shared buffers.

Every access to a Registration is declared on a byte range with a kind (AccessKind):
producers write the bytes (NVMe read, RDMA receive or remote-write target, GPU write),
consumers read them (NVMe write, RDMA send or remote-read source, GPU read). Consumers
may overlap each other; a producer overlaps nothing. A conflicting access waits for the
earlier one's fence (default) or raises OrderingError naming both (strict mode: per
registration ``reg.ordering.strict = True``, or per hub ``hub.strict_ordering = True``).

Fences (p2phub.ordering.Fence) come from NVMe commands, RDMA completions, GPU streams and
remote notifications, and share one interface: wait, done, exception, add_done_callback,
await, on_stream.
"""

from __future__ import annotations

from typing import Any

from ..memory import Memory
from .core import AccessFence, FencedAccess, GpuAccess, Ordering, as_fence, bind
from .errors import FenceError, FenceTimeout, OrderingError, OrderingTimeout
from .fence import Fence, HostFence, SourceFence, WordPool, completed, progress
from .tracker import CONSUMERS, PRODUCERS, Access, AccessKind, RangeTracker

__all__ = ["Access", "AccessFence", "AccessKind", "CONSUMERS", "Fence", "FencedAccess", "FenceError",
           "FenceTimeout", "GpuAccess", "HostFence", "Ordering", "OrderingError",
           "OrderingTimeout", "PRODUCERS", "RangeTracker", "SourceFence", "WordPool",
           "as_fence", "bind", "completed", "for_registration", "progress", "stream_ops_for"]


def stream_ops_for(backend: str) -> Any:
    """The stream ops of backend `backend` ("cuda", "rocm"), or None when not installed."""
    from ..backend import stream_ops_for as _find
    return _find(backend)


def for_registration(reg: Memory, strict: bool = False) -> Ordering:
    """The Ordering of a registration (GPU memory knows its device, for RDMA flushes)."""
    o = Ordering(str(reg), reg.length, strict=strict)
    gpu = reg.gpu
    if gpu is not None:
        ops = stream_ops_for(gpu.backend)
        if ops is not None:
            o.gpu_device = (ops, max(gpu.device, 0))
    return o
