"""Who may talk to a KV agent, and what a connection may cost it, on 127.0.0.1: a client
that knows only host:port gets nothing and changes nothing; a wrong secret is refused with a
clear error and a log line; two agents of one user need no configuration; a secret file
others can read is refused; so is listening beyond loopback without a configured secret;
every limit on unauthenticated and authenticated connections holds."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from p2phub.errors import UsageError
from p2phub.kv import Agent, KVError, KVLayout, KVPeerError, KVPool
from p2phub.kv import auth
from p2phub.kv import transport as tp
from p2phub.kv.auth import KVAuthError, KVLimits

pytestmark = pytest.mark.unit

TOP = Path(__file__).resolve().parent.parent.parent
LAY = KVLayout(num_layers=2, blocks_per_layer=8, block_bytes=4096)
SECRET = "a deployment secret of some length"
PAGE = b"victim KV page: the prompt was ..."


@pytest.fixture(autouse=True)
def _own_runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test: no configured secret, its own private runtime directory."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    monkeypatch.delenv(auth.ENV_SECRET, raising=False)
    monkeypatch.delenv(auth.ENV_SECRET_FILE, raising=False)
    for f in ("MAX_UNAUTHENTICATED", "AUTH_TIMEOUT", "MAX_CONNS_PER_PEER", "MAX_RUNS", "MAX_QPS"):
        monkeypatch.delenv("P2PHUB_KV_" + f, raising=False)


@pytest.fixture
def victim() -> Iterator[Agent]:
    """An agent holding one registered 4 KiB buffer, and a peer decode-0 it knows."""
    buf = bytearray(4096)
    buf[:len(PAGE)] = PAGE
    a = Agent("victim")
    d = Agent("decode-0")
    addr = _addr(buf)
    a.register_memory(addr, len(buf))
    a.add_remote(d.metadata())
    a.buf = buf                      # kept alive with the agent
    yield a
    a.close()
    d.close()


def _addr(buf: bytearray) -> int:
    import ctypes
    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def _hdr(type_: int, n: int = 0, nbytes: int = 0, flags: int = 0, xid: int = 1, req: int = 1,
         layer: int = 0) -> bytes:
    return tp.HDR.pack(tp.MAGIC, type_, flags, xid, req, layer, n, nbytes)


def _hello(name: str, **extra) -> bytes:
    body = json.dumps({"name": name, "incarnation": 8, **extra}).encode()
    return _hdr(tp.HELLO, len(body)) + body


def _send(s: socket.socket, data: bytes) -> None:
    """Send what an attacker would; the agent may have closed the connection already."""
    try:
        s.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass


def _drain(s: socket.socket, seconds: float) -> bytes:
    """Whatever the agent sends within `seconds` (until it closes)."""
    got = b""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.settimeout(max(0.01, end - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
    return got


def _proven(agent: Agent, name: str, secret: str | None = None) -> socket.socket:
    """A raw connection to `agent` that proved the secret as `name` (HELLO not sent yet)."""
    s = socket.create_connection((agent.host, agent.port), timeout=5)
    auth.client_handshake(s, auth.load_secret(secret), name, 5, "test")
    return s


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# ------------------------------------------------------------------ nobody in
def test_a_client_knowing_only_host_port_gets_nothing(victim: Agent) -> None:
    """What a reviewer did to an unauthenticated agent: fetch its segments, READ a page,
    WRITE over it, repoint a peer's name. Each connection gets no byte back and is closed;
    nothing in the agent changes."""
    host, port = victim.host, victim.port
    before = victim.remote("decode-0")
    seen = b""
    # 1. metadata: "want: metadata" carrying metadata that names decode-0 at 127.0.0.1:9
    fake = json.dumps({"v": 1, "name": "decode-0", "host": "127.0.0.1", "port": 9,
                       "incarnation": 8, "segments": []})
    with socket.create_connection((host, port)) as s:
        _send(s, _hello("decode-0", want="metadata", metadata=fake))
        seen += _drain(s, 2)
    # 2. a HELLO as a peer, then a READ of segment 0
    with socket.create_connection((host, port)) as s:
        _send(s, _hello("attacker"))
        _send(s, _hdr(tp.READ, 1, 4096, flags=tp.F_LAST) + struct.pack("<IIQQ", 0, 0, 0, 4096))
        seen += _drain(s, 2)
    # 3. a HELLO as decode-0, then DATA over the page
    with socket.create_connection((host, port)) as s:
        _send(s, _hello("decode-0"))
        _send(s, _hdr(tp.DATA, 1, 16, flags=tp.F_LAST) + struct.pack("<IIQQ", 0, 0, 0, 16)
                  + b"OVERWRITTEN!!!!!")
        seen += _drain(s, 2)
    assert seen == b"", f"the agent answered a client that proved nothing: {seen[:200]!r}"
    assert bytes(victim.buf[:len(PAGE)]) == PAGE
    now = victim.remote("decode-0")
    assert (now.host, now.port, now.incarnation) == (before.host, before.port, before.incarnation)
    assert "attacker" not in victim._in and "decode-0" not in victim._in


def test_a_peer_that_proved_one_name_cannot_use_another(victim: Agent) -> None:
    """The secret proven as "mallory": a HELLO as decode-0, or metadata naming decode-0, is
    refused, and decode-0's entry stays as it was."""
    before = victim.remote("decode-0")
    fake = json.dumps({"v": 1, "name": "decode-0", "host": "127.0.0.1", "port": 9,
                       "incarnation": 8, "segments": []})
    with _proven(victim, "mallory") as s:
        s.sendall(_hello("mallory", want="metadata", metadata=fake))
        with pytest.raises(KVError, match="'mallory' sent metadata of another agent"):
            tp.recv_hello(s, 5)
    with _proven(victim, "mallory") as s:
        s.sendall(_hello("decode-0"))
        with pytest.raises(KVError, match="its HELLO names 'decode-0', but it proved 'mallory'"):
            tp.recv_hello(s, 5)
    now = victim.remote("decode-0")
    assert (now.host, now.port, now.incarnation) == (before.host, before.port, before.incarnation)
    assert "decode-0" not in victim._in


