"""The memory contract where p2phub.ko is absent (staged mode), with real code end to end:
the Hub says why it is staged and logs it once; host memory is allocated, registered,
ordered against GPU work and storage transfers, loaded and saved byte-exact, bound to
devices with the path each takes, and moved as a KV pool over TCP on 127.0.0.1.

The only stand-in is a GPU stream (test_ordering's FakeStream/FakeOps: a thread that runs
enqueued work in order), since this host has no GPU."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from p2phub import Memory, StagedModeError, StagedRegistration
from p2phub.hub import Hub
from p2phub.kv import Agent, KVLayout, KVPool
from p2phub.memory import PathKind
from p2phub.ordering import AccessKind, OrderingError, WordPool

from kvpeer import page
from test_ordering import FakeOps, FakeStream

KiB, MiB = 1 << 10, 1 << 20
NVME = "0000:00:04.0"


@pytest.fixture()
def hub(tmp_path):
    with Hub(path=str(tmp_path / "p2phub")) as h:
        yield h


@pytest.fixture()
def ops() -> FakeOps:
    WordPool._pools.pop(("fake", 0), None)
    return FakeOps()


def test_hub_without_the_module_is_staged_says_why_and_logs_it_once(tmp_path, caplog) -> None:
    node = str(tmp_path / "p2phub")
    caplog.set_level(logging.INFO, logger="p2phub.hub")
    with Hub(path=node) as h1, Hub(path=node) as h2:
        assert h1.mode == h2.mode == "staged"
        assert h1.mode_reason.startswith("kmod.loaded: p2phub.ko is not loaded")
        assert node in h1.mode_reason and "\n" not in h1.mode_reason
        assert repr(h1).startswith("<Hub staged (kmod.loaded:")
    said = [r for r in caplog.records if node in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "staged mode" in said[0].getMessage()


@pytest.mark.skipif(os.path.exists("/dev/p2phub"), reason="this host has p2phub.ko loaded")
def test_the_default_hub_on_this_host_is_staged() -> None:
    with Hub() as h:
        assert h.mode == "staged" and h.mode_reason.startswith("kmod.")


def test_alloc_host_and_register_keep_the_whole_contract(hub) -> None:
    with hub.alloc_host(64 * KiB) as mem, hub.register(bytearray(8 * KiB)) as buf:
        for m in (mem, buf):
            assert isinstance(m, Memory) and isinstance(m, StagedRegistration)
            assert m.mode == "staged" and m.gpu is None and m.reason == hub.mode_reason
            assert m.info().length == m.length and not m.info().revoked
            assert m.users == [] and m.live_dependents == 0
        assert mem.length == 64 * KiB and buf.length == 8 * KiB
        # the CPU view of alloc_host memory: two mappings, the same pages
        a, b = mem.mmap(), mem.mmap()
        a[100:105] = b"hello"
        assert b[100:105] == b"hello"
        a.close()
        b.close()
        with pytest.raises(Exception, match="CPU mapping exists only"):
            buf.mmap()
    assert mem.closed and buf.closed
    with pytest.raises(Exception, match="multiple of"):
        hub.alloc_host(1000)


def test_load_and_save_round_trip_byte_exact(hub, tmp_path) -> None:
    data = os.urandom(3 * MiB + 5 * KiB + 3)
    src, out = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(data)
    with hub.alloc_host(4 * MiB) as mem:
        hub.load(src, mem, dest_offset=4096).wait(30)
        view = mem.mmap()
        assert bytes(view[4096:4096 + len(data)]) == data       # checked through another mapping
        assert bytes(view[:4096]) == bytes(4096)
        view.close()
        hub.save(mem, out, nbytes=len(data), source_offset=4096).wait(30)
    assert out.read_bytes() == data
    buf = bytearray(len(data))
    with hub.register(buf) as reg:
        hub.load(out, reg).wait(30)
    assert bytes(buf) == data


def test_gpu_work_waits_for_a_load_and_strict_ordering_refuses_a_conflict(hub, tmp_path,
                                                                          ops) -> None:
    data = os.urandom(256 * KiB)
    src = tmp_path / "in.bin"
    src.write_bytes(data)
    stream = FakeStream()
    with hub.alloc_host(256 * KiB) as mem:
        view = mem.mmap()
        seen: list[bytes] = []
        gate = threading.Event()
        # a GPU kernel writes the first page; the load of the same bytes waits for it
        with mem.gpu_access(0, 4096, AccessKind.GPU_WRITE, stream, "kernel", ops=ops):
            stream.launch("kernel", lambda: (gate.wait(5), seen.append(b"k")))
        t = threading.Thread(target=lambda: hub.load(src, mem).wait(30))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.2)
        assert bytes(view[:16]) == bytes(16)                     # the load has not started
        gate.set()
        t.join(30)
        assert seen == [b"k"] and time.monotonic() - t0 >= 0.2
        assert bytes(view[:len(data)]) == data
        # a GPU read of what the load filled: ordered behind the load's fence on the stream
        fence = hub.load(src, mem)
        with mem.gpu_access(0, len(data), AccessKind.GPU_READ, stream, "reader", ops=ops) as g:
            # a load still running now was running when the read was declared (a fast host
            # may have finished it before: then there is nothing to wait for)
            loading = not fence.done()
            stream.launch("reader", lambda: seen.append(bytes(view[:8])))
        fence.wait(30)
        stream.sync()
        g.access.fence.wait(5)                                   # the reader's access is over
        assert seen[-1] == data[:8]
        assert g.access.deps or not loading
        view.close()
        # strict ordering: a save of bytes a GPU kernel is still writing is refused by name
        mem.ordering.strict = True
        gate.clear()
        with mem.gpu_access(0, 4096, AccessKind.GPU_WRITE, stream, "writer", ops=ops):
            stream.launch("writer", lambda: gate.wait(5))
        with pytest.raises(OrderingError, match="writer"):
            hub.save(mem, tmp_path / "out.bin", nbytes=4096)
        gate.set()
        stream.sync()


def test_paths_are_chosen_when_bound_and_nvme_is_refused_naming_why(hub) -> None:
    assert hub.paths() == []
    with hub.alloc_host(64 * KiB) as mem:
        assert hub.paths() == []                       # nothing bound yet
        path = mem.path(NVME)
        assert path.kind is PathKind.STAGED and hub.mode_reason in path.reason
        binding = mem.bind(NVME)
        assert binding.staged and binding.handle == -1
        with pytest.raises(StagedModeError, match="an NVMe transfer .* staged .*kmod.loaded"):
            binding.require_direct("an NVMe transfer by " + NVME)
        assert [(p.device, p.kind) for p in hub.paths()] == [(NVME, PathKind.STAGED)]
        for call in (lambda: mem.dma_pages(NVME), mem.export):
            with pytest.raises(StagedModeError, match="peer-to-peer mode"):
                call()
    assert hub.paths() == []                           # closed memory binds nothing


def test_close_waits_for_a_transfer_and_the_hub_closes_what_is_left(tmp_path) -> None:
    src = tmp_path / "in.bin"
    src.write_bytes(os.urandom(MiB))
    hub = Hub(path=str(tmp_path / "none"))
    mem = hub.alloc_host(MiB)
    fence = hub.load(src, mem)
    mem.close()                                         # drains the load (its ordering user)
    assert fence.done() and fence.exception() is None and mem.closed
    left = hub.alloc_host(64 * KiB)
    hub.close()
    assert left.closed and hub.closed


LAY = KVLayout(num_layers=4, blocks_per_layer=32, block_bytes=4096)


def test_a_kv_pool_of_staged_memory_moves_over_tcp(hub) -> None:
    pa, pb = KVPool.registered(hub, LAY), KVPool.registered(hub, LAY)
    try:
        assert all(isinstance(s.registration, StagedRegistration) for s in pa.segments + pb.segments)
        for ly in range(LAY.num_layers):
            for kv in range(LAY.kv):
                for blk in range(LAY.blocks_per_layer):
                    pa.block(ly, kv, blk)[:] = page(11, ly, kv, blk, LAY.block_bytes)
        with Agent("a", pa, stall_timeout=5.0) as a, Agent("b", pb, stall_timeout=5.0) as b:
            a.add_remote(b.metadata())
            src, dst = [3, 4, 9, 17], [20, 21, 5, 0]
            r = b.expect("a", 1, blocks=dst)                # declared on the segments' ordering
            a.send_request("b", 1, src, dst).wait(10)
            r.done.wait(10)
        for ly in range(LAY.num_layers):
            for kv in range(LAY.kv):
                for s, d in zip(src, dst):
                    # read back through the registration's own CPU mapping, not the pool's view
                    seg, off, n = LAY.offset(ly, kv, d)
                    m = pb.segments[seg].registration.mmap()
                    assert bytes(m[off:off + n]) == page(11, ly, kv, s, LAY.block_bytes)
                    m.close()
    finally:
        pa.close()
        pb.close()
