"""CUDA pools over the TCP agent, on a host without a GPU: the refusals, and the whole staging
path (C copy loops, two pinned buffers per connection, the landing thread) run over a stand-in
driver whose "device" memory is host memory and whose copies are memmove. Real GPUs:
tests/gpu/test_kv_gpu.py."""

from __future__ import annotations

import ctypes
import json
import mmap
import random
import threading
from typing import Iterator

import pytest

from p2phub.errors import UsageError
from p2phub.kv import Agent, KVError, KVLayout, KVPool, KVRejected
from p2phub.kv import cuda as kvcuda
from p2phub.ordering.errors import FenceError

from kvpeer import page

LAY = KVLayout(num_layers=8, blocks_per_layer=64, block_bytes=4096)
ILLEGAL = 700

FN_CTX = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
FN_DTOH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)
FN_HTOD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


class FakeDriver:
    """kv.cuda.CudaDriver's interface over host memory; copies into or out of `poison`
    ranges fail with CUDA_ERROR_ILLEGAL_ADDRESS."""

    def __init__(self) -> None:
        self.poison: list[tuple[int, int]] = []
        self.pinned: dict[int, mmap.mmap] = {}
        self.streams: set[int] = set()
        self.copies = 0
        self.ctx_threads: set[str] = set()
        self._next_stream = 0x100
        self._fns = (FN_CTX(self._ctx), FN_DTOH(self._dtoh), FN_HTOD(self._htod), FN_CTX(self._sync))

    def _bad(self, addr: int, n: int) -> bool:
        return any(a < addr + n and addr < a + ln for a, ln in self.poison)

    def _ctx(self, ctx: int) -> int:
        self.ctx_threads.add(threading.current_thread().name)
        return 0 if ctx in (0xC0, 0xC1) else 201   # CUDA_ERROR_INVALID_CONTEXT

    def _dtoh(self, dst: int, src: int, n: int, stream: int) -> int:
        if self._bad(src, n):
            return ILLEGAL
        self.copies += 1
        ctypes.memmove(dst, src, n)
        return 0

    def _htod(self, dst: int, src: int, n: int, stream: int) -> int:
        if self._bad(dst, n):
            return ILLEGAL
        self.copies += 1
        ctypes.memmove(dst, src, n)
        return 0

    def _sync(self, stream: int) -> int:
        return 0

    def entry_points(self) -> dict[str, int]:
        def a(f: object) -> int:
            return ctypes.cast(f, ctypes.c_void_p).value or 0
        return {"ctx_set_current": a(self._fns[0]), "dtoh_async": a(self._fns[1]),
                "htod_async": a(self._fns[2]), "stream_sync": a(self._fns[3])}

    def error_name(self, code: int) -> str:
        return {ILLEGAL: "CUDA_ERROR_ILLEGAL_ADDRESS", 201: "CUDA_ERROR_INVALID_CONTEXT"}.get(code, str(code))

    def primary_context(self, ordinal: int) -> int:   # two devices: cuda:0 and cuda:1
        if ordinal not in (0, 1):
            raise UsageError(f"CUDA device {ordinal} does not exist (2 device(s))")
        return 0xC0 + ordinal

    def set_current(self, ctx: int) -> None:
        assert ctx in (0xC0, 0xC1)

    def pointer_device(self, addr: int) -> int:
        return 0

    def stream_create(self) -> int:
        self._next_stream += 1
        self.streams.add(self._next_stream)
        return self._next_stream

    def stream_sync(self, s: int) -> None:
        assert s in self.streams

    def stream_destroy(self, s: int) -> None:
        self.streams.remove(s)

    def host_alloc(self, n: int) -> int:
        m = mmap.mmap(-1, n)
        c = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(c)
        del c
        self.pinned[addr] = m
        return addr

    def host_free(self, addr: int) -> None:
        self.pinned.pop(addr).close()


class DeviceBuf:
    """Host memory that presents itself as CUDA memory (__cuda_array_interface__)."""

    def __init__(self, n: int, strides: tuple[int, ...] | None = None) -> None:
        self.map = mmap.mmap(-1, n)
        c = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(c)
        del c
        self.n = n
        self.strides = strides

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"data": (self.addr, False), "shape": (self.n,), "typestr": "|u1",
                "strides": self.strides, "version": 3}


@pytest.fixture
def fake() -> Iterator[FakeDriver]:
    d = FakeDriver()
    old = kvcuda.set_driver(d)  # type: ignore[arg-type]
    yield d
    kvcuda.set_driver(old)


