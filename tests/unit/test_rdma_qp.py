"""p2phub.rdma.QueuePair's bookkeeping on the host: which work requests are posted when,
which fence a completion completes, and what happens to fences when a QP dies. The QP
and CQ are stand-ins that record posts and hand back scripted work completions (the
lab's test_ordering runs the real thing between two soft-RoCE nodes)."""

from __future__ import annotations

import collections
import threading
import time
from types import SimpleNamespace

import pytest

pyverbs_enums = pytest.importorskip("pyverbs.enums")
e = pyverbs_enums

from p2phub.ordering import AccessKind, FenceError, HostFence, Ordering, OrderingError  # noqa: E402
from p2phub.rdma.mr import MemoryRegion, MrPath  # noqa: E402
from p2phub.rdma.qp import QueuePair, RdmaError, RemoteBuffer, WriteState  # noqa: E402


class FakeQP:
    def __init__(self) -> None:
        self.sends: list = []
        self.recvs: list = []
        self.qp_num = 0x42
        self.closed = False

    def post_send(self, wr) -> None:
        self.sends.append(wr)

    def post_recv(self, wr) -> None:
        self.recvs.append(wr)

    def close(self) -> None:
        self.closed = True


class FakeCQ:
    def __init__(self) -> None:
        self.wcs: collections.deque = collections.deque()

    def poll(self, n: int = 1):
        out = []
        while self.wcs and len(out) < n:
            out.append(self.wcs.popleft())
        return len(out), out

    def close(self) -> None:
        pass


def wc(wr_id: int, opcode: int, status: int = 0, imm: int = 0, byte_len: int = 0):
    return SimpleNamespace(wr_id=wr_id, opcode=opcode, status=status, imm_data=imm,
                           byte_len=byte_len, vendor_err=0)


def make_qp() -> QueuePair:
    import itertools

    q = QueuePair.__new__(QueuePair)
    q.pd = SimpleNamespace(device="fake0")
    q._e = e
    q.cq = FakeCQ()
    q.qp = FakeQP()
    q._lock = threading.RLock()
    q._ids = itertools.count(1)
    q._pending = {}
    q._recv_wqes = {}
    q._expect = {}
    q.unexpected = collections.deque(maxlen=16)
    q.on_notify = None
    q._closed = False
    q._dead = ""
    return q


def make_mr(size: int = 1 << 20, strict: bool = False) -> MemoryRegion:
    reg = SimpleNamespace(length=size, closed=False, ordering=Ordering("reg", size, strict=strict))
    return MemoryRegion(reg, SimpleNamespace(device="fake0"), MrPath.HOST_VA, 0x10000, 1, 2,
                        "test", [], lambda: None)


REMOTE = RemoteBuffer(0x900000, 7, 1 << 20)


def test_write_completes_its_fence_and_releases_the_range() -> None:
    q, mr = make_qp(), make_mr()
    f = q.write(mr, 0, REMOTE, 4096, 8192)
    assert f.state == WriteState.POSTED and len(q.qp.sends) == 1
    assert [a.kind for a in mr.registration.ordering.live()] == [AccessKind.RDMA_SEND]
    assert not f.done()
    q.cq.wcs.append(wc(q.qp.sends[0].wr_id, e.IBV_WC_RDMA_WRITE, byte_len=8192))
    f.wait(1)
    assert f.state == WriteState.REMOTE_COMPLETE
    assert mr.registration.ordering.live() == []


def test_strict_mode_posts_nothing() -> None:
    q, mr = make_qp(), make_mr(strict=True)
    held = mr.registration.ordering.enter(0, 4096, AccessKind.NVME_READ, "ssd read")
    with pytest.raises(OrderingError, match="nvme read"):
        q.send(mr, 0, 4096)
    with pytest.raises(OrderingError):
        q.read(mr, 0, REMOTE, 0, 4096)
    assert q.qp.sends == [] and q.outstanding == 0
    held.cancel()
    q.send(mr, 0, 4096)
    assert len(q.qp.sends) == 1


def test_send_waits_for_an_earlier_producer() -> None:
    q, mr = make_qp(), make_mr()
    rd = mr.registration.ordering.acquire(0, 8192, AccessKind.NVME_READ, "ssd read")
    cqe = HostFence()
    rd.bind(cqe)
    threading.Timer(0.05, cqe.set).start()
    t0 = time.monotonic()
    q.send(mr, 4096, 8192, timeout=5)
    assert time.monotonic() - t0 >= 0.04 and len(q.qp.sends) == 1 and cqe.done()