def test_nothing_but_the_challenge_comes_before_the_proof(victim: Agent) -> None:
    """The agent's first answer is its name, a nonce and its MAC; it then waits for the
    client's proof and closes on a wrong one, having sent nothing more."""
    with socket.create_connection((victim.host, victim.port), timeout=5) as s:
        body = json.dumps({"v": 1, "name": "x", "nonce": "00" * 32}).encode()
        s.sendall(_hdr(tp.AUTH, len(body)) + body)
        first = auth._recv(s, time.monotonic() + 5, "test", "5 s")
        assert sorted(first) == ["mac", "name", "nonce"] and first["name"] == "victim"
        body = json.dumps({"mac": "00" * 32}).encode()
        s.sendall(_hdr(tp.AUTH, len(body)) + body)
        assert _drain(s, 2) == b""


def test_wrong_secret_is_refused_with_a_clear_error_and_a_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2phub.kv")
    a = Agent("a", KVPool.host(LAY), secret="the secret of deployment one")
    b = Agent("b", KVPool.host(LAY), secret="the secret of deployment two")
    try:
        with pytest.raises(KVPeerError, match="unauthenticated.*different secrets"):
            a.handshake(b.host, b.port)
        a.add_remote(b.metadata())
        x = a.send_request("b", 1, [0], [0])
        with pytest.raises(KVPeerError, match="'b' unauthenticated"):
            x.wait(5)
        time.sleep(0.3)
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("kv a:" in m and "did not prove the KV secret" in m for m in lines), lines
        assert any("kv b: refused" in m and "closed before proving" in m for m in lines), lines
        # a client with a proof made of another key: the agent names it
        caplog.clear()
        with socket.create_connection((b.host, b.port), timeout=5) as s:
            with pytest.raises(KVAuthError, match="different secrets"):
                auth.client_handshake(s, auth.load_secret("not the one b holds at all"), "c",
                                      5, "b")
        bad = {"mac": "11" * 32}
        with socket.create_connection((b.host, b.port), timeout=5) as s:
            hi = json.dumps({"v": 1, "name": "c", "nonce": "22" * 32}).encode()
            s.sendall(_hdr(tp.AUTH, len(hi)) + hi)
            auth._recv(s, time.monotonic() + 5, "test", "5 s")
            raw = json.dumps(bad).encode()
            s.sendall(_hdr(tp.AUTH, len(raw)) + raw)
            assert _drain(s, 2) == b""
        time.sleep(0.2)
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("kv b: refused" in m and "proof does not match" in m and "'c'" in m
                   for m in lines), lines
    finally:
        a.close()
        b.close()


