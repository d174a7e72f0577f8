"""The KV agent's RDMA protocol on the host, over a stand-in NIC: a queue pair whose WRITE
copies the bytes to the remote address inside this process (both agents live here), with
RC's in-order completion, and a completion that can be held back. What is checked is the
agent's side: WRITEs of later layers posted before earlier ones completed, each layer
announced only after its WRITEs completed and in order, READs answered by WRITEs into the
reader's segments (nothing on the socket), the NIXL adapter told to use RDMA. The real
NIC path (rxe) is tests/lab/test_kv.py and tests/lab/test_kv_nixl_rdma.py."""

from __future__ import annotations

import ctypes
import itertools
import random
import threading
from dataclasses import dataclass
from typing import Iterator

import pytest

from p2phub.kv import Agent, KVLayout, KVPool
from p2phub.kv import rdma as kvrdma
from p2phub.kv.fence import HostFence
from p2phub.kv.pattern import page
from p2phub.rdma.qp import QpInfo

pytestmark = pytest.mark.unit

LAY = KVLayout(num_layers=6, blocks_per_layer=32, block_bytes=8192)


@dataclass
class _MR:
    addr: int
    lkey: int
    rkey: int
    length: int
    closed: bool = False

    def close(self) -> None:
        self.closed = True


class _Ctx:
    def query_gid(self, port: int, index: int) -> str:
        return "::1"


class FakePD:
    keys = itertools.count(100)

    def __init__(self, device: str) -> None:
        self.device = device
        self.ctx = _Ctx()
        self.mrs: list[_MR] = []

    def reg_va(self, addr: int, length: int, access=None) -> _MR:
        k = next(self.keys)
        mr = _MR(addr, k, k, length)
        self.mrs.append(mr)
        return mr

    def reg_mr(self, reg, access=None) -> _MR:
        raise AssertionError("host pools here have no p2phub registration")

    def close(self) -> None:
        pass


class FakeQP:
    """WRITE = memmove at post time; the fence completes when the test lets it (gate)."""

    nums = itertools.count(1)
    gate = threading.Event()      # set: completions flow; clear: held back
    log: list[tuple[str, int]] = []
    lock = threading.Lock()

    def __init__(self, pd: FakePD, depth: int = 256) -> None:
        self.pd = pd
        self.num = next(self.nums)
        self.fences: list[HostFence] = []

    def info(self) -> QpInfo:
        return QpInfo(self.num, "::1")

    def connect(self, info) -> None:
        pass

    def write_many(self, ops) -> "_Fence":
        rkeys = {mr.rkey: mr for pd in _PDS for mr in pd.mrs if not mr.closed}
        for laddr, lkey, n, raddr, rkey in ops:
            mr = rkeys.get(rkey)
            assert mr is not None and mr.addr <= raddr and raddr + n <= mr.addr + mr.length, \
                "WRITE outside the target MR"
            ctypes.memmove(raddr, laddr, n)
        with self.lock:
            self.log.append(("post", sum(op[2] for op in ops)))
        return _Fence(self)

    def close(self) -> None:
        pass


class _Fence:
    def __init__(self, qp: FakeQP) -> None:
        self.qp = qp

    def done(self) -> bool:
        return FakeQP.gate.is_set()

    def wait(self, timeout: float | None = None) -> None:
        from p2phub.ordering.errors import FenceTimeout
        if not FakeQP.gate.wait(timeout):
            raise FenceTimeout("held back")
        with FakeQP.lock:
            if FakeQP.log[-1][0] != "done":
                FakeQP.log.append(("done", 0))


_PDS: list[FakePD] = []


@pytest.fixture(autouse=True)
def fake_nic(monkeypatch) -> Iterator[None]:
    import p2phub.rdma
    import p2phub.rdma.qp

    def pd(device: str) -> FakePD:
        p = FakePD(device)
        _PDS.append(p)
        return p
    monkeypatch.setattr(p2phub.rdma, "ProtectionDomain", pd)
    monkeypatch.setattr(p2phub.rdma.qp, "QueuePair", FakeQP)
    FakeQP.gate.set()
    FakeQP.log.clear()
    yield
    FakeQP.gate.set()
    _PDS.clear()


