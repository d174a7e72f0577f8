"""The engine on a fake controller: the batch API, registrations held by the controller
(in-flight counts, quiesce), the future (fence) interface, metadata namespaces refused."""

from __future__ import annotations

import array
import asyncio
import bisect
import random
import time

import pytest

from nvme_fake import FakeControllerFile, FakeHub, FakeNamespace
from p2phub.errors import UsageError
from p2phub.nvme import ReadOp, WriteOp, _build, quiesce_registration
from p2phub.nvme.controller import Controller
from p2phub.nvme.recovery import ControllerState
from p2phub.nvme.errors import NvmeStatusError

pytestmark = pytest.mark.unit

hot = _build.load()


@pytest.fixture
def rig():
    dev = FakeControllerFile(hot, namespaces={
        1: FakeNamespace(blocks=8192),
        2: FakeNamespace(blocks=1024, lbads=9, ms=8, flbas=0x10),   # 512+8 inline metadata
        3: FakeNamespace(blocks=1024, lbads=12, ms=8, dps=1),       # separate metadata, PI type 1
        4: FakeNamespace(blocks=1024, lbads=8),                     # 256-byte blocks
    })
    c = Controller(dev, hot=hot, io_queues=2, queue_depth=64)
    c.start()
    hub = FakeHub(dev.device)
    yield c, dev, hub
    c.close()
    dev.stop()


def _reg(dev, hub, size=1 << 20):
    r = hub.register(size)
    dev.add_registration(r)
    return r


def test_metadata_and_small_block_namespaces_are_refused_with_the_format(rig) -> None:
    c, _dev, _hub = rig
    assert sorted(c.namespaces) == [1]
    with pytest.raises(UsageError, match=r"namespace 2 .*512-byte blocks \+ 8 bytes of metadata \(extended LBA\)"):
        c.namespace(2)
    with pytest.raises(UsageError, match=r"namespace 3 .*protection information type 1"):
        c.namespace(3)
    with pytest.raises(UsageError, match=r"namespace 4 .*LBADS 8 is outside 9..16"):
        c.namespace(4)
    assert set(c.info()["skipped_namespaces"]) == {"2", "3", "4"}


