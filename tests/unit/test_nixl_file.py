"""FILE memory through p2phub.nixl: fd-mode and path-mode registrations, DRAM <-> FILE READ
and WRITE to the agent's own name (initialize_xfer and prepared lists), the storage plugin
names and their parameters, query_memory, and the failures NIXL reports (a descriptor outside
every FILE registration, a read past the end of the file, an O_DIRECT write not aligned),
each with nothing written. Every byte is checked on disk (read back with plain os.pread) and
in memory."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Iterator

import pytest

np = pytest.importorskip("numpy")

from p2phub.nixl._api import nixl_agent, nixl_agent_config  # noqa: E402
from p2phub.nixl.errors import (  # noqa: E402
    nixlBackendError, nixlInvalidParamError, nixlNotFoundError, nixlNotSupportedError,
)


BLK = 4096


def _aligned(n: int) -> np.ndarray:
    """n zero bytes, 4096-aligned (what O_DIRECT wants of memory)."""
    raw = np.zeros(n + BLK, np.uint8)
    off = (-raw.ctypes.data) % BLK
    return raw[off:off + n]


def wait(agent: nixl_agent, h, timeout: float = 30.0) -> str:
    """Poll as LMCache does: until DONE or ERR (a failure raises nixlBackendError)."""
    st = agent.transfer(h)
    deadline = time.monotonic() + timeout
    while st not in ("DONE", "ERR"):
        assert time.monotonic() < deadline, "transfer did not finish"
        time.sleep(0.001)
        st = agent.check_xfer_state(h)
    return st


@pytest.fixture
def agent() -> Iterator[nixl_agent]:
    a = nixl_agent("store", nixl_agent_config(backends=[]))
    a.create_backend("POSIX")
    try:
        yield a
    finally:
        a.close()


def _open(path: Path) -> int:
    """How many of this process's fds are open on `path`."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
        except OSError:
            pass
    return n


def test_plugins_backends_and_parameters() -> None:
    a = nixl_agent("plugins", nixl_agent_config(backends=[]))
    try:
        assert {"POSIX", "GDS", "GDS_MT", "P2PHUB", "UCX"} <= set(a.get_plugin_list())
        assert a.get_plugin_mem_types("POSIX") == ["DRAM", "FILE"]
        assert a.get_plugin_mem_types("GDS_MT") == ["DRAM", "VRAM", "FILE"]
        assert a.get_plugin_params("POSIX")["kernel_queue_size"] == "256"
        assert a.get_plugin_params("GDS")["batch_limit"] == "128"
        assert "thread_count" in a.get_plugin_params("GDS_MT")
        assert a.backends == {}
        with pytest.raises(nixlNotFoundError, match="no backend for DRAM"):
            a.register_memory([(_aligned(BLK).ctypes.data, BLK, 0, "")], "DRAM")
        # another backend's key is ignored, as NIXL's plugins do (one config, several
        # backends), and refused by name where strict parameters are asked for
        other = nixl_agent("other", nixl_agent_config(backends=[]))
        strict = nixl_agent("strict", nixl_agent_config(backends=[]))
        try:
            other.create_backend("POSIX", {"thread_count": "8", "use_uring": "true"})
            assert "thread_count" not in other.get_backend_params("POSIX")
            assert other.get_backend_params("POSIX")["use_uring"] == "true"
            os.environ["P2PHUB_NIXL_STRICT_PARAMS"] = "1"
            with pytest.raises(nixlInvalidParamError, match="POSIX takes no parameter 'thread_count'"):
                strict.create_backend("POSIX", {"thread_count": "8"})
        finally:
            os.environ.pop("P2PHUB_NIXL_STRICT_PARAMS", None)
            other.close()
            strict.close()
        with pytest.raises(nixlInvalidParamError, match="thread_count='many'"):
            a.create_backend("GDS_MT", {"thread_count": "many"})
        with pytest.raises(nixlInvalidParamError, match="use_uring"):
            a.create_backend("POSIX", {"use_uring": "maybe"})
        with pytest.raises(nixlNotFoundError, match="no plugin 'HF3FS'"):
            a.create_backend("HF3FS")
        a.create_backend("POSIX", {"use_uring": "true", "kernel_queue_size": "64"})
        a.create_backend("GDS_MT", {"thread_count": "8"})
        a.create_backend("GDS", {"batch_limit": "256", "max_request_size": "1048576"})
        assert a.get_backend_params("POSIX")["use_uring"] == "true"
        assert a.get_backend_params("GDS_MT")["thread_count"] == "8"
        assert a.get_backend_mem_types("GDS") == ["DRAM", "VRAM", "FILE"]
        with pytest.raises(nixlInvalidParamError, match="already created"):
            a.create_backend("POSIX")
        # a storage plugin alone serves DRAM (and no peers)
        buf = _aligned(BLK)
        reg = a.register_memory([(buf.ctypes.data, BLK, 0, "")], "DRAM", backends=["POSIX"])
        with pytest.raises(nixlNotFoundError, match="no backend for a peer"):
            a.prep_xfer_dlist("somebody", [(buf.ctypes.data, BLK, 0)], "DRAM")
        a.deregister_memory(reg)
    finally:
        a.close()


