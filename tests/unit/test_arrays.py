"""p2phub.arrays: the (pointer, bytes) of GPU array objects, read once for the CUDA and ROCm backends.

The objects are fakes of the protocols (a torch-like tensor, a ``__cuda_array_interface__`` dict, a
DLPack capsule over a real DLManagedTensor); the CUDA backend is imported over a stand-in
``cuda.bindings.driver`` module to show that its claims and spans are the shared ones.
"""

from __future__ import annotations

import ctypes
import importlib
import sys
import types
from typing import Any

import pytest

from p2phub import arrays
from p2phub.arrays import DLPackDevices, DLTensor
from p2phub.errors import UsageError

pytestmark = pytest.mark.unit

GPU = DLPackDevices("Test", (arrays.KDL_CUDA,), {arrays.KDL_CUDA_MANAGED: "managed memory"})


class Tensor:
    """torch's shape of a GPU tensor."""

    is_cuda = True

    def __init__(self, ptr: int, n: int, size: int = 4, contiguous: bool = True) -> None:
        self.ptr, self.n, self.size, self.c = ptr, n, size, contiguous

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return self.size

    def is_contiguous(self) -> bool:
        return self.c


class CAI:
    def __init__(self, ptr: int | None, shape: tuple[int, ...], typestr: str = "<f4",
                 strides: tuple[int, ...] | None = None) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": typestr,
                                         "strides": strides, "version": 3}


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPack:
    """A DLPack producer; the capsule points at a DLManagedTensor this object owns."""

    def __init__(self, ptr: int, shape: tuple[int, ...], bits: int = 32, device: int = arrays.KDL_CUDA,
                 strides: tuple[int, ...] | None = None, byte_offset: int = 0) -> None:
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = (ctypes.c_int64 * len(strides))(*strides) if strides else None
        self.m = DLManagedTensor()
        t = self.m.dl_tensor
        t.data, t.ndim, t.shape, t.byte_offset = ptr, len(shape), self.shape, byte_offset
        if self.strides is not None:
            t.strides = self.strides
        t.device.device_type, t.device.device_id = device, 0
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 2, bits, 1
        self.device = device

    def __dlpack_device__(self) -> tuple[int, int]:
        return (self.device, 0)

    def __dlpack__(self, stream: Any = None) -> Any:
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.m), b"dltensor", None)


# ------------------------------------------------------------------ spans


@pytest.mark.parametrize("obj,want", [
    ((0x7F0000000000, 4096), (0x7F0000000000, 4096)),
    (Tensor(0x1000, 256, 4), (0x1000, 1024)),
    (CAI(0x2000, (16, 64)), (0x2000, 4096)),
    (CAI(0x2000, (16, 64), strides=(256, 4)), (0x2000, 4096)),     # explicit C-order strides
    (CAI(0x2000, (1, 64), strides=(999, 4)), (0x2000, 256)),       # a dimension of 1 has any stride
    (CAI(0x2000, (8,), typestr="<c16"), (0x2000, 128)),
    (CAI(None, (0,)), (0, 0)),
    (DLPack(0x3000, (16, 64)), (0x3000, 4096)),
    (DLPack(0x3000, (16, 64), strides=(64, 1), byte_offset=512), (0x3200, 4096)),
    (DLPack(0x3000, (3,), bits=1), (0x3000, 3)),                   # bool: a byte per element
])
def test_spans_of_every_kind_of_gpu_array(obj: Any, want: tuple[int, int]) -> None:
    assert arrays.span(obj, GPU) == want


@pytest.mark.parametrize("obj,msg", [
    (Tensor(0x1000, 16, contiguous=False), "tensor is not contiguous"),
    (CAI(0x2000, (16, 64), strides=(4, 64)), "array is not C-contiguous"),   # Fortran order
    (DLPack(0x3000, (16, 64), strides=(1, 16)), "DLPack tensor is not contiguous"),
    (DLPack(0x3000, (4,), device=arrays.KDL_CUDA_MANAGED), "DLPack tensor is in managed memory"),
    (DLPack(0x3000, (4,), device=arrays.KDL_ROCM), r"DLPack device type 10 is not Test \(2\)"),
    ((0x1000,), r"\(pointer, nbytes\) tuple of two ints"),
    ((0x1000, "4096"), r"\(pointer, nbytes\) tuple of two ints"),
    (object(), "builtins.object is not a GPU array"),
])
def test_what_cannot_be_a_contiguous_gpu_range_is_a_usage_error(obj: Any, msg: str) -> None:
    with pytest.raises(UsageError, match=msg):
        arrays.span(obj, GPU)


