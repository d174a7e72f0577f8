"""KV transfer between separate processes on 127.0.0.1: every byte checked by the receiving
process, layer fences ahead of the last layer, peers killed, stalled and restarted,
metadata through TCPStore and Redis."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

HERE = Path(__file__).resolve().parent
STALL = 3.0


class Proc:
    """One kvpeer.py process."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(HERE.parent.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
        self.p = subprocess.Popen([sys.executable, str(HERE / "kvpeer.py")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env)

    def send(self, op: str, **kw) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.p.stdin.flush()

    def reply(self) -> dict:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        assert line, f"kvpeer exited with {self.p.poll()}"
        out = json.loads(line)
        assert out["ok"], out.get("trace") or out
        return out

    def call(self, op: str, **kw) -> dict:
        self.send(op, **kw)
        return self.reply()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)

    def close(self) -> None:
        if self.p.poll() is None:
            try:
                self.call("exit")
            except (AssertionError, BrokenPipeError, OSError):
                pass
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    made: list[Proc] = []
    yield made
    for p in made:
        if p.p.poll() is None:
            os.kill(p.p.pid, signal.SIGCONT)
        p.close()


def start(procs: list[Proc], name: str, layout: dict, **kw) -> tuple[Proc, str]:
    p = Proc()
    procs.append(p)
    md = p.call("init", name=name, layout=layout, stall=kw.pop("stall", STALL), **kw)["md"]
    return p, md


# 32 layers x 2 x 64 pages of 16 KiB: 4096 pages, 64 MiB per request
BIG = dict(num_layers=32, blocks_per_layer=256, block_bytes=16384)


def test_32_layers_thousands_of_scattered_pages_every_byte(procs) -> None:
    a, _ = start(procs, "prefill", BIG)
    b, bmd = start(procs, "decode", BIG)
    rnd = random.Random(11)
    src, dst = rnd.sample(range(256), 64), rnd.sample(range(256), 64)
    a.call("fill", seed=3)
    a.call("add_remote", md=bmd)
    b.send("expect", peer="prefill", req=77, timeout=60)
    sent = a.call("send", peer="decode", req=77, local=src, remote=dst, notif="req-77", timeout=60)
    got = b.reply()
    assert sent["state"] == "DONE", sent
    assert got["error"] is None and got["landed"] == list(range(32))
    assert got["notifs"] == {"prefill": ["req-77"]}
    v = b.call("verify", seed=3, local=src, remote=dst)
    assert v == {"bad": 0, "checked": 32 * 2 * 64, "ok": True}


@pytest.mark.parametrize("block_bytes", [4096, 65536])
def test_layer0_fence_completes_before_the_last_layer_arrives(procs, block_bytes) -> None:
    lay = dict(num_layers=32, blocks_per_layer=64, block_bytes=block_bytes)
    a, _ = start(procs, "prefill", lay)
    b, bmd = start(procs, "decode", lay)
    a.call("fill", seed=4)
    a.call("add_remote", md=bmd)
    src = random.Random(2).sample(range(64), 40)
    dst = random.Random(3).sample(range(64), 40)
    b.send("expect", peer="prefill", req=1, timeout=60)
    # the producer finishes one layer every 20 ms, as a prefill pass would
    sent = a.call("send", peer="decode", req=1, local=src, remote=dst, pace=0.02, timeout=60)
    got = b.reply()
    assert sent["state"] == "DONE" and got["error"] is None
    t = got["layer_t"]
    assert t == sorted(t)
    assert t[0] < t[-1] - 0.3, t          # layer 0 was usable long before layer 31 landed
    assert b.call("verify", seed=4, local=src, remote=dst)["bad"] == 0


