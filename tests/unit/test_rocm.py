"""The ROCm backend (p2phub_rocm) on a host without an AMD GPU.

1. With the real hip-python bindings and whatever HIP runtime the host has (Debian's
   libamdhip64, installed by tools/setup, or none): every call fails with a RocmError that
   names the call and the reason, and nothing crashes (checked in a child process).
2. With a fake standing in for the ``hip`` module (below the hip-python call boundary:
   the backend's own code runs unchanged): the success paths and the refusals.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import mmap
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("hip", reason="hip-python is not installed (tools/setup installs it)")
from hip import hip as hip_mod  # noqa: E402
from p2phub import staged  # noqa: E402
from p2phub.arrays import DLTensor  # noqa: E402
from p2phub.errors import UsageError  # noqa: E402
from p2phub.hub import Hub  # noqa: E402

import p2phub_rocm  # noqa: E402

rb = importlib.import_module("p2phub_rocm.backend")   # the module (the package exports backend())

TOP = Path(__file__).resolve().parents[2]
E = hip_mod.hipError_t
MT = hip_mod.hipMemoryType


# ---------------------------------------------------------------- 1. the real bindings


CHILD = r"""
import json, sys
import p2phub_rocm
from p2phub_rocm import RocmError
from p2phub.errors import UsageError
be = p2phub_rocm.backend()
calls = {
    "resolve": lambda: be.resolve((0x7f0000200000, 1 << 20)),
    "export_dmabuf": lambda: be.export_dmabuf(0x7f0000200000, 1 << 20),
    "alloc_completion_words": lambda: be.alloc_completion_words(4),
    "stream_wait_value32": lambda: be.stream_wait_value32(0, 0x1000, 1),
    "stream_write_value32": lambda: be.stream_write_value32(0, 0x1000, 1),
    "stream_synchronize": lambda: be.stream_synchronize(0),
    "stream_device": lambda: be.stream_device(0x1234),
    "event_create": lambda: be.event_create(),
    "event_record": lambda: be.event_record(0x1234, 0),
    "event_synchronize": lambda: be.event_synchronize(0x1234),
    "event_query": lambda: be.event_query(0x1234),
    "stream_wait_event": lambda: be.stream_wait_event(0, 0x1234),
    "pinned": lambda: be.pinned(1 << 20),
    "stream_create": lambda: be.stream_create(),
    "copy_h2d": lambda: be.copy_h2d(0x1000, 0x2000, 16, 0),
    "bind_thread": lambda: be.bind_thread(0),
}
out = {}
for name, fn in calls.items():
    try:
        fn()
        out[name] = "no error"
    except RocmError as exc:
        out[name] = "RocmError: " + str(exc)
    except Exception as exc:
        out[name] = type(exc).__name__ + ": " + str(exc)
