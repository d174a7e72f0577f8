"""Producer/consumer ordering across the NVMe engine and RDMA, inside the lab.

Node A and node B are the lab's two soft-RoCE devices (a veth pair between them); the
NVMe controller is QEMU's, owned by p2phub's engine. Bytes are checked from sides the
ordering layer does not control: the receiving node's own CPU view of its memory, and
the SSD read back through the kernel nvme driver once the controller is given back.
"""

from __future__ import annotations

import errno
import mmap
import random
import threading
import time
from typing import Iterator

import pytest

from p2phub.errors import P2PHubOSError
from p2phub.hub import Hub
from p2phub.nvme import bind, kernel_io
from p2phub.nvme import ReadOp
from p2phub.ordering import AccessKind, FenceError, OrderingError
from p2phub.rdma import Access, WriteState, connected_pair, remote_buffer

pytestmark = pytest.mark.lab

KiB, MiB = 1 << 10, 1 << 20
LBA = 512
SSD_OFF = 24 * MiB  # a region of the namespace no other lab test uses


def _view(reg) -> mmap.mmap:
    src = reg.source
    if hasattr(src, "mmap"):
        return src.mmap()
    return mmap.mmap(src.fd, reg.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


class Pair:
    """Registrations, MRs and a connected QP pair on nodes A and B."""

    def __init__(self, hub: Hub, pds, size: int = MiB) -> None:
        self.reg_a, self.reg_b = hub.alloc_host(size), hub.alloc_host(size)
        # B is the target of A's WRITEs; sends and receives need no remote access.
        self.mr_a, self.mr_b = self.reg_a.mr(pds[0]), self.reg_b.mr(pds[1], Access.REMOTE_WRITE)
        self.qa, self.qb = connected_pair(pds[0], pds[1])
        self.va, self.vb = _view(self.reg_a), _view(self.reg_b)

    def close(self) -> None:
        self.va.close()
        self.vb.close()
        self.qa.close()
        self.qb.close()
        self.mr_a.close()
        self.mr_b.close()
        self.reg_a.close(force=True)
        self.reg_b.close(force=True)


@pytest.fixture
def pair(hub: Hub, pds) -> Iterator[Pair]:
    p = Pair(hub, pds)
    yield p
    p.close()


def test_nvme_read_then_rdma_send_on_overlapping_ranges_are_serialized(hub, pair, bdf) -> None:
    """The send is posted only once the SSD's bytes have landed: B receives them, never
    the old contents, in every round."""
    n = 256 * KiB
    rounds = 4
    patterns = [random.randbytes(n) for _ in range(rounds)]
    dev = kernel_io.require_namespace_device(bdf, 1)
    for k, pat in enumerate(patterns):
        kernel_io.write(dev, SSD_OFF + k * n, pat)
    ctrl = hub.nvme(bdf)
    try:
        ns = ctrl.namespace(1)
        for k, pat in enumerate(patterns):
            old = bytes([k + 1]) * (n + 4 * KiB)
            pair.va[:len(old)] = old
            recv = pair.qb.recv(pair.mr_b, 0, n + 4 * KiB)
            # The read fills [0, n); the send reads [4K, n + 4K): they overlap.
            (fut,) = ns.submit([ReadOp(pair.reg_a, (SSD_OFF + k * n) // LBA, n)])
            sent = pair.qa.send(pair.mr_a, 4 * KiB, n, timeout=30)
            assert fut.done(), "the send was posted before the NVMe read completed"
            assert fut.exception() is None
            sent.wait(30)
            assert sent.state == WriteState.REMOTE_COMPLETE
            recv.wait(30)
            assert recv.byte_len == n
            got = pair.vb[:n]
            assert got == pat[4 * KiB:] + old[n:n + 4 * KiB], f"round {k}: B got the wrong bytes"
            assert pair.reg_a.ordering.live() == [] and pair.reg_b.ordering.live() == []
    finally:
        ctrl.close()
        bind.unbind(bdf)
    # The SSD still holds what the kernel wrote (the engine only read it).
    assert kernel_io.read(kernel_io.require_namespace_device(bdf, 1), SSD_OFF, n) == patterns[0]


def test_write_with_imm_then_nvme_write_stores_the_received_bytes(hub, pair, bdf) -> None:
    """B lends a range to A's notified WRITE; B's NVMe write of that range waits for the
    notification (polling B's CQ), so the SSD gets A's bytes, not B's stale ones."""
    n = 128 * KiB
    off_b = 64 * KiB
    payload = random.randbytes(n)
    pair.vb[off_b:off_b + n] = b"\xee" * n       # stale bytes on B
    pair.va[:n] = payload
    lba = (SSD_OFF + 4 * MiB) // LBA
    kernel_io.write(kernel_io.require_namespace_device(bdf, 1), SSD_OFF + 4 * MiB, b"\x11" * n)

    pair.reg_b.ordering.timeout = 60  # a lost notification fails the test, never hangs it
    ctrl = hub.nvme(bdf)
    try:
        notified = pair.qb.expect_write(pair.mr_b, off_b, n, imm=0x5EED)
        assert [a.kind for a in pair.reg_b.ordering.live()] == [AccessKind.RDMA_WRITE_TARGET]

        def sender() -> None:
            time.sleep(0.3)  # B's NVMe write is declared (and waiting) by now
            pair.qa.write_with_imm(pair.mr_a, 0, remote_buffer(pair.mr_b), off_b, n, 0x5EED).wait(30)

        th = threading.Thread(target=sender)
        th.start()
        t0 = time.monotonic()
        ctrl.namespace(1).write(pair.reg_b, lba, n, offset=off_b, timeout=30)
        waited = time.monotonic() - t0
        th.join(30)
        assert waited >= 0.25, f"the NVMe write did not wait for the notification ({waited:.3f} s)"
        assert notified.done() and notified.state == WriteState.VISIBLE
        assert notified.byte_len == 0 or notified.byte_len == n
        assert pair.reg_b.ordering.live() == []
    finally:
        ctrl.close()
        bind.unbind(bdf)
    on_ssd = kernel_io.read(kernel_io.require_namespace_device(bdf, 1), SSD_OFF + 4 * MiB, n)
    assert on_ssd == payload, "the SSD does not hold the bytes node A wrote into node B"


def test_strict_mode_raises_before_anything_is_posted(hub, pds, bdf) -> None:
    hub.strict_ordering = True
    p = Pair(hub, pds, size=4 * MiB)
    n = 64 * KiB
    try:
        assert p.reg_a.ordering.strict
        pat = random.randbytes(n)
        kernel_io.write(kernel_io.require_namespace_device(bdf, 1), SSD_OFF + 8 * MiB, pat)
        p.vb[:n] = b"\x22" * n
        recv = p.qb.recv(p.mr_b, 0, n)
        ctrl = hub.nvme(bdf)
        try:
            ns = ctrl.namespace(1)
            # A read of two commands, one in flight at a time: the first round submits one
            # and nothing drives the queue until the result is asked for, so the read is
            # still live when the send comes, however fast the SSD is.
            span = 2 * ctrl.max_transfer
            assert span <= 4 * MiB
            (fut,) = ns.submit([ReadOp(p.reg_a, (SSD_OFF + 8 * MiB) // LBA, span)], qd=1)
            assert not fut.done()
            with pytest.raises(OrderingError) as ei:
                p.qa.send(p.mr_a, 0, n)
            msg = str(ei.value)
            assert "rdma send" in msg and "nvme read" in msg, msg
            assert p.qa.outstanding == 0  # nothing posted
            fut.result(30)
            time.sleep(0.1)
            assert not recv.done() and p.vb[:n] == b"\x22" * n  # B received nothing
            # In order, the same send goes through and B gets the SSD's bytes.
            p.qa.send(p.mr_a, 0, n).wait(30)
            recv.wait(30)
            assert p.vb[:n] == pat

            # Strict on the NVMe side: a write of a range lent to a peer is refused, and
            # nothing reaches the SSD.
            lent = p.qb.expect_write(p.mr_b, 0, n, imm=9)
            with pytest.raises(OrderingError, match="rdma write target"):
                ns.write(p.reg_b, (SSD_OFF + 8 * MiB) // LBA, n)
        finally:
            ctrl.close()
            bind.unbind(bdf)
        assert kernel_io.read(kernel_io.require_namespace_device(bdf, 1), SSD_OFF + 8 * MiB, n) == pat
        assert not lent.done()
    finally:
        p.close()


def test_destroyed_qp_fails_its_fences_and_wakes_waiters(hub, pair) -> None:
    lent = pair.qb.expect_write(pair.mr_b, 0, 4096, imm=1)
    woke: list[BaseException] = []

    def waiter() -> None:
        try:
            pair.reg_b.ordering.acquire(0, 4096, AccessKind.NVME_WRITE, timeout=30)
        except FenceError as exc:
            woke.append(exc)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.2)
    pair.qb.close()
    th.join(10)
    assert not th.is_alive()
    assert woke and "destroyed" in str(woke[0]), woke
    with pytest.raises(FenceError, match="destroyed"):
        lent.wait(0)
    assert pair.reg_b.ordering.live() == []


def test_close_refuses_in_flight_accesses_then_forces(hub, pair) -> None:
    lent = pair.qb.expect_write(pair.mr_b, 0, 4096, imm=2)
    pair.mr_b.close()
    with pytest.raises(P2PHubOSError) as ei:
        pair.reg_b.close(timeout=0.05)
    assert ei.value.errno == errno.EBUSY and "rdma write target" in str(ei.value)
    pair.reg_b.close(force=True)
    with pytest.raises(FenceError, match="closed"):
        lent.wait(0)
