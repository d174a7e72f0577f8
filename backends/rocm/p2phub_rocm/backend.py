"""ROCm allocations for p2phub through hip-python: recognise, validate, export as dma-buf,
order streams, stage copies.

Untested on AMD hardware: it is tested against the real hip-python bindings with
Debian's libamdhip64 and no AMD GPU (every call fails with a RocmError, never a
crash) and with fakes below the hip-python call boundary for the success paths.

Accepted objects: ``(ptr, nbytes)`` tuples, torch ROCm tensors (torch built
with HIP reports ``is_cuda``), ``__cuda_array_interface__`` objects of HIP
arrays (CuPy on ROCm), and DLPack producers on a ROCm device (kDLROCM). The
range must lie inside one hipMalloc allocation of device memory; host and
managed memory, freed pointers, ranges past their allocation and (for dma-buf
export) ranges not aligned to the host page are refused.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any, Callable

from p2phub import arrays
from p2phub.arrays import KDL_ROCM, KDL_ROCM_HOST
from p2phub.backend import GpuRange, check_range, describe
from p2phub.errors import P2PHubOSError, UsageError

from hip import hip  # type: ignore[import-not-found]  # hip-python; imports without ROCm

HOST_PAGE = 4096
DLPACK = arrays.DLPackDevices("ROCm", (KDL_ROCM,), {
    KDL_ROCM_HOST: "ROCm pinned host memory, not device memory"})
U32 = 0xFFFFFFFF


class RocmError(P2PHubOSError):
    """A HIP runtime call failed (or the runtime lacks it); carries the hipError_t name."""

    def __init__(self, what: str, detail: str, result: Any = None) -> None:
        super().__init__(5, what, detail)   # EIO: the runtime said no
        self.result = result


def _err_text(err: Any) -> str:
    name = getattr(err, "name", str(err))
    try:
        _, text = hip.hipGetErrorString(err)  # hip-python returns (hipSuccess, text) here
        text = (text.decode() if isinstance(text, bytes) else str(text)).strip("\x00 \n")
    except Exception:  # noqa: BLE001 - the name alone still says what happened
        text = ""
    hint = ""
    if "NoDevice" in name or "InvalidDevice" in name:
        hint = " (no AMD GPU visible: is the amdgpu driver loaded and /dev/kfd accessible?)"
    return f"{name}{': ' + text if text and text != name else ''}{hint}"


def call(what: str, fn: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    """Call a hip-python function; return the values after its hipError_t, or raise
    RocmError for a failed call or a runtime that lacks the symbol (RuntimeError from
    hip-python's loader)."""
    try:
        out = fn(*args)
    except RuntimeError as exc:
        raise RocmError(what, _loader_text(exc)) from None
    if not isinstance(out, tuple):
        out = (out,)
    err, rest = out[0], out[1:]
    if int(err) != 0:
        raise RocmError(what, _err_text(err), err)
    return rest


def _loader_text(exc: RuntimeError) -> str:
    msg = str(exc)
    if "dlsym" in msg:
        return (f"the HIP runtime (libamdhip64) has no such function; it is older than this "
                f"call needs ({msg})")
    if "dlopen" in msg:
        return f"no HIP runtime: libamdhip64.so cannot be loaded (install ROCm) ({msg})"
    return f"hip-python could not make the call: {msg}"


# ------------------------------------------------------------------ pinned memory and words


@dataclass
class PinnedBuffer:
    """hipHostMalloc'd memory: ``ptr``, ``size``, a writable ``view``; ``dev_ptr`` for mapped."""

    ptr: int
    size: int
    view: memoryview
    dev_ptr: int = 0

    def close(self) -> None:
        if self.ptr:
            self.view.release()
            call("hipHostFree", hip.hipHostFree, self.ptr)
            self.ptr = 0


class CompletionWords:
    """`count` zeroed 32-bit words of pinned host memory mapped for the device."""

    def __init__(self, count: int) -> None:
        if count <= 0:
            raise UsageError(f"count={count} must be positive")
        (host,) = call(f"hipHostMalloc({4 * count}, Mapped)", hip.hipHostMalloc, 4 * count,
                       hip.hipHostMallocMapped)
        self.host_ptr = _addr(host)
        self.count = count
        ctypes.memset(self.host_ptr, 0, 4 * count)
        try:
            (dev,) = call("hipHostGetDevicePointer", hip.hipHostGetDevicePointer, self.host_ptr, 0)
        except BaseException:
            hip.hipHostFree(self.host_ptr)
            raise
        self.dev_ptr = _addr(dev)

    def close(self) -> None:
        if self.host_ptr:
            call("hipHostFree", hip.hipHostFree, self.host_ptr)
            self.host_ptr = 0


def _addr(p: Any) -> int:
    """An address from whatever hip-python hands back (an int or a Pointer-like object)."""
    if p is None:
        return 0
    if isinstance(p, int):
        return p
    try:
        return int(p)
    except TypeError:
        return int(p.as_c_void_p().value or 0)


class RocmBackend:
    name = "rocm"

    def __init__(self) -> None:
        self._ready = False
        self._lock = threading.Lock()

    def _init(self) -> None:
        if not self._ready:
            call("hipInit", hip.hipInit, 0)
            (count,) = call("hipGetDeviceCount", hip.hipGetDeviceCount)
            if int(count) == 0:
                raise RocmError("hipGetDeviceCount", "no AMD GPU visible")
            self._ready = True

    # ------------------------------------------------------------- recognise

    def claims(self, obj: Any) -> bool:
        if arrays.is_raw_range(obj):
            return True
        if arrays.is_torch_gpu_tensor(obj):
            return arrays.torch_is_hip()
        if hasattr(obj, "__dlpack_device__"):
            if arrays.dlpack_device(obj) == KDL_ROCM:
                return True
        if hasattr(obj, "__cuda_array_interface__"):
            # CuPy on ROCm and other HIP arrays use the CUDA name for the protocol.
            return arrays.arrays_are_hip()
        return False

    @staticmethod
    def _span(obj: Any) -> tuple[int, int]:
        return arrays.span(obj, DLPACK)

    # ------------------------------------------------------------- validate

    def resolve(self, obj: Any, offset: int = 0, length: int | None = None,
                export_dmabuf: bool = True) -> GpuRange:
        what = describe(obj)
        ptr, nbytes = self._span(obj)
        if ptr == 0:
            raise UsageError(f"{what}: null pointer")
        offset, length = check_range(offset, length, nbytes, what)
        ptr += offset
        self._init()
        try:
            (attrs,) = call(f"hipPointerGetAttributes({ptr:#x})", hip.hipPointerGetAttributes, ptr)
        except RocmError as exc:
            if "InvalidValue" in exc.detail:
                raise UsageError(f"{what}: {ptr:#x} is not HIP memory: plain host memory, or an "
                                 f"allocation that was freed ({exc.detail})") from None
            raise
        if bool(attrs.isManaged) or int(attrs.type) == int(hip.hipMemoryType.hipMemoryTypeManaged):
            raise UsageError(f"{what}: {ptr:#x} is HIP managed memory, which cannot be pinned "
                             "for peer-to-peer DMA; use hipMalloc memory")
        if int(attrs.type) != int(hip.hipMemoryType.hipMemoryTypeDevice):
            raise UsageError(f"{what}: {ptr:#x} is not device memory (hipMemoryType "
                             f"{getattr(attrs.type, 'name', attrs.type)}); host memory registers "
                             "through hub.alloc_host()")
        ordinal = int(attrs.device)
        try:
            base, size = call(f"hipMemGetAddressRange({ptr:#x})", hip.hipMemGetAddressRange, ptr)
        except RocmError as exc:
            raise UsageError(f"{what}: {ptr:#x} is not inside a live HIP allocation "
                             f"({exc.detail}); was it freed?") from None
        base, size = _addr(base), int(size)
        if ptr + length > base + size:
            raise UsageError(f"{what}: range {ptr:#x}+{length:#x} runs past its allocation "
                             f"{base:#x}+{size:#x} (spans two allocations)")
        (bus,) = call("hipDeviceGetPCIBusId", hip.hipDeviceGetPCIBusId, 32, ordinal)
        pci = bus.decode() if isinstance(bus, bytes) else str(bus)
        rng = GpuRange("rocm", ordinal, ptr, length, base, size, pci.rstrip("\x00").lower(),
                       keepalive=[obj])
        if export_dmabuf:
            rng.dmabuf_fd = self.export_dmabuf(ptr, length, what)
        return rng

    def export_dmabuf(self, ptr: int, length: int, what: str = "range") -> int:
        """A dma-buf fd of exactly [ptr, ptr + length) (hipMemGetHandleForAddressRange)."""
        if ptr % HOST_PAGE or length % HOST_PAGE:
            raise UsageError(f"{what}: dma-buf export needs a range aligned to {HOST_PAGE} "
                             f"bytes (ptr={ptr:#x}, length={length:#x}): misaligned range")
        fd = ctypes.c_int(-1)
        call(f"hipMemGetHandleForAddressRange({ptr:#x}, {length:#x})",
             hip.hipMemGetHandleForAddressRange, ctypes.addressof(fd), ptr, length,
             hip.hipMemRangeHandleType.hipMemRangeHandleTypeDmaBufFd, 0)
        if fd.value < 0:
            raise RocmError("hipMemGetHandleForAddressRange", f"returned fd {fd.value}")
        return fd.value

    # ------------------------------------------------------------- streams (p2phub.backend.StreamOps)

    def claims_stream(self, stream: Any) -> bool:
        if stream is None or (isinstance(stream, int) and not isinstance(stream, bool)):
            return True
        if type(stream).__name__ == "ihipStream_t":
            return True
        if hasattr(stream, "cuda_stream"):          # torch.cuda.Stream on a HIP build
            return arrays.torch_is_hip()
        if hasattr(stream, "ptr") and type(stream).__module__.startswith("cupy"):
            return arrays.cupy_is_hip()
        return False

    def stream_handle(self, stream: Any) -> int:
        handle = arrays.stream_handle(stream, "HIP", ("cuda_stream", "ptr"))   # torch, CuPy
        if handle is not None:
            return handle
        if type(stream).__name__ == "ihipStream_t":
            return _addr(stream)
        raise UsageError(f"{describe(stream)} is not a HIP stream (want a torch stream, a CuPy "
                         "stream, a hip-python hipStream_t, an int handle or None)")

    def stream_device(self, stream: Any) -> int:
        dev = getattr(getattr(stream, "device", None), "index", None)
        if isinstance(dev, int):
            return dev
        if stream is None or stream == 0:
            (cur,) = call("hipGetDevice", hip.hipGetDevice)
            return int(cur)
        (dev,) = call("hipStreamGetDevice", hip.hipStreamGetDevice, self.stream_handle(stream))
        return int(dev)

    def alloc_completion_words(self, n: int, device: int = 0) -> CompletionWords:
        self._init()
        self.bind_thread(device)
        return CompletionWords(n)

    def stream_wait_value32(self, stream: Any, dev_addr: int, value: int) -> None:
        """Wait until *word >= value. hipStreamWaitValueGte compares unsigned, so unlike
        CUDA's GEQ it is not wrap-safe: word values must stay below 2**32."""
        call("hipStreamWaitValue32", hip.hipStreamWaitValue32, self.stream_handle(stream),
             dev_addr, value & U32, hip.hipStreamWaitValueGte, U32)

    def stream_write_value32(self, stream: Any, dev_addr: int, value: int) -> None:
        call("hipStreamWriteValue32", hip.hipStreamWriteValue32, self.stream_handle(stream),
             dev_addr, value & U32, 0)

    def stream_synchronize(self, stream: Any) -> None:
        call("hipStreamSynchronize", hip.hipStreamSynchronize, self.stream_handle(stream))

    def rdma_flush_required(self, device: int = 0) -> bool:
        """HIP has no counterpart of cuFlushGPUDirectRDMAWrites or its ordering attribute."""
        return False

    def flush_rdma_writes(self, device: int = 0) -> None:
        """Nothing to call on ROCm (see rdma_flush_required)."""

    # events
    def event_create(self) -> int:
        (ev,) = call("hipEventCreateWithFlags", hip.hipEventCreateWithFlags,
                     hip.hipEventDisableTiming)
        return _addr(ev)

    def event_destroy(self, ev: int) -> None:
        call("hipEventDestroy", hip.hipEventDestroy, ev)

    def event_record(self, ev: int, stream: Any) -> None:
        call("hipEventRecord", hip.hipEventRecord, ev, self.stream_handle(stream))

    def event_synchronize(self, ev: int) -> None:
        call("hipEventSynchronize", hip.hipEventSynchronize, ev)

    def event_query(self, ev: int) -> bool:
        try:
            out = hip.hipEventQuery(ev)
        except RuntimeError as exc:
            raise RocmError("hipEventQuery", _loader_text(exc)) from None
        err = out[0] if isinstance(out, tuple) else out
        if int(err) == int(hip.hipError_t.hipErrorNotReady):
            return False
        if int(err) != 0:
            raise RocmError("hipEventQuery", _err_text(err), err)
        return True

    def stream_wait_event(self, stream: Any, ev: int) -> None:
        call("hipStreamWaitEvent", hip.hipStreamWaitEvent, self.stream_handle(stream), ev, 0)

    # ------------------------------------------------------------- staging (p2phub.staged)

    def bind_thread(self, ordinal: int = 0) -> None:
        call(f"hipSetDevice({ordinal})", hip.hipSetDevice, ordinal)

    def pinned(self, size: int) -> PinnedBuffer:
        (host,) = call(f"hipHostMalloc({size})", hip.hipHostMalloc, size, hip.hipHostMallocPortable)
        ptr = _addr(host)
        view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
        return PinnedBuffer(ptr, size, view)

    def stream_create(self) -> int:
        (s,) = call("hipStreamCreateWithFlags", hip.hipStreamCreateWithFlags, hip.hipStreamNonBlocking)
        return _addr(s)

    def stream_destroy(self, stream: int) -> None:
        call("hipStreamDestroy", hip.hipStreamDestroy, stream)

    def copy_h2d(self, dst: int, src: int, n: int, stream: int) -> None:
        call(f"hipMemcpyAsync(H2D, {n})", hip.hipMemcpyAsync, dst, src, n,
             hip.hipMemcpyKind.hipMemcpyHostToDevice, stream)

    def copy_d2h(self, dst: int, src: int, n: int, stream: int) -> None:
        call(f"hipMemcpyAsync(D2H, {n})", hip.hipMemcpyAsync, dst, src, n,
             hip.hipMemcpyKind.hipMemcpyDeviceToHost, stream)


_BACKEND: RocmBackend | None = None


def backend() -> RocmBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = RocmBackend()
    return _BACKEND


def stream_ops() -> RocmBackend:
    """The p2phub.backend.StreamOps of ROCm (the backend object itself)."""
    return backend()
