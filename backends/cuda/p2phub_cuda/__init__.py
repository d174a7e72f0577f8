"""p2phub's CUDA backend: CUDA allocations -> validated ranges and dma-buf fds (cuda-python)."""

from .backend import CudaBackend, PinnedBuffer, backend, stream_handle

__all__ = ["CudaBackend", "PinnedBuffer", "backend", "stream_handle", "stream_ops"]


def stream_ops():  # -> p2phub_cuda.streams.CudaStreamOps
    """Stream ops for p2phub.ordering (see p2phub.backend.StreamOps)."""
    from .streams import stream_ops as _ops
    return _ops()
