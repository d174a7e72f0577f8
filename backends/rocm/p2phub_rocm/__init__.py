"""p2phub's ROCm backend (hip-python): ROCm allocations -> validated ranges and dma-buf fds,
stream ordering (hipStreamWaitValue32/hipStreamWriteValue32, events) and staging copies.

Untested on AMD hardware; see backend.py for how it is tested."""

from .backend import CompletionWords, PinnedBuffer, RocmBackend, RocmError, backend, stream_ops

__all__ = ["CompletionWords", "PinnedBuffer", "RocmBackend", "RocmError", "backend", "stream_ops"]