@pytest.mark.parametrize("form", ["initialize_xfer", "prepped"])
def test_dram_file_write_then_read_fd_mode(agent: nixl_agent, tmp_path: Path, form: str) -> None:
    n = 16
    src, dst = _aligned(n * BLK), _aligned(n * BLK)
    src[:] = np.frombuffer(random.Random(1).randbytes(n * BLK), np.uint8)
    mreg = agent.register_memory([(src.ctypes.data, n * BLK, 0, ""), (dst.ctypes.data, n * BLK, 0, "")],
                                 "DRAM")
    path = tmp_path / "kv.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    try:
        freg = agent.register_memory([(0, n * BLK, fd, "")], "FILE")
        perm = random.Random(2).sample(range(n), n)          # block i goes to file slot perm[i]
        mem_rows = [(src.ctypes.data + i * BLK, BLK, 0) for i in range(n)]
        file_rows = [(perm[i] * BLK, BLK, fd) for i in range(n)]
        back_rows = [(dst.ctypes.data + i * BLK, BLK, 0) for i in range(n)]
        if form == "initialize_xfer":
            w = agent.initialize_xfer("WRITE", agent.get_xfer_descs(mem_rows, "DRAM"),
                                      agent.get_xfer_descs(file_rows, "FILE"), "store")
            assert wait(agent, w) == "DONE"
            r = agent.initialize_xfer("READ", agent.get_xfer_descs(back_rows, "DRAM"),
                                      agent.get_xfer_descs(file_rows, "FILE"), "store")
            assert wait(agent, r) == "DONE"
        else:
            fh = agent.prep_xfer_dlist("store", file_rows, "FILE")
            sh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", mem_rows, "DRAM")
            dh = agent.prep_xfer_dlist("", back_rows, "DRAM")
            idx = list(range(n))
            w = agent.make_prepped_xfer("WRITE", sh, idx, fh, idx)
            assert wait(agent, w) == "DONE"
            r = agent.make_prepped_xfer("READ", dh, np.arange(n), fh, np.array(idx))
            assert wait(agent, r) == "DONE"
            assert agent.query_xfer_backend(r) == "POSIX"
        disk = open(path, "rb").read()
        assert len(disk) == n * BLK
        for i in range(n):
            assert disk[perm[i] * BLK:(perm[i] + 1) * BLK] == src[i * BLK:(i + 1) * BLK].tobytes()
        assert np.array_equal(dst, src)
        agent.release_xfer_handle(w)
        agent.release_xfer_handle(r)
        agent.deregister_memory(freg)
    finally:
        os.close(fd)
    agent.deregister_memory(mreg)