def _pair(**kw) -> tuple[Agent, Agent]:
    pa, pb = KVPool.host(LAY), KVPool.host(LAY)
    for ly in range(LAY.num_layers):
        for kv in range(2):
            for blk in range(LAY.blocks_per_layer):
                pa.block(ly, kv, blk)[:] = page(9, ly, kv, blk, LAY.block_bytes)
    a = Agent("a", pa, stall_timeout=10.0, rdma_devices=["nic-a"], **kw)
    b = Agent("b", pb, stall_timeout=10.0, rdma_devices=["nic-b"], **kw)
    a.add_remote(b.metadata())
    return a, b


def test_layers_are_posted_back_to_back_and_announced_in_order_after_their_writes() -> None:
    a, b = _pair()
    try:
        assert a.transport_to("b") == "rdma"
        rnd = random.Random(3)
        src, dst = rnd.sample(range(32), 12), rnd.sample(range(32), 12)
        r = b.expect("a", 1)
        FakeQP.gate.clear()                 # no WRITE completes yet
        x = a.send_request("b", 1, src, dst)
        import time
        deadline = time.monotonic() + 10
        while len([e for e in FakeQP.log if e[0] == "post"]) < LAY.num_layers:
            assert time.monotonic() < deadline, FakeQP.log
            time.sleep(0.01)
        # every layer's WRITEs are posted while none completed, and no layer is announced
        time.sleep(0.2)
        assert not r.layer(0).done() and x.state == "PROC"
        FakeQP.gate.set()
        x.wait(10)
        r.done.wait(10)
        assert r.landed_layers() == list(range(LAY.num_layers))
        for ly in range(LAY.num_layers):
            for kv in range(2):
                for s, d in zip(src, dst):
                    assert bytes(b.pool.block(ly, kv, d)) == page(9, ly, kv, s, LAY.block_bytes)
        assert a.rail_bytes() == {"nic-a": LAY.num_layers * 2 * 12 * LAY.block_bytes}
    finally:
        a.close()
        b.close()


def test_read_is_answered_by_writes_into_the_readers_segments() -> None:
    a, b = _pair()
    try:
        n = 5
        src = [b.pool.segments[0].addr + i * LAY.block_bytes for i in (3, 9, 4, 20, 1)]
        mine = [a.pool.segments[0].addr + i * LAY.block_bytes for i in (30, 2, 17, 6, 11)]
        for i, s in enumerate(src):
            ctypes.memmove(s, bytes([i + 1]) * LAY.block_bytes, LAY.block_bytes)
        lo = a.prep_local([(m, LAY.block_bytes) for m in mine])
        rem = a.prep_remote("b", [(s, LAY.block_bytes) for s in src])
        x = a.make_xfer("b", lo, range(n), rem, range(n), notif=b"pulled", op="READ")
        a.post(x)
        x.wait(10)
        for i, m in enumerate(mine):
            assert ctypes.string_at(m, LAY.block_bytes) == bytes([i + 1]) * LAY.block_bytes
        # the answering side WROTE them over its rail; the reader WROTE nothing
        assert b.rail_bytes() == {"nic-b": n * LAY.block_bytes}
        assert a.rail_bytes() == {"nic-a": 0}
        b.wait_notif("a", b"pulled", 10)
    finally:
        a.close()
        b.close()


def test_read_of_a_range_registered_after_connecting_comes_over_the_socket() -> None:
    a, b = _pair()
    try:
        a.connect("b")                       # its handshake carried a's MRs of the pool only
        late = ctypes.create_string_buffer(LAY.block_bytes)
        a.register_memory(ctypes.addressof(late), LAY.block_bytes)
        src = b.pool.segments[1].addr
        ctypes.memmove(src, b"\x5a" * LAY.block_bytes, LAY.block_bytes)
        lo = a.prep_local([(ctypes.addressof(late), LAY.block_bytes)])
        rem = a.prep_remote("b", [(src, LAY.block_bytes)])
        x = a.make_xfer("b", lo, [0], rem, [0], op="READ")
        a.post(x)
        x.wait(10)
        assert late.raw == b"\x5a" * LAY.block_bytes
        assert b.rail_bytes() == {"nic-b": 0}
    finally:
        a.close()
        b.close()