def test_a_failed_proof_is_counted() -> None:
    from p2phub import metrics
    if not metrics.ENABLED:
        pytest.skip("prometheus_client is not installed")
    b = Agent("counted", secret="the secret of deployment two")
    try:
        def count() -> float:
            v = metrics._pc.REGISTRY.get_sample_value(
                "p2phub_kv_auth_failures_total", {"agent": "counted", "reason": "malformed"})
            return v or 0.0
        n = count()
        with socket.create_connection((b.host, b.port)) as s:
            s.sendall(_hello("x"))
            _drain(s, 2)
        time.sleep(0.2)
        assert count() == n + 1
    finally:
        b.close()


def test_two_agents_of_one_user_need_no_configuration() -> None:
    pa, pb = KVPool.host(LAY), KVPool.host(LAY)
    pa.block(1, 1, 3)[:] = b"\x5a" * LAY.block_bytes
    a, b = Agent("a", pa), Agent("b", pb)
    try:
        assert a.handshake(b.host, b.port) == "b"
        r = b.expect("a", 4)
        a.send_request("b", 4, [3], [6]).wait(10)
        r.done.wait(5)
        assert bytes(pb.block(1, 1, 6)) == b"\x5a" * LAY.block_bytes
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "p2phub" / "kv-secret"
        st = path.stat()
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
        assert path.parent.stat().st_mode & 0o777 == 0o700
    finally:
        a.close()
        b.close()


def test_two_processes_of_one_user_need_no_configuration(tmp_path: Path) -> None:
    """Two `p2phub kv` processes, nothing configured: each makes or finds the per-user
    secret, and the transfer is checked byte for byte."""
    small = ["--layers", "2", "--blocks", "16", "--block-bytes", "4096", "--json"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOP), os.environ.get("PYTHONPATH", "")]))
    srv = subprocess.Popen([sys.executable, "-m", "p2phub", "kv", "serve", "--count", "1", *small],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = json.loads(srv.stdout.readline())["port"]
        snd = subprocess.run([sys.executable, "-m", "p2phub", "kv", "send", "--to",
                              f"127.0.0.1:{port}", "--pages", "5", *small],
                             capture_output=True, text=True, env=env, timeout=60)
        assert snd.returncode == 0, snd.stderr
        out, err = srv.communicate(timeout=30)
        assert srv.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["bad_pages"] == 0
    finally:
        if srv.poll() is None:
            srv.kill()


def test_another_users_secret_is_not_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two users' runtime directories hold two secrets: their agents refuse each other."""
    a = Agent("a", KVPool.host(LAY))
    other = tmp_path / "other-run"
    other.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(other))
    b = Agent("b", KVPool.host(LAY))
    try:
        with pytest.raises(KVPeerError, match="unauthenticated"):
            a.handshake(b.host, b.port)
    finally:
        a.close()
        b.close()


def test_a_secret_file_others_can_read_is_refused(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "kv.secret"
    f.write_text("0123456789abcdef0123456789abcdef\n")
    f.chmod(0o644)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(f))
    with pytest.raises(KVAuthError, match="mode 0644: group or others"):
        Agent("a")
    f.chmod(0o600)
    Agent("a").close()
    if os.geteuid() == 0:
        os.chown(f, 4321, 4321)
        with pytest.raises(KVAuthError, match="owned by uid 4321"):
            Agent("a")
        os.chown(f, 0, 0)
    link = tmp_path / "link.secret"
    link.symlink_to(f)
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(link))
    with pytest.raises(KVAuthError, match="cannot open it"):
        Agent("a")
    f.write_text("short\n")
    monkeypatch.setenv(auth.ENV_SECRET_FILE, str(f))
    with pytest.raises(UsageError, match="at least 16"):
        Agent("a")
    monkeypatch.setenv(auth.ENV_SECRET, "0123456789abcdef")
    with pytest.raises(UsageError, match="set one"):
        Agent("a")


