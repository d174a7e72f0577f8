"""(pointer, bytes) of array protocol objects: __cuda_array_interface__ and DLPack."""

from __future__ import annotations

import ctypes
from typing import Any

from p2phub.backend import describe
from p2phub.errors import UsageError

KDL_ROCM = 10
KDL_ROCM_HOST = 11


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


def dlpack_span(obj: Any) -> tuple[int, int]:
    """(pointer, bytes) of a DLPack producer on a ROCm device, read without consuming the
    capsule (a DLManagedTensor starts with its DLTensor)."""
    what = describe(obj)
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    t = DLTensor.from_address(get(capsule, b"dltensor"))
    if t.device.device_type == KDL_ROCM_HOST:
        raise UsageError(f"{what}: DLPack tensor is in ROCm pinned host memory, not device memory")
    if t.device.device_type != KDL_ROCM:
        raise UsageError(f"{what}: DLPack device type {t.device.device_type} is not ROCm "
                         f"({KDL_ROCM})")
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