def test_error_completion_fails_the_fence_and_the_qp() -> None:
    q, mr = make_qp(), make_mr()
    f = q.read(mr, 0, REMOTE, 0, 4096)
    g = q.write(mr, 8192, REMOTE, 0, 4096)
    q.cq.wcs.append(wc(q.qp.sends[0].wr_id, e.IBV_WC_RDMA_READ, status=10))  # REM_ACCESS_ERR
    q.cq.wcs.append(wc(q.qp.sends[1].wr_id, e.IBV_WC_RDMA_WRITE, status=5))   # flushed
    with pytest.raises(RdmaError, match="REM_ACCESS_ERR") as ei:
        f.wait(1)
    assert ei.value.status == 10
    with pytest.raises(RdmaError, match="WR_FLUSH_ERR"):
        g.wait(1)
    assert mr.registration.ordering.live() == []
    with pytest.raises(FenceError, match="dead"):
        q.send(mr, 0, 16)


def test_notified_write_completes_the_receivers_range_visible() -> None:
    q, mr = make_qp(), make_mr()
    flushes = []
    mr.registration.ordering.gpu_device = (SimpleNamespace(
        rdma_flush_required=lambda d: True, flush_rdma_writes=lambda d: flushes.append(d)), 0)
    a = q.expect_write(mr, 0, 65536, imm=0x77)
    b = q.expect_write(mr, 65536, 4096, imm=0x78)
    assert len(q.qp.recvs) == 2 and q.outstanding == 2
    # A consumer of the lent range waits for the notification.
    got = []
    th = threading.Thread(target=lambda: got.append(
        mr.registration.ordering.acquire(0, 4096, AccessKind.NVME_WRITE, timeout=5)))
    th.start()
    time.sleep(0.05)
    assert not got
    # Notifications arrive out of order: each goes to its own imm.
    q.cq.wcs.append(wc(q.qp.recvs[0].wr_id, e.IBV_WC_RECV_RDMA_WITH_IMM, imm=0x78))
    q.cq.wcs.append(wc(q.qp.recvs[1].wr_id, e.IBV_WC_RECV_RDMA_WITH_IMM, imm=0x77,
                       byte_len=65536))
    th.join(5)
    assert got and a.done() and b.done()
    assert a.state == WriteState.VISIBLE and a.byte_len == 65536
    assert flushes == [0, 0]


def test_unexpected_notifications_are_kept() -> None:
    q, mr = make_qp(), make_mr()
    seen = []
    q.on_notify = lambda imm, n: seen.append((imm, n))
    f = q.expect_write(mr, 0, 4096, imm=1)
    q.cq.wcs.append(wc(q.qp.recvs[0].wr_id, e.IBV_WC_RECV_RDMA_WITH_IMM, imm=99, byte_len=3))
    q.poll()
    assert seen == [(99, 3)] and list(q.unexpected) == [(99, 3)] and not f.done()


def test_close_fails_every_pending_fence() -> None:
    q, mr = make_qp(), make_mr()
    f = q.write(mr, 0, REMOTE, 0, 4096)
    n = q.expect_write(mr, 8192, 4096, imm=5)
    r = q.recv(mr, 16384, 4096)
    q.close()
    for fence in (f, n, r):
        with pytest.raises(FenceError, match="destroyed"):
            fence.wait(0)
    assert mr.registration.ordering.live() == []
    assert q.qp.closed
    q.close()  # idempotent


def test_bad_arguments() -> None:
    q, mr = make_qp(), make_mr(size=8192)
    with pytest.raises(Exception, match="outside"):
        q.write(mr, 4096, REMOTE, 0, 8192)
    with pytest.raises(Exception, match="outside the peer"):
        q.write(mr, 0, RemoteBuffer(0, 1, 100), 0, 4096)
    with pytest.raises(Exception, match="32-bit"):
        q.write_with_imm(mr, 0, REMOTE, 0, 16, imm=1 << 32)
    with pytest.raises(Exception, match="MemoryRegion"):
        q.send(object(), 0, 16)  # type: ignore[arg-type]
    assert q.qp.sends == []
