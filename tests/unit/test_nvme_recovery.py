"""Recovery of the engine: timeouts, aborts, resets, fences, removal, a dead controller.

The controller is built through its public constructor, ``Controller(kfile)`` +
``start()``, on a fake controller fd whose device thread works the same rings in
host memory (tests/unit/nvme_fake.py). QEMU 7.2 (the lab's) answers every Abort
with "not aborted", so the abort branch is only seen here.
"""

from __future__ import annotations

import os
import time

import pytest

from nvme_fake import FakeControllerFile, FakeHub, FakeNamespace
from p2phub import uapi
from p2phub.errors import RevokedError
from p2phub.nvme import _build, spec
from p2phub.nvme.controller import Controller
from p2phub.nvme.recovery import ControllerState
from p2phub.nvme.errors import (ControllerDeadError, ControllerRemovedError, ControllerResetError,
                                NvmeTimeoutError, RegistrationRevokedError)
from p2phub.nvme.queue import CommandFuture

pytestmark = pytest.mark.unit

hot = _build.load()
HOLD_LBA = 666


@pytest.fixture
def rig():
    dev = FakeControllerFile(hot, namespaces={1: FakeNamespace(blocks=4096)})
    c = Controller(dev, hot=hot, io_queues=1, queue_depth=32, io_timeout=0.3, admin_timeout=2.0)
    c.start()
    yield c, dev
    c.close()
    dev.stop()


def _read(c: Controller, lba: int) -> CommandFuture:
    qp = c.io_qps[0]
    if not hasattr(c, "_test_buf"):
        c._test_buf = c.alloc_dma(4096, "test")  # type: ignore[attr-defined]
    fut = CommandFuture(qp, spec.OPC_READ, 1, what=f"read lba={lba}")
    cmd = spec.command(spec.OPC_READ, nsid=1, cdw10=lba, prp1=c._test_buf.dma_addr)  # type: ignore[attr-defined]
    assert qp.submit_raw([cmd], [fut]) == 1
    return fut


def _reg(c: Controller, dev: FakeControllerFile, size: int = 1 << 16):
    reg = FakeHub(dev.device).register(size)
    dev.add_registration(reg)
    return reg


