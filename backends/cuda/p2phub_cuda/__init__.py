"""p2phub's CUDA backend: CUDA allocations -> validated ranges and dma-buf fds (cuda-python)."""

from .backend import CudaBackend, backend

__all__ = ["CudaBackend", "backend"]
