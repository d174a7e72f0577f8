"""Batches of requests on a fake controller: thousands of reads and writes of any size into
several registrations in one submit call, checked whole before anything is sent; failures after
the call returned arrive through the futures; the controller's state is an enum with logged
transitions; a namespace uses only what it was handed."""

from __future__ import annotations

import dataclasses
import logging
import random
import time

import pytest

from nvme_fake import FakeControllerFile, FakeHub, FakeNamespace
from p2phub.errors import UsageError
from p2phub.nvme import ControllerState, Op, ReadOp, WriteOp, _build
from p2phub.nvme.controller import Controller
from p2phub.nvme.errors import ControllerResetError, NvmeStatusError, NvmeTimeoutError, RegistrationRevokedError

pytestmark = pytest.mark.unit

hot = _build.load()
KiB, MiB = 1 << 10, 1 << 20
LBA = 512
BLOCKS = 1 << 16  # 32 MiB namespace


@pytest.fixture
def rig():
    dev = FakeControllerFile(hot, namespaces={1: FakeNamespace(blocks=BLOCKS)})  # MDTS 128 KiB
    c = Controller(dev, hot=hot, io_queues=1, queue_depth=32, io_timeout=2.0)
    c.start()
    hub = FakeHub(dev.device)
    yield c, dev, hub
    c.close()
    dev.stop()


def _reg(dev, hub, size):
    r = hub.register(size)
    dev.add_registration(r)
    return r


def _plan(n: int, seed: int, reg_size: int, nregs: int, span: int):
    """n requests of 4..160 KiB (some above MDTS), alternately reads and writes, each at its own
    LBA range and its own range of one of nregs registrations."""
    rnd = random.Random(seed)
    sizes = [rnd.choice((4, 4, 4, 4, 8, 8, 8, 16, 160)) * KiB for _ in range(n)]
    lba_next = 0
    buf_next = [0] * nregs
    plan = []
    for k, size in enumerate(sizes):
        r = k % nregs
        if buf_next[r] + size > reg_size or (lba_next * LBA) + size > span:
            break
        plan.append(("read" if k % 2 else "write", r, lba_next, size, buf_next[r]))
        lba_next += size // LBA + rnd.randrange(0, 3) * 8   # scattered: gaps between them
        buf_next[r] += size + 4096 * rnd.randrange(0, 2)
    rnd.shuffle(plan)
    return plan