def test_nixl_adapter_is_told_rdma_by_config_and_environment(monkeypatch) -> None:
    import numpy as np

    from p2phub.nixl._api import nixl_agent, nixl_agent_config
    from p2phub.nixl.errors import nixlInvalidParamError

    monkeypatch.setenv("P2PHUB_NIXL_RDMA_DEVICES", "nic-b")
    d = nixl_agent("dec", nixl_agent_config(capture_telemetry=True))           # from the environment
    p = nixl_agent("pre", nixl_agent_config(rdma_devices=["nic-a"]))           # from the config
    t = nixl_agent("tcp", nixl_agent_config(transport="tcp"))                  # told: TCP
    try:
        assert p.get_plugin_params("P2PHUB")["rdma_devices"] == "nic-a"
        assert d.get_backend_params("P2PHUB")["rdma_devices"] == "nic-b"
        assert t.get_plugin_params("P2PHUB")["rdma_devices"] == ""
        src = np.arange(64 * 1024, dtype=np.uint8) * 7
        dst = np.zeros_like(src)
        p.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
        d.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        name = d.add_remote_agent(p.get_agent_metadata())
        assert d.transport_to(name) == "rdma"
        lh = d.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst.ctypes.data + i * 4096, 4096, 0) for i in range(16)], "DRAM")
        rh = d.prep_xfer_dlist(name, [(src.ctypes.data + i * 4096, 4096, 0) for i in range(16)], "DRAM")
        h = d.make_prepped_xfer("READ", lh, list(range(16)), rh, list(range(15, -1, -1)), b"r:1")
        st = d.transfer(h)
        import time
        deadline = time.monotonic() + 10
        while st == "PROC":
            assert time.monotonic() < deadline
            st = d.check_xfer_state(h)
        assert st == "DONE"
        assert d.get_xfer_telemetry(h).totalBytes == 16 * 4096
        for i in range(16):
            assert (dst[i * 4096:(i + 1) * 4096] == src[(15 - i) * 4096:(16 - i) * 4096]).all()
        assert p.kv.rail_bytes() == {"nic-a": 16 * 4096}       # answered over the NIC
        t.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        t.add_remote_agent(p.get_agent_metadata())
        assert t.transport_to("pre") == "tcp"
        with pytest.raises(nixlInvalidParamError, match="needs RDMA devices"):
            nixl_agent("x", nixl_agent_config(transport="rdma", rdma_devices=[]))
        with pytest.raises(ValueError):
            nixl_agent_config(transport="udp")
    finally:
        for ag in (d, p, t):
            ag.close()


def test_two_rails_each_carry_a_share_and_every_byte_lands() -> None:
    pa, pb = KVPool.host(LAY), KVPool.host(LAY)
    for ly in range(LAY.num_layers):
        for kv in range(2):
            for blk in range(LAY.blocks_per_layer):
                pa.block(ly, kv, blk)[:] = page(4, ly, kv, blk, LAY.block_bytes)
    a = Agent("a", pa, stall_timeout=10.0, rdma_devices=["nic-a", "nic-c"])
    b = Agent("b", pb, stall_timeout=10.0, rdma_devices=["nic-b", "nic-d"])
    try:
        a.add_remote(b.metadata())
        src, dst = list(range(0, 32, 2)), list(range(31, 0, -2))
        r = b.expect("a", 4)
        a.send_request("b", 4, src, dst).wait(10)
        r.done.wait(10)
        for ly in range(LAY.num_layers):
            for kv in range(2):
                for s, d in zip(src, dst):
                    assert bytes(b.pool.block(ly, kv, d)) == page(4, ly, kv, s, LAY.block_bytes)
        per = a.rail_bytes()
        total = LAY.num_layers * 2 * len(src) * LAY.block_bytes
        assert set(per) == {"nic-a", "nic-c"} and sum(per.values()) == total
        assert min(per.values()) >= total // 4, per
    finally:
        a.close()
        b.close()