def _pool(lay: KVLayout = LAY) -> tuple[KVPool, list[DeviceBuf]]:
    bufs = [DeviceBuf(lay.segment_bytes) for _ in range(lay.num_segments)]
    return KVPool.cuda(lay, bufs), bufs


def _page_addr(pool: KVPool, ly: int, kv: int, blk: int) -> tuple[int, int]:
    seg, off, n = pool.layout.offset(ly, kv, blk)
    return pool.segments[seg].addr + off, n


def _fill(pool: KVPool, seed: int) -> None:
    lay = pool.layout
    for ly in range(lay.num_layers):
        for kv in range(2):
            for blk in range(lay.blocks_per_layer):
                a, n = _page_addr(pool, ly, kv, blk)
                ctypes.memmove(a, page(seed, ly, kv, blk, n), n)


def _read(pool: KVPool, ly: int, kv: int, blk: int) -> bytes:
    a, n = _page_addr(pool, ly, kv, blk)
    return ctypes.string_at(a, n)


def _block(pool: KVPool, ly: int, kv: int, blk: int) -> bytes:
    if pool.device == "cuda":
        return _read(pool, ly, kv, blk)
    return bytes(pool.block(ly, kv, blk))


def _check(dst: KVPool, src_ids: list[int], dst_ids: list[int], seed: int, layers) -> None:
    for ly in layers:
        for kv in range(2):
            for s, d in zip(src_ids, dst_ids):
                assert _block(dst, ly, kv, d) == page(seed, ly, kv, s, dst.layout.block_bytes), (ly, kv, s, d)


@pytest.mark.parametrize("chunk", [4 << 20, 5000, 3 * 4096])
@pytest.mark.parametrize("sides", ["cuda->cuda", "host->cuda", "cuda->host"])
def test_staged_pages_land_byte_for_byte(fake, sides, chunk) -> None:
    sdev, rdev = sides.split("->")
    sp = _pool()[0] if sdev == "cuda" else KVPool.host(LAY)
    rp = _pool()[0] if rdev == "cuda" else KVPool.host(LAY)
    if sdev == "cuda":
        _fill(sp, 3)
    else:
        for ly in range(LAY.num_layers):
            for kv in range(2):
                for blk in range(LAY.blocks_per_layer):
                    sp.block(ly, kv, blk)[:] = page(3, ly, kv, blk, LAY.block_bytes)
    rnd = random.Random(7)
    src, dst = rnd.sample(range(64), 48), rnd.sample(range(64), 48)
    with Agent("s", sp) as a, Agent("r", rp) as b:
        assert (a.cuda_device, b.cuda_device) == ((0 if sdev == "cuda" else None),
                                                  (0 if rdev == "cuda" else None))
        a.stage_chunk = b.stage_chunk = chunk   # chunks that cut runs anywhere
        a.add_remote(b.metadata())
        r = b.expect("s", 1)
        for req in (1, 2):   # the second reuses the staging buffers
            a.send_request("r", req, src, dst, notif=b"n%d" % req).wait(10)
        r.done.wait(5)
        _check(rp, src, dst, 3, range(LAY.num_layers))
        assert b.get_new_notifs() == {"s": [b"n1", b"n2"]}
        assert sorted(r.visible_blocks(3)) == sorted((kv, d) for kv in range(2) for d in dst)
    assert fake.pinned == {} and fake.streams == set()   # staging freed on close
    # the copies ran in the transport's threads, each with the pool's context current
    assert any(t.startswith("kv-tx-") or t.startswith("kv-land-") or t.startswith("kv-rx-")
               for t in fake.ctx_threads)


def test_odd_chunks_and_a_long_merged_run(fake) -> None:
    """tests/gpu/test_kv_gpu.py::test_odd_staging_chunks_cut_runs_anywhere over the stand-in."""
    lay = KVLayout(num_layers=8, blocks_per_layer=128, block_bytes=16 << 10)
    rest_s = random.Random(13).sample(range(40, 128), 80)
    rest_d = random.Random(14).sample([b for b in range(128) if not 50 <= b < 90], 80)
    sids, dids = list(range(40)) + rest_s, list(range(50, 90)) + rest_d
    sp, rp = _pool(lay)[0], _pool(lay)[0]
    _fill(sp, 12)
    with Agent("s", sp) as a, Agent("r", rp) as b:
        a.stage_chunk, b.stage_chunk = 100_003, 77_777
        a.add_remote(b.metadata())
        r = b.expect("s", 1)
        a.send_request("r", 1, sids, dids).wait(30)
        r.done.wait(10)
        _check(rp, sids, dids, 12, range(lay.num_layers))


