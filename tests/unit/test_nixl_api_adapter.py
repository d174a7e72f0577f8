"""p2phub.nixl's nixl_agent as NIXL defines it: errors by NIXL's classes (and the builtins a
connector catches), names as bytes, transfers to the agent's own name, partial metadata,
invalidation, telemetry, state after release, deregistration refusing later writes, a dead
peer reported by name. Two agents in one process over loopback TCP; bytes checked in the
buffers themselves."""

from __future__ import annotations

import ctypes
import time

import pytest

np = pytest.importorskip("numpy")

from p2phub.errors import P2PHubError  # noqa: E402
from p2phub.nixl import _bindings as bindings  # noqa: E402
from p2phub.nixl import _utils as utils  # noqa: E402
from p2phub.nixl._api import nixl_agent, nixl_agent_config  # noqa: E402
from p2phub.nixl.errors import (  # noqa: E402
    nixlBackendError, nixlInvalidParamError, nixlNoTelemetryError, nixlNotFoundError,
    nixlNotPostedError, nixlNotSupportedError, nixlRemoteDisconnectError, nixlRepostActiveError,
)


@pytest.fixture
def two():
    a = nixl_agent("A", nixl_agent_config(capture_telemetry=True, stall_timeout=2.0))
    b = nixl_agent("B", nixl_agent_config(capture_telemetry=True, stall_timeout=2.0))
    yield a, b
    a.close()
    b.close()