def test_path_mode_opens_and_closes_the_file(agent: nixl_agent, tmp_path: Path) -> None:
    buf = _aligned(4 * BLK)
    buf[:] = 0x5A
    agent.register_memory([(buf.ctypes.data, 4 * BLK, 0, "")], "DRAM")
    path = tmp_path / "sub-key"
    with pytest.raises(nixlBackendError, match="No such file"):
        agent.register_memory([(0, 4 * BLK, 1, f"rw,direct:{path}")], "FILE")
    assert not path.exists()
    # SGLang's probe: an exception says "path mode is honoured"
    with pytest.raises(nixlBackendError):
        agent.register_memory(agent.get_reg_descs([(0, 4096, 1, "rw:/nonexistent-nixl-probe")], "FILE"))
    reg = agent.register_memory([(0, 4 * BLK, 7, f"rw,create,direct,noatime:{path}")], "FILE")
    assert path.exists() and _open(path) == 1
    with pytest.raises(nixlBackendError, match="id 7 is already a path-mode registration"):
        agent.register_memory([(0, BLK, 7, f"ro:{path}")], "FILE")
    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(buf.ctypes.data, 4 * BLK, 0)], "DRAM"),
                              reg.trim(), "store")
    assert wait(agent, h) == "DONE"
    assert path.read_bytes() == b"\x5a" * 4 * BLK
    agent.deregister_memory(reg)
    assert _open(path) == 0
    with pytest.raises(nixlNotFoundError, match="not inside a FILE registration"):
        agent.initialize_xfer("READ", agent.get_xfer_descs([(buf.ctypes.data, BLK, 0)], "DRAM"),
                              agent.get_xfer_descs([(0, BLK, 7)], "FILE"), "store")
    # read-only path mode: READ works, a WRITE through it is refused by the engine ("ERR")
    ro = agent.register_memory([(0, 4 * BLK, 8, f"ro:{path}")], "FILE")
    buf[:] = 0
    h = agent.initialize_xfer("READ", agent.get_xfer_descs([(buf.ctypes.data, 4 * BLK, 0)], "DRAM"),
                              ro.trim(), "store")
    assert wait(agent, h) == "DONE" and bytes(buf) == b"\x5a" * 4 * BLK
    buf[:] = 1
    h = agent.initialize_xfer("WRITE", agent.get_xfer_descs([(buf.ctypes.data, BLK, 0)], "DRAM"),
                              agent.get_xfer_descs([(0, BLK, 8)], "FILE"), "store")
    assert agent.transfer(h) == "ERR"
    with pytest.raises(nixlBackendError, match="reading only"):
        agent.check_xfer_state(h)
    assert path.read_bytes() == b"\x5a" * 4 * BLK
    agent.deregister_memory(ro)
    for bad, what in (("rw,fast:/tmp/x", "unknown flag 'fast'"), ("ro:", "no path"),
                      ("ro,rw:/tmp/x", "unknown flag 'rw'")):
        with pytest.raises(nixlInvalidParamError, match=what):
            agent.register_memory([(0, BLK, 9, bad)], "FILE")


def test_bad_descriptors_fail_with_nothing_written(agent: nixl_agent, tmp_path: Path) -> None:
    buf = _aligned(8 * BLK)
    buf[:] = 0xEE
    agent.register_memory([(buf.ctypes.data, 8 * BLK, 0, "")], "DRAM")
    path = tmp_path / "short.bin"
    path.write_bytes(b"\x11" * 2 * BLK)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        # the registration says 8 blocks; the file has 2
        agent.register_memory([(0, 8 * BLK, fd, "")], "FILE")
        mem = lambda k, n=BLK: agent.get_xfer_descs([(buf.ctypes.data + k, n, 0)], "DRAM")  # noqa: E731
        fil = lambda off, n=BLK, dev=fd: agent.get_xfer_descs([(off, n, dev)], "FILE")  # noqa: E731
        # outside every FILE registration: refused when the transfer is made (as NIXL)
        with pytest.raises(nixlNotFoundError, match="not inside a FILE registration"):
            agent.initialize_xfer("READ", mem(0), fil(8 * BLK), "store")
        with pytest.raises(nixlNotFoundError, match="of 12345"):
            agent.initialize_xfer("READ", mem(0), fil(0, dev=12345), "store")
        with pytest.raises(nixlNotFoundError, match="not inside memory registered"):
            agent.initialize_xfer("READ", agent.get_xfer_descs([(1, BLK, 0)], "DRAM"), fil(0), "store")
        with pytest.raises(nixlInvalidParamError, match="has 8192 bytes, FILE descriptor 0 has 4096"):
            agent.initialize_xfer("READ", mem(0, 2 * BLK), fil(0), "store")
        # a read past the end of the file, and an O_DIRECT write not aligned: "ERR"
        for op, m, f in (("READ", mem(0, 2 * BLK), fil(BLK, 2 * BLK)), ("WRITE", mem(0, 100), fil(1, 100))):
            h = agent.initialize_xfer(op, m, f, "store")
            assert agent.transfer(h) == "ERR"
            with pytest.raises(nixlBackendError):
                agent.check_xfer_state(h)
            agent.release_xfer_handle(h)
        assert path.read_bytes() == b"\x11" * 2 * BLK
        assert bytes(buf) == b"\xee" * 8 * BLK
        # a FILE side is the remote one, prepared with the agent's own name
        with pytest.raises(nixlNotSupportedError, match="own name"):
            agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(0, BLK, fd)], "FILE")
    finally:
        os.close(fd)