def test_sender_killed_mid_transfer_is_reported_and_the_pool_reused(procs) -> None:
    lay = dict(num_layers=32, blocks_per_layer=64, block_bytes=65536)
    a, _ = start(procs, "prefill", lay)
    b, bmd = start(procs, "decode", lay)
    a.call("fill", seed=5)
    a.call("add_remote", md=bmd)
    ids = list(range(64))
    b.send("expect", peer="prefill", req=2, timeout=30)
    a.send("send", peer="decode", req=2, local=ids, remote=ids, pace=0.05, timeout=30)
    time.sleep(0.4)                         # a few layers in
    t_kill = time.monotonic()
    a.kill()
    got = b.reply()
    seen = time.monotonic() - t_kill
    assert got["error"] and "KVPeerError" in got["error"] or "FenceError" in got["error"], got
    assert "prefill" in got["error"]
    assert seen < STALL + 2.0, seen
    landed = got["landed"]
    assert 0 < len(landed) < 32
    assert None in got["layer_t"]           # the rest never became visible
    # a second sender uses the same pool of the same decode process
    c, _ = start(procs, "prefill-2", lay)
    c.call("fill", seed=6)
    c.call("add_remote", md=bmd)
    b.send("expect", peer="prefill-2", req=2, timeout=30)
    assert c.call("send", peer="decode", req=2, local=ids, remote=ids)["state"] == "DONE"
    assert b.reply()["error"] is None
    assert b.call("verify", seed=6, local=ids, remote=ids)["bad"] == 0


def test_receiver_killed_fails_the_sender_and_a_restarted_one_reconnects(procs) -> None:
    lay = dict(num_layers=8, blocks_per_layer=64, block_bytes=65536)
    a, _ = start(procs, "prefill", lay)
    b, bmd = start(procs, "decode", lay)
    other, omd = start(procs, "decode-other", lay)
    a.call("fill", seed=7)
    a.call("add_remote", md=bmd)
    a.call("add_remote", md=omd)
    ids = list(range(64))
    a.send("send", peer="decode", req=3, local=ids, remote=ids, pace=0.1, timeout=30)
    time.sleep(0.25)
    b.kill()
    sent = a.reply()
    assert sent["state"] == "ERR"
    assert any("decode" in e and ("closed" in e or "reset" in e or "unreachable" in e)
               for e in sent["errors"]), sent
    assert sent["seconds"] < 0.8 + STALL + 2
    # the connection to the other peer is untouched
    other.send("expect", peer="prefill", req=3, timeout=20)
    assert a.call("send", peer="decode-other", req=3, local=ids, remote=ids)["state"] == "DONE"
    assert other.reply()["error"] is None
    assert other.call("verify", seed=7, local=ids, remote=ids)["bad"] == 0
    # the receiver comes back (new process, new port): new metadata, and it works again
    b2, b2md = start(procs, "decode", lay)
    a.call("add_remote", md=b2md)
    b2.send("expect", peer="prefill", req=4, timeout=20)
    assert a.call("send", peer="decode", req=4, local=ids, remote=ids)["state"] == "DONE"
    assert b2.reply()["error"] is None
    assert b2.call("verify", seed=7, local=ids, remote=ids)["bad"] == 0


