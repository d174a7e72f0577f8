"""RDMA for p2phub registrations: protection domains and memory regions on the best path."""

from .mr import MemoryRegion, MrPath, ProtectionDomain, dmabuf_mr_support

__all__ = ["MemoryRegion", "MrPath", "ProtectionDomain", "dmabuf_mr_support"]
