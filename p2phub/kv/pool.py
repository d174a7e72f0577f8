"""A KV pool: the memory of a KVLayout, registered once.

    pool = KVPool.host(layout)                 # plain host memory (TCP, no /dev/p2phub)
    pool = KVPool.registered(hub, layout)      # hub.alloc_host per segment (RDMA, lab)
    pool = KVPool.from_tensors(hub, layout, tensors)  # GPU tensors via hub.register
    pool = KVPool.cuda(layout, tensors)        # GPU tensors, no p2phub.ko (TCP, staged)

Segments follow the layout's arrangement: one per layer or one for the whole cache.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any, Sequence

from .._resource import Resource
from ..errors import UsageError
from ..ordering import AccessKind
from ..ordering import bind as bind_access
from .layout import KVLayout

__all__ = ["KVPool", "Segment", "page_runs"]


def page_runs(blocks: Sequence[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive page numbers in `blocks`."""
    out: list[tuple[int, int]] = []
    for b in sorted(set(int(b) for b in blocks)):
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


class Segment:
    """One contiguous range of the pool: its address, length and (for host memory) a view."""

    def __init__(self, addr: int, length: int, view: memoryview | None,
                 registration: Any = None, keep: Sequence[Any] = ()) -> None:
        self.addr = addr
        self.length = length
        self.view = view
        self.registration = registration
        self._keep = list(keep)