@pytest.mark.parametrize("chunk", [4 << 20, 5000])
def test_receiver_cuda_error_fails_that_request_only(fake, chunk) -> None:
    sp, rp = _pool()[0], _pool()[0]
    _fill(sp, 4)
    seg, off, _n = LAY.offset(5, 1, 0)   # V of layer 5: mid-message with small chunks
    fake.poison = [(rp.segments[seg].addr + off, LAY.segment_bytes - off)]
    ids = list(range(0, 64, 3))
    with Agent("s", sp) as a, Agent("r", rp) as b:
        a.stage_chunk = b.stage_chunk = chunk
        a.add_remote(b.metadata())
        r = b.expect("s", 9)
        x = a.send_request("r", 9, ids, ids)
        with pytest.raises(KVRejected, match="CUDA error CUDA_ERROR_ILLEGAL_ADDRESS \\(700\\)"):
            x.wait(10)
        assert "host-to-device copy of request 9 layer 5" in str(x.error)
        with pytest.raises(FenceError, match="CUDA_ERROR_ILLEGAL_ADDRESS"):
            r.done.wait(5)
        assert isinstance(r.error, KVError)
        assert not r.layer(5).done() or r.layer(5).failed()
        assert 5 not in r.landed_layers() and r.visible_blocks(5) == []
        assert all(ly < 5 for ly in r.landed_layers())
        # the connection stays usable: the next request lands whole
        fake.poison = []
        r2 = b.expect("s", 10)
        a.send_request("r", 10, ids, ids).wait(10)
        r2.done.wait(5)
        _check(rp, ids, ids, 4, range(LAY.num_layers))


def test_sender_cuda_error_fails_the_transfer_and_no_later_layer_lands(fake) -> None:
    sp, rp = _pool()[0], KVPool.host(LAY)
    _fill(sp, 6)
    seg, _off, _n = LAY.offset(3, 1, 0)
    fake.poison = [(sp.segments[seg].addr, LAY.segment_bytes)]
    ids = [1, 2, 3, 40]
    with Agent("s", sp) as a, Agent("r", rp) as b, Agent("other", KVPool.host(LAY)) as c:
        a.add_remote(b.metadata())
        a.add_remote(c.metadata())
        r = b.expect("s", 1)
        x = a.send_request("r", 1, ids, ids)
        with pytest.raises(KVError, match="CUDA error CUDA_ERROR_ILLEGAL_ADDRESS") as ei:
            x.wait(10)
        assert "device-to-host copy of request 1 layer 3" in str(ei.value)
        with pytest.raises(FenceError, match="device-to-host copy of request 1 layer 3"):
            r.done.wait(5)
        assert all(ly < 3 for ly in r.landed_layers())
        assert r.visible_blocks(3) == []
        # other requests, to this peer and to another, go through
        fake.poison = []
        r2, r3 = b.expect("s", 2), c.expect("s", 3)
        a.send_request("r", 2, ids, ids).wait(10)
        a.send_request("other", 3, ids, ids).wait(10)
        r2.done.wait(5)
        r3.done.wait(5)
        _check(rp, ids, ids, 6, range(LAY.num_layers))
    assert fake.pinned == {} and fake.streams == set()


def test_sender_cuda_error_mid_message_drops_the_connection_then_reconnects(fake) -> None:
    sp, rp = _pool()[0], KVPool.host(LAY)
    _fill(sp, 8)
    seg, off, _n = LAY.offset(3, 1, 0)   # V of layer 3: after the message's first chunk went out
    fake.poison = [(sp.segments[seg].addr + off, LAY.segment_bytes - off)]
    ids = list(range(0, 64, 2))
    with Agent("s", sp, stall_timeout=3) as a, Agent("r", rp) as b:
        a.stage_chunk = 8192
        a.add_remote(b.metadata())
        r = b.expect("s", 1)
        x = a.send_request("r", 1, ids, ids)
        with pytest.raises(KVError, match="device-to-host copy of request 1 layer 3: CUDA error "
                                          "CUDA_ERROR_ILLEGAL_ADDRESS"):
            x.wait(10)
        with pytest.raises(FenceError):
            r.done.wait(5)
        assert r.landed_layers() == [0, 1, 2] and r.visible_blocks(3) == []
        fake.poison = []
        r2 = b.expect("s", 2)
        a.send_request("r", 2, ids, ids).wait(10)   # a new connection
        r2.done.wait(5)
        _check(rp, ids, ids, 8, range(LAY.num_layers))
    assert fake.pinned == {} and fake.streams == set()