def test_thousands_of_requests_in_one_call_beyond_the_queue_depth(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    qp = c.io_qps[0]
    regs = [_reg(dev, hub, 16 * MiB), _reg(dev, hub, 16 * MiB)]
    data = dev.ns[1].data
    data[:] = random.Random(1).randbytes(len(data))
    for r in regs:
        r.mem[:] = random.Random(r.handle).randbytes(len(r.mem))
    plan = _plan(1200, 7, 16 * MiB, 2, BLOCKS * LBA)
    assert len(plan) > 1000 and len(plan) > 10 * qp.ntrk
    disk_before = bytes(data)
    mem_before = [bytes(r.mem) for r in regs]
    ops = [Op(kind, regs[r], lba, size, off) for kind, r, lba, size, off in plan]
    before = qp.stats()
    fut = ns.submit_ops(ops)
    assert fut.result(timeout=60) == len(ops) and set(fut.statuses()) == {0}
    for kind, r, lba, size, off in plan:
        if kind == "write":
            assert data[lba * LBA:lba * LBA + size] == mem_before[r][off:off + size]
        else:
            assert bytes(regs[r].mem[off:off + size]) == disk_before[lba * LBA:lba * LBA + size]
    st = qp.stats()
    commands = sum(-(-size // c.max_transfer) for _k, _r, _l, size, _o in plan)
    assert st["submitted"] - before["submitted"] == commands > len(plan)   # the big ones were split
    rounds = st["doorbells"] - before["doorbells"]
    assert commands / qp.ntrk <= rounds < commands   # rung per round as slots freed, not per command
    assert all(c.inflight(r) == 0 for r in regs) and st["outstanding"] == 0


def test_submit_gives_one_future_per_request_completing_on_its_own(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    reg = _reg(dev, hub, 1 * MiB)
    dev.hold_lbas.add(800)
    futs = ns.submit([ReadOp(reg, 800, 4096), WriteOp(reg, 16, 256 * KiB, 8192), Op("flush")])
    assert [f.index for f in futs] == [0, 1, 2]
    assert futs[1].result(timeout=5) == 0 and futs[2].result(timeout=5) == 0
    assert not futs[0].done() and c.inflight(reg) == 1 and dev.held
    dev.hold_lbas.clear()
    (qid, cid), = list(dev.held)
    dev._post(dev.held.pop((qid, cid))[0], qid, cid)
    assert futs[0].result(timeout=5) == 0 and c.inflight(reg) == 0


@pytest.mark.parametrize("bad, match", [
    (Op("read", None, 0, 4096), "no buffer given"),
    (ReadOp("REG", BLOCKS - 4, 4096), f"LBA range lba={BLOCKS - 4} nblocks=8 is outside namespace 1"),
    (ReadOp("REG", 0, 4096, 2), "offset=2 must be a multiple of 4"),
    (ReadOp("REG", 0, 1000), "nbytes=1000 is not a positive multiple of the LBA size 512"),
    (ReadOp("REG", 0, 2 * MiB), "buffer range offset=0 nbytes=2097152 is outside registration"),
    (ReadOp("REG", -1, 4096), "LBA range lba=-1 is outside namespace 1"),
    (ReadOp("REG", 0, 4096, -8), "buffer range offset=-8"),
    (ReadOp("REG", "0", 4096), "integers in 0..2"),
    (Op("trim", "REG", 0, 4096), "unknown kind 'trim'"),
    (Op("write_zeroes", lba=0, nblocks=0), "nblocks=0 must be positive"),
    (ReadOp("CLOSED", 0, 4096), "is closed"),
])
def test_one_bad_request_refuses_the_whole_call_and_names_it(rig, bad, match) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    qp = c.io_qps[0]
    reg = _reg(dev, hub, 1 * MiB)
    closed = _reg(dev, hub, 1 * MiB)
    ns.read(closed, 0, 4096)   # mapped for the controller, then closed by its owner
    closed._closed = True     # closed by its owner while still mapped (Resource state)
    bad = dataclasses.replace(bad, buf={"REG": reg, "CLOSED": closed}.get(bad.buf, bad.buf))
    ops = [WriteOp(reg, 8 * k, 4096, 4096 * k) for k in range(100)]
    ops.insert(57, bad)
    before = qp.stats()["submitted"]
    disk = bytes(dev.ns[1].data[:MiB])
    with pytest.raises(UsageError, match=match) as e:
        ns.submit(ops)
    assert e.value.index == 57 and "request 57 of 101" in str(e.value)
    assert qp.stats()["submitted"] == before and c.inflight(reg) == 0
    assert bytes(dev.ns[1].data[:MiB]) == disk


def test_a_revoked_registration_refuses_the_call_before_anything_is_sent(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    reg, victim = _reg(dev, hub, 1 * MiB), _reg(dev, hub, 1 * MiB)
    ns.read(victim, 0, 4096)
    dev.revoke(victim.handle, fence=False)
    before = c.io_qps[0].stats()["submitted"]
    with pytest.raises(RegistrationRevokedError) as e:
        ns.submit([ReadOp(reg, 0, 4096), ReadOp(victim, 8, 4096)])
    assert e.value.index == 1 and "read request 1 of 2" in str(e.value)
    assert c.io_qps[0].stats()["submitted"] == before


def test_after_the_call_returns_every_failure_arrives_through_the_futures(rig) -> None:
    """The gate refuses the rest of a batch when its registration is revoked part way: submit
    has already returned; what completed stays a success, the rest fail through their futures."""
    c, dev, hub = rig
    ns = c.namespace(1)
    reg = _reg(dev, hub, 1 * MiB)
    dev.hold_lbas.add(0)
    futs = ns.submit([ReadOp(reg, 8 * k, 4096, 4096 * k) for k in range(40)], qd=1)
    deadline = time.monotonic() + 10
    while not dev.held and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not any(f.done() for f in futs)      # the first is held by the device
    dev.revoke(reg.handle, fence=False)         # the owner takes the memory back
    dev.hold_lbas.clear()
    (qid, cid), = list(dev.held)
    dev._post(dev.held.pop((qid, cid))[0], qid, cid)
    assert futs[0].result(timeout=5) == 0
    for f in futs[1:]:
        with pytest.raises(RegistrationRevokedError, match=f"registration {reg.handle} .* was revoked by its owner"):
            f.result(timeout=5)
    assert futs[1].batch.exception() is futs[1].exception()
    assert c.inflight(reg) == 0


def test_error_statuses_fail_only_their_request(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    reg = _reg(dev, hub, 1 * MiB)
    dev.ns[1].blocks = 100  # the device now answers LBA Out of Range past 100
    try:
        fut = ns.submit_ops([ReadOp(reg, 0, 4096), ReadOp(reg, 200, 256 * KiB, 8192), ReadOp(reg, 8, 4096)],
                            futures=True)
        with pytest.raises(NvmeStatusError, match="LBA Out of Range") as e:
            fut.result(timeout=5)
        assert e.value.index == 1 and "read nsid=1 lba=200" in str(e.value)
        assert [f.exception() is None for f in fut.op_futures()] == [True, False, True]
        assert fut.statuses()[0] == 0 and fut.statuses()[1] != 0
    finally:
        dev.ns[1].blocks = BLOCKS


def test_a_queue_that_cannot_take_the_batch_fails_its_futures(rig) -> None:
    """The controller starts a reset after the call was checked (here: while an access hook
    runs): the call still returns its futures, and they fail."""
    c, dev, hub = rig
    ns = c.namespace(1)
    buf = c.alloc_dma(64 * KiB)

    class ResetMeanwhile:
        def begin(self, b, offset, length, kind):
            c.recovery.enter(ControllerState.RESETTING, "test: a reset in another thread")

        def end(self, token):
            pass

    c.access_hooks.append(ResetMeanwhile())
    before = c.io_qps[0].stats()["submitted"]
    try:
        futs = ns.submit([ReadOp(buf, 0, 4096), ReadOp(buf, 8, 4096)])
    finally:
        c.access_hooks.clear()
        c.recovery.enter(ControllerState.LIVE, "test: done")
    for f in futs:
        with pytest.raises(ControllerResetError, match="being reset"):
            f.result(timeout=1)
    assert c.io_qps[0].stats()["submitted"] == before
    ns.read(buf, 0, 4096)  # usable again


def test_controller_state_is_an_enum_with_logged_transitions(caplog) -> None:
    dev = FakeControllerFile(hot)
    caplog.set_level(logging.INFO, logger="p2phub.nvme.recovery")
    try:
        c = Controller(dev, hot=hot, io_queues=1, queue_depth=16)
        assert c.state is ControllerState.NEW and not c.state.terminal
        c.start()
        assert c.state is ControllerState.LIVE and c.stats()["state"] == "live"
        c.recovery.reset(why="test reset")
        assert c.state is ControllerState.LIVE and c.resets == 1
        c.close()
        assert c.state is ControllerState.CLOSED and c.state.terminal and c.closed
        c.close()  # idempotent
    finally:
        dev.stop()
    moves = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "p2phub.nvme.recovery"]
    assert [m for _l, m in moves] == [
        f"{dev.bdf}: new -> live: enabled; admin queue up",
        f"{dev.bdf}: live -> resetting: test reset",
        f"{dev.bdf}: resetting -> live: enabled again; re-creating the I/O queues",
        f"{dev.bdf}: live -> closed: closed by its owner"]
    assert moves[1][0] == "WARNING"


def test_a_namespace_uses_only_what_it_was_handed(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    assert not hasattr(ns, "ctrl")
    buf = c.alloc_dma(64 * KiB)
    other = c.io_qps[0]
    seen: list[object] = []

    def resolve(b):
        seen.append(b)
        return c.resolve_buffer(b)

    ns2 = type(ns)(ns.ident, dataclasses.replace(ns._ctx, resolve=resolve, qpair=lambda: other))
    before = other.stats()["submitted"]
    ns2.read(buf, 0, 8192)
    assert seen == [buf] and other.stats()["submitted"] == before + 1


def test_run_generated_is_the_engine_loop(rig) -> None:
    c, dev, hub = rig
    ns = c.namespace(1)
    qp = c.io_qps[0]
    buf = c.alloc_dma(64 * KiB)
    before = qp.stats()["submitted"]
    t0 = time.monotonic()
    lat = ns.run_generated("read", buf, 4096, 300, qd=8, seed=3, qpair=qp, slots=8, latencies=True)
    assert len(lat) == 300 and all(x > 0 for x in lat) and time.monotonic() - t0 < 30
    assert qp.stats()["submitted"] == before + 300
    with pytest.raises(UsageError, match="slots"):
        ns.run_generated("read", buf, 4096, 10, qd=1, slots=17)


def test_a_request_that_times_out_fails_through_its_future_after_a_reset() -> None:
    dev = FakeControllerFile(hot, namespaces={1: FakeNamespace(blocks=4096)})
    c = Controller(dev, hot=hot, io_queues=1, queue_depth=16, io_timeout=0.3, admin_timeout=2.0)
    c.start()
    try:
        reg = _reg(dev, FakeHub(dev.device), 64 * KiB)
        dev.refuse_abort = True   # the controller cannot abort it: the engine resets
        dev.hold_lbas.add(666)
        futs = c.namespace(1).submit([ReadOp(reg, 8, 4096), ReadOp(reg, 666, 4096, 4096)])
        assert futs[0].result(timeout=5) == 0
        with pytest.raises(NvmeTimeoutError) as e:
            futs[1].result(timeout=10)
        assert e.value.recovery == "reset" and c.resets == 1 and e.value.index == 1
        dev.hold_lbas.clear()
        c.namespace(1).read(reg, 16, 4096)   # usable again
        assert c.inflight(reg) == 0
    finally:
        c.close()
        dev.stop()


def test_hub_batch_with_namespace_entries_goes_through_one_submit(rig) -> None:
    """hub.load_batch / save_batch with a Namespace as the storage: entries over two
    registrations become one submit of the NVMe engine; a bad entry submits nothing."""
    from p2phub import batch
    c, dev, hub = rig
    hub._check_open = lambda: None          # the fake owner stands in for the Hub
    ns, qp = c.namespace(1), c.io_qps[0]
    regs = [_reg(dev, hub, 2 * MiB), _reg(dev, hub, 2 * MiB)]
    data = dev.ns[1].data
    data[:] = random.Random(2).randbytes(len(data))
    rnd = random.Random(4)
    n, page = 600, 4096
    offs = [rnd.randrange(0, BLOCKS * LBA // page) * page for _ in range(n)]
    places = rnd.sample(range(4 * MiB // page), n)
    midx = [p * page // (2 * MiB) for p in places]
    moffs = [p * page % (2 * MiB) for p in places]
    cols = dict(storage=ns, lengths=page, memory=regs, memory_index=midx, mem_offsets=moffs)
    try:
        before = qp.stats()["submitted"]
        bad = list(offs)
        bad[321] = BLOCKS * LBA
        with pytest.raises(UsageError, match="entry 321: range .* past the end"):
            batch.load_batch(hub, offsets=bad, **cols)
        assert qp.stats()["submitted"] == before
        f = batch.load_batch(hub, offsets=offs, per_entry=True, **cols)
        f.wait(30)
        assert list(f.results) == [page] * n and qp.stats()["submitted"] - before == n
        for o, r, m in zip(offs, midx, moffs):
            assert regs[r].mem[m:m + page] == data[o:o + page]
        woffs = [k * 2 * page for k in range(n)]
        batch.save_batch(hub, offsets=woffs, sync=False, **cols).wait(30)
        for o, r, m in zip(woffs, midx, moffs):
            assert data[o:o + page] == regs[r].mem[m:m + page]
    finally:
        hub.engines.close()