def _map_anon(length: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, length, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, _addr_of(m)


def _addr_of(m: mmap.mmap) -> int:
    c = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(c)
    del c
    return addr


def _cuda_ordinal(t: Any) -> int | None:
    dev = getattr(t, "device", None)
    idx = getattr(dev, "index", None)
    return int(idx) if idx is not None else None


def _cuda_buffer(t: Any, i: int) -> tuple[int, int, int | None]:
    """(address, bytes, device ordinal or None) of one CUDA tensor, checked contiguous."""
    if hasattr(t, "data_ptr") and hasattr(t, "is_cuda"):   # torch
        if not t.is_cuda:
            raise UsageError(f"KV pool: tensor {i} is on {t.device}, not a CUDA device")
        if not t.is_contiguous():
            raise UsageError(f"KV pool: tensor {i} is not contiguous (shape {tuple(t.shape)}, "
                             f"strides {tuple(t.stride())}); pass .contiguous() storage")
        return int(t.data_ptr()), int(t.numel() * t.element_size()), _cuda_ordinal(t)
    cai = getattr(t, "__cuda_array_interface__", None)
    if not isinstance(cai, dict):
        raise UsageError(f"KV pool: object {i} ({type(t).__name__}) is neither a torch CUDA "
                         "tensor nor has __cuda_array_interface__")
    try:
        addr = int(cai["data"][0])
        shape = tuple(int(d) for d in cai["shape"])
        item = int(str(cai["typestr"])[2:])
        strides = cai.get("strides")
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise UsageError(f"KV pool: object {i} has a malformed __cuda_array_interface__: {exc!r}") from None
    n = item
    for d in shape:
        n *= d
    if strides is not None:
        want, expect = [], item
        for d in reversed(shape):
            want.append(expect)
            expect *= d
        if tuple(int(x) for x in strides) != tuple(reversed(want)) and n:
            raise UsageError(f"KV pool: object {i} is not contiguous (shape {shape}, strides "
                             f"{tuple(strides)})")
    if addr == 0 and n:
        raise UsageError(f"KV pool: object {i} has a NULL device pointer")
    return addr, n, None


class KVPool(Resource):
    """The segments of one KV layout. ``device`` is "cpu" (host memory) or a GPU backend name."""

    def __init__(self, layout: KVLayout, segments: list[Segment], device: str = "cpu") -> None:
        if len(segments) != layout.num_segments:
            raise UsageError(f"KV pool: {len(segments)} segments for a layout of "
                             f"{layout.num_segments}")
        for i, s in enumerate(segments):
            if s.length < layout.segment_bytes:
                raise UsageError(f"KV pool: segment {i} has {s.length} bytes, the layout needs "
                                 f"{layout.segment_bytes}")
        self.layout = layout
        self.segments = segments
        self.device = device
        self.cuda_device: int | None = None   # the CUDA device ordinal of a "cuda" pool
        self._closers: list[Any] = []

    # ------------------------------------------------------------------ constructors
    @classmethod
    def host(cls, layout: KVLayout) -> "KVPool":
        """Anonymous host memory, one mapping per segment (pages are touched on first use)."""
        segs: list[Segment] = []
        maps: list[mmap.mmap] = []
        try:
            for _ in range(layout.num_segments):
                m, addr = _map_anon(layout.segment_bytes)
                maps.append(m)
                segs.append(Segment(addr, layout.segment_bytes, memoryview(m)))
        except BaseException:
            for s in segs:
                s.view.release()  # type: ignore[union-attr]
            for m in maps:
                m.close()
            raise
        pool = cls(layout, segs)
        pool._closers = [*(s.view.release for s in segs), *(m.close for m in maps)]  # type: ignore[union-attr]
        return pool

    @classmethod
    def registered(cls, hub: Any, layout: KVLayout, device: Any = None) -> "KVPool":
        """Host memory allocated and registered by p2phub (``hub.alloc_host``), once per
        segment; the registrations serve RDMA MRs (``reg.mr(pd)``) and NVMe alike."""
        segs: list[Segment] = []
        closers: list[Any] = []
        try:
            for _ in range(layout.num_segments):
                size = -(-layout.segment_bytes // mmap.PAGESIZE) * mmap.PAGESIZE
                reg = hub.alloc_host(size, device)
                closers.append(reg.close)
                m = reg.mmap()
                view = memoryview(m)
                closers[-1:-1] = [view.release, m.close]
                segs.append(Segment(_addr_of(m), size, view, registration=reg))
        except BaseException:
            for c in closers:
                c()
            raise
        pool = cls(layout, segs)
        pool._closers = closers
        return pool

    @classmethod
    def from_tensors(cls, hub: Any, layout: KVLayout, tensors: Sequence[Any]) -> "KVPool":
        """GPU tensors (one per segment), each registered with ``hub.register`` (CUDA backend).

        The pool holds no CPU view; the RDMA transport uses the registrations' MRs, the TCP
        transport stages its pages through pinned host memory (see `cuda`)."""
        if len(tensors) != layout.num_segments:
            raise UsageError(f"KV pool: {len(tensors)} tensors for {layout.num_segments} segments")
        segs: list[Segment] = []
        closers: list[Any] = []
        try:
            for t in tensors:
                nbytes = int(t.numel() * t.element_size())
                if not t.is_contiguous():
                    raise UsageError("KV pool: tensors must be contiguous")
                reg = hub.register(t)
                closers.append(reg.close)
                segs.append(Segment(int(t.data_ptr()), nbytes, None, registration=reg, keep=[t]))
        except BaseException:
            for c in closers:
                c()
            raise
        pool = cls(layout, segs, device="cuda")
        pool.cuda_device = _cuda_ordinal(tensors[0]) if tensors else None
        pool._closers = closers
        return pool

    @classmethod
    def cuda(cls, layout: KVLayout, tensors: Sequence[Any], device: int | None = None) -> "KVPool":
        """GPU memory the TCP transport moves through pinned host staging, without
        p2phub.ko: one tensor per segment, torch CUDA tensors or any object with
        ``__cuda_array_interface__`` (CuPy, Numba), contiguous, all on one device, each at
        least the layout's segment size. The pool keeps the tensors alive; it registers
        nothing. ``device``: the CUDA ordinal where the objects do not say it (found from the
        pointer with the driver otherwise)."""
        if len(tensors) != layout.num_segments:
            raise UsageError(f"KV pool: {len(tensors)} tensors for {layout.num_segments} segments")
        segs: list[Segment] = []
        ordinals: set[int] = set()
        for i, t in enumerate(tensors):
            addr, nbytes, ordinal = _cuda_buffer(t, i)
            if ordinal is None:
                from .cuda import driver   # the driver knows where a bare pointer lives
                ordinal = device if device is not None else driver().pointer_device(addr)
            ordinals.add(ordinal)
            segs.append(Segment(addr, nbytes, None, keep=[t]))
        if device is not None:
            ordinals.add(int(device))
        if len(ordinals) > 1:
            raise UsageError(f"KV pool: the tensors are on different CUDA devices "
                             f"({', '.join(f'cuda:{d}' for d in sorted(ordinals))}); a pool is "
                             "one device's memory")
        pool = cls(layout, segs, device="cuda")
        pool.cuda_device = ordinals.pop() if ordinals else 0
        return pool

    # ------------------------------------------------------------------ access
    def block(self, layer: int, kv: int, block: int) -> memoryview:
        """The host view of one page (host pools only)."""
        seg, off, n = self.layout.offset(layer, kv, block)
        view = self.segments[seg].view
        if view is None:
            raise UsageError(f"KV pool on {self.device} has no host view")
        return view[off:off + n]

    def declare(self, blocks: Sequence[int], layers: Sequence[int] | range, kind: AccessKind,
                fences: Sequence[Any], what: str, timeout: float | None) -> None:
        """Accesses of `kind` on pages `blocks` (K and V) of every layer in `layers`, with
        consecutive pages merged, each bound to its layer's fence in `fences` (by position in
        `layers`): the ordering layer then orders other users of those pages against them.
        A producer first waits (up to `timeout`) for earlier readers of its pages. Segments
        with no registration (plain host memory) have no ordering to declare on."""
        lay = self.layout
        runs = page_runs(blocks)
        for i, ly in enumerate(layers):
            for kv in range(lay.kv):
                seg, base = lay.block_base(ly, kv)
                reg = self.segments[seg].registration
                if reg is None:
                    continue
                for first, count in runs:
                    a = reg.ordering.acquire(base + first * lay.block_bytes,
                                             count * lay.block_bytes, kind,
                                             f"{what} layer {ly}", timeout=timeout)
                    bind_access(a, fences[i])

    def seg_table(self) -> list[tuple[int, int]]:
        return [(s.addr, s.length) for s in self.segments]

    @property
    def nbytes(self) -> int:
        return sum(s.length for s in self.segments)

    def _close(self) -> None:
        closers, self._closers = self._closers, []
        for c in closers:
            c()

    def __repr__(self) -> str:
        return f"<KVPool {self.layout.num_layers} layers, {self.nbytes} bytes on {self.device}>"
