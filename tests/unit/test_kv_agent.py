"""The KV agent over TCP on 127.0.0.1, two agents in one process: what lands where, what is
refused, and the NIXL-style prepared lists. Two-process behaviour: test_kv_loopback.py."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Iterator

import pytest

from p2phub.errors import UsageError
from p2phub.kv import Agent, KVLayout, KVPool, KVPeerError, KVRejected
from p2phub.kv import transport as tp

from kvpeer import page

LAY = KVLayout(num_layers=4, blocks_per_layer=32, block_bytes=4096)


@pytest.fixture
def pair() -> Iterator[tuple[Agent, Agent]]:
    pa, pb = KVPool.host(LAY), KVPool.host(LAY)
    a, b = Agent("a", pa, stall_timeout=5.0), Agent("b", pb, stall_timeout=5.0)
    for ly in range(LAY.num_layers):
        for kv in range(2):
            for blk in range(LAY.blocks_per_layer):
                pa.block(ly, kv, blk)[:] = page(5, ly, kv, blk, LAY.block_bytes)
    a.add_remote(b.metadata())
    yield a, b
    a.close()
    b.close()


def _check(b: Agent, src: list[int], dst: list[int], layers=range(LAY.num_layers)) -> None:
    for ly in layers:
        for kv in range(2):
            for s, d in zip(src, dst):
                assert bytes(b.pool.block(ly, kv, d)) == page(5, ly, kv, s, LAY.block_bytes), (ly, kv, s, d)


def test_scattered_pages_land_and_the_rest_stays_untouched(pair) -> None:
    a, b = pair
    rnd = random.Random(1)
    src, dst = rnd.sample(range(32), 20), rnd.sample(range(32), 20)
    x = a.send_request("b", 3, src, dst, notif=b"req-3")
    x.wait(5)
    assert x.state == "DONE"
    r = b.expect("a", 3)
    r.done.wait(5)
    _check(b, src, dst)
    untouched = set(range(32)) - set(dst)
    for blk in untouched:
        assert bytes(b.pool.block(0, 0, blk)) == bytes(4096)
    assert sorted(r.visible_blocks(2)) == sorted((kv, d) for kv in range(2) for d in dst)
    assert b.get_new_notifs() == {"a": [b"req-3"]}
    assert b.get_new_notifs() == {}


def test_contiguous_pages_merge_into_one_run_per_kv(pair) -> None:
    a, _ = pair
    x = a.make_request("b", 1, list(range(4, 20)), list(range(10, 26)), layers=[0])
    assert [m.nruns for m in x.messages] == [2]          # K run and V run
    assert x.messages[0].nbytes == 2 * 16 * 4096
    y = a.make_request("b", 2, [1, 2, 3, 9], [5, 6, 8, 9], layers=[0])
    assert y.messages[0].nruns == 2 * 3                   # 1-2 | 3 | 9 (remote 8 breaks 2->3? no: 6->8)


def test_layer_fences_complete_one_by_one(pair) -> None:
    a, b = pair
    r = b.expect("a", 9)
    a.send_request("b", 9, [0, 1], [2, 3], layers=[0], end=False).wait(5)
    r.layer(0).wait(5)
    assert not r.layer(1).done() and not r.done.done()
    a.send_request("b", 9, [0, 1], [2, 3], layers=[1, 2, 3]).wait(5)
    r.done.wait(5)
    assert r.landed_layers() == [0, 1, 2, 3]
    _check(b, [0, 1], [2, 3])


def test_await_a_transfer_and_a_layer(pair) -> None:
    a, b = pair

    async def go() -> None:
        x = a.send_request("b", 4, [7], [8])
        await x
        await b.expect("a", 4).layer(3)

    asyncio.run(go())
    _check(b, [7], [8])


@pytest.mark.parametrize("local, remote, match", [
    ([0, 32], [0, 1], "pair 1 \\(local block 32, remote block 1\\) is outside"),
    ([0], [-1], "pair 0"),
    ([0, 1], [0], "2 local blocks but 1 remote"),
    (["x"], [0], "int32"),
])
def test_bad_block_lists_are_refused_before_sending(pair, local, remote, match) -> None:
    a, _ = pair
    with pytest.raises(UsageError, match=match):
        a.make_request("b", 1, local, remote)


def test_bad_requests_are_refused(pair) -> None:
    a, _ = pair
    with pytest.raises(UsageError, match="unknown KV peer 'nobody'"):
        a.make_request("nobody", 1, [0], [0])
    with pytest.raises(UsageError, match="layer 9 is not in"):
        a.make_request("b", 1, [0], [0], layers=[9])
    with pytest.raises(UsageError, match="request id"):
        a.make_request("b", -1, [0], [0])


def test_incompatible_layouts_are_refused(pair) -> None:
    a, _ = pair
    other = Agent("c", KVPool.host(KVLayout(num_layers=4, blocks_per_layer=32, block_bytes=8192)))
    try:
        a.add_remote(other.metadata())
        with pytest.raises(UsageError, match="block_bytes: 4096 here, 8192 there"):
            a.make_request("c", 1, [0], [0])
    finally:
        other.close()


def test_receiver_refuses_runs_outside_its_pool_and_stays_usable(pair) -> None:
    a, b = pair
    # A peer that claims a bigger pool than it has: the receiver checks every run itself.
    md = json.loads(b.metadata())
    md["layout"]["blocks_per_layer"] = 64
    md["segments"] = [[s[0], s[1] * 2] for s in md["segments"]]
    a.add_remote(json.dumps(md))
    x = a.send_request("b", 5, [0, 1], [40, 41], notif=b"never")
    with pytest.raises(KVRejected, match="outside the 4 registered segment"):
        x.wait(5)
    r = b.expect("a", 5)
    assert r.done.failed() and r.landed_layers() == []
    assert b.get_new_notifs() == {}
    # the same connection carries the next, valid request
    a.add_remote(b.metadata())
    a.send_request("b", 6, [0, 1], [30, 31]).wait(5)
    _check(b, [0, 1], [30, 31])


def test_prepped_lists_move_by_index_and_repost(pair) -> None:
    a, b = pair
    sa, sb = a.pool.segments[0], b.pool.segments[0]
    local = a.prep_local([(sa.addr + i * 4096, 4096) for i in range(8)])
    remote = a.prep_remote("b", [(sb.addr + i * 4096, 4096) for i in range(8)])
    x = a.make_xfer("b", local, [0, 1, 2, 5], remote, [4, 5, 6, 0], notif=b"n1")
    assert x.messages[0].nruns == 2 and x.messages[0].nbytes == 4 * 4096
    assert a.post(x) in ("PROC", "DONE")
    x.wait(5)
    assert bytes(sb.view[4 * 4096:7 * 4096]) == bytes(sa.view[0:3 * 4096])
    assert bytes(sb.view[0:4096]) == bytes(sa.view[5 * 4096:6 * 4096])
    sa.view[0:4096] = b"\x11" * 4096
    a.post(x)          # the same handle, again
    x.wait(5)
    assert bytes(sb.view[4 * 4096:5 * 4096]) == b"\x11" * 4096
    assert b.get_new_notifs() == {"a": [b"n1", b"n1"]}
    with pytest.raises(UsageError, match="in no registered segment"):
        a.prep_local([(4096, 4096)])
    with pytest.raises(UsageError, match="in no segment 'b' registered"):
        a.prep_remote("b", [(sb.addr + sb.length, 1)])
    with pytest.raises(UsageError, match="outside the lists"):
        a.make_xfer("b", local, [8], remote, [0])


def test_unreachable_peer_fails_the_transfer_at_once() -> None:
    pa = KVPool.host(LAY)
    a = Agent("a", pa, stall_timeout=1.0)
    b = Agent("b", KVPool.host(LAY))
    md = b.metadata()
    b.close()
    try:
        a.add_remote(md)
        x = a.make_request("b", 1, [0], [0])
        assert a.post(x) == "ERR"
        with pytest.raises(KVPeerError, match="'b' unreachable"):
            x.wait(1)
    finally:
        a.close()


def test_bad_metadata_is_refused(pair) -> None:
    a, _ = pair
    with pytest.raises(UsageError, match="not JSON"):
        a.add_remote(b"{")
    with pytest.raises(UsageError, match="version"):
        a.add_remote({"v": 99})
    with pytest.raises(UsageError, match="malformed"):
        a.add_remote({"v": 1, "name": "x"})
    with pytest.raises(UsageError, match="own metadata"):
        a.add_remote(a.metadata())


def test_a_stream_that_is_not_ours_is_dropped(pair) -> None:
    import socket
    _, b = pair
    with socket.create_connection((b.host, b.port)) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n" + bytes(64))
        s.settimeout(3)
        try:
            assert s.recv(100) == b""     # closed by the agent ...
        except ConnectionResetError:
            pass                          # ... with the rest of our bytes unread
    # ... which keeps serving
    c = Agent("c", KVPool.host(LAY))
    try:
        assert c.handshake(b.host, b.port) == "b"
    finally:
        c.close()


def test_more_runs_than_one_sendmsg_takes() -> None:
    # 2 x 3000 unmergeable pages in one layer message: several sendmsg/readv batches of 1024
    lay = KVLayout(num_layers=1, blocks_per_layer=3000, block_bytes=512)
    pa, pb = KVPool.host(lay), KVPool.host(lay)
    a, b = Agent("a", pa), Agent("b", pb)
    try:
        for kv in range(2):
            for blk in range(3000):
                pa.block(0, kv, blk)[:] = page(9, 0, kv, blk, 512)
        a.add_remote(b.metadata())
        src = list(range(0, 3000, 2)) + list(range(1, 3000, 2))
        dst = random.Random(4).sample(range(3000), 3000)
        x = a.make_request("b", 1, src, dst)
        assert x.messages[0].nruns > 4000
        a.post(x)
        x.wait(10)
        for kv in range(2):
            for s, d in zip(src, dst):
                assert bytes(pb.block(0, kv, d)) == page(9, 0, kv, s, 512)
    finally:
        a.close()
        b.close()


def test_read_pulls_pages_back_and_refuses_bad_ranges(pair) -> None:
    a, b = pair
    sa, sb = a.pool.segments[1], b.pool.segments[2]
    sb.view[0:3 * 4096] = bytes(range(256)) * 48
    local = a.prep_local([(sa.addr + i * 4096, 4096) for i in range(4)])
    remote = a.prep_remote("b", [(sb.addr + i * 4096, 4096) for i in range(4)])
    x = a.make_xfer("b", local, [3, 0, 1], remote, [0, 1, 2], notif=b"read-done", op="READ")
    a.post(x)
    x.wait(5)
    assert bytes(sa.view[3 * 4096:4 * 4096]) == bytes(sb.view[0:4096])
    assert bytes(sa.view[0:2 * 4096]) == bytes(sb.view[4096:3 * 4096])
    assert b.get_new_notifs() == {"a": [b"read-done"]}
    # a peer whose published segments were a lie: the reading side is refused, not fed
    md = json.loads(b.metadata())
    md["segments"][2][1] *= 1000
    a.add_remote(json.dumps(md))
    far = a.prep_remote("b", [(sb.addr + 100 * sb.length, 4096)])
    y = a.make_xfer("b", local, [0], far, [0], op="READ")
    a.post(y)
    with pytest.raises(KVRejected, match="outside"):
        y.wait(5)
    a.add_remote(b.metadata())
    a.post(x)
    x.wait(5)


# --------------------------------------------------------------------------- ordering


def _ordered_pools() -> tuple[KVPool, KVPool]:
    """Host pools whose segments carry an ordering layer, as registered pools do."""
    from types import SimpleNamespace

    from p2phub.ordering import Ordering
    pools = KVPool.host(LAY), KVPool.host(LAY)
    for p in pools:
        for i, s in enumerate(p.segments):
            s.registration = SimpleNamespace(ordering=Ordering(f"seg {i}", s.length))
    return pools


def _consume(pool: KVPool, layer: int, blk: int, within: float) -> bool:
    """Would a reader of (layer, K, blk) start within `within` s? (It ends at once if so.)"""
    from p2phub.ordering import AccessKind, OrderingTimeout, bind, completed
    seg, base = LAY.block_base(layer, 0)
    ordering = pool.segments[seg].registration.ordering
    try:
        a = ordering.acquire(base + blk * LAY.block_bytes, LAY.block_bytes, AccessKind.NVME_WRITE,
                             "reader", timeout=within)
    except OrderingTimeout:
        return False
    bind(a, completed())
    return True


def test_receiver_declares_the_pages_each_layer_fills() -> None:
    """expect(blocks=...) makes each layer's pages a producer until that layer landed: a
    reader of layer 0 starts once layer 0 is in while a reader of layer 3 waits; releasing
    the unfinished request fails the reader waiting on it."""
    import threading
    import time

    from p2phub.ordering import FenceError
    pa, pb = _ordered_pools()
    with Agent("a", pa, stall_timeout=5.0) as a, Agent("b", pb, stall_timeout=5.0) as b:
        a.add_remote(b.metadata())
        src, dst = [3, 4, 9], [20, 21, 5]
        r = b.expect("a", 7, blocks=dst)
        assert not _consume(pb, 0, 20, within=0.2)            # nothing landed yet
        a.send_request("b", 7, src, dst, layers=[0], end=False).wait(5)
        r.layer(0).wait(5)
        assert _consume(pb, 0, 20, within=5)
        assert not _consume(pb, 3, 5, within=0.2)             # layer 3 still to come
        assert _consume(pb, 3, 6, within=0.2)                 # a page the request does not fill
        failed: list[BaseException] = []

        def reader() -> None:
            try:
                _consume(pb, 3, 5, within=10)
            except FenceError as exc:
                failed.append(exc)
        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.2)
        b.release("a", 7)                                     # gives the rest up
        t.join(10)
        assert len(failed) == 1 and "released" in str(failed[0]), failed
        # the pool is usable for the next request
        r = b.expect("a", 8, blocks=dst)
        a.send_request("b", 8, src, dst).wait(5)
        r.done.wait(5)
        assert _consume(pb, 3, 5, within=5)


def test_sender_waits_for_the_writer_of_its_pages() -> None:
    """The pages a transfer sends are read: posting it waits until an earlier writer of
    those pages (a GPU kernel, an NVMe read) completed."""
    import threading

    from p2phub.ordering import AccessKind, HostFence, bind
    pa, pb = _ordered_pools()
    with Agent("a", pa, stall_timeout=5.0) as a, Agent("b", pb, stall_timeout=5.0) as b:
        a.add_remote(b.metadata())
        seg, base = LAY.block_base(2, 1)
        writer = HostFence("writer")
        bind(pa.segments[seg].registration.ordering.enter(base + 3 * LAY.block_bytes, 4096,
                                                          AccessKind.GPU_WRITE, "writer"), writer)
        x = a.make_request("b", 1, [3], [0])
        t = threading.Thread(target=a.post, args=(x,))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not x.posted                 # held back by the writer
        pa.block(2, 1, 3)[:] = b"\x77" * 4096
        writer.set()
        t.join(5)
        x.wait(5)
        assert bytes(pb.block(2, 1, 0)) == b"\x77" * 4096


def test_declaring_blocks_needs_a_pool() -> None:
    with Agent("lone", stall_timeout=5.0) as a:
        with pytest.raises(UsageError, match="has no KV pool to declare blocks on"):
            a.expect("peer", 1, blocks=[0, 1])


def test_a_fence_for_a_layer_that_does_not_exist_is_refused_at_once(pair) -> None:
    a, b = pair
    r = b.expect("a", 1)
    for bad in (LAY.num_layers, -1, 99, "0"):
        with pytest.raises(UsageError, match=f"no layer {bad!r}"):
            r.layer(bad)
    assert r.status == "pending"
    a.send_request("b", 1, [0], [0]).wait(10)
    r.done.wait(5)
    assert r.status == "done" and r.layer(LAY.num_layers - 1).done()


def test_an_expected_request_that_never_comes_fails_by_its_deadline(pair) -> None:
    _a, b = pair
    r = b.expect("a", 5, deadline=0.3)
    assert r.done.exception(3) is r.error
    assert isinstance(r.error, KVPeerError) and r.error.peer == "a"
    assert "'a' timed out: request 5 not complete within its deadline" in str(r.error)
    assert r.status == "failed" and r.layer(0).failed()


def test_timeouts_must_be_positive(pair) -> None:
    a, b = pair
    for kw in ({"stall_timeout": 0}, {"peer_timeout": -1}, {"xfer_timeout": 0}):
        with pytest.raises(UsageError, match="must be > 0"):
            Agent("x", **kw)
    with pytest.raises(UsageError, match="deadline=0 must be > 0"):
        b.expect("a", 1, deadline=0)
    x = a.make_request("b", 1, [0], [0])
    with pytest.raises(UsageError, match="timeout=-1 must be > 0"):
        a.post(x, timeout=-1)
    assert x.status == "pending" and not x.posted   # refused before anything was sent


def test_the_transport_is_chosen_per_peer_and_can_be_told(pair) -> None:
    a, b = pair
    assert a.transport_to("b") == "tcp" and a.rail_bytes() == {}    # no NIC on either end
    md = json.loads(b.metadata())
    assert md["rdma"] is None
    md["rdma"] = [{"device": "mlx5_9", "gid": "::1", "mrs": [[4096, 7]]}]
    a.add_remote(md)
    assert a.transport_to("b") == "tcp"          # the peer has a NIC, this agent has none
    with pytest.raises(UsageError, match="transport='rdma' needs rdma_devices"):
        Agent("r", transport="rdma")
    with pytest.raises(UsageError, match="transport='udp': want 'auto', 'tcp' or 'rdma'"):
        Agent("r", transport="udp")
    with Agent("t", transport="tcp", rdma_devices=["no-such-nic"]) as t:   # told: never opened
        t.add_remote(md)
        assert t.rails is None and t.transport_to("b") == "tcp"