def _buf(n: int, seed: int | None = None):
    arr = np.zeros(n, dtype=np.uint8)
    if seed is not None:
        arr[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return arr


def _wait(agent, h, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    st = agent.check_xfer_state(h)
    while st == "PROC":
        assert time.monotonic() < deadline, "transfer still in progress"
        time.sleep(0.001)
        st = agent.check_xfer_state(h)
    return st


def _notified(agent, peer: str, tag: bytes, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not agent.check_remote_xfer_done(peer, tag):
        assert time.monotonic() < deadline, f"no notification {tag!r} from {peer}"
        time.sleep(0.001)


def test_errors_are_nixls_classes_and_the_builtins(two) -> None:
    a, b = two
    with pytest.raises(ValueError):
        nixl_agent("")
    with pytest.raises(KeyError, match="'RD'"):
        a.make_prepped_xfer("RD", 0, [], 0, [])
    with pytest.raises(KeyError, match="V-RAM"):
        a.get_xfer_descs([(1, 2, 3)], mem_type="V-RAM")
    with pytest.raises(bindings.nixlNotFoundError) as ei:
        a.create_backend("UVX")
    assert isinstance(ei.value, KeyError) and isinstance(ei.value, P2PHubError)
    assert "UVX" in str(ei.value)
    with pytest.raises(TypeError, match="sync_mode"):
        nixl_agent_config(sync_mode=1)
    buf = _buf(4096)
    with pytest.raises(KeyError, match="backend 'LIBFABRIC'"):
        a.register_memory([(buf.ctypes.data, 4096, 0, "")], "DRAM", backends=["LIBFABRIC"])
    with pytest.raises(nixlNotFoundError, match="not inside memory registered"):
        a.prep_xfer_dlist("", [(buf.ctypes.data, 4096, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError):
        a.prep_xfer_dlist("nobody", [(buf.ctypes.data, 4096, 0)], "DRAM")
    a.register_memory([(buf.ctypes.data, 4096, 0, "")], "DRAM", backends=["UCX"])
    lh = a.prep_xfer_dlist("", [(buf.ctypes.data, 4096, 0), (buf.ctypes.data, 1024, 0)], "DRAM")
    rh = a.prep_xfer_dlist("A", [(buf.ctypes.data, 4096, 0)], "DRAM")
    with pytest.raises(nixlInvalidParamError, match="outside the lists"):
        a.make_prepped_xfer("WRITE", lh, [0], rh, [1])
    with pytest.raises(nixlInvalidParamError, match="1024 bytes"):
        a.make_prepped_xfer("WRITE", lh, [1], rh, [0])
    with pytest.raises(ValueError):
        a.make_prepped_xfer("WRITE", lh, [0, 1], rh, [0])
    h = a.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    with pytest.raises(nixlNotPostedError):
        a.check_xfer_state(h)
    blk = [(buf.ctypes.data, 4096, 0, "")]
    with pytest.raises(nixlNotSupportedError, match="BLOCK needs a storage plugin"):
        a.register_memory(blk, "BLOCK")
    with pytest.raises(ValueError, match="not found"):
        a.query_memory(blk, "GDS", "DRAM")


def test_plugins_and_backends(two) -> None:
    a, _ = two
    assert a.get_plugin_list() == ["P2PHUB", "UCX", "POSIX", "GDS", "GDS_MT"]
    assert a.get_plugin_mem_types("P2PHUB") == ["DRAM", "VRAM", "FILE"]
    assert "stall_timeout" in a.get_plugin_params("P2PHUB")
    # UCX is a name of the KV agent too (NIXL's parameters, its memory types) ...
    assert a.get_plugin_mem_types("UCX") == ["DRAM", "VRAM"]
    assert a.get_plugin_params("UCX")["num_workers"] == "1"
    # ... and in a backends list it selects P2PHUB: not created under its own name here
    assert a.get_backend_params("UCX") == {} and a.get_backend_mem_types("UCX") == []
    assert a.get_plugin_params("LIBFABRIC") == {} and a.get_plugin_mem_types("LIBFABRIC") == []
    assert list(a.backends) == ["P2PHUB"]
    empty = nixl_agent("E", nixl_agent_config(backends=[]))
    try:
        buf = _buf(64)
        with pytest.raises(nixlNotFoundError, match="no backend"):
            empty.register_memory([(buf.ctypes.data, 64, 0, "")], "DRAM")
        empty.create_backend("P2PHUB", {"stall_timeout": "3"})
        assert empty.kv.stall_timeout == 3.0
        with pytest.raises(nixlInvalidParamError):
            empty.create_backend("P2PHUB")
        reg = empty.register_memory([(buf.ctypes.data, 64, 0, "")], "DRAM")
        assert empty.query_memory(reg, "P2PHUB")[0]["registered"] == "true"
        assert empty.query_memory([(buf.ctypes.data + 64, 8, 0, "")], "UCX", "DRAM") == [None]
    finally:
        empty.close()


def test_transfer_to_own_name_and_descriptor_lists(two) -> None:
    a, _ = two
    src, dst = _buf(8192, seed=1), _buf(8192)
    reg = a.register_memory([(src.ctypes.data, 8192, 0, "s"), (dst.ctypes.data, 8192, 0, "d")], "DRAM")
    assert reg[0] == (src.ctypes.data, 8192, 0, b"s")
    x = a.deserialize_descs(a.get_serialized_descs(reg.trim()))
    assert isinstance(x, bindings.nixlXferDList) and x.descCount() == 2 and x[1] == (dst.ctypes.data, 8192, 0)
    with pytest.raises(nixlNotFoundError):
        x.index((1, 2, 3))
    lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(src.ctypes.data + i * 1024, 1024, 0) for i in range(8)], "DRAM")
    rh = a.prep_xfer_dlist(a.name, [(dst.ctypes.data + i * 1024, 1024, 0) for i in range(8)], "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, [0, 1, 2], rh, [7, 5, 3], b"self")
    assert a.transfer(h) == "DONE"
    for i, j in ((0, 7), (1, 5), (2, 3)):
        assert (dst[j * 1024:(j + 1) * 1024] == src[i * 1024:(i + 1) * 1024]).all()
    assert not dst[:3 * 1024].any()
    assert a.get_new_notifs() == {"A": [b"self"]}
    t = a.get_xfer_telemetry(h)
    assert (t.totalBytes, t.descCount) == (3072, 3) and 0 < t.postDuration <= t.xferDuration
    assert a.query_xfer_backend(h) == "P2PHUB"
    a.release_xfer_handle(h)
    assert a.check_xfer_state(h) == "DONE"          # after release: the state it had
    back = _buf(1024)
    a.register_memory([(back.ctypes.data, 1024, 0, "")], "DRAM")
    r = a.initialize_xfer("READ", a.get_xfer_descs([(back.ctypes.data, 1024, 0)], "DRAM"),
                          a.get_xfer_descs([(dst.ctypes.data + 7 * 1024, 1024, 0)], "DRAM"), b"A")
    assert a.transfer(r) == "DONE" and (back == src[:1024]).all()


def test_write_read_telemetry_and_repost(two) -> None:
    a, b = two
    src, dst = _buf(1 << 20, seed=2), _buf(1 << 20)
    a.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    name = a.add_remote_agent(b.get_agent_metadata())
    assert name == b"B"
    n = 16
    blk = src.nbytes // n
    lh = a.prep_xfer_dlist("", [(src.ctypes.data + i * blk, blk, 0) for i in range(n)], "DRAM")
    rh = a.prep_xfer_dlist(name, [(dst.ctypes.data + i * blk, blk, 0) for i in range(n)], "DRAM")
    perm = np.random.default_rng(3).permutation(n).astype(np.int32)
    h = a.make_prepped_xfer("WRITE", lh, np.arange(n, dtype=np.int32), rh, perm, b"w1")
    assert a.transfer(h) in ("PROC", "DONE")
    with pytest.raises(nixlRepostActiveError):
        while True:                                          # repost while it moves
            a.transfer(h)
    assert _wait(a, h) == "DONE"
    _notified(b, "A", b"w1")
    for i, j in enumerate(perm):
        assert (dst[j * blk:(j + 1) * blk] == src[i * blk:(i + 1) * blk]).all()
    t = a.get_xfer_telemetry(h)
    assert t.totalBytes == src.nbytes and t.descCount == n and t.startTime > 0
    assert 0 < t.postDuration <= t.xferDuration
    assert a.transfer(h, b"w2") in ("PROC", "DONE")          # repost with a new notification
    assert _wait(a, h) == "DONE"
    _notified(b, "A", b"w2")
    d, margin, method = a.estimate_xfer_cost(h)
    assert d > 0 and margin >= 0 and method == "UNKNOWN"
    back = _buf(blk)
    a.register_memory([(back.ctypes.data, blk, 0, "")], "DRAM")
    bh = a.prep_xfer_dlist("", [(back.ctypes.data, blk, 0)], "DRAM")
    r = a.make_prepped_xfer("READ", bh, [0], rh, [int(perm[5])])
    a.transfer(r)
    assert _wait(a, r) == "DONE" and (back == src[5 * blk:6 * blk]).all()
    quiet = nixl_agent("Q", nixl_agent_config())
    try:
        quiet.register_memory([(back.ctypes.data, blk, 0, "")], "DRAM")
        quiet.add_remote_agent(b.get_agent_metadata())
        q = quiet.initialize_xfer("WRITE", quiet.get_xfer_descs([(back.ctypes.data, blk, 0)], "DRAM"),
                                  quiet.get_xfer_descs([(dst.ctypes.data, blk, 0)], "DRAM"), "B")
        quiet.transfer(q)
        assert _wait(quiet, q) == "DONE"
        with pytest.raises(nixlNoTelemetryError):
            quiet.get_xfer_telemetry(q)
    finally:
        quiet.close()


def test_estimate_needs_a_measured_transfer(two) -> None:
    a, _ = two
    buf = _buf(64)
    a.register_memory([(buf.ctypes.data, 64, 0, "")], "DRAM")
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(buf.ctypes.data, 32, 0)], "DRAM"),
                          a.get_xfer_descs([(buf.ctypes.data + 32, 32, 0)], "DRAM"), "A")
    with pytest.raises(nixlNotSupportedError, match="no completed transfer"):
        a.estimate_xfer_cost(h)


def test_partial_metadata_and_invalidation() -> None:
    t = nixl_agent("target", nixl_agent_config(True, True, 0))
    i = nixl_agent("initiator", nixl_agent_config(True, True, 0))
    try:
        bufs = [utils.malloc_passthru(4096) for _ in range(3)]
        for k, addr in enumerate(bufs[:2]):
            ctypes.memset(addr, 0x11 * (k + 1), 4096)
        r1 = t.register_memory([(bufs[0], 4096, 0, "")], "DRAM")
        r2 = t.register_memory([(bufs[1], 4096, 0, "")], "DRAM")
        i.register_memory([(bufs[2], 4096, 0, "")], "DRAM")
        t.send_partial_agent_metadata(r1, True, ["UCX"], "127.0.0.1", i.kv.port)
        assert i.check_remote_metadata("target", r1.trim())
        assert not i.check_remote_metadata("target", r2.trim())
        local = i.get_xfer_descs([(bufs[2], 4096, 0)], "DRAM")
        with pytest.raises(nixlNotFoundError):
            i.initialize_xfer("READ", local, r2.trim(), "target", b"U2")
        h = i.initialize_xfer("READ", local, r1.trim(), "target", b"U1")
        i.transfer(h)
        assert _wait(i, h) == "DONE" and ctypes.string_at(bufs[2], 4096) == b"\x11" * 4096
        _notified(t, "initiator", b"U1")
        t.send_partial_agent_metadata(r2, True, [], "127.0.0.1", i.kv.port)
        assert i.check_remote_metadata("target", r1.trim()) and i.check_remote_metadata("target", r2.trim())
        h2 = i.initialize_xfer("READ", local, r2.trim(), "target", b"U2")
        i.transfer(h2)
        assert _wait(i, h2) == "DONE" and ctypes.string_at(bufs[2], 4096) == b"\x22" * 4096
        t.invalidate_local_metadata("127.0.0.1", i.kv.port)
        assert not i.check_remote_metadata("target")
        with pytest.raises(nixlNotFoundError):
            i.initialize_xfer("READ", local, r2.trim(), "target", b"U3")
        # fetch: the other way round, one call
        i.fetch_remote_metadata("target", "127.0.0.1", t.kv.port)
        assert i.check_remote_metadata("target", r2.trim())
        for addr in bufs:
            utils.free_passthru(addr)
    finally:
        t.close()
        i.close()


def test_deregistered_memory_refuses_writes(two) -> None:
    a, b = two
    src, dst = _buf(4096, seed=4), _buf(4096)
    a.register_memory([(src.ctypes.data, 4096, 0, "")], "DRAM")
    reg = b.register_memory([(dst.ctypes.data, 4096, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())          # metadata from before deregistration
    b.deregister_memory(reg)
    with pytest.raises(nixlNotFoundError):
        b.deregister_memory(reg)
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, 4096, 0)], "DRAM"),
                          a.get_xfer_descs([(dst.ctypes.data, 4096, 0)], "DRAM"), "B")
    with pytest.raises(nixlBackendError, match="B"):
        a.transfer(h)
        _wait(a, h)
    assert not dst.any()
    with pytest.raises(nixlNotFoundError):
        b.prep_xfer_dlist("", [(dst.ctypes.data, 4096, 0)], "DRAM")


