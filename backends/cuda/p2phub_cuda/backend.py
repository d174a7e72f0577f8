"""CUDA allocations for p2phub: recognise, validate, export as dma-buf.

Accepted objects: ``(ptr, nbytes)`` tuples, torch CUDA tensors, anything with
``__cuda_array_interface__`` (CuPy, Numba, ...), and DLPack producers on a
CUDA device. The range must lie inside one cuMemAlloc'd allocation of device
memory: host, pinned-host and managed memory are refused, as are freed
pointers and ranges that run into a neighbouring allocation.
"""

from __future__ import annotations

import ctypes
from typing import Any

from p2phub.backend import GpuRange, check_range, describe
from p2phub.errors import P2PHubOSError, UsageError

try:  # cuda-python >= 12.6 layout first, then the older one
    from cuda.bindings import driver as cu  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the installed cuda-python
    from cuda import cuda as cu  # type: ignore[import-not-found,no-redef]

HOST_PAGE = 4096
KDL_CUDA = 2          # DLPack device types: CUDA, CUDA managed
KDL_CUDA_MANAGED = 13


class CudaError(P2PHubOSError):
    """A CUDA driver call failed; carries the CUresult name."""

    def __init__(self, what: str, result: Any) -> None:
        name = getattr(result, "name", str(result))
        super().__init__(5, what, f"{name}")  # EIO: the driver said no
        self.result = result


def _check(result: Any, what: str) -> None:
    if int(result) != 0:
        raise CudaError(what, result)


class CudaBackend:
    name = "cuda"

    def __init__(self) -> None:
        self._ready = False

    def _init(self) -> None:
        if not self._ready:
            (err,) = cu.cuInit(0)
            _check(err, "cuInit")
            self._ready = True

    # ------------------------------------------------------------- recognise

    def claims(self, obj: Any) -> bool:
        if isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(x, int) for x in obj):
            return True
        if getattr(obj, "is_cuda", False) and hasattr(obj, "data_ptr"):
            return True
        if hasattr(obj, "__cuda_array_interface__"):
            return True
        if hasattr(obj, "__dlpack_device__"):
            try:
                return obj.__dlpack_device__()[0] in (KDL_CUDA, KDL_CUDA_MANAGED)
            except Exception:
                return False
        return False

    @staticmethod
    def _span(obj: Any) -> tuple[int, int]:
        """(pointer, bytes) of a contiguous object."""
        if isinstance(obj, tuple):
            ptr, nbytes = obj
            return ptr, nbytes
        if getattr(obj, "is_cuda", False) and hasattr(obj, "data_ptr"):
            if not obj.is_contiguous():
                raise UsageError(f"{describe(obj)}: tensor is not contiguous")
            return obj.data_ptr(), obj.numel() * obj.element_size()
        if hasattr(obj, "__cuda_array_interface__"):
            cai = obj.__cuda_array_interface__
            ptr = cai["data"][0]
            itemsize = int(cai["typestr"][2:])
            n = 1
            for dim in cai["shape"]:
                n *= dim
            strides = cai.get("strides")
            if strides is not None:
                expect = itemsize
                for dim, stride in zip(reversed(cai["shape"]), reversed(strides)):
                    if dim > 1 and stride != expect:
                        raise UsageError(f"{describe(obj)}: array is not C-contiguous")
                    expect *= dim
            return ptr, n * itemsize
        return _dlpack_span(obj)

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
            raise UsageError(f"{what}: {ptr:#x} is not device memory (CUmemorytype {memtype}); "
                             "host memory registers through p2phub's host backend")
        err, base, size = cu.cuMemGetAddressRange(ptr)
        if int(err) != 0:
            raise UsageError(f"{what}: {ptr:#x} is not inside a live CUDA allocation "
                             f"({getattr(err, 'name', err)}); was it freed?")
        base, size = int(base), int(size)
        if ptr + length > base + size:
            raise UsageError(f"{what}: range {ptr:#x}+{length:#x} runs past its allocation "
                             f"{base:#x}+{size:#x} (spans two allocations)")
        err, bus_id = cu.cuDeviceGetPCIBusId(32, ordinal)
        _check(err, "cuDeviceGetPCIBusId")
        pci = bus_id.decode().rstrip("\x00") if isinstance(bus_id, bytes) else str(bus_id)

        rng = GpuRange("cuda", ordinal, ptr, length, base, size, pci.lower(), keepalive=[obj])
        if export_dmabuf:
            rng.dmabuf_fd = self.export_dmabuf(ptr, length, what)
        return rng

    def _pointer_attributes(self, ptr: int, what: str) -> tuple[int, bool, int]:
        A = cu.CUpointer_attribute
        out = []
        for attr in (A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, A.CU_POINTER_ATTRIBUTE_IS_MANAGED,
                     A.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL):
            err, value = cu.cuPointerGetAttribute(attr, ptr)
            if int(err) != 0:
                raise UsageError(f"{what}: {ptr:#x} is not CUDA memory "
                                 f"({getattr(err, 'name', err)})")
            out.append(int(value))
        return out[0], bool(out[1]), out[2]

    # ------------------------------------------------------------- export

    def export_dmabuf(self, ptr: int, length: int, what: str = "range") -> int:
        """A dma-buf fd of exactly [ptr, ptr + length) (cuMemGetHandleForAddressRange)."""
        if ptr % HOST_PAGE or length % HOST_PAGE:
            raise UsageError(f"{what}: dma-buf export needs a range aligned to {HOST_PAGE} "
                             f"bytes (ptr={ptr:#x}, length={length:#x})")
        err, fd = cu.cuMemGetHandleForAddressRange(
            ptr, length, cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
        _check(err, f"cuMemGetHandleForAddressRange({ptr:#x}, {length:#x})")
        return int(fd)

    def dmabuf_supported(self, ordinal: int = 0) -> bool:
        self._init()
        err, dev = cu.cuDeviceGet(ordinal)
        _check(err, "cuDeviceGet")
        err, value = cu.cuDeviceGetAttribute(
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev)
        _check(err, "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)")
        return bool(value)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def _dlpack_span(obj: Any) -> tuple[int, int]:
    """(pointer, bytes) of a DLPack producer, read without consuming the capsule."""
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    t = _DLTensor.from_address(get(capsule, b"dltensor"))  # DLManagedTensor starts with DLTensor
    if t.device.device_type == KDL_CUDA_MANAGED:
        raise UsageError(f"{describe(obj)}: DLPack tensor is in CUDA managed memory")
    n = 1
    for i in range(t.ndim):
        n *= t.shape[i]
    itemsize = (t.dtype.bits * t.dtype.lanes + 7) // 8
    if t.strides:
        expect = 1
        for i in reversed(range(t.ndim)):
            if t.shape[i] > 1 and t.strides[i] != expect:
                raise UsageError(f"{describe(obj)}: DLPack tensor is not contiguous")
            expect *= t.shape[i]
    return int(t.data or 0) + int(t.byte_offset), n * itemsize


_BACKEND: CudaBackend | None = None


def backend() -> CudaBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = CudaBackend()
    return _BACKEND
