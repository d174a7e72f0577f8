"""KV transfer between the lab's two RDMA nodes (rxe-a, rxe-b on a veth pair) with the one
KV agent over its RDMA transport: pools registered with p2phub, payload RDMA-WRITTEN per
layer, the layer announced on the control connection, every received byte checked on the
receiving side's own CPU view; two rails (a second veth pair with rxe devices, made by the
test) striped, bytes seen on both NICs' own counters."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from p2phub.hub import Hub
from p2phub_lab import rails
from p2phub.kv import Agent, KVLayout, KVPeerError, KVPool
from p2phub.kv.fence import FenceError
from p2phub.kv.pattern import page
from p2phub.ordering import AccessKind, OrderingTimeout, bind, completed

# The pools' CPU view (checking every byte, filling pages) is the udmabuf's memfd; the 6.1 lab
# kernel has no udmabuf, and a vgem buffer offers no CPU mapping of its own to the pool.
pytestmark = [pytest.mark.skipif(not os.path.exists("/dev/udmabuf"),
                                 reason="KV pools in the lab need udmabuf host memory (6.12 lab kernel)")]

TOP = Path(__file__).resolve().parent.parent.parent
STALL = 60.0     # progress deadline: under TCG on a shared host a layer can take seconds
PEER = 10.0      # liveness deadline: heartbeats on the control connection
DEATH = 25.0     # a killed peer is reported within this
# 32 layers x (K, V) x 128 pages of 16 KiB per node; a request moves 24 pages of each (24 MiB:
# seconds over rxe under TCG).
LAY = KVLayout(num_layers=32, blocks_per_layer=128, block_bytes=16384)
PAGES = 24


def _fill(pool: KVPool, seed: int, blocks) -> None:
    lay = pool.layout
    for ly in range(lay.num_layers):
        for kv in range(lay.kv):
            for b in blocks:
                pool.block(ly, kv, b)[:] = page(seed, ly, kv, b, lay.block_bytes)


def _bad_pages(pool: KVPool, seed: int, src, dst, layers=None) -> int:
    lay = pool.layout
    bad = 0
    for ly in layers if layers is not None else range(lay.num_layers):
        for kv in range(lay.kv):
            for s, d in zip(src, dst):
                if bytes(pool.block(ly, kv, d)) != page(seed, ly, kv, s, lay.block_bytes):
                    bad += 1
    return bad


def _page(pool: KVPool, layer: int, kv: int, block: int):
    """(registration, offset, length) of one page of a registered pool."""
    seg, off, n = pool.layout.offset(layer, kv, block)
    return pool.segments[seg].registration, off, n


def _consume_now(pool: KVPool, layer: int, block: int, within: float = 0.05) -> bool:
    """Whether an NVMe write of that page can start within `within` seconds (its producers
    are done; a landed layer's accesses end from the receiving thread right after its fence)."""
    reg, off, n = _page(pool, layer, 0, block)
    try:
        a = reg.ordering.acquire(off, n, AccessKind.NVME_WRITE, "check", timeout=within)
    except OrderingTimeout:
        return False
    bind(a, completed())
    return True


def _agent(name: str, pool: KVPool, devs, **kw) -> Agent:
    return Agent(name, pool, stall_timeout=STALL, peer_timeout=PEER, transport="rdma",
                 rdma_devices=devs, **kw)


def _send_paced(tx: Agent, peer: str, req: int, src, dst, pace: float) -> None:
    """A producer that finishes a layer every `pace` seconds: one transfer per layer."""
    xs = []
    for ly in range(LAY.num_layers):
        xs.append(tx.send_request(peer, req, src, dst, [ly], end=ly == LAY.num_layers - 1))
        time.sleep(pace)
    for x in xs:
        x.wait(300)


def test_32_layers_scattered_pages_every_byte_and_layer0_first(hub: Hub, lab) -> None:
    rnd = random.Random(1)
    src, dst = rnd.sample(range(128), PAGES), rnd.sample(range(128), PAGES)
    with KVPool.registered(hub, LAY) as pa, KVPool.registered(hub, LAY) as pb:
        _fill(pa, 21, src)
        with _agent("prefill", pa, [lab["node_a_rdma"]]) as tx, \
             _agent("decode", pb, [lab["node_b_rdma"]]) as rx:
            assert tx.add_remote(rx.metadata()) == "decode"
            assert tx.transport_to("decode") == "rdma"
            r = rx.expect("prefill", 5, blocks=dst)
            t0 = time.monotonic()
            done_at: dict[int, float] = {}
            for ly in (0, LAY.num_layers - 1):
                r.layer(ly).add_done_callback(lambda _f, ly=ly: done_at.setdefault(ly, time.monotonic()))
            sender = threading.Thread(target=_send_paced, args=(tx, "decode", 5, src, dst, 0.05),
                                      daemon=True)
            sender.start()
            r.layer(0).wait(60)
            assert not r.layer(LAY.num_layers - 1).done()     # layer 0 usable, 31 still to come
            # the ordering agrees: a consumer of layer 0's pages starts, one of layer 31's waits
            assert _consume_now(pb, 0, dst[0], within=10)
            assert not _consume_now(pb, LAY.num_layers - 1, dst[0]) or r.layer(LAY.num_layers - 1).done()
            assert _bad_pages(pb, 21, src, dst, layers=[0]) == 0
            r.done.wait(300)
            sender.join(60)
            assert done_at[0] - t0 < done_at[LAY.num_layers - 1] - t0 - 0.5
            assert _bad_pages(pb, 21, src, dst) == 0
            assert {blk for _kv, blk in r.visible_blocks(7)} == set(dst)
            assert _consume_now(pb, LAY.num_layers - 1, dst[0], within=10)
            untouched = sorted(set(range(128)) - set(dst))[:4]
            for b in untouched:
                assert bytes(pb.block(3, 1, b)) == bytes(LAY.block_bytes)
            # every payload byte went over the NIC, none over the control socket
            assert tx.rail_bytes() == {lab["node_a_rdma"]: LAY.num_layers * 2 * PAGES * LAY.block_bytes}


_CHILD = r"""
import sys, random
from p2phub.hub import Hub
from p2phub.kv import Agent, KVLayout, KVPool
from p2phub.kv.pattern import page
dev, md, seed, pages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
lay = KVLayout(num_layers=32, blocks_per_layer=128, block_bytes=16384)
rnd = random.Random(1)
src, dst = rnd.sample(range(128), pages), rnd.sample(range(128), pages)
with Hub() as hub, KVPool.registered(hub, lay) as pool:
    for ly in range(32):
        for kv in range(2):
            for b in src:
                pool.block(ly, kv, b)[:] = page(seed, ly, kv, b, 16384)
    a = Agent("prefill-child", pool, stall_timeout=60.0, peer_timeout=8.0, transport="rdma",
              rdma_devices=[dev])
    a.add_remote(md)
    a.connect("decode")
    print("connected", flush=True)
    import time
    xs = []
    for ly in range(32):
        xs.append(a.send_request("decode", 9, src, dst, [ly], end=ly == 31))
        time.sleep(0.5)    # a killer has time to strike mid-request
    for x in xs:
        x.wait(120)
    print("sent", flush=True)
"""


def test_sender_killed_mid_transfer_is_reported_and_the_pool_reused(hub: Hub, lab) -> None:
    rnd = random.Random(1)
    src, dst = rnd.sample(range(128), PAGES), rnd.sample(range(128), PAGES)
    with KVPool.registered(hub, LAY) as pb, _agent("decode", pb, [lab["node_b_rdma"]]) as rx:
        env = dict(os.environ, PYTHONPATH=str(TOP))
        child = subprocess.Popen([sys.executable, "-c", _CHILD, lab["node_a_rdma"],
                                  rx.metadata().decode(), "31", str(PAGES)],
                                 stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert child.stdout.readline().strip() == "connected"
            r = rx.expect("prefill-child", 9, blocks=dst)
            r.layer(2).wait(60)                      # a few layers in
            # a consumer of the last layer's page waits for that layer, and must fail with it
            reg, off, n = _page(pb, LAY.num_layers - 1, 0, dst[0])
            got: dict = {}

            def consume() -> None:
                try:
                    reg.ordering.acquire(off, n, AccessKind.NVME_WRITE, "consumer", timeout=DEATH + 60)
                    got["ok"] = True
                except Exception as exc:  # noqa: BLE001 - the test inspects it
                    got["exc"] = exc
            consumer = threading.Thread(target=consume)
            consumer.start()
            deadline = time.monotonic() + 10
            while not any(a.kind is AccessKind.NVME_WRITE for a in reg.ordering.overlapping(off, n)):
                assert time.monotonic() < deadline and consumer.is_alive(), got
                time.sleep(0.01)
            t_kill = time.monotonic()
            child.kill()                             # its exit may take long: not waited for
            with pytest.raises(Exception) as ei:
                r.done.wait(DEATH)
            seen = time.monotonic() - t_kill
            child.wait(300)
        finally:
            if child.poll() is None:
                child.kill()
        assert "prefill-child" in str(ei.value), ei.value
        assert "closed" in str(ei.value) or "silent" in str(ei.value) or "reset" in str(ei.value), ei.value
        assert seen < DEATH
        landed = r.landed_layers()
        assert 3 <= len(landed) < LAY.num_layers
        missing = [ly for ly in range(LAY.num_layers) if ly not in landed]
        assert r.visible_blocks(missing[0]) == []    # never marked visible
        assert r.layer(missing[0]).failed()
        consumer.join(DEATH + 60)
        assert isinstance(got.get("exc"), FenceError), got   # never told the bytes are there
        # the same pool, a new sender on new QPs: the next request lands whole
        with KVPool.registered(hub, LAY) as pa, _agent("prefill-2", pa, [lab["node_a_rdma"]]) as tx:
            _fill(pa, 32, src)
            tx.add_remote(rx.metadata())
            r2 = rx.expect("prefill-2", 10, blocks=dst)
            tx.send_request("decode", 10, src, dst).wait(60)
            r2.done.wait(60)
            assert _bad_pages(pb, 32, src, dst) == 0


def test_receiver_gone_fails_the_sender_and_a_restarted_one_is_reached(hub: Hub, lab) -> None:
    with KVPool.registered(hub, LAY) as pa, KVPool.registered(hub, LAY) as pb:
        _fill(pa, 5, range(8))
        tx = _agent("prefill", pa, [lab["node_a_rdma"]])
        rx = _agent("decode", pb, [lab["node_b_rdma"]])
        port = rx.port
        try:
            tx.add_remote(rx.metadata())
            r = rx.expect("prefill", 1, blocks=list(range(8)))
            tx.send_request("decode", 1, list(range(8)), list(range(8))).wait(60)
            r.done.wait(60)
            rx.close()                                 # QPs destroyed, control socket closed
            t0 = time.monotonic()
            x = tx.send_request("decode", 2, list(range(8)), list(range(8)))
            with pytest.raises(KVPeerError) as ei:
                x.wait(DEATH)
            assert time.monotonic() - t0 < DEATH and x.status == "failed"
            assert "decode" in str(ei.value)
            # the receiver restarts at the same address: reached under its name, new QPs
            rx = _agent("decode", pb, [lab["node_b_rdma"]], port=port)
            r = rx.expect("prefill", 3, blocks=list(range(8)))
            tx.send_request("decode", 3, list(range(8)), list(range(8))).wait(60)
            r.done.wait(60)
            assert _bad_pages(pb, 5, range(8), range(8)) == 0
        finally:
            tx.close()
            rx.close()


@pytest.fixture
def second_rail(lab) -> Iterator[tuple[str, str]]:
    with rails.second_rail() as devs:
        yield devs


def test_two_rails_stripe_a_request_and_both_carry_bytes(hub: Hub, lab, second_rail) -> None:
    rc, rd = second_rail
    ra_, rb_ = lab["node_a_rdma"], lab["node_b_rdma"]
    lay = KVLayout(num_layers=4, blocks_per_layer=128, block_bytes=16384)
    rnd = random.Random(4)
    src, dst = rnd.sample(range(128), 64), rnd.sample(range(128), 64)
    with KVPool.registered(hub, lay) as pa, KVPool.registered(hub, lay) as pb:
        for ly in range(lay.num_layers):
            for kv in range(2):
                for b in src:
                    pa.block(ly, kv, b)[:] = page(44, ly, kv, b, lay.block_bytes)
        with Agent("prefill", pa, stall_timeout=STALL, peer_timeout=PEER,
                   rdma_devices=[ra_, rc]) as tx, \
             Agent("decode", pb, stall_timeout=STALL, peer_timeout=PEER,
                   rdma_devices=[rb_, rd]) as rx:
            tx.add_remote(rx.metadata())
            assert tx.transport_to("decode") == "rdma"      # auto: both ends have NICs
            before = {d: rails.sent_packets(d) for d in (ra_, rc)}
            r = rx.expect("prefill", 1, blocks=dst)
            tx.send_request("decode", 1, src, dst).wait(120)
            r.done.wait(60)
            after = {d: rails.sent_packets(d) for d in (ra_, rc)}
            for ly in range(lay.num_layers):
                for kv in range(2):
                    for s_, d_ in zip(src, dst):
                        assert bytes(pb.block(ly, kv, d_)) == page(44, ly, kv, s_, lay.block_bytes)
            total = lay.num_layers * 2 * 64 * lay.block_bytes
            per = tx.rail_bytes()
            assert set(per) == {ra_, rc} and sum(per.values()) == total
            assert min(per.values()) >= total // 4, per       # striped, not all on one rail
            # each NIC's own counter saw packets: at least the payload over a 1024-byte MTU
            for d in (ra_, rc):
                assert after[d] - before[d] >= per[d] // 1024, (d, before, after, per)