print(json.dumps(out))
"""


def test_real_bindings_fail_every_call_clearly_without_a_device() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(TOP), str(TOP / "backends" / "rocm"), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, f"the child crashed or failed: rc={res.returncode} {res.stderr[-2000:]}"
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name, text in out.items():
        assert text.startswith("RocmError: "), (name, text)
        call = text.split(": ", 2)[1]
        assert call.startswith("hip"), (name, text)       # names the HIP call
        assert ("hipError" in text or "libamdhip64" in text or "HIP runtime" in text), (name, text)


def test_error_text_names_missing_symbols_and_devices() -> None:
    exc = RuntimeError("failed to dlsym 'b'hipFoo'': undefined symbol: hipFoo")
    assert "has no such function" in rb._loader_text(exc)
    assert "cannot be loaded" in rb._loader_text(RuntimeError("failed to dlopen 'libamdhip64.so'"))
    assert "no AMD GPU visible" in rb._err_text(E.hipErrorNoDevice)


# ---------------------------------------------------------------- 2. a fake below hip-python


class FakeHip:
    """The hip-python calls the backend makes, over host memory standing in for a GPU."""

    hipError_t = E
    hipMemoryType = MT
    hipMemRangeHandleType = hip_mod.hipMemRangeHandleType
    hipMemcpyKind = hip_mod.hipMemcpyKind
    hipHostMallocMapped = hip_mod.hipHostMallocMapped
    hipHostMallocPortable = hip_mod.hipHostMallocPortable
    hipStreamWaitValueGte = hip_mod.hipStreamWaitValueGte
    hipEventDisableTiming = hip_mod.hipEventDisableTiming
    hipStreamNonBlocking = hip_mod.hipStreamNonBlocking

    def __init__(self) -> None:
        self.allocs: dict[int, ctypes.Array] = {}   # "device" allocations: base -> buffer
        self.kinds: dict[int, object] = {}
        self.host: dict[int, ctypes.Array] = {}
        self.log: list[tuple] = []
        self.device = 0
        self.n = 0x100

    def malloc(self, size: int, kind=MT.hipMemoryTypeDevice) -> int:
        m = mmap.mmap(-1, size)                       # page aligned, like a GPU allocation
        buf = (ctypes.c_char * size).from_buffer(m)
        base = ctypes.addressof(buf)
        self.allocs[base] = buf
        self.kinds[base] = kind
        return base

    def free(self, base: int) -> None:
        del self.allocs[base]

    def _find(self, ptr: int):
        for base, buf in self.allocs.items():
            if base <= ptr < base + len(buf):
                return base, len(buf)
        return None

    # hip-python signatures: (hipError_t, values...)
    def hipInit(self, flags):
        return (E.hipSuccess,)

    def hipGetDeviceCount(self):
        return (E.hipSuccess, 1)

    def hipGetErrorString(self, err):
        return (E.hipSuccess, err.name)

    def hipPointerGetAttributes(self, ptr):
        hit = self._find(ptr)
        if hit is None:
            return (E.hipErrorInvalidValue, None)
        kind = self.kinds[hit[0]]
        attrs = types.SimpleNamespace(type=kind, isManaged=kind == MT.hipMemoryTypeManaged,
                                      device=self.device)
        return (E.hipSuccess, attrs)

    def hipMemGetAddressRange(self, ptr):
        hit = self._find(ptr)
        if hit is None:
            return (E.hipErrorNotFound, None, 0)
        return (E.hipSuccess, hit[0], hit[1])

    def hipDeviceGetPCIBusId(self, n, dev):
        return (E.hipSuccess, b"0000:C1:00.0\x00")

    def hipMemGetHandleForAddressRange(self, handle, ptr, size, kind, flags):
        self.log.append(("export", ptr, size, kind, flags))
        fd = os.memfd_create("fake-dmabuf")
        os.ftruncate(fd, size)
        ctypes.c_int.from_address(handle).value = fd
        return (E.hipSuccess,)

    def hipHostMalloc(self, size, flags):
        m = mmap.mmap(-1, size)                       # page aligned, as hipHostMalloc's is
        m.write(b"\x5a" * size)                      # not zero: the backend must clear words
        buf = (ctypes.c_char * size).from_buffer(m)
        addr = ctypes.addressof(buf)
        self.host[addr] = buf
        self.log.append(("hostmalloc", size, flags))
        return (E.hipSuccess, addr)

    def hipHostFree(self, ptr):
        self.host.pop(ptr)
        return (E.hipSuccess,)

    def hipHostGetDevicePointer(self, ptr, flags):
        return (E.hipSuccess, ptr + (1 << 40))    # a distinct "device" address

    def hipGetDevice(self):
        return (E.hipSuccess, self.device)

    def hipStreamGetDevice(self, s):
        return (E.hipSuccess, 1)

    def hipSetDevice(self, d):
        self.log.append(("setdevice", d))
        return (E.hipSuccess,)

    def hipStreamWaitValue32(self, s, ptr, value, flags, mask):
        self.log.append(("wait", s, ptr, value, flags, mask))
        return (E.hipSuccess,)

    def hipStreamWriteValue32(self, s, ptr, value, flags):
        self.log.append(("write", s, ptr, value, flags))
        return (E.hipSuccess,)

    def hipStreamSynchronize(self, s):
        return (E.hipSuccess,)

    def _handle(self):
        self.n += 1
        return self.n

    def hipEventCreateWithFlags(self, flags):
        return (E.hipSuccess, self._handle())

    def hipEventDestroy(self, ev):
        return (E.hipSuccess,)

    def hipEventRecord(self, ev, s):
        self.log.append(("record", ev, s))
        return (E.hipSuccess,)

    def hipEventSynchronize(self, ev):
        return (E.hipSuccess,)

    def hipEventQuery(self, ev):
        return (E.hipErrorNotReady if ev == 0xBAD else E.hipSuccess,)

    def hipStreamWaitEvent(self, s, ev, flags):
        self.log.append(("waitevent", s, ev))
        return (E.hipSuccess,)

    def hipStreamCreateWithFlags(self, flags):
        return (E.hipSuccess, self._handle())

    def hipStreamDestroy(self, s):
        return (E.hipSuccess,)

    def hipMemcpyAsync(self, dst, src, n, kind, s):
        ctypes.memmove(dst, src, n)
        return (E.hipSuccess,)


@pytest.fixture()
def fake(monkeypatch):
    f = FakeHip()
    monkeypatch.setattr(rb, "hip", f)
    monkeypatch.setattr(rb, "_BACKEND", None)
    return f


@pytest.fixture()
def rocm_torch(monkeypatch):
    """sys.modules['torch'] of a ROCm build (torch.version.hip set)."""
    mod = types.SimpleNamespace(version=types.SimpleNamespace(hip="6.2", cuda=None))
    monkeypatch.setitem(sys.modules, "torch", mod)
    return mod


class FakeTensor:
    is_cuda = True

    def __init__(self, ptr: int, n: int, contiguous: bool = True) -> None:
        self._ptr, self._n, self._c = ptr, n, contiguous

    def data_ptr(self) -> int:
        return self._ptr

    def numel(self) -> int:
        return self._n

    def element_size(self) -> int:
        return 1

    def is_contiguous(self) -> bool:
        return self._c


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackArray:
    """A DLPack producer on a ROCm device (kDLROCM = 10)."""

    def __init__(self, ptr: int, n: int, device_type: int = 10) -> None:
        self.shape = (ctypes.c_int64 * 1)(n)
        self.m = DLManagedTensor()
        t = self.m.dl_tensor
        t.data, t.ndim, t.shape = ptr, 1, self.shape
        t.device.device_type, t.device.device_id = device_type, 0
        t.dtype.code, t.dtype.bits, t.dtype.lanes = 1, 8, 1
        self.device_type = device_type

    def __dlpack_device__(self):
        return (self.device_type, 0)

    def __dlpack__(self, stream=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self.m), b"dltensor", None)


def test_resolve_a_rocm_torch_tensor_and_export(fake, rocm_torch) -> None:
    base = fake.malloc(4 << 20)
    t = FakeTensor(base + (1 << 20), 2 << 20)
    be = p2phub_rocm.backend()
    assert be.claims(t)
    rng = be.resolve(t)
    try:
        assert (rng.backend, rng.ptr, rng.length) == ("rocm", base + (1 << 20), 2 << 20)
        assert (rng.alloc_base, rng.alloc_size) == (base, 4 << 20)
        assert rng.pci_bus_id == "0000:c1:00.0"
        assert os.lseek(rng.dmabuf_fd, 0, os.SEEK_END) == 2 << 20
        assert fake.log[-1][:3] == ("export", base + (1 << 20), 2 << 20)
    finally:
        rng.close()
    assert rng.dmabuf_fd == -1


def test_cuda_build_tensors_are_not_claimed(fake, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(
        version=types.SimpleNamespace(hip=None, cuda="13.0")))
    assert not p2phub_rocm.backend().claims(FakeTensor(0x1000, 10))


def test_cuda_array_interface_of_a_hip_array(fake, monkeypatch) -> None:
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(is_hip=True)))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    base = fake.malloc(1 << 20)

    class HipArray:
        __cuda_array_interface__ = {"data": (base, False), "shape": (256, 1024), "typestr": "<f4",
                                    "strides": None, "version": 3}
    be = p2phub_rocm.backend()
    assert be.claims(HipArray())
    rng = be.resolve(HipArray(), export_dmabuf=False)
    assert (rng.ptr, rng.length) == (base, 1 << 20)


def test_dlpack_on_a_rocm_device(fake) -> None:
    base = fake.malloc(1 << 20)
    arr = DLPackArray(base, 1 << 20)
    be = p2phub_rocm.backend()
    assert be.claims(arr)
    rng = be.resolve(arr, offset=4096, length=8192)
    try:
        assert (rng.ptr, rng.length) == (base + 4096, 8192)
    finally:
        rng.close()
    assert not be.claims(DLPackArray(base, 16, device_type=1))   # a CPU tensor
    with pytest.raises(UsageError, match="pinned host"):
        be.resolve(DLPackArray(base, 4096, device_type=11))


def test_refusals(fake) -> None:
    be = p2phub_rocm.backend()
    dev = fake.malloc(2 << 20)
    managed = fake.malloc(1 << 20, MT.hipMemoryTypeManaged)
    host = fake.malloc(1 << 20, MT.hipMemoryTypeHost)
    with pytest.raises(UsageError, match="managed"):
        be.resolve((managed, 1 << 20))
    with pytest.raises(UsageError, match="not device memory"):
        be.resolve((host, 1 << 20))
    with pytest.raises(UsageError, match="spans two allocations"):
        be.resolve((dev + (1 << 20), 2 << 20))
    with pytest.raises(UsageError, match="misaligned"):
        be.resolve((dev + 100, 4096))
    assert be.resolve((dev + 100, 4096), export_dmabuf=False).length == 4096
    fake.free(dev)
    with pytest.raises(UsageError, match="freed"):
        be.resolve((dev, 4096))
    with pytest.raises(UsageError, match="null pointer"):
        be.resolve((0, 4096))
    with pytest.raises(UsageError, match="not contiguous"):
        be.resolve(FakeTensor(managed, 10, contiguous=False))


def test_stream_ops(fake, rocm_torch) -> None:
    be = p2phub_rocm.stream_ops()
    torch_stream = types.SimpleNamespace(cuda_stream=0xABC, device=types.SimpleNamespace(index=2))
    assert be.claims_stream(torch_stream) and be.claims_stream(7) and be.claims_stream(None)
    assert not be.claims_stream("s") and not be.claims_stream(True)
    assert be.stream_handle(torch_stream) == 0xABC and be.stream_handle(None) == 0
    assert be.stream_device(torch_stream) == 2 and be.stream_device(0x55) == 1
    with pytest.raises(UsageError):
        be.stream_handle(-1)
    words = be.alloc_completion_words(4, device=0)
    try:
        assert ctypes.string_at(words.host_ptr, 16) == bytes(16)          # zeroed
        assert words.dev_ptr == words.host_ptr + (1 << 40) and words.count == 4
        be.stream_wait_value32(torch_stream, words.dev_ptr + 4, (1 << 32) + 5)
        be.stream_write_value32(7, words.dev_ptr, 9)
        assert fake.log[-2] == ("wait", 0xABC, words.dev_ptr + 4, 5, hip_mod.hipStreamWaitValueGte,
                                0xFFFFFFFF)
        assert fake.log[-1] == ("write", 7, words.dev_ptr, 9, 0)
    finally:
        words.close()
    assert not be.rdma_flush_required() and be.flush_rdma_writes() is None
    ev = be.event_create()
    be.event_record(ev, torch_stream)
    be.stream_wait_event(7, ev)
    assert fake.log[-2:] == [("record", ev, 0xABC), ("waitevent", 7, ev)]
    assert be.event_query(ev) and not be.event_query(0xBAD)
    be.event_synchronize(ev)
    be.event_destroy(ev)


def test_failed_calls_raise_rocm_errors(fake, monkeypatch) -> None:
    monkeypatch.setattr(fake, "hipStreamWaitValue32",
                        lambda *a: (E.hipErrorNotSupported,), raising=False)
    with pytest.raises(p2phub_rocm.RocmError, match="hipStreamWaitValue32.*hipErrorNotSupported"):
        p2phub_rocm.backend().stream_wait_value32(0, 0x1000, 1)


def test_staged_load_and_save_into_rocm_memory(fake, rocm_torch, tmp_path) -> None:
    data = os.urandom((3 << 20) + 123)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    base = fake.malloc(len(data))
    t = FakeTensor(base, len(data))
    with Hub(mode="staged") as hub:
        staged.configure(hub, chunk=256 << 10, lanes=3)
        with hub.register(t) as reg:
            assert reg.mode == "staged" and reg.source.backend == "rocm"
            hub.load(src, reg).wait(30)
            assert ctypes.string_at(base, len(data)) == data
            out = tmp_path / "out.bin"
            hub.save(reg, out).wait(30)
            assert out.read_bytes() == data
    assert ("setdevice", 0) in fake.log