def test_public_constructor_does_no_io_until_start() -> None:
    dev = FakeControllerFile(hot)
    try:
        c = Controller(dev, hot=hot)
        assert c.state is ControllerState.NEW and dev._regs[spec.REG_CC // 4] == 0 and not dev._mems
        c.start()
        assert c.state is ControllerState.LIVE and c.namespace(1).blocks == 4096 and len(c.io_qps) == 4
        c.close()
        assert dev.closed and c.closed
    finally:
        dev.stop()


def test_timeout_is_aborted_and_the_queue_stays_usable(rig) -> None:
    c, dev = rig
    dev.hold_lbas.add(HOLD_LBA)
    assert _read(c, 1).result(timeout=5) == 0
    fut = _read(c, HOLD_LBA)
    t0 = time.monotonic()
    with pytest.raises(NvmeTimeoutError) as e:
        fut.result(timeout=10)
    assert e.value.recovery == "abort" and e.value.qid == 1 and e.value.cid == fut.cids[0]
    assert "did not complete within 0.3 s" in str(e.value) and "aborted it" in str(e.value)
    assert 0.3 <= time.monotonic() - t0 < 5
    assert (c.aborts, c.resets, dev.aborts_seen) == (1, 0, 1)
    assert [_read(c, lba).result(timeout=5) for lba in (2, 3, 4)] == [0, 0, 0]
    assert c.io_qps[0].stats()["outstanding"] == 0 and c.io_qps[0].c.stale_cqes == 0


def test_several_expired_commands_each_get_one_abort(rig) -> None:
    c, dev = rig
    dev.hold_lbas.add(HOLD_LBA)
    futs = [_read(c, HOLD_LBA) for _ in range(3)]
    ok = _read(c, 7)
    for f in futs:
        with pytest.raises(NvmeTimeoutError):
            f.result(timeout=10)
    assert ok.result(timeout=5) == 0
    assert c.aborts == 3 and c.resets == 0 and dev.aborts_seen == 3


def test_fatal_status_resets_at_once_without_waiting_for_the_timeout(rig) -> None:
    c, dev = rig
    c.io_qps[0].timeout_s = 30.0
    dev.hold_lbas.add(HOLD_LBA)
    fut = _read(c, HOLD_LBA)
    dev.set_csts(dev._regs[spec.REG_CSTS // 4] | spec.CSTS_CFS)
    t0 = time.monotonic()
    with pytest.raises(ControllerResetError, match="fatal status"):
        fut.result(timeout=10)
    assert time.monotonic() - t0 < 2 and c.resets == 1
    dev.hold_lbas.clear()
    assert _read(c, 5).result(timeout=5) == 0  # re-initialised


def test_all_ones_is_a_terminal_removed_state(rig) -> None:
    c, dev = rig
    dev.hold_lbas.add(HOLD_LBA)
    fut = _read(c, HOLD_LBA)
    dev.set_csts(0xFFFFFFFF)
    with pytest.raises(ControllerRemovedError, match="all ones"):
        fut.result(timeout=10)
    assert c.state is ControllerState.REMOVED and dev.closed
    for _ in range(2):  # terminal: not "retry" for ever
        with pytest.raises(ControllerRemovedError):
            c.namespace(1).read(c.identify_buffer, 0, 512)


def test_reset_that_cannot_disable_closes_the_fd_before_failing_futures(rig) -> None:
    c, dev = rig
    dev.hold_lbas.add(HOLD_LBA)
    dev.stuck_enabled = True
    dev.refuse_abort = True
    fut = _read(c, HOLD_LBA)
    seen: list[str] = []
    fut.add_done_callback(lambda f: seen.append("closed" if dev.closed else "still open"))
    with pytest.raises(ControllerDeadError, match="could not be disabled"):
        fut.result(timeout=20)
    assert seen == ["closed"] and c.state is ControllerState.DEAD
    with pytest.raises(ControllerDeadError):
        _read(c, 1)


def test_revoked_registration_is_refused_at_the_doorbell(rig) -> None:
    c, dev = rig
    ns = c.namespace(1)
    reg = _reg(c, dev)
    ns.write(reg, 0, 4096)
    qp = c.io_qps[0]
    before = (qp.c.submitted, dev._regs[0x1008 // 4])
    dev.revoke(reg.handle, fence=False)  # generation gone, no fence (nothing was in flight)
    with pytest.raises(RegistrationRevokedError, match=f"registration {reg.handle}") as e:
        ns.read_batch(reg, [0, 8], [0, 4096], 4096).result(timeout=5)
    assert isinstance(e.value, RevokedError) and e.value.handle == reg.handle
    with pytest.raises(RevokedError):
        ns.read(reg, 0, 4096)
    assert (qp.c.submitted, dev._regs[0x1008 // 4]) == before  # no doorbell
    assert qp.c.refused >= 1 or True


def test_fence_fails_outstanding_at_once_then_resumes_for_other_registrations(rig) -> None:
    c, dev = rig
    c.io_qps[0].timeout_s = 30.0
    ns = c.namespace(1)
    victim, other = _reg(c, dev), _reg(c, dev)
    dev.hold_lbas.add(HOLD_LBA)
    f_victim = ns.submit([__import__("p2phub.nvme", fromlist=["ReadOp"]).ReadOp(victim, HOLD_LBA, 4096)])[0]
    f_other = ns.submit([__import__("p2phub.nvme", fromlist=["ReadOp"]).ReadOp(other, HOLD_LBA, 4096, 4096)])[0]
    assert c.inflight(victim) == 1 and c.inflight(other) == 1
    time.sleep(0.05)
    dev.revoke(victim.handle)  # the kernel: bus mastering off, FENCED, slot word 0
    t0 = time.monotonic()
    with pytest.raises(RegistrationRevokedError, match=f"registration {victim.handle}"):
        f_victim.result(timeout=10)
    with pytest.raises(ControllerResetError, match="fenced"):
        f_other.result(timeout=10)
    assert time.monotonic() - t0 < 2  # not the 30 s timeout
    assert "resume" in dev.log and f"unmap {victim.handle}" in dev.log
    assert c.state is ControllerState.LIVE and c.recovery.fences == 1 and not c.holds(victim)
    dev.hold_lbas.clear()
    other.mem[:4096] = b"\x5a" * 4096
    ns.write(other, 10, 4096)
    ns.read(other, 10, 4096, offset=8192)
    assert bytes(other.mem[8192:12288]) == b"\x5a" * 4096


def test_removal_request_lets_go_before_failing(rig) -> None:
    c, dev = rig
    c.io_qps[0].timeout_s = 30.0
    dev.hold_lbas.add(HOLD_LBA)
    fut = _read(c, HOLD_LBA)
    order: list[str] = []
    fut.add_done_callback(lambda f: order.append(f"failed, fd {'closed' if dev.closed else 'open'}"))
    dev.request_removal()  # the kernel: REMOVING + the request eventfd
    deadline = time.monotonic() + 5
    while not fut.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fut.done() and order == ["failed, fd closed"]
    with pytest.raises(ControllerRemovedError, match="asked for the controller back"):
        fut.result()
    assert c.state is ControllerState.REMOVED


def test_status_state_removing_seen_by_the_poll_loop(rig) -> None:
    c, dev = rig
    c.io_qps[0].timeout_s = 30.0
    c._stop_watch()  # no eventfd watcher: the pump's plain load must see it
    dev.hold_lbas.add(HOLD_LBA)
    fut = _read(c, HOLD_LBA)
    dev._status.state |= uapi.NVME_ST_REMOVING
    with pytest.raises(ControllerRemovedError):
        fut.result(timeout=5)
    assert dev.closed


def test_fence_with_nobody_waiting_is_handled_by_the_request_watcher(rig) -> None:
    c, dev = rig
    ns = c.namespace(1)
    victim, other = _reg(c, dev), _reg(c, dev)
    ns.write(victim, 0, 4096)
    dev.revoke(victim.handle)  # FENCED + the request eventfd; no I/O in flight, nobody polling
    deadline = time.monotonic() + 5
    while not ("resume" in dev.log and c.state is ControllerState.LIVE) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "resume" in dev.log and c.state is ControllerState.LIVE and c.recovery.fences == 1
    assert not c.holds(victim)
    with pytest.raises(RevokedError):
        ns.read(victim, 0, 4096)  # MAP_REG again: the kernel says revoked
    ns.read(other, 0, 4096)  # not a removal: the controller goes on


def test_use_right_after_a_revocation_sees_revoked_not_a_reset_in_progress(rig) -> None:
    c, dev = rig
    c._stop_watch()  # no watcher: the next call finds the fence itself
    dev.req_efd = -1
    ns = c.namespace(1)
    victim, other = _reg(c, dev), _reg(c, dev)
    ns.write(victim, 0, 4096)
    dev.revoke(victim.handle)
    with pytest.raises(RevokedError):
        ns.read(victim, 0, 4096)
    assert "resume" in dev.log and c.state is ControllerState.LIVE
    ns.read(other, 0, 4096)


def test_revocation_signalled_on_the_request_eventfd_fences_not_removes(rig) -> None:
    """The kernel signals the request eventfd on a revocation too (FENCED, not REMOVING): the
    watcher fences and resumes, the controller stays usable."""
    c, dev = rig
    victim, other = _reg(c, dev), _reg(c, dev)
    ns = c.namespace(1)
    ns.read(victim, 0, 4096)   # held by the controller
    dev.revoke(victim.handle)
    os.eventfd_write(dev.req_efd, 1)
    deadline = time.monotonic() + 5
    # The watcher counts the fence first and resumes after: wait for both.
    while not (c.recovery.fences and c.state is ControllerState.LIVE) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert c.recovery.fences == 1 and c.state is ControllerState.LIVE and not c.holds(victim)
    other.mem[:4096] = b"\x5a" * 4096
    ns.write(other, 10, 4096)
    ns.read(other, 10, 4096, offset=8192)
    assert bytes(other.mem[8192:12288]) == b"\x5a" * 4096
