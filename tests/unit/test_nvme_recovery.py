"""Timeout recovery of the engine when the controller honours Abort.

QEMU 7.2 (the lab's) answers every Abort with "not aborted", so the lab only
sees the reset branch. Here a fake device thread, working on the same rings
in host memory, holds one command forever and completes it with "Command
Abort Requested" when the engine aborts it.
"""

from __future__ import annotations

import itertools
import struct
import threading
import time

import pytest

from p2phub.nvme import _build, spec
from p2phub.nvme.controller import Controller
from p2phub.nvme.errors import NvmeTimeoutError
from p2phub.nvme.queue import CommandFuture, QueuePair

pytestmark = pytest.mark.unit

hot = _build.load()
ffi = hot.ffi

HOLD_LBA = 666


class _Mem:
    def __init__(self, size: int, base: int) -> None:
        self.buf = ffi.new("uint8_t[]", size)
        self.cptr = ffi.cast("void *", self.buf)
        self.dma_addr = base


class FakeDevice(threading.Thread):
    """Consumes both SQs, completes commands; holds reads of HOLD_LBA until aborted."""

    def __init__(self, regs, qps: dict[int, QueuePair], depth: dict[int, int]) -> None:
        super().__init__(daemon=True)
        self.regs, self.qps, self.depth = regs, qps, depth
        self.head = {q: 0 for q in qps}
        self.tail = {q: 0 for q in qps}
        self.phase = {q: 1 for q in qps}
        self.held: dict[tuple[int, int], bool] = {}
        self.stop = threading.Event()
        self.aborts_seen = 0

    def post(self, qid: int, cid: int, status: int, dw0: int = 0) -> None:
        qp = self.qps[qid]
        cq = ffi.buffer(qp.cq_buf.buf)
        off = self.tail[qid] * 16
        struct.pack_into("<IIHH", cq, off, dw0, 0, self.head[qid], qid)
        struct.pack_into("<H", cq, off + 12, cid)
        struct.pack_into("<H", cq, off + 14, (status << 1) | self.phase[qid])  # phase last
        self.tail[qid] += 1
        if self.tail[qid] == self.depth[qid]:
            self.tail[qid] = 0
            self.phase[qid] ^= 1

    def run(self) -> None:
        while not self.stop.is_set():
            for qid, qp in self.qps.items():
                tail_db = self.regs[(0x1000 + 8 * qid) // 4]
                while self.head[qid] != tail_db:
                    e = bytes(ffi.buffer(qp.sq_buf.buf + self.head[qid] * 64, 64))
                    self.head[qid] = (self.head[qid] + 1) % self.depth[qid]
                    opc, cid = e[0], struct.unpack_from("<H", e, 2)[0]
                    cdw10 = struct.unpack_from("<I", e, 40)[0]
                    if qid and opc == spec.OPC_READ and cdw10 == HOLD_LBA:
                        self.held[(qid, cid)] = True
                        continue
                    if qid == 0 and opc == spec.ADM_ABORT:
                        self.aborts_seen += 1
                        key = (cdw10 & 0xFFFF, cdw10 >> 16)
                        if self.held.pop(key, False):
                            self.post(key[0], key[1], 0x07)  # Command Abort Requested
                            self.post(0, cid, 0, dw0=0)  # aborted
                        else:
                            self.post(0, cid, 0, dw0=1)  # not aborted
                        continue
                    self.post(qid, cid, 0)
            time.sleep(0.0005)


@pytest.fixture
def rig():
    regs = ffi.new("uint32_t[]", 0x2000 // 4)
    bases = itertools.count(0x10_0000_0000, 0x100_0000)
    c = Controller.__new__(Controller)
    c.bdf = "0000:00:00.0"
    c.hot = hot
    c.cap = spec.Cap(2047)  # MQES 2048, DSTRD 0
    c.io_timeout_s = 0.3
    c.admin_timeout_s = 2.0
    c.interrupts = False
    c._state = "live"
    c._recovering = threading.local()
    c._reset_lock = threading.RLock()
    c._thread_qp = threading.local()
    c._rr = itertools.count()
    c._tags = itertools.count(1)
    c.resets = c.aborts = 0
    c._vector_fds = {}
    c.alloc_dma = lambda size, name="": _Mem(size, next(bases))  # type: ignore[method-assign]
    c.doorbell_ptr = lambda off: regs + off // 4  # type: ignore[method-assign]
    c._hfd = -1
    c.admin = QueuePair(c, 0, 16, prp_stride=0, vector=None)
    io = QueuePair(c, 1, 32, prp_stride=1024, vector=None)
    c.io_qps = [io]
    dev = FakeDevice(regs, {0: c.admin, 1: io}, {0: 16, 1: 32})
    dev.start()
    yield c, io, dev
    dev.stop.set()
    dev.join()
    for q in (c.admin, io):
        q.close()


def _read(qp: QueuePair, lba: int) -> CommandFuture:
    fut = CommandFuture(qp, spec.OPC_READ, 1, what=f"read lba={lba}")
    assert qp.submit_raw([spec.command(spec.OPC_READ, nsid=1, cdw10=lba)], [fut]) == 1
    return fut


def test_timeout_is_aborted_and_the_queue_stays_usable(rig) -> None:
    c, io, dev = rig
    assert _read(io, 1).result(timeout=5) == 0
    fut = _read(io, HOLD_LBA)
    t0 = time.monotonic()
    with pytest.raises(NvmeTimeoutError) as e:
        fut.result(timeout=10)
    assert e.value.recovery == "abort" and e.value.qid == 1 and e.value.cid == fut.cids[0]
    assert "did not complete within 0.3 s" in str(e.value) and "aborted it" in str(e.value)
    assert 0.3 <= time.monotonic() - t0 < 5
    assert (c.aborts, c.resets, dev.aborts_seen) == (1, 0, 1)
    # Other commands, before and after, are unaffected.
    assert [_read(io, lba).result(timeout=5) for lba in (2, 3, 4)] == [0, 0, 0]
    assert io.stats()["outstanding"] == 0 and io.c.stale_cqes == 0


def test_several_expired_commands_each_get_one_abort(rig) -> None:
    c, io, dev = rig
    futs = [_read(io, HOLD_LBA) for _ in range(3)]
    ok = _read(io, 7)
    for f in futs:
        with pytest.raises(NvmeTimeoutError):
            f.result(timeout=10)
    assert ok.result(timeout=5) == 0
    assert c.aborts == 3 and c.resets == 0 and dev.aborts_seen == 3