def test_an_unsafe_runtime_directory_is_refused(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    run = Path(os.environ["XDG_RUNTIME_DIR"])
    (run / "p2phub").mkdir(mode=0o755)
    (run / "p2phub").chmod(0o755)
    with pytest.raises(KVAuthError, match="mode 0755"):
        Agent("a")
    (run / "p2phub").rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (run / "p2phub").symlink_to(elsewhere)
    with pytest.raises(KVAuthError, match="not a directory"):
        Agent("a")
    (run / "p2phub").unlink()
    (run / "p2phub").mkdir(mode=0o700)
    (run / "p2phub" / "kv-secret").write_text("0123456789abcdef0123456789abcdef")
    (run / "p2phub" / "kv-secret").chmod(0o640)
    with pytest.raises(KVAuthError, match="mode 0640"):
        Agent("a")
    (run / "p2phub" / "kv-secret").unlink()
    run.chmod(0o755)          # a runtime directory others may use: the secret goes under /tmp
    Agent("b").close()
    assert not (run / "p2phub" / "kv-secret").exists()
    assert (Path("/tmp") / f"p2phub-{os.geteuid()}" / "kv-secret").exists()
    run.chmod(0o700)


def test_listening_beyond_loopback_needs_a_configured_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="beyond loopback.*P2PHUB_KV_SECRET"):
        Agent("a", host="0.0.0.0")
    Agent("a", host="0.0.0.0", secret=SECRET).close()
    monkeypatch.setenv(auth.ENV_SECRET, SECRET)
    Agent("a", host="0.0.0.0").close()
    monkeypatch.delenv(auth.ENV_SECRET)
    # the NIXL adapter, told to listen everywhere as a vLLM worker would be
    monkeypatch.setenv("P2PHUB_NIXL_HOST", "0.0.0.0")
    from p2phub.nixl import _bindings
    from p2phub.nixl.errors import nixlInvalidParamError
    with pytest.raises(nixlInvalidParamError, match="P2PHUB_KV_SECRET"):
        _bindings.nixlAgent("w", _bindings.nixlAgentConfig())
    # the command line
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOP), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "p2phub", "kv", "serve", "--listen", "0.0.0.0:0",
                        "--layers", "1", "--blocks", "4"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 4 and "P2PHUB_KV_SECRET" in p.stderr, p.stderr


def test_nixl_agents_prove_the_secret_in_the_metadata_exchange(monkeypatch: pytest.MonkeyPatch) -> None:
    from p2phub.nixl import _bindings
    from p2phub.nixl._kvagent import exchange
    from p2phub.nixl.errors import nixlRemoteDisconnectError
    w = _bindings.nixlAgent("w", _bindings.nixlAgentConfig())
    monkeypatch.setenv(auth.ENV_SECRET, SECRET)
    v = _bindings.nixlAgent("v", _bindings.nixlAgentConfig())
    try:
        with pytest.raises(nixlRemoteDisconnectError, match="different secrets"):
            exchange(v.kv, w.kv.host, w.kv.port, v.kv.metadata_dict(), 2)
        assert "v" not in w.kv._remotes
    finally:
        w.close()
        v.close()


# ------------------------------------------------------------------ bounded peers
def test_too_many_unauthenticated_connections_are_closed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2phub.kv")
    b = Agent("b", KVPool.host(LAY), limits=KVLimits(max_unauthenticated=2, auth_timeout=30))
    held = [socket.create_connection((b.host, b.port)) for _ in range(2)]
    try:
        time.sleep(0.2)
        with socket.create_connection((b.host, b.port)) as s:
            t0 = time.monotonic()
            assert _drain(s, 5) == b""
            assert time.monotonic() - t0 < 2          # closed at once, not at auth_timeout
        time.sleep(0.1)
        assert any("max_unauthenticated" in r.getMessage() for r in caplog.records)
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    a = Agent("a", KVPool.host(LAY))
    try:
        assert a.handshake(b.host, b.port) == "b"      # the slots came back
    finally:
        a.close()
        b.close()