def test_query_memory_answers_for_files(agent: nixl_agent, tmp_path: Path) -> None:
    p = tmp_path / "there"
    p.write_bytes(b"x" * 12345)
    got = agent.query_memory([(0, 0, 0, str(p)), (0, 0, 0, str(tmp_path / "not-there"))], "POSIX", "FILE")
    assert got[0]["size"] == "12345" and got[1] is None
    assert int(got[0]["mode"]) == os.stat(p).st_mode
    with pytest.raises(ValueError, match="Backend 'GDS' not found"):
        agent.query_memory([(0, 0, 0, str(p))], "GDS", "FILE")


def test_transfers_run_as_one_batch_each(agent: nixl_agent, tmp_path: Path, monkeypatch) -> None:
    """Each FILE transfer is one hub.load_batch / hub.save_batch of all its descriptors, and
    its telemetry counts them."""
    n = 64
    buf = _aligned(n * BLK)
    buf[:] = np.frombuffer(random.Random(3).randbytes(n * BLK), np.uint8)
    want = buf.copy()
    agent.register_memory([(buf.ctypes.data, n * BLK, 0, "")], "DRAM")
    fd = os.open(tmp_path / "b.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        agent.register_memory([(0, n * BLK, fd, "")], "FILE")
        hub = agent.agent.storage.hub
        calls: list[tuple[str, int]] = []
        for name in ("load_batch", "save_batch"):
            real = getattr(hub, name)
            monkeypatch.setattr(hub, name, lambda *a, _r=real, _n=name, **kw:
                                calls.append((_n, len(kw["offsets"]))) or _r(*a, **kw))
        rows = [(buf.ctypes.data + i * BLK, BLK, 0) for i in range(n)]
        frows = [((n - 1 - i) * BLK, BLK, fd) for i in range(n)]
        w = agent.initialize_xfer("WRITE", agent.get_xfer_descs(rows, "DRAM"),
                                  agent.get_xfer_descs(frows, "FILE"), "store")
        assert wait(agent, w) == "DONE"
        buf[:] = 0
        r = agent.initialize_xfer("READ", agent.get_xfer_descs(rows, "DRAM"),
                                  agent.get_xfer_descs(frows, "FILE"), "store")
        assert wait(agent, r) == "DONE"
        assert wait(agent, r) == "DONE"          # posted again: another batch
        assert calls == [("save_batch", n), ("load_batch", n), ("load_batch", n)]
        assert np.array_equal(buf, want)
        assert os.pread(fd, BLK, 0) == want[(n - 1) * BLK:].tobytes()
    finally:
        os.close(fd)


def test_deregistered_memory_is_gone_from_the_engine(agent: nixl_agent, tmp_path: Path) -> None:
    buf = _aligned(2 * BLK)
    reg = agent.register_memory([(buf.ctypes.data, BLK, 0, ""), (buf.ctypes.data + BLK, BLK, 0, "")],
                                "DRAM")
    fd = os.open(tmp_path / "c.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"\x42" * 2 * BLK, 0)
        freg = agent.register_memory([(0, 2 * BLK, fd, "")], "FILE")
        lh = agent.prep_xfer_dlist("", [(buf.ctypes.data, BLK, 0), (buf.ctypes.data + BLK, BLK, 0)], "DRAM")
        fh = agent.prep_xfer_dlist("store", [(0, BLK, fd), (BLK, BLK, fd)], "FILE")
        assert wait(agent, agent.make_prepped_xfer("READ", lh, [0, 1], fh, [1, 0])) == "DONE"
        assert bytes(buf) == b"\x42" * 2 * BLK
        spans = agent.agent.storage.spans
        assert [(s.addr, s.length) for s in spans] == [(buf.ctypes.data, 2 * BLK)]   # one registration
        agent.deregister_memory(reg)
        assert agent.agent.storage.spans == []
        with pytest.raises(nixlNotFoundError, match="not inside registered memory"):
            agent.make_prepped_xfer("READ", lh, [0], fh, [0])
        agent.deregister_memory(freg)
        with pytest.raises(nixlNotFoundError, match="is not registered"):
            agent.deregister_memory(freg)
    finally:
        os.close(fd)


def test_vram_ranges_that_follow_one_another_merge_only_within_one_allocation(monkeypatch) -> None:
    """Two GPU buffers may sit back to back in the address space (cudaMalloc, torch's
    caching allocator) while no registration can span both: registered VRAM ranges merge
    into one span only where the backend puts them in one allocation; DRAM ranges, and
    VRAM that no backend can place (its registration says why later), merge as before."""
    from p2phub.nixl import _storage

    bases = {0x10000: 0x10000, 0x20000: 0x10000, 0x30000: 0x30000}     # else: no backend says
    monkeypatch.setattr(_storage, "_allocation", lambda addr, n: bases.get(addr))
    st = _storage.Storage()
    try:
        for addr in (0x10000, 0x20000, 0x30000, 0x40000, 0x50000):    # 64 KiB each, back to back
            st.add_mems([(addr, 0x10000)], True, 0)
        st.add_mems([(0x60000, 0x10000)], False, 0)              # DRAM right after the VRAM
        st.add_mems([(0x70000, 0x10000)], False, 0)
        assert [(s.addr, s.length, s.vram, s.alloc) for s in st.spans] == [
            (0x10000, 0x20000, True, 0x10000), (0x30000, 0x10000, True, 0x30000),
            (0x40000, 0x20000, True, None), (0x60000, 0x20000, False, None)]
        st.drop_mems([(0x20000, 0x10000)])
        assert [(s.addr, s.length) for s in st.spans][:2] == [(0x10000, 0x10000), (0x30000, 0x10000)]
    finally:
        st.close()


def test_agents_of_one_process_share_one_storage_engine(tmp_path: Path) -> None:
    """Every agent's FILE transfers run on one staged Hub per process (one engine thread, one
    staging): a second agent makes none of its own, and closing one leaves the other working."""
    path = tmp_path / "shared.bin"
    path.write_bytes(bytes(range(256)) * (2 * BLK // 256))
    agents = [nixl_agent(f"s{i}", nixl_agent_config(backends=[])) for i in range(2)]
    try:
        hubs = []
        for a in agents:
            a.create_backend("POSIX")
            buf = _aligned(BLK)
            a.register_memory([(buf.ctypes.data, BLK, 0, "")], "DRAM")
            a.register_memory([(0, 2 * BLK, 3, f"ro:{path}")], "FILE")
            h = a.initialize_xfer("READ", a.get_xfer_descs([(buf.ctypes.data, BLK, 0)], "DRAM"),
                                  a.get_xfer_descs([(BLK, BLK, 3)], "FILE"), a.name)
            assert wait(a, h) == "DONE"
            assert buf.tobytes() == path.read_bytes()[BLK:]
            hubs.append(a.agent.storage.hub)
        assert hubs[0] is hubs[1]
        agents[0].close()
        a, buf = agents[1], _aligned(BLK)
        a.register_memory([(buf.ctypes.data, BLK, 0, "")], "DRAM")
        h = a.initialize_xfer("READ", a.get_xfer_descs([(buf.ctypes.data, BLK, 0)], "DRAM"),
                              a.get_xfer_descs([(0, BLK, 3)], "FILE"), a.name)
        assert wait(a, h) == "DONE" and buf.tobytes() == path.read_bytes()[:BLK]
        assert not hubs[1].closed
    finally:
        for a in agents:
            a.close()
    assert hubs[1].closed     # closed with the last agent
