"""CUDA pools over the TCP transport: the driver entry points, pinned staging buffers, streams.

The TCP transport moves a CUDA pool's pages through pinned host memory: per layer message,
the sender queues one device-to-host copy per run into a staging buffer and sends the buffer;
the receiver reads the payload into a staging buffer and queues one host-to-device copy per
run. The per-run loops are C (``kv_cuda_copy`` in _kvhot.c); they call the driver through the
addresses resolved here once, from ``libcuda.so.1`` with ctypes (no CUDA toolkit needed).
Every copy first makes the pool device's primary context current in the calling thread (the
context torch and CuPy use).

Each connection direction has one pinned staging buffer of two chunk-sized halves
(``Agent.stage_chunk``, 4 MiB by default), each half with its own non-blocking stream: the
sender copies chunk c+1 of a message into one half while chunk c goes out of the other; the
receiver reads chunk c+1 into one half while chunk c's copies to the device run, and completes
the layer's fence only after both streams are synchronized.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from .._resource import Resource
from ._build import hot
from ..errors import UsageError
from .errors import KVError

__all__ = ["CudaCopyError", "CudaDriver", "Staging", "driver", "set_driver"]

CU_STREAM_NON_BLOCKING = 0x1
CU_MEMHOSTALLOC_PORTABLE = 0x1
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9


class CudaCopyError(KVError):
    """A CUDA call of the staging path failed; ``code`` is its CUresult, ``name`` its name."""

    def __init__(self, what: str, code: int, name: str) -> None:
        super().__init__(f"{what}: CUDA error {name} ({code})")
        self.code = code
        self.name = name


class CudaDriver:
    """The CUDA driver API through ctypes (``libcuda.so.1``)."""

    def __init__(self, lib: Any = None) -> None:
        if lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise UsageError(f"a CUDA KV pool needs the CUDA driver (libcuda.so.1): {exc}; "
                                 "this machine has no CUDA") from None
        self.lib = lib
        self._check(lib.cuInit(0), "cuInit")
        self._ctx: dict[int, int] = {}
        self._lock = threading.Lock()

    # the addresses _kvhot.c calls
    def entry_points(self) -> dict[str, int]:
        def addr(name: str) -> int:
            return ctypes.cast(getattr(self.lib, name), ctypes.c_void_p).value or 0
        return {"ctx_set_current": addr("cuCtxSetCurrent"),
                "dtoh_async": addr("cuMemcpyDtoHAsync_v2"),
                "htod_async": addr("cuMemcpyHtoDAsync_v2"),
                "stream_sync": addr("cuStreamSynchronize")}

    def error_name(self, code: int) -> str:
        p = ctypes.c_char_p()
        if self.lib.cuGetErrorName(int(code), ctypes.byref(p)) != 0 or not p.value:
            return f"CUresult {code}"
        return p.value.decode()

    def _check(self, rc: int, what: str) -> None:
        if rc:
            raise CudaCopyError(what, int(rc), self.error_name(int(rc)))

    def device_count(self) -> int:
        n = ctypes.c_int()
        self._check(self.lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        return n.value

    def primary_context(self, ordinal: int) -> int:
        """The primary context of device `ordinal` (retained once per process)."""
        with self._lock:
            if ordinal in self._ctx:
                return self._ctx[ordinal]
            n = self.device_count()
            if not 0 <= ordinal < n:
                raise UsageError(f"CUDA device {ordinal} does not exist ({n} device(s))")
            dev = ctypes.c_int()
            self._check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
            ctx = ctypes.c_void_p()
            self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                        "cuDevicePrimaryCtxRetain")
            self._ctx[ordinal] = ctx.value or 0
            return self._ctx[ordinal]

    def set_current(self, ctx: int) -> None:
        self._check(self.lib.cuCtxSetCurrent(ctypes.c_void_p(ctx)), "cuCtxSetCurrent")

    def pointer_device(self, addr: int) -> int:
        """The device ordinal of device pointer `addr`."""
        v = ctypes.c_int()
        self._check(self.lib.cuPointerGetAttribute(ctypes.byref(v), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                                   ctypes.c_uint64(addr)), "cuPointerGetAttribute")
        return v.value

    def stream_create(self) -> int:
        s = ctypes.c_void_p()
        self._check(self.lib.cuStreamCreate(ctypes.byref(s), CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        return s.value or 0

    def stream_sync(self, stream: int) -> None:
        self.lib.cuStreamSynchronize(ctypes.c_void_p(stream))

    def stream_destroy(self, stream: int) -> None:
        self.lib.cuStreamDestroy_v2(ctypes.c_void_p(stream))

    def host_alloc(self, n: int) -> int:
        p = ctypes.c_void_p()
        self._check(self.lib.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(n),
                                            CU_MEMHOSTALLOC_PORTABLE), f"cuMemHostAlloc({n})")
        return p.value or 0

    def host_free(self, addr: int) -> None:
        self.lib.cuMemFreeHost(ctypes.c_void_p(addr))


_driver: CudaDriver | None = None
_driver_lock = threading.Lock()


def driver() -> CudaDriver:
    """The process's driver (loaded on first use; UsageError where there is no CUDA)."""
    global _driver
    with _driver_lock:
        if _driver is None:
            _driver = CudaDriver()
        return _driver


def set_driver(d: CudaDriver | None) -> CudaDriver | None:
    """Replace the process's driver (any object with CudaDriver's calls, e.g. one that
    copies host memory); returns the previous one."""
    global _driver
    with _driver_lock:
        old, _driver = _driver, d
        return old


class Staging(Resource):
    """A pinned staging buffer of two chunk-sized halves, with a stream each, for one
    direction of one connection; made, used and freed by one thread (the connection's sender
    or its reader)."""

    def __init__(self, drv: CudaDriver, ordinal: int, what: str, chunk: int) -> None:
        h = hot()
        self.drv = drv
        self.what = what
        self.chunk = chunk
        self.ctx = drv.primary_context(ordinal)
        self.c = h.ffi.new("struct kv_cuda *")
        for k, v in drv.entry_points().items():
            setattr(self.c, k, v)
        self.c.ctx = self.ctx
        self.cuerr = h.ffi.new("int *")
        self.sent = h.ffi.new("int *")
        self.streams = h.ffi.new("uint64_t[2]")
        self.buf = 0
        drv.set_current(self.ctx)
        try:
            for k in range(2):
                self.streams[k] = drv.stream_create()
            self.buf = drv.host_alloc(2 * chunk)
        except BaseException:
            self.close()
            raise
        self.stage = h.ffi.cast("void *", self.buf)

    def error(self, what: str) -> CudaCopyError:
        code = int(self.cuerr[0])
        return CudaCopyError(f"{self.what}: {what}", code, self.drv.error_name(code))

    def _close(self) -> None:
        """Wait for the streams, free the buffer and the streams (errors are ignored: this
        runs when a connection ends, whatever ended it)."""
        try:
            self.drv.set_current(self.ctx)
        except KVError:
            pass
        for k in range(2):
            if self.streams[k]:
                self.drv.stream_sync(self.streams[k])
        if self.buf:
            self.drv.host_free(self.buf)
            self.buf = 0
        for k in range(2):
            if self.streams[k]:
                self.drv.stream_destroy(self.streams[k])
                self.streams[k] = 0