def test_a_slow_prover_is_timed_out(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2phub.kv")
    b = Agent("b", limits=KVLimits(auth_timeout=0.5))
    try:
        with socket.create_connection((b.host, b.port)) as s:
            body = json.dumps({"v": 1, "name": "slow", "nonce": "33" * 32}).encode()
            s.sendall(_hdr(tp.AUTH, len(body)) + body[:10])      # and then nothing more
            t0 = time.monotonic()
            assert _drain(s, 5) == b""
            took = time.monotonic() - t0
        assert 0.3 < took < 2, took
        time.sleep(0.1)
        assert any("auth_timeout=0.5" in r.getMessage() for r in caplog.records)
    finally:
        b.close()


def test_an_oversized_auth_header_is_refused_before_reading_it(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2phub.kv")
    b = Agent("b")
    try:
        with socket.create_connection((b.host, b.port)) as s:
            s.sendall(_hdr(tp.AUTH, 1 << 30))
            t0 = time.monotonic()
            assert _drain(s, 5) == b""
            assert time.monotonic() - t0 < 2
        time.sleep(0.1)
        assert any("AUTH message of 1073741824 bytes" in r.getMessage() for r in caplog.records)
    finally:
        b.close()


def test_an_oversized_run_table_header_does_not_grow_memory() -> None:
    """A peer that proved the secret announces run tables of millions of runs: refused by
    the message's bytes and the layout before anything is allocated, or read only as fast
    as their bytes come (never allocated whole)."""
    lay = KVLayout(num_layers=2, blocks_per_layer=1 << 16, block_bytes=16)   # 256 Ki pages
    b = Agent("b", KVPool.host(lay), stall_timeout=30)
    socks = []
    try:
        rss = _rss()
        big = 4 << 20          # 4 Mi runs: 96 MiB of table each, if allocated from the header
        for i, (n, nbytes) in enumerate([(big, 16), (big, big * 16), (1 << 24, 1 << 40),
                                         (200_000, 200_000 * 16)] * 2):
            s = _proven(b, f"p{i}")
            s.sendall(_hello(f"p{i}"))
            tp.recv_hello(s, 5)
            s.sendall(_hdr(tp.DATA, n, nbytes, flags=tp.F_LAST))
            socks.append(s)
        time.sleep(1.0)
        assert _rss() - rss < 40 << 20, (_rss() - rss) >> 20
        for s in socks[:3] + socks[4:7]:
            assert _drain(s, 2) == b""        # dropped: more runs than bytes, or than pages
    finally:
        for s in socks:
            s.close()
        b.close()


def test_run_limits_are_named_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2phub.kv")
    b = Agent("b", limits=KVLimits(max_runs=10))
    buf = bytearray(1 << 16)
    b.register_memory(_addr(buf), len(buf))
    a = Agent("a")
    a.register_memory(_addr(bytearray(1 << 16)), 1 << 16)
    try:
        with _proven(b, "a") as s:
            s.sendall(_hello("a"))
            tp.recv_hello(s, 5)
            s.sendall(_hdr(tp.DATA, 11, 1 << 16, flags=tp.F_LAST))
            assert _drain(s, 3) == b""
        time.sleep(0.2)
        assert any("DATA with 11 runs: more than 10 (max_runs, P2PHUB_KV_MAX_RUNS)"
                   in r.getMessage() for r in caplog.records)
        assert a.handshake(b.host, b.port) == "b"
    finally:
        a.close()
        b.close()


def test_connections_per_peer_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2phub.kv")
    b = Agent("b", KVPool.host(LAY), limits=KVLimits(max_conns_per_peer=1))
    a1, a2 = Agent("a", KVPool.host(LAY)), Agent("a", KVPool.host(LAY))
    try:
        for a in (a1, a2):
            a.add_remote(b.metadata())
        a1.connect("b")
        with pytest.raises(KVPeerError, match="handshake refused: b: 1 connections of 'a' "
                           "are still open.*max_conns_per_peer=1"):
            a2.connect("b")
        time.sleep(0.1)
        assert any("max_conns_per_peer=1" in r.getMessage() for r in caplog.records)
        assert b._in["a"].alive()
    finally:
        for a in (a1, a2, b):
            a.close()


def test_requests_nobody_released_are_pruned_after_their_deadline() -> None:
    pa, pb = KVPool.host(LAY), KVPool.host(LAY)
    a = Agent("a", pa, stall_timeout=0.2, peer_timeout=0.2)
    b = Agent("b", pb, stall_timeout=0.2, peer_timeout=0.2, xfer_timeout=0.3)
    try:
        a.add_remote(b.metadata())
        for req in range(20):                            # never expected, never released
            a.send_request("b", req, [1], [2]).wait(5)
        r = b.expect("a", 99, deadline=0.2)
        assert len(b._inbound_reqs) == 21
        time.sleep(2.0)
        assert r.status == "failed"
        assert b._inbound_reqs == {}
        assert b._inbound_error("a", 99) is r.error     # a late last message still gets ERR
    finally:
        a.close()
        b.close()


def test_runs_of_a_layer_are_kept_without_copying_them_again() -> None:
    """Many messages for one layer of one request: each run table is kept once (linear),
    and the layer's pages are all visible."""
    r = tp.InboundRequest("a", 1, LAY)
    wire = struct.pack("<IIQQ", 0, 0, 0, LAY.block_bytes)
    t0 = time.monotonic()
    for _ in range(60_000):
        r._landed(0, wire)
    assert time.monotonic() - t0 < 2.0
    assert len(r.visible_blocks(0)) == 60_000


def test_queue_pairs_beyond_the_limit_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """An RDMA agent makes at most max_qps queue pairs, one per rail the peer published."""
    made: list[int] = []

    class Rails:
        def __init__(self, devices):
            self.devices = list(devices)

        def __len__(self):
            return len(self.devices)

        def add_segment(self, *a):
            pass

        def metadata(self):
            return [{"device": d, "gid": "::1", "mrs": []} for d in self.devices]

        def close(self):
            pass

    class Link:
        def __init__(self, rails, n, peer):
            made.append(n)

        def connect(self, *a):
            pass

        def infos(self):
            return []

        def close(self):
            pass

    from p2phub.kv import rdma
    monkeypatch.setattr(rdma, "Rails", Rails)
    monkeypatch.setattr(rdma, "Link", Link)
    b = Agent("b", rdma_devices=["r0", "r1"], limits=KVLimits(max_qps=4))
    try:
        for nq, rails, ok in ((64, 64, False), (3, 1, False), (2, 2, True)):
            with _proven(b, "a") as s:
                s.sendall(_hello("a", qps=[{}] * nq, rdma=[{}] * rails))
                if ok:
                    assert "metadata" in tp.recv_hello(s, 5)
                else:
                    with pytest.raises(KVError, match=f"handshake refused: b: {nq} queue pairs "
                                       r"asked for.*at most 4 \(max_qps, P2PHUB_KV_MAX_QPS\)"):
                        tp.recv_hello(s, 5)
        assert made == [2]
    finally:
        b.close()


def test_kv_serve_and_send_share_a_configured_secret_beyond_loopback(tmp_path: Path) -> None:
    """`p2phub kv` listening on every address with P2PHUB_KV_SECRET_FILE: a sender with the
    same file is served; one with another secret fails with an error saying so (exit 1)."""
    f = tmp_path / "kv.secret"
    f.write_text("the deployment's secret, from a file\n")
    f.chmod(0o600)
    small = ["--layers", "2", "--blocks", "16", "--block-bytes", "4096", "--json"]
    base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOP), os.environ.get("PYTHONPATH", "")]))
    env = dict(base, P2PHUB_KV_SECRET_FILE=str(f))
    srv = subprocess.Popen([sys.executable, "-m", "p2phub", "kv", "serve", "--listen", "0.0.0.0:0",
                            "--count", "1", *small], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = json.loads(srv.stdout.readline())["port"]
        bad = subprocess.run([sys.executable, "-m", "p2phub", "kv", "send", "--to",
                              f"127.0.0.1:{port}", "--pages", "5", *small], capture_output=True,
                             text=True, env=dict(base, P2PHUB_KV_SECRET="some other secret here"),
                             timeout=60)
        assert bad.returncode == 1 and "different secrets" in bad.stderr, bad.stderr
        ok = subprocess.run([sys.executable, "-m", "p2phub", "kv", "send", "--to",
                             f"127.0.0.1:{port}", "--pages", "5", *small], capture_output=True,
                            text=True, env=env, timeout=60)
        assert ok.returncode == 0, ok.stderr
        out, err = srv.communicate(timeout=30)
        assert srv.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1])["bad_pages"] == 0
        assert "refused connection from 127.0.0.1" in err and "closed before proving" in err
    finally:
        if srv.poll() is None:
            srv.kill()


def test_limits_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PHUB_KV_AUTH_TIMEOUT", "0.25")
    monkeypatch.setenv("P2PHUB_KV_MAX_UNAUTHENTICATED", "3")
    a = Agent("a")
    try:
        assert (a.limits.auth_timeout, a.limits.max_unauthenticated) == (0.25, 3)
    finally:
        a.close()
    monkeypatch.setenv("P2PHUB_KV_MAX_RUNS", "lots")
    with pytest.raises(UsageError, match="P2PHUB_KV_MAX_RUNS='lots': want a number"):
        Agent("a")
    monkeypatch.setenv("P2PHUB_KV_MAX_RUNS", "0")
    with pytest.raises(UsageError, match="max_runs=0 must be > 0"):
        Agent("a")