KINDS = ("host", "cuda:0", "cuda:1")


class Mem:
    """One agent's memory without a KVLayout: a host range and a range on each of two
    stand-in CUDA devices, registered as (addr, len, dev) descriptors."""

    def __init__(self, agent: Agent, n: int) -> None:
        self.bufs = {k: DeviceBuf(n) for k in KINDS}   # host memory underneath, all three
        for k, b in self.bufs.items():
            agent.register_memory(b.addr, n, device=None if k == "host" else int(k[-1]))

    def fill(self, seed: int) -> None:
        for k, b in self.bufs.items():
            ctypes.memmove(b.addr, random.Random(f"{seed}{k}").randbytes(b.n), b.n)

    def get(self, kind: str, off: int, n: int) -> bytes:
        return ctypes.string_at(self.bufs[kind].addr + off, n)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_read_and_write_between_any_mix_of_cuda_and_host_memory(fake, op) -> None:
    blk, nblk = 4096, 32
    with Agent("a", stall_timeout=5) as a, Agent("b", stall_timeout=5) as b:
        ma, mb = Mem(a, blk * nblk), Mem(b, blk * nblk)
        a.stage_chunk = b.stage_chunk = 3 * blk + 512     # chunks cut pages anywhere
        a.add_remote(b.metadata())
        b.add_remote(a.metadata())
        assert json.loads(a.metadata())["devices"] == [-1, 0, 1]
        rnd = random.Random(5)
        for lk in KINDS:
            for rk in KINDS:
                ma.fill(1)
                mb.fill(2)
                # scattered blocks, distinct on each side
                pairs = list(zip(rnd.sample(range(nblk), 12), rnd.sample(range(nblk), 12)))
                loc = a.prep_local([(ma.bufs[lk].addr + s_ * blk, blk) for s_, _ in pairs])
                rem = a.prep_remote("b", [(mb.bufs[rk].addr + d_ * blk, blk) for _, d_ in pairs])
                idx = list(range(len(pairs)))
                copies = fake.copies
                x = a.make_xfer("b", loc, idx, rem, idx, notif=f"{lk}>{rk}".encode(), op=op)
                a.post(x)
                x.wait(10)
                assert x.status == "done"
                b.wait_notif("a", f"{lk}>{rk}".encode(), 5)
                # CUDA memory on either side went through the driver's copies, host alone not
                assert (fake.copies > copies) == (lk != "host" or rk != "host"), (lk, rk)
                for s_, d_ in pairs:
                    if op == "WRITE":    # a's pages are now in b's
                        assert mb.get(rk, d_ * blk, blk) == ma.get(lk, s_ * blk, blk), (lk, rk, s_, d_)
                    else:                # b's pages are now in a's
                        assert ma.get(lk, s_ * blk, blk) == mb.get(rk, d_ * blk, blk), (lk, rk, s_, d_)
        # one transfer across every kind at once: a message per device pair
        ma.fill(3)
        mb.fill(4)
        ld = [(ma.bufs[k].addr + i * blk, blk) for i, k in enumerate(KINDS * 2)]
        rd = [(mb.bufs[k].addr + (10 + i) * blk, blk) for i, k in enumerate(KINDS[::-1] * 2)]
        x = a.make_xfer("b", a.prep_local(ld), range(6), a.prep_remote("b", rd), range(6), op=op)
        assert len(x.messages) == 3       # (host, cuda:1), (cuda:0, cuda:0), (cuda:1, host)
        a.post(x)
        x.wait(10)
        for (la, n), (ra_, _n) in zip(ld, rd):
            src_b, dst_b = (la, ra_) if op == "WRITE" else (ra_, la)
            assert ctypes.string_at(dst_b, n) == ctypes.string_at(src_b, n)
        assert fake.copies > 0


def test_a_vram_descriptor_on_a_device_that_does_not_exist_is_refused(fake) -> None:
    with Agent("a") as a:
        buf = DeviceBuf(4096)
        with pytest.raises(UsageError, match="CUDA device 2 does not exist"):
            a.register_memory(buf.addr, 4096, device=2)
        with pytest.raises(UsageError, match="device=-1 must be a CUDA ordinal"):
            a.register_memory(buf.addr, 4096, device=-1)
        assert a.metadata() and json.loads(a.metadata())["devices"] == []


