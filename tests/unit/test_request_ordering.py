"""A single hub.load / hub.save is an ordered access of its memory, its fence and its record
in one object: it waits for the earlier accesses it conflicts with, later ones wait for it,
strict mode refuses the conflict naming both, a failed request releases its range, and a
queued request leaves the cycle collector one object, not a dozen."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from p2phub.hub import Hub
from p2phub.ordering import AccessKind, FenceError, HostFence, OrderingError

pytestmark = pytest.mark.unit

BLOCK = 4096


@pytest.fixture()
def blocks(tmp_path):
    path = tmp_path / "blocks.bin"
    path.write_bytes(bytes(range(1, 17)) * (16 * BLOCK // 16))
    return str(path)


def test_a_load_waits_for_an_earlier_reader_of_its_bytes(blocks) -> None:
    """A load into bytes a socket is still sending from waits until that send's fence
    completes; the bytes are the old ones until then."""
    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(4 * BLOCK)
        view = memoryview(mem.mmap())
        send = mem.ordering.acquire(0, BLOCK, AccessKind.SOCKET_SEND, "send block 0")
        done = HostFence("the send")
        send.bind(done)
        out: list = []
        t = threading.Thread(target=lambda: out.append(hub.load(blocks, mem, 0, BLOCK, 0)))
        t.start()
        time.sleep(0.3)
        assert t.is_alive() and not out          # still waiting for the send
        assert bytes(view[:BLOCK]) == bytes(BLOCK)
        done.set()
        t.join(10)
        out[0].wait(10)
        assert bytes(view[:16]) == bytes(range(1, 17))
        assert len(mem.ordering) == 0             # both ranges released
        view.release()


def test_a_later_access_waits_for_a_queued_load_and_strict_mode_names_it(blocks) -> None:
    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(4 * BLOCK)
        with hub.engines.paused():
            load = hub.load(blocks, mem, 0, 2 * BLOCK, 0)
            later = mem.ordering.enter(BLOCK, BLOCK, AccessKind.SOCKET_SEND, "send block 1")
            assert later.deps == [load]           # the request is the access it waits for
            assert load.fence is load and load.producer and not load.done()
            mem.ordering.strict = True
            with pytest.raises(OrderingError) as ei:
                hub.load(blocks, mem, BLOCK, BLOCK, BLOCK)
            assert ei.value.conflict is load
            assert "nvme read" in str(ei.value)
            mem.ordering.strict = False
            later.cancel()
        load.wait(10)
        assert len(mem.ordering) == 0


def test_a_failed_load_releases_its_range(blocks, tmp_path) -> None:
    short = tmp_path / "short.bin"
    short.write_bytes(b"\x01" * (2 * BLOCK))
    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(4 * BLOCK)
        f = hub.load(str(short), mem, 0, 2 * BLOCK, 0)
        short.write_bytes(b"\x01" * BLOCK)        # the file shrinks under the queued read
        try:
            f.wait(10)
        except FenceError:
            pass
        assert len(mem.ordering) == 0
        hub.load(blocks, mem, 0, BLOCK, 0).wait(10)   # the range is free for the next


def test_a_queued_request_leaves_one_object_for_the_cycle_collector(blocks) -> None:
    n = 512
    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(n * BLOCK)
        hub.load(blocks, mem, 0, BLOCK, 0).wait(10)
        gc.collect()
        gc.disable()
        try:
            with hub.engines.paused():
                before = len(gc.get_objects())
                fences = [hub.load(blocks, mem, (i % 16) * BLOCK, BLOCK, i * BLOCK)
                          for i in range(n)]
                queued = (len(gc.get_objects()) - before) / n
            for f in fences:
                f.wait(10)
            done = (len(gc.get_objects()) - before) / n
        finally:
            gc.enable()
        assert mem.holds == 0 and len(mem.ordering) == 0   # released in bulk, all of them
        # the request itself: alone on its range, the tracker keeps it bare (no tuple)
        assert queued <= 1.1, queued
        assert done <= 1.1, done


def test_a_request_has_every_field_a_fence_has(blocks) -> None:
    """RequestFence sets the fields of its base classes itself (one frame per request):
    none may be missing."""
    from p2phub import staged
    from p2phub.batch import RequestFence

    with Hub(mode="staged") as hub:
        mem = hub.alloc_host(BLOCK)
        req = hub.load(blocks, mem, 0, BLOCK, 0)
        req.wait(10)
        assert type(req) is RequestFence
        base = staged.Fence("a fence", BLOCK)
        # `what` and `stats` are properties of a request, made when asked for
        assert set(vars(base)) - {"what", "stats"} <= set(vars(req))
        assert req.stats["requests"] >= 1 and not req.failed()
