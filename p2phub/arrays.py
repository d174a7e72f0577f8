"""(pointer, bytes) of the GPU array objects users register, and the raw handles of their streams,
read the same way for every backend.

The objects: a ``(ptr, nbytes)`` tuple, a torch GPU tensor (``data_ptr()``), anything with
``__cuda_array_interface__`` (CuPy, Numba; CuPy and torch built for ROCm use the same protocol
name) and DLPack producers (``__dlpack__``, ``__dlpack_device__``). Each must be contiguous.
Whether the pointer is device memory of the backend's runtime is the backend's question (its
pointer attributes); of DLPack's device type, the backend says which ones it takes
(`DLPackDevices`). Streams come as None, an int handle or a library's stream object that holds
the handle in an attribute (`stream_handle`). Nothing here imports a GPU runtime.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from .backend import describe
from .errors import UsageError

# DLPack device types (dlpack.h, DLDeviceType)
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_ROCM = 10
KDL_ROCM_HOST = 11
KDL_CUDA_MANAGED = 13


@dataclass(frozen=True)
class DLPackDevices:
    """The DLPack device types a backend takes, and those it refuses with a reason."""

    runtime: str                                   # "CUDA", "ROCm": named in errors
    accepted: tuple[int, ...]                      # the backend validates these pointers itself
    refused: Mapping[int, str] = field(default_factory=dict)  # type -> what the memory is


# ------------------------------------------------------------------ which runtime an object is of


def is_raw_range(obj: Any) -> bool:
    """A ``(pointer, nbytes)`` tuple of two ints."""
    return isinstance(obj, tuple) and len(obj) == 2 and \
        all(isinstance(x, int) and not isinstance(x, bool) for x in obj)


def is_torch_gpu_tensor(obj: Any) -> bool:
    """A torch tensor on a GPU (torch built for ROCm reports ``is_cuda`` too)."""
    return hasattr(obj, "data_ptr") and bool(getattr(obj, "is_cuda", False))


def torch_is_hip() -> bool:
    """True when the torch loaded here is a ROCm build (its tensors are HIP memory)."""
    torch = sys.modules.get("torch")
    return getattr(getattr(torch, "version", None), "hip", None) is not None


def cupy_is_hip() -> bool:
    """True when the CuPy loaded here is a ROCm build. Never raises."""
    cupy = sys.modules.get("cupy")
    try:
        return bool(cupy and cupy.cuda.runtime.is_hip)
    except Exception:  # noqa: BLE001 - used by claims(), which never raises
        return False


def arrays_are_hip() -> bool:
    """True when the array libraries loaded here (torch, CuPy) are ROCm builds: their
    ``__cuda_array_interface__`` describes HIP memory. Never raises."""
    return torch_is_hip() or cupy_is_hip()


def dlpack_device(obj: Any) -> int | None:
    """The DLPack device type of `obj`, or None when it has none. Never raises."""
    try:
        return int(obj.__dlpack_device__()[0])
    except Exception:  # noqa: BLE001 - used by claims(), which never raises
        return None


# ------------------------------------------------------------------ spans


def span(obj: Any, devices: DLPackDevices) -> tuple[int, int]:
    """(pointer, bytes) of a contiguous GPU array of any of the kinds above."""
    if isinstance(obj, tuple):
        if not is_raw_range(obj):
            raise UsageError(f"{obj!r}: a raw range is a (pointer, nbytes) tuple of two ints")
        return obj[0], obj[1]
    if is_torch_gpu_tensor(obj):
        if not obj.is_contiguous():
            raise UsageError(f"{describe(obj)}: tensor is not contiguous")
        return obj.data_ptr(), obj.numel() * obj.element_size()
    if hasattr(obj, "__cuda_array_interface__"):
        return cai_span(obj)
    if hasattr(obj, "__dlpack__"):
        return dlpack_span(obj, devices)
    raise UsageError(f"{describe(obj)} is not a GPU array (want a (pointer, nbytes) tuple, a torch "
                     "tensor, a __cuda_array_interface__ object or a DLPack producer)")


def cai_span(obj: Any) -> tuple[int, int]:
    """(pointer, bytes) of a C-contiguous ``__cuda_array_interface__`` object."""
    cai = obj.__cuda_array_interface__
    ptr = cai["data"][0] or 0
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


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


def dlpack_span(obj: Any, devices: DLPackDevices) -> tuple[int, int]:
    """(pointer, bytes) of a contiguous DLPack producer on one of `devices`' device types.

    Reads the DLTensor without consuming the capsule (a DLManagedTensor starts with its
    DLTensor); the capsule lives until this returns, and `obj` owns the memory."""
    what = describe(obj)
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    t = DLTensor.from_address(get(capsule, b"dltensor"))
    kind = int(t.device.device_type)
    if kind in devices.refused:
        raise UsageError(f"{what}: DLPack tensor is in {devices.refused[kind]}")
    if kind not in devices.accepted:
        raise UsageError(f"{what}: DLPack device type {kind} is not {devices.runtime} "
                         f"({', '.join(map(str, devices.accepted))})")
    n = 1
    for i in range(t.ndim):
        n *= t.shape[i]
    itemsize = (t.dtype.bits * t.dtype.lanes + 7) // 8
    if t.strides:
        expect = 1
        for i in reversed(range(t.ndim)):
            if t.shape[i] > 1 and t.strides[i] != expect:
                raise UsageError(f"{what}: DLPack tensor is not contiguous")
            expect *= t.shape[i]
    return int(t.data or 0) + int(t.byte_offset), n * itemsize


# ------------------------------------------------------------------ streams


def stream_handle(stream: Any, runtime: str, attrs: tuple[str, ...]) -> int | None:
    """The raw stream handle of `stream` in the shapes GPU libraries share: None (the legacy
    default stream, 0), an int handle, or an object holding it in one of `attrs` (torch
    ``cuda_stream``, CuPy ``ptr``, cuda.core ``handle``). None when `stream` is none of these:
    the backend then tries its runtime's own stream types."""
    if stream is None:
        return 0
    if isinstance(stream, bool):
        raise UsageError(f"{stream!r} is not a {runtime} stream")
    if isinstance(stream, int):
        if stream < 0:
            raise UsageError(f"stream handle {stream} is negative")
        return stream
    for attr in attrs:
        value = getattr(stream, attr, None)
        if value is not None and not callable(value):
            return int(value)
    return None