def test_dead_peer_is_named(two) -> None:
    a, b = two
    src = _buf(4096, seed=5)
    dst = _buf(4096)
    a.register_memory([(src.ctypes.data, 4096, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, 4096, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", a.get_xfer_descs([(src.ctypes.data, 4096, 0)], "DRAM"),
                          a.get_xfer_descs([(dst.ctypes.data, 4096, 0)], "DRAM"), "B")
    b.close()
    t0 = time.monotonic()
    with pytest.raises(nixlRemoteDisconnectError, match="'B'"):
        a.transfer(h)
        _wait(a, h)
    assert time.monotonic() - t0 < 2.0 * 2 + 1
    with pytest.raises(nixlRemoteDisconnectError, match="'B'"):
        a.send_notif("B", b"anyone?")
    with pytest.raises(nixlNotFoundError):
        a.send_notif("C", b"who?")


def test_alias_makes_import_nixl_resolve_here() -> None:
    import subprocess
    import sys
    code = ("import p2phub.nixl; p2phub.nixl.alias()\n"
            "from nixl._api import nixl_agent as NixlWrapper, nixl_agent_config\n"
            "from nixl._bindings import nixlXferTelemetry, nixlNotFoundError\n"
            "import nixl._utils, nixl.logging\n"
            "a = NixlWrapper('x', nixl_agent_config(num_threads=4, capture_telemetry=True))\n"
            "assert type(a).__module__ == 'p2phub.nixl._api', type(a).__module__\n"
            "assert nixlNotFoundError.__module__ == 'p2phub.nixl.errors'\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "ok", r.stderr


def test_strided_nx5_prep_is_every_block(two) -> None:
    a, _ = two
    src, dst = _buf(8 * 512, seed=9), _buf(8 * 512)
    a.register_memory([(src.ctypes.data, src.nbytes, 0, ""), (dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    # 4 blocks of 256 bytes, 512 apart, starting at each buffer (NIXL 1.5's Nx5 form)
    lh = a.prep_xfer_dlist("", np.array([[src.ctypes.data, 256, 0, 512, 4]], dtype=np.uint64), "DRAM")
    rh = a.prep_xfer_dlist("A", np.array([[dst.ctypes.data + 256, 256, 0, 512, 4]], dtype=np.uint64), "DRAM")
    with pytest.raises(ValueError, match="mem type"):
        a.prep_xfer_dlist("", np.array([[src.ctypes.data, 256, 0, 512, 4]], dtype=np.uint64))
    h = a.make_prepped_xfer("WRITE", lh, [0, 3], rh, [3, 0])
    assert a.transfer(h) == "DONE"
    assert (dst[3 * 512 + 256:4 * 512] == src[0:256]).all()
    assert (dst[256:512] == src[3 * 512:3 * 512 + 256]).all()
    assert int(dst.astype(bool).sum()) == int(src[0:256].astype(bool).sum() + src[1536:1792].astype(bool).sum())
