"""The small interface through which GPU memory and GPU devices reach p2phub.

The core never imports a vendor runtime and names no device of its own. A
backend is a plugin: a module named by an entry point of the group
``p2phub.backends`` (in its distribution's pyproject.toml)::

    [project.entry-points."p2phub.backends"]
    cuda = "p2phub_cuda"

The module has a ``backend()`` factory returning an object of the `Backend`
shape below, and may have other factories for other interfaces
(``stream_ops()``). A backend recognises the objects of its runtime (raw
pointers, tensors, ``__cuda_array_interface__``, DLPack; `p2phub.arrays` reads
their pointer and size the same way for every backend), validates the byte
range, and hands the core something p2phub.ko can pin: a dma-buf fd of exactly
that range, or, for the NVIDIA P2P path, a 64 KiB aligned GPU virtual address
range. It may also claim PCI functions as GPUs for `p2phub doctor`
(``discover_gpu``) and give the doctor's active test a buffer of GPU memory
(``test_buffer``). Every hook but ``name`` is optional.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Iterator, Protocol

from .errors import UsageError
from ._resource import Resource

GROUP = "p2phub.backends"

NVIDIA_P2P_ALIGN = 64 << 10


@dataclass
class GpuRange(Resource):
    """A validated range of GPU memory, ready to register."""

    backend: str             # "cuda", "rocm"
    device: int              # runtime device ordinal
    ptr: int                 # first byte (GPU virtual address)
    length: int              # bytes
    alloc_base: int          # the allocation that holds the range
    alloc_size: int
    pci_bus_id: str = ""     # the GPU's PCI address, when the runtime knows it
    dmabuf_fd: int = -1      # a dma-buf of exactly [ptr, ptr + length), owned by this object
    keepalive: list[Any] = field(default_factory=list)  # the caller's object, kept alive

    def _close(self) -> None:
        if self.dmabuf_fd >= 0:
            os.close(self.dmabuf_fd)
            self.dmabuf_fd = -1

    @property
    def nvidia_p2p_ok(self) -> bool:
        return self.ptr % NVIDIA_P2P_ALIGN == 0 and self.length % NVIDIA_P2P_ALIGN == 0


@dataclass(frozen=True)
class PciFunction:
    """What the doctor knows of a PCI function when it asks backends which ones are GPUs."""

    bdf: str                 # 0000:04:00.0
    vendor: int
    device: int
    cls: int                 # 24-bit class code
    driver: str | None       # the bound driver's name


@dataclass
class GpuClaim:
    """A backend's word that a PCI function is a GPU whose memory it can export."""

    flavour: str             # a short name for reports and verdicts
    name: str                # shown in the device list
    vendor: str
    p2p_bar: int             # the BAR index peers reach the GPU's memory through
    # extra facts for the report; "bar_covers_memory": True says the whole memory sits in
    # that BAR, so a small BAR is no limit on what can be registered
    info: dict[str, Any] = field(default_factory=dict)


class GpuBuffer(Resource):
    """GPU memory exported as a dma-buf (``fd``), with a CPU path to fill and read it."""

    fd: int = -1
    describe: str = ""
    bus_address: int | None = None  # where peers reach the buffer without an IOMMU, when known

    def write(self, data: bytes) -> None:
        raise NotImplementedError

    def read(self, n: int) -> bytes:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


class Backend(Protocol):
    name: str

    def claims(self, obj: Any) -> bool:
        """True when `obj` is memory of this runtime (never raises)."""

    def resolve(self, obj: Any, offset: int = 0, length: int | None = None,
                export_dmabuf: bool = True) -> GpuRange:
        """Validate `obj`'s byte range [offset, offset + length) and describe it.

        Raises UsageError for memory p2phub cannot pin (host or managed memory,
        a freed pointer, a range spanning two allocations, misalignment)."""

    # Optional:
    #   discover_gpu(fn: PciFunction) -> GpuClaim | None   (sysfs facts only: no device I/O)
    #   test_buffer(bdf: str, length: int) -> GpuBuffer   (doctor --active)


_broken: dict[str, str] = {}
VENDOR_BACKENDS = ("cuda", "rocm")  # shipped beside the core as p2phub_cuda, p2phub_rocm


@functools.lru_cache(maxsize=1)
def _modules() -> tuple[tuple[str, ModuleType], ...]:
    out = []
    eps = sorted(importlib.metadata.entry_points(group=GROUP), key=lambda e: e.name)
    for ep in eps:
        if any(name == ep.name for name, _ in out):
            continue  # one plugin per name (a second installed copy is ignored)
        try:
            mod = ep.load()
        except ImportError as exc:  # the vendor runtime is not installed here
            _broken[ep.name] = f"{type(exc).__name__}: {exc}"
            continue
        except Exception as exc:  # noqa: BLE001 - a broken plugin must not break the others
            _broken[ep.name] = f"{type(exc).__name__}: {exc}"
            continue
        out.append((ep.name, mod))
    # A checkout run from source (PYTHONPATH, no installed distribution) has no entry
    # points: the vendor backends shipped beside the core are found by module name.
    for name in VENDOR_BACKENDS:
        if name in _broken or any(n == name for n, _ in out):
            continue
        try:
            out.append((name, importlib.import_module(f"p2phub_{name}")))
        except ImportError:
            continue
    return tuple(out)


def backend_modules() -> Iterator[tuple[str, ModuleType]]:
    """(name, module) of every installed backend plugin that imports here."""
    yield from _modules()


def unavailable() -> dict[str, str]:
    """Backend plugins installed but not importable here, with the reason."""
    _modules()
    return dict(_broken)