def test_dlpack_device_never_raises() -> None:
    class Broken:
        def __dlpack_device__(self) -> None:
            raise RuntimeError("stream gone")

    assert arrays.dlpack_device(DLPack(0, (1,), device=arrays.KDL_ROCM)) == arrays.KDL_ROCM
    assert arrays.dlpack_device(Broken()) is None and arrays.dlpack_device(object()) is None


def test_which_runtime_the_loaded_array_libraries_are_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    assert not arrays.torch_is_hip() and not arrays.cupy_is_hip() and not arrays.arrays_are_hip()
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace())      # a CuPy without .cuda
    assert not arrays.arrays_are_hip()
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(is_hip=True))))
    assert arrays.cupy_is_hip() and arrays.arrays_are_hip() and not arrays.torch_is_hip()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(version=types.SimpleNamespace(hip="6.2")))
    assert arrays.torch_is_hip()


# ------------------------------------------------------------------ the CUDA backend over them


@pytest.fixture()
def cuda_backend(monkeypatch: pytest.MonkeyPatch) -> Any:
    """p2phub_cuda.backend imported over a stand-in cuda.bindings.driver (no cuda-python here)."""
    driver = types.ModuleType("cuda.bindings.driver")
    bindings = types.ModuleType("cuda.bindings")
    bindings.driver = driver  # type: ignore[attr-defined]
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings  # type: ignore[attr-defined]
    for name, mod in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.driver", driver)):
        monkeypatch.setitem(sys.modules, name, mod)
    for name in ("p2phub_cuda", "p2phub_cuda.backend"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    yield importlib.import_module("p2phub_cuda.backend")
    for name in ("p2phub_cuda", "p2phub_cuda.backend", "p2phub_cuda.streams"):
        sys.modules.pop(name, None)


def test_cuda_backend_claims_and_spans_through_the_shared_parser(cuda_backend: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    be = cuda_backend.CudaBackend()
    cai, dl = CAI(0x2000, (1024,), typestr="|u1"), DLPack(0x3000, (256,))
    for obj, want in (((0x1000, 64), (0x1000, 64)), (Tensor(0x1000, 16), (0x1000, 64)), (cai, (0x2000, 1024)),
                      (dl, (0x3000, 1024))):
        assert be.claims(obj)
        assert be._span(obj) == want
    assert not be.claims(DLPack(0x3000, (4,), device=arrays.KDL_ROCM)) and not be.claims(object())
    managed = DLPack(0x3000, (4,), device=arrays.KDL_CUDA_MANAGED)
    assert be.claims(managed)   # claimed, so that resolve() says why it is refused
    with pytest.raises(UsageError, match="CUDA managed memory"):
        be._span(managed)
    with pytest.raises(UsageError, match="CUDA pinned host memory"):
        be._span(DLPack(0x3000, (4,), device=arrays.KDL_CUDA_HOST))
    # torch and CuPy built for ROCm use the CUDA names: their objects are not CUDA's
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(version=types.SimpleNamespace(hip="6.2")))
    assert not be.claims(Tensor(0x1000, 16)) and not be.claims(cai)


# ------------------------------------------------------------------ streams


def test_stream_handles_in_the_shapes_gpu_libraries_share() -> None:
    torch_stream = types.SimpleNamespace(cuda_stream=0xABC)
    cupy_stream = types.SimpleNamespace(ptr=0xDEF)
    attrs = ("cuda_stream", "ptr")
    assert arrays.stream_handle(None, "X", attrs) == 0 and arrays.stream_handle(7, "X", attrs) == 7
    assert arrays.stream_handle(torch_stream, "X", attrs) == 0xABC
    assert arrays.stream_handle(cupy_stream, "X", attrs) == 0xDEF
    assert arrays.stream_handle(types.SimpleNamespace(ptr=lambda: 1), "X", attrs) is None   # a method, not a handle
    assert arrays.stream_handle(object(), "X", attrs) is None
    with pytest.raises(UsageError, match="True is not a X stream"):
        arrays.stream_handle(True, "X", attrs)
    with pytest.raises(UsageError, match="stream handle -1 is negative"):
        arrays.stream_handle(-1, "X", attrs)


def test_cuda_stream_handles(cuda_backend: Any) -> None:
    class CudaCore:
        handle = 0x55

    class Proto:
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 0x66)

    class CUstream:
        def __int__(self) -> int:
            return 0x77

    ops = importlib.import_module("p2phub_cuda.streams").CudaStreamOps()
    for h in (cuda_backend.stream_handle, ops.stream_handle):    # one parser for both
        assert (h(None), h(5), h(CudaCore()), h(Proto()), h(CUstream())) == (0, 5, 0x55, 0x66, 0x77)
        with pytest.raises(UsageError, match="not a CUDA stream"):
            h(False)
        with pytest.raises(UsageError, match="builtins.object is not a CUDA stream"):
            h(object())