def test_batch_api_moves_the_right_bytes(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    reg = _reg(dev, hub)
    for i in range(64):
        dev.ns[1].data[i * 4096:(i + 1) * 4096] = bytes([i]) * 4096
    order = list(reversed(range(64)))
    fut = ns.read_batch(reg, array.array("Q", [8 * i for i in order]), [4096 * k for k in range(64)], 4096, qd=5)
    assert fut.result(timeout=10) == 64 and fut.statuses() == [0] * 64
    for k, i in enumerate(order):
        assert bytes(reg.mem[4096 * k:4096 * (k + 1)]) == bytes([i]) * 4096
    # And back out, to other LBAs.
    fut = ns.write_batch(reg, [4096 + 8 * k for k in range(64)], [4096 * k for k in range(64)], 4096)
    fut.result(timeout=10)
    assert bytes(dev.ns[1].data[4096 * 512:4096 * 513]) == bytes([63]) * 4096
    assert c.inflight(reg) == 0 and c.holds(reg)


def test_a_batch_of_many_rounds_puts_each_block_where_its_request_says(rig) -> None:
    """More requests than the pump encodes per round (64) and than the queue holds: each one
    still reads its own LBA into its own offset."""
    c, dev, hub = rig
    ns = c.namespace(1)
    reg = _reg(dev, hub, 300 * 4096)
    data = dev.ns[1].data
    for i in range(1000):
        data[i * 4096:(i + 1) * 4096] = i.to_bytes(2, "little") * 2048
    order = random.Random(5).sample(range(1000), 300)
    slots = random.Random(6).sample(range(300), 300)
    fut = ns.read_batch(reg, [8 * i for i in order], [4096 * k for k in slots], 4096, qd=32)
    assert fut.result(timeout=30) == 300 and fut.statuses() == [0] * 300
    for i, k in zip(order, slots):
        assert bytes(reg.mem[4096 * k:4096 * (k + 1)]) == i.to_bytes(2, "little") * 2048
    assert c.inflight(reg) == 0


def test_batch_latencies_bucketed_in_c_match_the_list(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    reg = _reg(dev, hub)
    fut = ns.read_batch(reg, [8 * i for i in range(100)], [4096 * (i % 64) for i in range(100)], 4096,
                        latencies=True)
    fut.result(timeout=10)
    lat = sorted(fut.latencies_ns())
    bounds = [0, lat[0], lat[50], lat[50] + 1, lat[-1], 10**12]
    assert fut.latency_histogram(bounds) == ([bisect.bisect_right(lat, b) for b in bounds], 100, sum(lat))
    with pytest.raises(UsageError, match="65 histogram bounds: at most 64"):
        fut.latency_histogram(list(range(65)))
    plain = ns.read_batch(reg, [0], [0], 4096)
    plain.result(timeout=10)
    assert plain.latency_histogram(bounds) == ([0] * len(bounds), 0, 0)   # none asked for
    # a histogram's own counters, added to in place: twice the batch, then the sum
    acc = array.array("Q", [5] * (len(bounds) + 2))
    tb = tuple(bounds)
    assert fut.add_latencies(tb, acc) == 100 and fut.add_latencies(tb, acc) == 100
    assert list(acc) == [5 + 2 * bisect.bisect_right(lat, b) for b in bounds] + [5, 5 + 2 * sum(lat)]
    assert plain.add_latencies(tb, acc) == 0
    with pytest.raises(UsageError, match="needs 8 counters"):
        fut.add_latencies(tb, array.array("Q", [0] * 7))


def test_latency_buckets_in_c_match_bisect_on_any_order() -> None:
    """The C bucketing tries the previous latency's bucket first: runs in one bucket, values
    on a bound, above every bound and jumps between far buckets all count as bisect does."""
    from p2phub.nvme.queue import bucket_latencies
    hot = _build.load()
    rnd = random.Random(11)
    bounds = [5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000, 1_000_000]
    cases = [
        [150_000] * 50 + [200_000, 200_001, 199_999] + [4_000] * 7 + [2_000_000, 0, 5_000],
        [rnd.choice(bounds) + rnd.choice((-1, 0, 1)) for _ in range(500)],
        sorted(rnd.randrange(0, 3_000_000) for _ in range(500)),
        [rnd.randrange(0, 3_000_000) for _ in range(500)],
        [1_000_001] * 10,
    ]
    for lat in cases:
        arr = hot.ffi.new("uint32_t[]", lat)
        want = sorted(lat)
        assert bucket_latencies(hot, arr, len(lat), bounds) == (
            [bisect.bisect_right(want, b) for b in bounds], len(lat), sum(lat))
    assert bucket_latencies(hot, hot.ffi.new("uint32_t[]", [7, 9]), 2, []) == ([], 2, 16)


def test_latency_buckets_narrow_and_wide_batches_count_as_bisect_does() -> None:
    """A batch between a few bounds is counted a pass per bound in between, a wide one
    latency by latency from its bit length: both agree with bisect on the metrics' own
    bounds, on bounds at powers of two and on the extremes of uint32, and add to what a
    histogram already holds."""
    from p2phub.nvme.queue import bucket_latencies
    hot = _build.load()
    ffi, lib = hot.ffi, hot.lib
    rnd = random.Random(12)
    lat_bounds = [5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000, 1_000_000, 2_000_000,
                  5_000_000, 10_000_000, 50_000_000, 100_000_000, 500_000_000, 1_000_000_000,
                  5_000_000_000]
    pow2 = [1 << k for k in range(0, 33, 3)] + [(1 << 32) - 1]
    top = (1 << 32) - 1
    for bounds in (lat_bounds, pow2, [0], [top]):
        cases = [
            [rnd.randrange(150_000, 450_000) for _ in range(4096)],   # between two bounds
            [rnd.randrange(0, 1 << rnd.randrange(1, 33)) for _ in range(3000)],  # wide
            [b + d for b in bounds for d in (-1, 0, 1) if 0 <= b + d <= top] * 3,
            [0, 1, top, top - 1, 1 << 31, (1 << 31) - 1],
            [42],
        ]
        for lat in cases:
            want = sorted(lat)
            arr = ffi.new("uint32_t[]", lat)
            assert bucket_latencies(hot, arr, len(lat), bounds) == (
                [bisect.bisect_right(want, b) for b in bounds], len(lat), sum(lat)), (bounds, lat[:8])
            # the C call adds to counts (and sum) already there
            c_bounds = ffi.new("uint64_t[]", bounds)
            counts, total = ffi.new("uint64_t[]", [7] * len(bounds)), ffi.new("uint64_t *", 5)
            assert lib.p2h_lat_buckets(arr, len(lat), c_bounds, len(bounds), counts, total) == 0
            assert list(counts) == [7 + bisect.bisect_right(want, b) for b in bounds]
            assert total[0] == 5 + sum(lat)
    assert bucket_latencies(hot, ffi.new("uint32_t[]", 1), 0, lat_bounds) == ([0] * 16, 0, 0)


def test_batch_check_finds_the_first_bad_request_as_a_request_by_request_check_would() -> None:
    """p2h_fill_rw checks a batch by its largest LBA and offset, smallest offset and OR of
    offsets, and only searches a bad one: the first bad request and its reason, and the
    span of a good batch, match a check of each request in turn."""
    hot = _build.load()
    ffi, lib = hot.ffi, hot.lib
    rnd = random.Random(13)
    blocks, shift, npages = 1 << 12, 9, 16
    limit = npages * 4096
    pages = ffi.new("uint64_t[]", [0x10000 * (i + 1) for i in range(npages)])

    def model(lbas: list[int], offs: list[int], nbytes: int) -> tuple[int, int, tuple[int, int]]:
        nlb = nbytes >> shift
        for i, (lba, off) in enumerate(zip(lbas, offs)):
            if lba >= blocks or nlb > blocks - lba:
                return i, 1, (0, 0)
            if off >= limit or nbytes > limit - off:
                return i, 2, (0, 0)
            if off & 3:
                return i, 3, (0, 0)
        return -1, 0, (min(offs), max(offs) + nbytes)

    for trial in range(400):
        nbytes = rnd.choice((512, 4096, 8192))
        n = rnd.randrange(1, 64)
        nlb = nbytes >> shift
        lbas = [rnd.randrange(0, blocks - nlb + 1) for _ in range(n)]
        offs = [rnd.randrange(0, (limit - nbytes) // 4 + 1) * 4 for _ in range(n)]
        for _ in range(rnd.choice((0, 0, 1, 2, 3))):   # some bad requests, anywhere
            k = rnd.randrange(n)
            what = rnd.randrange(5)
            if what == 0:
                lbas[k] = rnd.choice((blocks, blocks - nlb + 1, (1 << 64) - 1))
            elif what == 1:
                offs[k] = rnd.choice((limit, limit - nbytes + 4, (1 << 64) - 4))
            elif what == 2:
                offs[k] = (offs[k] & ~3) | rnd.choice((1, 2, 3))
            elif what == 3:
                offs[k] = (1 << 64) - 1                      # every reason at once
            else:
                lbas[k] = 0                                   # a good extreme
        bad, why = ffi.new("int *"), ffi.new("int *")
        span = ffi.new("uint64_t[2]")
        rc = lib.p2h_fill_rw(ffi.NULL, n, 2, 1, shift, nbytes, ffi.new("uint64_t[]", lbas),
                             ffi.new("uint64_t[]", offs), pages, npages, 0, 0, blocks, span, bad, why)
        k, reason, want_span = model(lbas, offs, nbytes)
        assert (rc != 0, bad[0], why[0]) == (k >= 0, k, reason), (trial, lbas, offs, nbytes)
        if k < 0:
            assert (span[0], span[1]) == want_span


def test_batch_bad_request_refuses_the_whole_batch(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    reg = _reg(dev, hub, 64 << 10)
    qp = c.io_qps[0]
    before = qp.c.submitted
    with pytest.raises(UsageError, match="request 2: LBA range lba=8192"):
        ns.read_batch(reg, [0, 8, 8192], [0, 4096, 8192], 4096, qpair=qp)
    with pytest.raises(UsageError, match=r"request 1: buffer range offset=65536"):
        ns.read_batch(reg, [0, 8], [0, 65536], 4096, qpair=qp)
    with pytest.raises(UsageError, match="multiple of 4"):
        ns.read_batch(reg, [0], [2], 4096, qpair=qp)
    with pytest.raises(UsageError, match="MDTS"):
        ns.read_batch(reg, [0], [0], 1 << 20, qpair=qp)
    assert qp.c.submitted == before and c.inflight(reg) == 0


def test_batch_error_status_names_the_request(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    reg = _reg(dev, hub)
    dev.ns[1].blocks = 100  # the device now says LBA out of range past 100
    fut = ns.read_batch(reg, [0, 200, 8], [0, 4096, 8192], 4096)
    with pytest.raises(NvmeStatusError, match="LBA Out of Range") as e:
        fut.result(timeout=10)
    assert e.value.index == 1 and fut.statuses()[0] == 0 and fut.statuses()[1] != 0
    with pytest.raises(NvmeStatusError, match="LBA Out of Range"):   # wait() raises it, as Fence.wait
        fut.wait(10)


def test_inflight_count_and_quiesce_registration(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    reg, other = _reg(dev, hub), _reg(dev, hub)
    dev.hold_lbas.add(800)
    futs = ns.submit([ReadOp(reg, 800, 4096), ReadOp(reg, 0, 8192, 4096), WriteOp(other, 16, 4096)])
    assert c.inflight(reg) == 2 and c.inflight(other) == 1
    futs[2].result(timeout=5)
    assert c.inflight(other) == 0
    assert c.quiesce_registration(other, timeout=5) and not c.holds(other)
    assert f"unmap {other.handle}" in dev.log
    # reg has a command the device holds: quiesce times out and keeps the hold.
    assert not c.quiesce_registration(reg, timeout=0.2) and c.holds(reg)
    assert f"unmap {reg.handle}" not in dev.log
    dev.hold_lbas.clear()
    dev.held.clear()
    c.io_qps[0].timeout_s = c.io_qps[1].timeout_s = 0.2  # the held command is recovered by the engine
    assert quiesce_registration(reg, timeout=30)  # the module function: every controller holding it
    assert c.inflight(reg) == 0 and not c.holds(reg) and f"unmap {reg.handle}" in dev.log


def test_registration_of_another_hub_is_refused(rig) -> None:
    c, dev, _hub = rig
    stranger = FakeHub(object()).register(4096)
    dev.add_registration(stranger)
    with pytest.raises(UsageError, match="another /dev/p2phub file"):
        c.namespace(1).read(stranger, 0, 4096)


def test_future_interface_for_fences(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    reg = _reg(dev, hub)
    dev.hold_lbas.add(900)
    f = ns.submit([ReadOp(reg, 900, 4096)])[0]
    b = ns.read_batch(reg, [0, 8], [0, 4096], 4096)
    seen: list[object] = []
    f.add_done_callback(seen.append)
    b.add_done_callback(seen.append)
    with pytest.raises(TimeoutError):   # FenceTimeout, as Fence.wait raises: one interface
        f.wait(0.05)
    assert not f.done()
    assert b.wait(5) is None and b.done() and b.exception() is None and seen == [b]
    dev.hold_lbas.clear()
    (qid, cid), = list(dev.held)
    dev._post(dev.held.pop((qid, cid))[0], qid, cid)  # the device completes it at last
    assert f.wait(5) is None and f.exception() is None and seen == [b, f]

    async def main() -> int:
        return await ns.submit([ReadOp(reg, 8, 4096)])[0] + await ns.read_batch(reg, [1], [0], 4096)

    assert asyncio.run(main()) == 1


def test_access_hooks_see_every_access_declared_then_released(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    reg = _reg(dev, hub)
    events: list[tuple] = []

    class Hook:
        def begin(self, buf, offset, length, kind):
            events.append(("begin", buf is reg, offset, length, kind))
            return len(events)

        def end(self, token):
            events.append(("end", token))

    c.access_hooks.append(Hook())
    ns.write(reg, 0, 8192, offset=4096)
    ns.read_batch(reg, [0, 16], [0, 65536], 4096).result(timeout=5)
    assert events == [("begin", True, 4096, 8192, "write"), ("end", 1),
                      ("begin", True, 0, 65536 + 4096, "read"), ("end", 3)]
    t0 = time.monotonic()
    assert time.monotonic() - t0 < 1


def test_pci_device_numbers_above_0x1f_are_refused() -> None:
    from p2phub.nvme import bind

    with pytest.raises(UsageError, match="device number 0xff is above 0x1f"):
        bind.split_bdf("0000:00:ff.0")
    assert bind.split_bdf("0000:00:1f.7") == (0, 0, 0xFF)


def test_close_with_io_outstanding_fails_it_after_the_fd_is_closed() -> None:
    dev = FakeControllerFile(hot)
    c = Controller(dev, hot=hot, io_queues=1, queue_depth=16)
    c.start()
    reg = _reg(dev, FakeHub(dev.device))
    dev.hold_lbas.add(5)
    fut = c.namespace(1).submit([ReadOp(reg, 5, 4096)])[0]
    order: list[bool] = []
    fut.add_done_callback(lambda f: order.append(dev.closed))
    c.close()
    dev.stop()
    assert order == [True] and fut.done() and "closed" in str(fut.exception())
    assert c.inflight(reg) == 0