@functools.lru_cache(maxsize=1)
def backends() -> tuple[Backend, ...]:
    out = []
    for name, mod in _modules():
        factory = getattr(mod, "backend", None)
        if factory is not None:
            out.append(factory())
    return tuple(out)


def find_backend(obj: Any) -> Backend | None:
    for be in backends():
        if be.claims(obj):
            return be
    return None


def get_backend(name: str) -> Backend | None:
    return next((be for be in backends() if be.name == name), None)


def backend_names() -> list[str]:
    return [be.name for be in backends()]


def discover_gpu(fn: PciFunction) -> tuple[str, GpuClaim] | None:
    """(backend name, claim) of the first backend that claims PCI function `fn` as a GPU."""
    for be in backends():
        hook = getattr(be, "discover_gpu", None)
        if hook is None:
            continue
        try:
            claim = hook(fn)
        except Exception as exc:  # noqa: BLE001 - one plugin's bug must not hide the other GPUs
            _broken[f"{be.name}.discover_gpu"] = f"{type(exc).__name__}: {exc}"
            continue
        if claim is not None:
            return be.name, claim
    return None


def describe(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def check_range(offset: int, length: int | None, total: int, what: str) -> tuple[int, int]:
    """Resolve and validate a byte range inside an object of `total` bytes."""
    if offset < 0:
        raise UsageError(f"{what}: offset={offset} is negative")
    if length is None:
        length = total - offset
    if length <= 0:
        raise UsageError(f"{what}: length={length} must be positive")
    if offset + length > total:
        raise UsageError(f"{what}: range offset={offset} length={length} ends past its "
                         f"{total} bytes")
    return offset, length


# --------------------------------------------------------------------------- stream ops
#
# What p2phub.ordering needs from a GPU runtime to order GPU streams against NVMe and
# RDMA without a CPU round trip. A backend module exposes ``stream_ops()`` returning an
# object of this shape (p2phub_cuda.streams for CUDA, p2phub_rocm for HIP).
#
# Completion words are 32-bit words in pinned host memory that the device can address.
# A fence that completes on the host stores a value into its word; a stream that must
# wait for it runs ``stream_wait_value32`` (cuStreamWaitValue32 / hipStreamWaitValue32,
# "wait until (int32)(*word - value) >= 0", so values may wrap). Work recorded on a
# stream completes a host-visible fence with ``stream_write_value32`` of a word the host
# polls. Values only grow; a word is never reset while a wait on it may be pending.

WAIT_GEQ = "geq"  # the only wait condition p2phub uses: wrap-safe "word - value >= 0"


class CompletionWords(Protocol):
    """`count` 32-bit words of pinned host memory, mapped for the device."""

    host_ptr: int    # CPU address of word 0
    dev_ptr: int     # device address of word 0 (for stream wait/write)
    count: int

    def close(self) -> None:
        """Free the words; only once no stream can still wait on or write them."""


class StreamOps(Protocol):
    name: str        # "cuda", "rocm"

    def claims_stream(self, stream: Any) -> bool:
        """True when `stream` is a stream of this runtime (a torch/CuPy stream object or a
        raw handle as int); never raises."""

    def stream_handle(self, stream: Any) -> int:
        """The raw CUstream / hipStream_t of `stream` (0 is the legacy default stream)."""

    def stream_device(self, stream: Any) -> int:
        """The device ordinal `stream` runs on."""

    def alloc_completion_words(self, n: int, device: int = 0) -> CompletionWords:
        """`n` zeroed words of pinned, device-mapped host memory (cuMemHostAlloc with
        DEVICEMAP / hipHostMalloc with hipHostMallocMapped)."""

    def stream_wait_value32(self, stream: Any, dev_addr: int, value: int) -> None:
        """Enqueue on `stream`: wait until (int32)(*dev_addr - value) >= 0."""

    def stream_write_value32(self, stream: Any, dev_addr: int, value: int) -> None:
        """Enqueue on `stream`: store `value` at dev_addr once earlier work on it is done."""

    def stream_synchronize(self, stream: Any) -> None:
        """Block the calling thread until `stream` is idle."""

    def rdma_flush_required(self, device: int = 0) -> bool:
        """True when writes by a NIC into this device's memory may be seen out of order by
        its kernels without a flush (GPU_DIRECT_RDMA_WRITES_ORDERING below OWNER, or
        FLUSH_GPU_DIRECT_RDMA_WRITES_OPTIONS advertises a flush to use)."""

    def flush_rdma_writes(self, device: int = 0) -> None:
        """Make every completed NIC write into `device`'s memory visible to its kernels
        (cuFlushGPUDirectRDMAWrites(TARGET_CURRENT_CTX, TO_OWNER)); a no-op where the
        device needs none."""


def stream_ops_for(name: str) -> StreamOps | None:
    """The stream ops of backend `name` ("cuda", "rocm"), or None when it has none here."""
    for n, mod in backend_modules():
        if n == name:
            factory = getattr(mod, "stream_ops", None)
            return factory() if factory is not None else None
    return None


def find_stream_ops(stream: Any) -> StreamOps:
    """The stream ops of the backend that owns `stream` (raises UsageError if none does).

    A bare int is a raw handle; it goes to the first backend with stream ops."""
    tried = []
    for name, mod in backend_modules():
        factory = getattr(mod, "stream_ops", None)
        if factory is None:
            continue
        tried.append(name)
        ops = factory()
        if ops.claims_stream(stream):
            return ops
    raise UsageError(f"{describe(stream)}: not a GPU stream of an installed backend "
                     f"(backends with stream ops: {', '.join(tried) or 'none'}; a torch/CuPy "
                     "stream or a raw handle)")
