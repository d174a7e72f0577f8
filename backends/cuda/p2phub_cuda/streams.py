"""Stream ops for p2phub.ordering on CUDA (cuda-python): completion words in pinned,
device-mapped host memory, cuStreamWaitValue32 / cuStreamWriteValue32 on any stream
(torch, CuPy, cuda-python or a raw CUstream handle), and cuFlushGPUDirectRDMAWrites.

See p2phub.backend.StreamOps for the contract.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from p2phub.errors import UsageError

from .backend import CudaError, _check, cu, stream_handle

__all__ = ["CudaStreamOps", "HostWords", "stream_ops"]

# cudaHostAlloc flags (driver names): portable across contexts, mapped for the device.
_HOSTALLOC = None


def _flags() -> int:
    global _HOSTALLOC
    if _HOSTALLOC is None:
        _HOSTALLOC = int(cu.CU_MEMHOSTALLOC_PORTABLE) | int(cu.CU_MEMHOSTALLOC_DEVICEMAP)
    return _HOSTALLOC


class HostWords:
    """`count` zeroed 32-bit words of pinned host memory mapped for the device."""

    def __init__(self, count: int) -> None:
        import ctypes

        if count <= 0:
            raise UsageError(f"count={count} must be positive")
        self.count = count
        err, ptr = cu.cuMemHostAlloc(4 * count, _flags())
        _check(err, f"cuMemHostAlloc({4 * count}, DEVICEMAP)")
        self.host_ptr = int(ptr)
        ctypes.memset(self.host_ptr, 0, 4 * count)
        err, dptr = cu.cuMemHostGetDevicePointer(self.host_ptr, 0)
        if int(err) != 0:
            cu.cuMemFreeHost(self.host_ptr)
            raise CudaError("cuMemHostGetDevicePointer", err)
        self.dev_ptr = int(dptr)

    def close(self) -> None:
        if self.host_ptr:
            cu.cuMemFreeHost(self.host_ptr)
            self.host_ptr = 0


class CudaStreamOps:
    name = "cuda"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = False
        self._flush_cache: dict[int, bool] = {}
        # Testing and bring-up: force the flush step even where the GPU orders NIC writes.
        self.force_flush = os.environ.get("P2PHUB_FORCE_RDMA_FLUSH") == "1"

    # ------------------------------------------------------------------ context
    def _ctx(self, device: int = 0) -> None:
        """Make sure a context is current on this thread (the device's primary one)."""
        if not self._ready:
            (err,) = cu.cuInit(0)
            _check(err, "cuInit")
            self._ready = True
        err, ctx = cu.cuCtxGetCurrent()
        _check(err, "cuCtxGetCurrent")
        if int(ctx) != 0:
            return
        err, dev = cu.cuDeviceGet(device)
        _check(err, f"cuDeviceGet({device})")
        err, pctx = cu.cuDevicePrimaryCtxRetain(dev)
        _check(err, "cuDevicePrimaryCtxRetain")
        (err,) = cu.cuCtxSetCurrent(pctx)
        _check(err, "cuCtxSetCurrent")

    # ------------------------------------------------------------------ streams
    def claims_stream(self, stream: Any) -> bool:
        if isinstance(stream, bool):
            return False
        if isinstance(stream, int) or isinstance(stream, cu.CUstream):
            return True
        if hasattr(stream, "__cuda_stream__"):
            return True
        mod = type(stream).__module__
        if mod.startswith("torch") and hasattr(stream, "cuda_stream"):
            return True
        if mod.startswith("cupy") and hasattr(stream, "ptr"):
            return True
        return False

    def stream_handle(self, stream: Any) -> int:
        return stream_handle(stream)

    def stream_device(self, stream: Any) -> int:
        dev = getattr(stream, "device", None)
        idx = getattr(dev, "index", None)  # torch
        if isinstance(idx, int):
            return idx
        dev_id = getattr(stream, "device_id", None)  # cupy
        if isinstance(dev_id, int):
            return dev_id
        return 0

    def _cstream(self, stream: Any) -> Any:
        return cu.CUstream(self.stream_handle(stream))

    def alloc_completion_words(self, n: int, device: int = 0) -> HostWords:
        self._ctx(device)
        return HostWords(n)

    def stream_wait_value32(self, stream: Any, dev_addr: int, value: int) -> None:
        self._ctx(self.stream_device(stream))
        (err,) = cu.cuStreamWaitValue32(self._cstream(stream), cu.CUdeviceptr(dev_addr),
                                        cu.cuuint32_t(value & 0xFFFFFFFF),
                                        int(cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ))
        _check(err, "cuStreamWaitValue32(GEQ)")

    def stream_write_value32(self, stream: Any, dev_addr: int, value: int) -> None:
        self._ctx(self.stream_device(stream))
        (err,) = cu.cuStreamWriteValue32(
            self._cstream(stream), cu.CUdeviceptr(dev_addr), cu.cuuint32_t(value & 0xFFFFFFFF),
            int(cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT))
        _check(err, "cuStreamWriteValue32")

    def stream_synchronize(self, stream: Any) -> None:
        self._ctx(self.stream_device(stream))
        (err,) = cu.cuStreamSynchronize(self._cstream(stream))
        _check(err, "cuStreamSynchronize")

    # ------------------------------------------------------------------ RDMA writes
    def rdma_write_ordering(self, device: int = 0) -> tuple[int, int]:
        """(GPU_DIRECT_RDMA_WRITES_ORDERING, GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS)."""
        self._ctx(device)
        A = cu.CUdevice_attribute
        err, dev = cu.cuDeviceGet(device)
        _check(err, "cuDeviceGet")
        err, order = cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING, dev)
        _check(err, "cuDeviceGetAttribute(GPU_DIRECT_RDMA_WRITES_ORDERING)")
        err, opts = cu.cuDeviceGetAttribute(A.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS, dev)
        _check(err, "cuDeviceGetAttribute(GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS)")
        return int(order), int(opts)

    def rdma_flush_required(self, device: int = 0) -> bool:
        """A consumer on the owning GPU needs a flush when the GPU does not order NIC
        writes itself (ORDERING below OWNER = 100) and offers the host flush (option 1)."""
        if self.force_flush:
            return True
        with self._lock:
            cached = self._flush_cache.get(device)
        if cached is None:
            order, opts = self.rdma_write_ordering(device)
            owner = int(cu.CUGPUDirectRDMAWritesOrdering.CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER)
            host = int(cu.CUflushGPUDirectRDMAWritesOptions.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST)
            cached = order < owner and bool(opts & host)
            with self._lock:
                self._flush_cache[device] = cached
        return cached

    def flush_rdma_writes(self, device: int = 0) -> None:
        self._ctx(device)
        (err,) = cu.cuFlushGPUDirectRDMAWrites(
            cu.CUflushGPUDirectRDMAWritesTarget.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
            cu.CUflushGPUDirectRDMAWritesScope.CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)
        _check(err, "cuFlushGPUDirectRDMAWrites(CURRENT_CTX, TO_OWNER)")


_OPS: CudaStreamOps | None = None


def stream_ops() -> CudaStreamOps:
    global _OPS
    if _OPS is None:
        _OPS = CudaStreamOps()
    return _OPS
