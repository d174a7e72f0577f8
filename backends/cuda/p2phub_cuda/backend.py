"""CUDA allocations for p2phub: recognise, validate, export as dma-buf; staging copies.

Accepted objects: ``(ptr, nbytes)`` tuples, torch CUDA tensors, anything with
``__cuda_array_interface__`` (CuPy, Numba, ...), and DLPack producers on a
CUDA device. The range must lie inside device memory of one allocation:
``cuMemAlloc`` memory (torch's caching allocator takes its segments from it),
or a VMM reservation (``cuMemCreate`` + ``cuMemMap``, torch's expandable
segments) whose range is mapped contiguously by chunks of one device with one
set of allocation properties. Host, pinned-host and managed memory are
refused, as are freed pointers, ranges that run into a neighbouring
``cuMemAlloc`` allocation, and (for dma-buf export) ranges not aligned to the
host page.

Exports ask for the PCIe (BAR1) mapping type where the driver offers it
(``CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE``) and fall back to the
driver's default mapping where it refuses the flag; ``GpuRange.keepalive``
records which one was used. Every exported range gets
``CU_POINTER_ATTRIBUTE_SYNC_MEMOPS`` so a synchronous cuMemcpy into it is
complete before a peer device reads it.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

from p2phub import arrays
from p2phub.arrays import KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED
from p2phub.backend import GpuRange, check_range, describe
from p2phub.errors import P2PHubOSError, UsageError
from p2phub.hostmem import HugeMapping

try:  # cuda-python >= 12.6 layout first, then the older one
    from cuda.bindings import driver as cu  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    from cuda import cuda as cu  # type: ignore[import-not-found,no-redef]

HOST_PAGE = 4096
DLPACK = arrays.DLPackDevices("CUDA", (KDL_CUDA,), {
    KDL_CUDA_MANAGED: "CUDA managed memory", KDL_CUDA_HOST: "CUDA pinned host memory, not device memory"})

# cuda-python 12.8+ / 13 name it CUmemRangeFlags.CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE (0x1)
_FLAGS = getattr(cu, "CUmemRangeFlags", None)
_HOSTREGISTER_PORTABLE = getattr(cu, "CU_MEMHOSTREGISTER_PORTABLE", 0x01)
DMA_BUF_MAPPING_TYPE_PCIE = int(getattr(_FLAGS, "CU_MEM_RANGE_FLAG_DMA_BUF_MAPPING_TYPE_PCIE", 1)) \
    if _FLAGS is not None else 0


class CudaError(P2PHubOSError):
    """A CUDA driver call failed; carries the CUresult name."""

    def __init__(self, what: str, result: Any) -> None:
        name = getattr(result, "name", str(result))
        super().__init__(5, what, f"{name}")  # EIO: the driver said no
        self.result = result


def _check(result: Any, what: str) -> None:
    if int(result) != 0:
        raise CudaError(what, result)


def _name(result: Any) -> str:
    return getattr(result, "name", str(result))


# ------------------------------------------------------------------ streams


def stream_handle(stream: Any) -> int:
    """The raw CUstream of `stream`: None (legacy default stream, 0), an int handle,
    a cuda.bindings ``CUstream``, a torch ``torch.cuda.Stream`` (``.cuda_stream``), a CuPy
    stream (``.ptr``), a cuda.core stream (``.handle``) or anything with ``__cuda_stream__``."""
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        return int(value[1])
    handle = arrays.stream_handle(stream, "CUDA", ("cuda_stream", "ptr", "handle"))  # torch, CuPy, cuda.core
    if handle is not None:
        return handle
    if type(stream).__name__ == "CUstream" or hasattr(stream, "getPtr"):
        return int(stream)                           # cuda.bindings CUstream
    raise UsageError(f"{describe(stream)} is not a CUDA stream (want a torch.cuda.Stream, a CuPy "
                     "stream, a cuda.bindings CUstream, an int handle or None)")


# ------------------------------------------------------------------ pinned host memory


@dataclass
class PinnedBuffer:
    """Page-locked host memory (cuMemHostAlloc): ``ptr``, ``size`` and a writable ``view``."""

    ptr: int
    size: int
    view: memoryview

    def close(self) -> None:
        if self.ptr:
            self.view.release()
            cu.cuMemFreeHost(self.ptr)
            self.ptr = 0


@dataclass
class RegisteredHugeBuffer(PinnedBuffer):
    """Page-locked host memory on transparent huge pages (p2phub.hostmem.HugeMapping),
    registered with CUDA (cuMemHostRegister): what disks read into as few segments."""

    mapping: Any = None

    def close(self) -> None:
        if self.ptr:
            self.view.release()
            cu.cuMemHostUnregister(self.ptr)
            self.ptr = 0
            self.mapping.close()


class CudaBackend:
    name = "cuda"

    def __init__(self) -> None:
        self._ready = False
        self._ctx: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.last_mapping = ""

    def _init(self) -> None:
        if not self._ready:
            (err,) = cu.cuInit(0)
            _check(err, "cuInit")
            self._ready = True

    # ------------------------------------------------------------- recognise

    def claims(self, obj: Any) -> bool:
        if arrays.is_raw_range(obj):
            return True
        if arrays.is_torch_gpu_tensor(obj):
            return not arrays.torch_is_hip()   # torch on ROCm reports is_cuda too
        if hasattr(obj, "__cuda_array_interface__"):
            return not arrays.arrays_are_hip()   # CuPy and torch on ROCm use the CUDA protocol name
        if hasattr(obj, "__dlpack_device__"):
            return arrays.dlpack_device(obj) in (KDL_CUDA, KDL_CUDA_MANAGED)
        return False

    @staticmethod
    def _span(obj: Any) -> tuple[int, int]:
        """(pointer, bytes) of a contiguous object."""
        return arrays.span(obj, DLPACK)

    # ------------------------------------------------------------- identify

    def cache_key(self, obj: Any, offset: int = 0, length: int | None = None) -> Any:
        """The allocation's buffer id (CU_POINTER_ATTRIBUTE_BUFFER_ID) and the range: unique for
        the process's lifetime, so a range freed and allocated again at the same address misses."""
        self._init()
        ptr, nbytes = self._span(obj)
        offset, length = check_range(offset, length, nbytes, describe(obj))
        ptr += offset
        err, buffer_id = cu.cuPointerGetAttribute(
            cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_BUFFER_ID, ptr)
        if int(err) != 0:
            return None  # not CUDA memory: resolve() says why
        return int(buffer_id), ptr, length

    # ------------------------------------------------------------- validate

    def resolve(self, obj: Any, offset: int = 0, length: int | None = None,
                export_dmabuf: bool = True) -> GpuRange:
        self._init()
        what = describe(obj)
        ptr, nbytes = self._span(obj)
        if ptr == 0:
            raise UsageError(f"{what}: null pointer")
        offset, length = check_range(offset, length, nbytes, what)
        ptr += offset

        memtype, managed, ordinal = self._pointer_attributes(ptr, what)
        if managed:
            raise UsageError(f"{what}: {ptr:#x} is CUDA managed (unified) memory, which "
                             "cannot be pinned for peer-to-peer DMA; use cuMemAlloc memory")
        if memtype != int(cu.CUmemorytype.CU_MEMORYTYPE_DEVICE):
            raise UsageError(f"{what}: {ptr:#x} is not device memory (CUmemorytype {memtype}: "
                             "pinned host memory); host memory registers through "
                             "hub.alloc_host()")
        base, size, kind = self.allocation_of(ptr, length, what)
        err, bus_id = cu.cuDeviceGetPCIBusId(32, ordinal)
        _check(err, "cuDeviceGetPCIBusId")
        pci = bus_id.decode().rstrip("\x00") if isinstance(bus_id, bytes) else str(bus_id)

        rng = GpuRange("cuda", ordinal, ptr, length, base, size, pci.lower(), keepalive=[obj])
        rng.keepalive.append({"alloc_kind": kind})
        if export_dmabuf:
            rng.dmabuf_fd = self.export_dmabuf(ptr, length, what)
            rng.keepalive[-1]["mapping"] = self.last_mapping
            rng.keepalive[-1]["sync_memops"] = self.set_sync_memops(ptr, what, kind)
        return rng

    def _pointer_attributes(self, ptr: int, what: str) -> tuple[int, bool, int]:
        A = cu.CUpointer_attribute
        out = []
        for attr in (A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, A.CU_POINTER_ATTRIBUTE_IS_MANAGED,
                     A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL):
            err, value = cu.cuPointerGetAttribute(attr, ptr)
            if int(err) != 0:
                raise UsageError(f"{what}: {ptr:#x} is not CUDA memory: plain host memory, or an "
                                 f"allocation that was freed ({_name(err)})")
            out.append(int(value))
        return out[0], bool(out[1]), out[2]

    def allocation_of(self, ptr: int, length: int, what: str = "range") -> tuple[int, int, str]:
        """(base, size, kind) of the allocation that holds [ptr, ptr + length).

        kind is "cuMemAlloc" or "vmm". A cuMemAlloc range must end inside its allocation.
        A VMM range may cross the chunks that torch's expandable segments (or any
        cuMemCreate user) map back to back, if each is mapped, on one device, with the
        same allocation properties (what cuMemGetHandleForAddressRange requires)."""
        err, base, size = cu.cuMemGetAddressRange(ptr)
        if int(err) != 0:
            raise UsageError(f"{what}: {ptr:#x} is not inside a live CUDA allocation "
                             f"({_name(err)}); was it freed?")
        base, size = int(base), int(size)
        props = self._vmm_props(ptr)
        if props is None:
            if ptr + length > base + size:
                raise UsageError(f"{what}: range {ptr:#x}+{length:#x} runs past its allocation "
                                 f"{base:#x}+{size:#x} (spans two allocations)")
            return base, size, "cuMemAlloc"
        first, end = base, base + size
        while end < ptr + length:
            err, nbase, nsize = cu.cuMemGetAddressRange(end)
            nprops = self._vmm_props(end) if int(err) == 0 else None
            if int(err) != 0 or int(nbase) != end or nprops is None:
                raise UsageError(f"{what}: range {ptr:#x}+{length:#x} runs past the mapped memory "
                                 f"at {end:#x} (spans two allocations, or an unmapped hole)")
            if nprops != props:
                raise UsageError(f"{what}: range {ptr:#x}+{length:#x} spans two allocations with "
                                 f"different properties at {end:#x} ({props} vs {nprops})")
            end = int(nbase) + int(nsize)
        return first, end - first, "vmm"

    @staticmethod
    def _vmm_props(ptr: int) -> tuple[int, int, int] | None:
        """(type, location type, location id) of the cuMemCreate handle mapped at ptr, or
        None when ptr is not VMM memory (cuMemAlloc memory has no retainable handle)."""
        err, handle = cu.cuMemRetainAllocationHandle(ptr)
        if int(err) != 0:
            return None
        try:
            err, prop = cu.cuMemGetAllocationPropertiesFromHandle(handle)
            if int(err) != 0:
                return (-1, -1, -1)
            return (int(prop.type), int(prop.location.type), int(prop.location.id))
        finally:
            cu.cuMemRelease(handle)

    def set_sync_memops(self, ptr: int, what: str = "range", kind: str = "cuMemAlloc") -> bool:
        """CU_POINTER_ATTRIBUTE_SYNC_MEMOPS: synchronous copies into the allocation are done
        when they return (a peer may read right after). The driver refuses the attribute
        for VMM memory (CUDA_ERROR_NOT_SUPPORTED, seen on the H200 with driver 580), whose
        synchronous copies it already completes before returning; False then."""
        one = ctypes.c_uint(1)
        (err,) = cu.cuPointerSetAttribute(
            one, cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_SYNC_MEMOPS, ptr)
        if kind == "vmm" and int(err) == int(cu.CUresult.CUDA_ERROR_NOT_SUPPORTED):
            return False
        _check(err, f"{what}: cuPointerSetAttribute(SYNC_MEMOPS, {ptr:#x})")
        return True

    # ------------------------------------------------------------- export

    def export_dmabuf(self, ptr: int, length: int, what: str = "range") -> int:
        """A dma-buf fd of exactly [ptr, ptr + length) (cuMemGetHandleForAddressRange),
        mapped through PCIe BAR1 where the driver offers that mapping type."""
        if ptr % HOST_PAGE or length % HOST_PAGE:
            raise UsageError(f"{what}: dma-buf export needs a range aligned to {HOST_PAGE} "
                             f"bytes (ptr={ptr:#x}, length={length:#x}): misaligned range")
        kind = cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
        if DMA_BUF_MAPPING_TYPE_PCIE:
            err, fd = cu.cuMemGetHandleForAddressRange(ptr, length, kind, DMA_BUF_MAPPING_TYPE_PCIE)
            if int(err) == 0:
                self.last_mapping = "pcie"
                return int(fd)
        err, fd = cu.cuMemGetHandleForAddressRange(ptr, length, kind, 0)
        _check(err, f"cuMemGetHandleForAddressRange({ptr:#x}, {length:#x})")
        self.last_mapping = "default"
        return int(fd)

    def device_attribute(self, name: str, ordinal: int = 0) -> int:
        self._init()
        err, dev = cu.cuDeviceGet(ordinal)
        _check(err, "cuDeviceGet")
        err, value = cu.cuDeviceGetAttribute(getattr(cu.CUdevice_attribute, name), dev)
        _check(err, f"cuDeviceGetAttribute({name})")
        return int(value)

    def dmabuf_supported(self, ordinal: int = 0) -> bool:
        return bool(self.device_attribute("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED", ordinal))

    # ------------------------------------------------------------- staging (p2phub.staged)

    def bind_thread(self, ordinal: int = 0) -> None:
        """Make the device's primary context current on the calling thread (torch's too)."""
        self._init()
        with self._lock:
            ctx = self._ctx.get(ordinal)
            if ctx is None:
                err, dev = cu.cuDeviceGet(ordinal)
                _check(err, "cuDeviceGet")
                err, ctx = cu.cuDevicePrimaryCtxRetain(dev)
                _check(err, "cuDevicePrimaryCtxRetain")
                self._ctx[ordinal] = ctx
        (err,) = cu.cuCtxSetCurrent(ctx)
        _check(err, "cuCtxSetCurrent")

    def pinned(self, size: int) -> PinnedBuffer:
        """Page-locked host memory for staging: a huge-page mapping registered with CUDA
        (an O_DIRECT read into it is one segment per 2 MiB: a disk takes large reads in
        fewer requests), or cuMemHostAlloc memory where registering it fails."""
        m = HugeMapping(size)
        (err,) = cu.cuMemHostRegister(m.ptr, m.length, _HOSTREGISTER_PORTABLE)
        if int(err) == 0:
            return RegisteredHugeBuffer(m.ptr, size, m.view(), m)
        m.close()
        err, ptr = cu.cuMemHostAlloc(size, cu.CU_MEMHOSTALLOC_PORTABLE)
        _check(err, f"cuMemHostAlloc({size})")
        ptr = int(ptr)
        view = memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")
        return PinnedBuffer(ptr, size, view)

    def stream_create(self) -> int:
        err, s = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        _check(err, "cuStreamCreate")
        return int(s)

    def stream_destroy(self, stream: int) -> None:
        cu.cuStreamDestroy(stream)

    def stream_synchronize(self, stream: Any) -> None:
        (err,) = cu.cuStreamSynchronize(stream_handle(stream))
        _check(err, "cuStreamSynchronize")

    def copy_h2d(self, dst: int, src: int, n: int, stream: int) -> None:
        (err,) = cu.cuMemcpyHtoDAsync(dst, src, n, stream)
        _check(err, f"cuMemcpyHtoDAsync({dst:#x}, {n})")

    def copy_d2h(self, dst: int, src: int, n: int, stream: int) -> None:
        (err,) = cu.cuMemcpyDtoHAsync(dst, src, n, stream)
        _check(err, f"cuMemcpyDtoHAsync({src:#x}, {n})")

    def event_create(self) -> int:
        err, ev = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        _check(err, "cuEventCreate")
        return int(ev)

    def event_destroy(self, ev: int) -> None:
        cu.cuEventDestroy(ev)

    def event_record(self, ev: int, stream: Any) -> None:
        (err,) = cu.cuEventRecord(ev, stream_handle(stream))
        _check(err, "cuEventRecord")

    def event_synchronize(self, ev: int) -> None:
        (err,) = cu.cuEventSynchronize(ev)
        _check(err, "cuEventSynchronize")

    def event_query(self, ev: int) -> bool:
        (err,) = cu.cuEventQuery(ev)
        if int(err) == int(cu.CUresult.CUDA_ERROR_NOT_READY):
            return False
        _check(err, "cuEventQuery")
        return True

    def stream_wait_event(self, stream: Any, ev: int) -> None:
        (err,) = cu.cuStreamWaitEvent(stream_handle(stream), ev, 0)
        _check(err, "cuStreamWaitEvent")


_BACKEND: CudaBackend | None = None


def backend() -> CudaBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = CudaBackend()
    return _BACKEND