def test_cuda_pool_refusals(fake) -> None:
    lay = KVLayout(num_layers=2, blocks_per_layer=4, block_bytes=4096)
    with pytest.raises(UsageError, match="1 tensors for 2 segments"):
        KVPool.cuda(lay, [DeviceBuf(lay.segment_bytes)])
    with pytest.raises(UsageError, match="segment 1 has 4096 bytes"):
        KVPool.cuda(lay, [DeviceBuf(lay.segment_bytes), DeviceBuf(4096)])
    with pytest.raises(UsageError, match="object 0 is not contiguous"):
        KVPool.cuda(lay, [DeviceBuf(lay.segment_bytes, strides=(2,)), DeviceBuf(lay.segment_bytes)])
    with pytest.raises(UsageError, match="neither a torch CUDA tensor nor has __cuda_array_interface__"):
        KVPool.cuda(lay, [bytearray(lay.segment_bytes)] * 2)
    # one pool is one device's memory
    pool = KVPool.cuda(lay, [DeviceBuf(lay.segment_bytes)] * 2, device=2)
    with pytest.raises(UsageError, match="CUDA device 2 does not exist"):
        Agent("x", pool)
    pool = KVPool.cuda(lay, [DeviceBuf(lay.segment_bytes)] * 2)
    with Agent("y", pool) as a:
        assert a.cuda_device == 0 and '"device": "cuda"' in a.metadata().decode()
        host = bytearray(4096)     # host memory beside a CUDA pool is one more segment
        addr = ctypes.addressof(ctypes.c_char.from_buffer(host))
        assert a.register_memory(addr, 4096) == 2
        assert json.loads(a.metadata())["devices"] == [0, 0, -1]


class FakeTorch:
    """What KVPool.cuda reads of a torch tensor."""

    def __init__(self, ptr: int, n: int, index: int, cuda: bool = True, contiguous: bool = True) -> None:
        self._ptr, self._n, self.is_cuda, self._contig = ptr, n, cuda, contiguous
        self.device = type("D", (), {"index": index, "__str__": lambda s: f"cuda:{index}" if cuda else "cpu"})()
        self.shape, self._stride = (n,), (1,)

    def data_ptr(self) -> int:
        return self._ptr

    def numel(self) -> int:
        return self._n

    def element_size(self) -> int:
        return 1

    def is_contiguous(self) -> bool:
        return self._contig

    def stride(self) -> tuple[int, ...]:
        return self._stride


def test_torch_like_tensors_checked() -> None:
    lay = KVLayout(num_layers=2, blocks_per_layer=4, block_bytes=4096)
    n = lay.segment_bytes
    with pytest.raises(UsageError, match="different CUDA devices \\(cuda:0, cuda:1\\)"):
        KVPool.cuda(lay, [FakeTorch(1 << 20, n, 0), FakeTorch(2 << 20, n, 1)])
    with pytest.raises(UsageError, match="tensor 1 is on cpu, not a CUDA device"):
        KVPool.cuda(lay, [FakeTorch(1 << 20, n, 0), FakeTorch(2 << 20, n, None, cuda=False)])
    with pytest.raises(UsageError, match="tensor 0 is not contiguous"):
        KVPool.cuda(lay, [FakeTorch(1 << 20, n, 0, contiguous=False), FakeTorch(2 << 20, n, 0)])
    pool = KVPool.cuda(lay, [FakeTorch(1 << 20, n, 0), FakeTorch(2 << 20, n, 0)])
    assert pool.device == "cuda" and pool.cuda_device == 0
    with pytest.raises(UsageError, match="no host view"):
        pool.block(0, 0, 0)


def test_no_cuda_on_this_machine_is_a_clear_error(monkeypatch) -> None:
    old = kvcuda.set_driver(None)
    try:
        def no_lib(name: str, *a, **k):
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")
        monkeypatch.setattr(kvcuda.ctypes, "CDLL", no_lib)
        lay = KVLayout(num_layers=1, blocks_per_layer=4, block_bytes=4096)
        pool = KVPool.cuda(lay, [DeviceBuf(lay.num_layers * lay.segment_bytes)], device=0)
        with pytest.raises(UsageError, match="needs the CUDA driver \\(libcuda.so.1\\).*this machine has no CUDA"):
            Agent("z", pool)
        with pytest.raises(UsageError, match="this machine has no CUDA"):
            KVPool.cuda(lay, [DeviceBuf(lay.segment_bytes)])   # device found from the pointer
    finally:
        kvcuda.set_driver(old)