def test_stalled_receiver_is_detected_within_the_deadline(procs) -> None:
    lay = dict(num_layers=32, blocks_per_layer=64, block_bytes=65536)   # 256 MiB: more than socket buffers
    a, _ = start(procs, "prefill", lay)
    b, bmd = start(procs, "decode", lay)
    a.call("fill", seed=8)
    a.call("add_remote", md=bmd)
    ids = list(range(64))
    b.send("expect", peer="prefill", req=4, layers=[0], timeout=20)   # connected and working first
    assert a.call("send", peer="decode", req=4, local=[0], remote=[0], layers=[0])["state"] == "DONE"
    b.reply()
    os.kill(b.p.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        sent = a.call("send", peer="decode", req=5, local=ids, remote=ids, timeout=30)
        took = time.monotonic() - t0
    finally:
        os.kill(b.p.pid, signal.SIGCONT)
    # the blocked send (stall_timeout) or the missing heartbeats (peer_timeout, the same
    # 3 s here) find it first, whichever the scheduler lets run
    assert sent["state"] == "ERR" and ("'decode' stalled" in sent["errors"][0]
                                       or "'decode' silent" in sent["errors"][0]), sent
    assert took < STALL + 3, took
    # the receiver, resumed, saw its sender give up on it: nothing of req 5 is visible
    got = b.call("expect", peer="prefill", req=5, timeout=STALL + 3)
    assert got["error"] and got["landed"] == [] or len(got["landed"]) < 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rdv_roundtrip(procs, url: str) -> None:
    lay = dict(num_layers=2, blocks_per_layer=8, block_bytes=4096)
    b, _ = start(procs, "decode", lay, rdv=url)
    a, _ = start(procs, "prefill", lay)
    assert a.call("lookup", rdv=url, name="decode")["peer"] == "decode"
    a.call("fill", seed=9)
    b.send("expect", peer="prefill", req=1, timeout=20)
    assert a.call("send", peer="decode", req=1, local=[0, 1], remote=[5, 6])["state"] == "DONE"
    assert b.reply()["error"] is None
    assert b.call("verify", seed=9, local=[0, 1], remote=[5, 6])["bad"] == 0


def test_metadata_through_torch_tcpstore(procs) -> None:
    pytest.importorskip("torch.distributed")
    from p2phub.kv.rendezvous import TCPStoreRendezvous
    master = TCPStoreRendezvous("127.0.0.1", 0, is_master=True)
    _rdv_roundtrip(procs, f"tcpstore://127.0.0.1:{master.port}")


def test_metadata_through_redis(procs, tmp_path) -> None:
    exe = shutil.which("redis-server")
    if not exe:
        pytest.skip("redis-server is not installed (apt install redis-server)")
    port = _free_port()
    srv = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no", "--dir", str(tmp_path)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        _rdv_roundtrip(procs, f"redis://127.0.0.1:{port}/0")
    finally:
        srv.terminate()
        srv.wait(10)


# ---------------------------------------------------------------------- bounded failure
HB = 1.0      # peer_timeout of the heartbeat tests: well under their stall_timeout


def test_killed_peer_fails_both_directions_within_the_peer_timeout_and_its_restart_is_reached(procs) -> None:
    lay = dict(num_layers=16, blocks_per_layer=32, block_bytes=65536)
    port = _free_port()
    a, amd = start(procs, "prefill", lay, stall=30.0, peer_timeout=HB)
    b, bmd = start(procs, "decode", lay, stall=30.0, peer_timeout=HB, port=port)
    a.call("fill", seed=1)
    b.call("fill", seed=2)
    a.call("add_remote", md=bmd)
    b.call("add_remote", md=amd)
    ids = list(range(32))
    # both directions in flight: a -> b (paced) and b -> a (paced); a waits for b's
    b.send("send", peer="prefill", req=8, local=ids, remote=ids, pace=0.2, timeout=30)
    time.sleep(0.5)
    a.send("send", peer="decode", req=9, local=ids, remote=ids, pace=0.2, timeout=30)
    time.sleep(0.4)
    t_kill = time.monotonic()
    b.kill()
    sent = a.reply()
    took = time.monotonic() - t_kill
    assert sent["state"] == "ERR" and sent["status"][-1] == "failed", sent
    assert all("'decode'" in e for e in sent["errors"]), sent
    assert took < HB + 2.0, took            # not the 30 s stall timeout
    got = a.call("expect", peer="decode", req=8, timeout=30)   # what b was sending to a
    assert got["status"] == "failed" and "'decode'" in got["error"], got
    assert 0 < len(got["landed"]) < 16
    # decode restarts at its address: the next request each way succeeds, every byte whole
    b2, _ = start(procs, "decode", lay, stall=30.0, peer_timeout=HB, port=port)
    b2.call("add_remote", md=amd)
    a.call("fill", seed=1)          # req 8's landed layers overwrote some of a's pages
    b2.send("expect", peer="prefill", req=10, timeout=20)
    sent = a.call("send", peer="decode", req=10, local=ids, remote=ids[::-1], timeout=20)
    assert sent["state"] == "DONE", sent                 # no add_remote: found under its name
    assert b2.reply()["status"] == "done"
    assert b2.call("verify", seed=1, local=ids, remote=ids[::-1])["bad"] == 0
    b2.call("fill", seed=2)         # req 10 filled b2's pages with a's
    a.send("expect", peer="decode", req=11, timeout=20)
    assert b2.call("send", peer="prefill", req=11, local=ids, remote=ids, timeout=20)["state"] == "DONE"
    assert a.reply()["status"] == "done"
    assert a.call("verify", seed=2, local=ids, remote=ids)["bad"] == 0


def test_restarted_peer_at_the_same_address_is_reconnected_under_its_name(procs) -> None:
    lay = dict(num_layers=4, blocks_per_layer=16, block_bytes=4096)
    port = _free_port()
    a, _ = start(procs, "prefill", lay, peer_timeout=HB)
    b, bmd = start(procs, "decode", lay, port=port, peer_timeout=HB)
    a.call("fill", seed=3)
    a.call("add_remote", md=bmd)
    ids = list(range(16))
    b.send("expect", peer="prefill", req=1, timeout=20)
    assert a.call("send", peer="decode", req=1, local=ids, remote=ids)["state"] == "DONE"
    assert b.reply()["status"] == "done"
    b.kill()
    b2, b2md = start(procs, "decode", lay, port=port, peer_timeout=HB)
    assert json.loads(b2md)["incarnation"] != json.loads(bmd)["incarnation"]
    # no add_remote: the next request finds the new process under the same name
    b2.send("expect", peer="prefill", req=2, timeout=20)
    sent = a.call("send", peer="decode", req=2, local=ids, remote=ids[::-1], timeout=20)
    assert sent["state"] == "DONE", sent
    assert b2.reply()["status"] == "done"
    assert b2.call("verify", seed=3, local=ids, remote=ids[::-1])["bad"] == 0


def _connected(procs, seed: int, peer_timeout: float, block_bytes: int = 4096) -> tuple[Proc, Proc]:
    """prefill -> decode, connected by one request that landed; a 30 s stall timeout, so
    only the heartbeat (peer_timeout) or a deadline can end what follows early."""
    lay = dict(num_layers=4, blocks_per_layer=16, block_bytes=block_bytes)
    a, _ = start(procs, "prefill", lay, stall=30.0, peer_timeout=peer_timeout)
    b, bmd = start(procs, "decode", lay, stall=30.0, peer_timeout=peer_timeout)
    a.call("fill", seed=seed)
    a.call("add_remote", md=bmd)
    b.send("expect", peer="prefill", req=1, timeout=20)
    assert a.call("send", peer="decode", req=1, local=[0], remote=[0])["state"] == "DONE"
    assert b.reply()["status"] == "done"
    return a, b


def test_frozen_sender_is_found_by_heartbeat_while_nothing_is_in_flight(procs) -> None:
    a, b = _connected(procs, 4, HB)
    b.send("expect", peer="prefill", req=2, timeout=20)   # expected, nothing sent yet
    time.sleep(0.3)
    os.kill(a.p.pid, signal.SIGSTOP)                       # partitioned: silent, socket open
    t0 = time.monotonic()
    got = b.reply()
    took = time.monotonic() - t0
    assert got["status"] == "failed" and "'prefill' silent" in got["error"], got
    assert took < HB + 2.0, took
    os.kill(a.p.pid, signal.SIGCONT)


def test_frozen_receiver_fails_the_sender_by_heartbeat_before_the_stall_timeout(procs) -> None:
    a, b = _connected(procs, 5, HB)
    os.kill(b.p.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()     # 128 KiB: fits the socket buffers, so only the ACK is missing
        sent = a.call("send", peer="decode", req=2, local=[1], remote=[1], timeout=30)
        took = time.monotonic() - t0
    finally:
        os.kill(b.p.pid, signal.SIGCONT)
    assert sent["state"] == "ERR" and "'decode' silent" in sent["errors"][0], sent
    assert took < HB + 2.0, took


def test_transfer_deadline_fails_both_sides(procs) -> None:
    # 32 MiB: more than the socket buffers hold, so the deadline finds it on the wire
    a, b = _connected(procs, 6, 30.0, block_bytes=262144)
    os.kill(b.p.pid, signal.SIGSTOP)      # no heartbeat timeout can fire: only the deadline
    try:
        t0 = time.monotonic()
        ids = list(range(16))
        sent = a.call("send", peer="decode", req=2, local=ids, remote=ids, deadline=1.0, timeout=30)
        took = time.monotonic() - t0
    finally:
        os.kill(b.p.pid, signal.SIGCONT)
    assert sent["state"] == "ERR" and "'decode' timed out" in sent["errors"][0], sent
    assert sent["status"] == ["failed"]
    assert took < 1.0 + 1.5, took
    # the receiver, resumed, does not count request 2 as landed: its connection was dropped
    got = b.call("expect", peer="prefill", req=2, timeout=5)
    assert got["status"] == "failed", got
    # and the next transfer reconnects
    b.send("expect", peer="prefill", req=3, timeout=20)
    assert a.call("send", peer="decode", req=3, local=[2], remote=[2])["state"] == "DONE"
    assert b.reply()["status"] == "done"
