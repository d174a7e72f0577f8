"""RDMA for p2phub registrations: protection domains, memory regions on the best path, and
queue pairs whose work requests are ordered accesses with fences."""

from .mr import MemoryRegion, MrPath, ProtectionDomain, dmabuf_mr_support
from .verbs import Access
from .qp import (NotifyFence, QpInfo, QueuePair, RdmaError, RdmaFence, RemoteBuffer, WriteState,
                 connected_pair, remote_buffer)

__all__ = ["Access", "MemoryRegion", "MrPath", "NotifyFence", "ProtectionDomain", "QpInfo", "QueuePair",
           "RdmaError", "RdmaFence", "RemoteBuffer", "WriteState", "connected_pair",
           "dmabuf_mr_support", "remote_buffer"]
