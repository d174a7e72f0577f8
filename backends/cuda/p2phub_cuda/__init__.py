"""p2phub's CUDA backend: CUDA allocations -> validated ranges and dma-buf fds (cuda-python)."""

from .backend import CudaBackend, PinnedBuffer, backend, stream_handle

__all__ = ["CudaBackend", "PinnedBuffer", "backend", "stream_handle"]
