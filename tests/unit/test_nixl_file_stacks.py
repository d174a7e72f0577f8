"""The storage call sequences of two serving stacks, replayed against p2phub.nixl as
``import nixl`` (``p2phub.nixl.alias()``), with their arguments and shapes, every byte
checked on disk (plain reads of the files) and in memory.

Written from the sources read (not copied):
- LMCache ``lmcache/v1/storage_backend/nixl_storage_backend.py`` at 016953bb2a64
  (NixlStorageAgent, NixlStaticStorageAgent with NixlFilePool, NixlDynamicStorageAgent):
  an agent built with ``backends=[]`` and ``sync_mode``, ``create_backend(NAME, params)``,
  the buffer registered page by page, prepared once with ``""``; the static pool's files
  (O_CREAT | O_RDWR | O_DIRECT) registered ``(0, page, fd, "")`` and prepared with the agent's
  own name from a list of tuples; ``make_prepped_xfer`` by page indices, ``transfer`` then
  ``check_xfer_state`` polled each millisecond until DONE or ERR; the dynamic form registers,
  prepares, moves, releases and deregisters per put.
- SGLang ``python/sglang/srt/mem_cache/storage/nixl/``: hicache_nixl.py at 070d0bee0d57,
  nixl_utils.py at 114585e364f1, nixl_registry.py at 0d522fac09b4: ``nixlBind.nixlAgentConfig()``
  filled field by field and ``agent.agent`` replaced by ``nixlBind.nixlAgent``,
  ``agent.plugin_list = agent.agent.getAvailPlugins()``, the automatic plugin order (3FS,
  POSIX, GDS_MT, GDS), the path-mode probe ``"rw:/nonexistent-nixl-probe"``, the storage side
  registered per transfer in path mode (``"rw,create,direct:<path>"`` to write,
  ``"ro,direct:<path>"`` to read) with ids from a counter, ``reg.trim()`` as the FILE side,
  ``initialize_xfer(direction, host, storage, own name)``, existence by ``query_memory``.
"""

from __future__ import annotations

import os
import random
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

np = pytest.importorskip("numpy")


PAGE = 16384


# P2PHUB_STACKS_NIXL=plugin (set by test_the_stacks_sequences_through_the_plugin, which runs
# this file in a process of its own): ``nixl`` is the real NIXL (the pip nixl_cu12) loading
# libplugin_P2PHUB.so from NIXL_PLUGIN_DIR under every storage plugin's name.
THROUGH_PLUGIN = os.environ.get("P2PHUB_STACKS_NIXL") == "plugin"


@pytest.fixture
def nixl() -> Iterator[Any]:
    """``nixl`` as a stack imports it: p2phub.nixl under NIXL's module names (or the real
    NIXL with p2phub's plugin, see THROUGH_PLUGIN)."""
    saved = {k: v for k, v in sys.modules.items() if k == "nixl" or k.startswith("nixl.")}
    if THROUGH_PLUGIN:
        import nixl_cu12
        import nixl_cu12._api
        import nixl_cu12._bindings
        sys.modules.update({"nixl": nixl_cu12, "nixl._api": nixl_cu12._api,
                            "nixl._bindings": nixl_cu12._bindings})
    else:
        import p2phub.nixl
        p2phub.nixl.alias()
    import nixl._api
    import nixl._bindings
    yield nixl
    for k in [k for k in sys.modules if k == "nixl" or k.startswith("nixl.")]:
        del sys.modules[k]
    sys.modules.update(saved)


def _close(agent: Any) -> None:
    """p2phub's agents close their listener (NIXL's at destruction: nothing to call)."""
    close = getattr(agent, "close", None)
    if close is not None:
        close()


def _pages(n: int, seed: int) -> np.ndarray:
    raw = np.zeros(n * PAGE + 4096, np.uint8)
    buf = raw[(-raw.ctypes.data) % 4096:][:n * PAGE]
    buf[:] = np.frombuffer(random.Random(seed).randbytes(n * PAGE), np.uint8)
    return buf


# ---------------------------------------------------------------------------- LMCache
class LMCacheLikeAgent:
    """The calls LMCache's NixlStorageAgent makes, in its order and shapes."""

    def __init__(self, nixl: Any, buf: np.ndarray, backend: str, params: dict[str, str]) -> None:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        self.agent_name = "NixlAgent_" + str(uuid.uuid4())
        conf = nixl_agent_config(backends=[], enable_prog_thread=True,
                                 sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.nixl_agent = nixl_agent(self.agent_name, conf)
        self.nixl_agent.create_backend(backend, params)
        ptr, size = buf.ctypes.data, buf.nbytes
        reg_list = [(a, PAGE, 0, "") for a in range(ptr, ptr + size, PAGE)]
        xfer_desc = [(a, PAGE, 0) for a in range(ptr, ptr + size, PAGE)]
        self.mem_reg_descs = self.nixl_agent.register_memory(reg_list, mem_type="DRAM")
        xfer_descs = self.nixl_agent.get_xfer_descs(xfer_desc, mem_type="DRAM")
        self.mem_xfer_handler = self.nixl_agent.prep_xfer_dlist("", xfer_descs, mem_type="DRAM")

    def post_blocking(self, handle: Any) -> None:
        import nixl._bindings as nixlBind
        state = self.nixl_agent.transfer(handle)
        while state != "DONE" and state != "ERR":
            try:
                state = self.nixl_agent.check_xfer_state(handle)
            except nixlBind.nixlBackendError:
                raise
            if state != "DONE" and state != "ERR":
                time.sleep(0.001)
        if state == "ERR":
            raise RuntimeError("NIXL transfer failed")

    def move(self, op: str, mem_indices: list[int], storage_handler: Any, storage_indices: list[int]) -> None:
        h = self.nixl_agent.make_prepped_xfer(op, self.mem_xfer_handler, mem_indices,
                                              storage_handler, storage_indices)
        self.post_blocking(h)
        self.nixl_agent.release_xfer_handle(h)


@pytest.mark.parametrize("backend,params", [("POSIX", {}), ("GDS_MT", {"thread_count": "4"}),
                                            ("GDS", {"batch_limit": "64"})])
def test_lmcache_static_file_pool(nixl, tmp_path: Path, backend: str, params: dict[str, str]) -> None:
    npages, pool_size = 12, 8
    buf = _pages(npages, 11)
    original = buf.copy()
    agent = LMCacheLikeAgent(nixl, buf, backend, params)
    fds, paths = [], []
    for i in reversed(range(pool_size)):
        p = tmp_path / f"obj_{i}_{uuid.uuid4().hex[0:4]}.bin"
        fds.append(os.open(p, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644))
        paths.append(p)
    a = agent.nixl_agent
    reg_list = [(0, PAGE, fd, "") for fd in fds]
    xfer_desc = [(0, PAGE, fd) for fd in fds]
    storage_reg = a.register_memory(reg_list, mem_type="FILE")
    a.get_xfer_descs(xfer_desc, mem_type="FILE")
    storage_handler = a.prep_xfer_dlist(agent.agent_name, xfer_desc, mem_type="FILE")
    # put: pages 3, 0, 7, 5 into pool slots popped from the free list
    put_pages = [3, 0, 7, 5]
    slots = [pool_size - 1 - k for k in range(len(put_pages))]
    agent.move("WRITE", put_pages, storage_handler, slots)
    for page, slot in zip(put_pages, slots):
        assert paths[slot].read_bytes() == original[page * PAGE:(page + 1) * PAGE].tobytes()
    # get: back into other pages (8..11)
    get_pages = [8, 9, 10, 11]
    buf[8 * PAGE:] = 0
    agent.move("READ", get_pages, storage_handler, slots)
    for page, src in zip(get_pages, put_pages):
        assert np.array_equal(buf[page * PAGE:(page + 1) * PAGE], original[src * PAGE:(src + 1) * PAGE])
    assert np.array_equal(buf[:8 * PAGE], original[:8 * PAGE])      # the rest untouched
    # close, as NixlStaticStorageAgent.close
    a.release_dlist_handle(storage_handler)
    a.release_dlist_handle(agent.mem_xfer_handler)
    a.deregister_memory(storage_reg)
    a.deregister_memory(agent.mem_reg_descs)
    for fd in fds:
        os.close(fd)
    _close(a)


def test_lmcache_dynamic_files_per_key(nixl, tmp_path: Path) -> None:
    buf = _pages(6, 12)
    original = buf.copy()
    agent = LMCacheLikeAgent(nixl, buf, "POSIX", {})
    a = agent.nixl_agent

    def batched(keys: list[str], create: bool) -> tuple[Any, Any, list[int]]:
        flags = os.O_RDWR | os.O_DIRECT | (os.O_CREAT if create else 0)
        fds = [os.open(tmp_path / k, flags, 0o644) for k in keys]
        reg_list = [(0, PAGE, fd, k) for fd, k in zip(fds, keys)]
        xfer_desc = [(0, PAGE, fd) for fd in fds]
        reg = a.register_memory(reg_list, "FILE")
        xd = a.get_xfer_descs(xfer_desc, "FILE")
        return reg, a.prep_xfer_dlist(agent.agent_name, xd, mem_type="FILE"), fds

    def release(reg: Any, h: Any, fds: list[int]) -> None:
        a.release_dlist_handle(h)
        a.deregister_memory(reg)
        for fd in fds:
            os.close(fd)

    keys = ["k-a", "k-b", "k-c"]
    reg, h, fds = batched(keys, create=True)
    agent.move("WRITE", [1, 2, 4], h, [0, 1, 2])
    release(reg, h, fds)
    for k, page in zip(keys, [1, 2, 4]):
        assert os.path.exists(tmp_path / k)          # LMCache's FILE existence check
        assert (tmp_path / k).read_bytes() == original[page * PAGE:(page + 1) * PAGE].tobytes()
    buf[:] = 0
    reg, h, fds = batched(keys[::-1], create=False)
    agent.move("READ", [0, 3, 5], h, [0, 1, 2])     # k-c -> 0, k-b -> 3, k-a -> 5
    release(reg, h, fds)
    for page, src in ((0, 4), (3, 2), (5, 1)):
        assert np.array_equal(buf[page * PAGE:(page + 1) * PAGE], original[src * PAGE:(src + 1) * PAGE])
    assert not buf[PAGE:3 * PAGE].any() and not buf[4 * PAGE:5 * PAGE].any()
    a.release_dlist_handle(agent.mem_xfer_handler)
    a.deregister_memory(agent.mem_reg_descs)
    _close(a)


# ---------------------------------------------------------------------------- SGLang
class HiCacheLike:
    """The calls SGLang's HiCacheNixl makes for the FILE storage tier."""

    FILE_PLUGINS = ["3FS", "POSIX", "GDS_MT", "GDS"]

    def __init__(self, nixl: Any, host: np.ndarray, plugin: str = "auto") -> None:
        import nixl._bindings as nixlBind
        from nixl._api import nixl_agent, nixl_agent_config
        sync_mode = getattr(nixlBind, "NIXL_THREAD_SYNC_RW", nixlBind.NIXL_THREAD_SYNC_STRICT)
        agent_config = nixl_agent_config(backends=[])
        self.agent_name = f"hicache_nixl_{uuid.uuid4()}"
        self.agent = nixl_agent(self.agent_name, agent_config)
        bind_cfg = nixlBind.nixlAgentConfig()
        bind_cfg.useProgThread = agent_config.enable_pthread
        bind_cfg.useListenThread = agent_config.enable_listen
        bind_cfg.listenPort = agent_config.port
        bind_cfg.syncMode = sync_mode
        bind_cfg.pthrDelay = 0
        bind_cfg.lthrDelay = 100000
        bind_cfg.captureTelemetry = agent_config.capture_telemetry
        self.first_core = self.agent.agent
        self.agent.agent = nixlBind.nixlAgent(self.agent_name, bind_cfg)
        self.agent.plugin_list = self.agent.agent.getAvailPlugins()
        plugins = self.agent.get_plugin_list()
        self.backend_name = next(p for p in self.FILE_PLUGINS if p in plugins) if plugin == "auto" else plugin
        self.agent.create_backend(self.backend_name, {})
        self.agent.get_backend_params(self.backend_name)
        self.path_mode = self._probe_path_mode()
        self.host = host
        self.agent.register_memory([(host.ctypes.data, host.nbytes, 0, "")], "DRAM")
        self._next_id = 1

    def _probe_path_mode(self) -> bool:
        reg_descs = self.agent.get_reg_descs([(0, 4096, 1, "rw:/nonexistent-nixl-probe")], "FILE")
        try:
            reg = self.agent.register_memory(reg_descs)
            if reg is not None:
                self.agent.deregister_memory(reg)
            return False
        except Exception:
            return True

    def _xfer_and_wait(self, host_descs: Any, storage_descs: Any, direction: str) -> bool:
        try:
            xfer_req = self.agent.initialize_xfer(direction, host_descs, storage_descs, self.agent_name)
        except Exception:
            return False
        try:
            state = self.agent.transfer(xfer_req)
            while state != "DONE":
                state = self.agent.check_xfer_state(xfer_req)
                if state == "ERR":
                    return False
                time.sleep(0.0001)
            return True
        except Exception:
            return False

    def transfer(self, pages: list[int], paths: list[str], direction: str) -> bool:
        buffers = [(self.host.ctypes.data + p * PAGE, PAGE) for p in pages]
        spec = ",".join((["rw", "create"] if direction == "WRITE" else ["ro"]) + ["direct"])
        ids = range(self._next_id, self._next_id + len(paths))
        self._next_id += len(paths)
        tuples = [(0, buffers[i][1], dev, f"{spec}:{paths[i]}") for i, dev in enumerate(ids)]
        try:
            reg = self.agent.register_memory(self.agent.get_reg_descs(tuples, "FILE"))
        except Exception:
            return False
        try:
            host_descs = self.agent.get_xfer_descs([(a, n, 0) for a, n in buffers], "DRAM")
            return self._xfer_and_wait(host_descs, reg.trim(), direction)
        finally:
            self.agent.deregister_memory(reg)

    def exists(self, paths: list[str]) -> list[bool]:
        res = self.agent.query_memory([(0, 0, 0, p) for p in paths], self.backend_name, mem_type="FILE")
        return [r is not None for r in res]


def test_sglang_hicache_file_tier(nixl, tmp_path: Path) -> None:
    host = _pages(8, 21)
    original = host.copy()
    hc = HiCacheLike(nixl, host)
    try:
        assert hc.backend_name == "POSIX"             # the automatic order finds POSIX
        assert hc.path_mode is True                   # the probe's registration raised
        keys = [str(tmp_path / "b0" / f"page-{i}") for i in range(3)]
        os.makedirs(tmp_path / "b0")
        assert hc.exists(keys) == [False, False, False]
        assert hc.transfer([2, 5, 6], keys, "WRITE")
        assert hc.exists(keys) == [True, True, True]
        for k, p in zip(keys, [2, 5, 6]):
            assert Path(k).read_bytes() == original[p * PAGE:(p + 1) * PAGE].tobytes()
        host[:] = 0
        assert hc.transfer([7, 0, 1], keys, "READ")
        for dst, src in ((7, 2), (0, 5), (1, 6)):
            assert np.array_equal(host[dst * PAGE:(dst + 1) * PAGE], original[src * PAGE:(src + 1) * PAGE])
        assert not host[2 * PAGE:7 * PAGE].any()
        # a page that was never stored: the read-only open fails at registration, nothing moves
        assert not hc.transfer([3], [str(tmp_path / "b0" / "missing")], "READ")
        assert not host[3 * PAGE:4 * PAGE].any()
        # the file tier left no file open (path mode closes at deregistration)
        fds = [os.readlink(f"/proc/self/fd/{f}") for f in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{f}")]
        assert not [f for f in fds if f.startswith(str(tmp_path))]
    finally:
        _close(hc.agent)
        _close(hc.first_core)


@pytest.mark.parametrize("plugin", ["GDS_MT", "GDS", "P2PHUB"])
def test_sglang_named_plugins(nixl, tmp_path: Path, plugin: str) -> None:
    """SGLANG_HICACHE_NIXL_BACKEND_PLUGIN names the plugin: each name moves the same bytes."""
    host = _pages(2, 22)
    original = host.copy()
    hc = HiCacheLike(nixl, host, plugin)
    try:
        key = str(tmp_path / "k")
        assert hc.transfer([0], [key], "WRITE")
        host[:] = 0
        assert hc.transfer([1], [key], "READ")
        assert np.array_equal(host[PAGE:], original[:PAGE]) and not host[:PAGE].any()
    finally:
        _close(hc.agent)
        _close(hc.first_core)


def test_the_stacks_sequences_through_the_plugin(tmp_path: Path) -> None:
    """Every sequence above, run again through the real NIXL (the pip nixl_cu12) loading
    libplugin_P2PHUB.so as POSIX, GDS_MT, GDS and P2PHUB: in a process of its own, since NIXL
    may crash at its exit (so its exit status is not judged, its pytest summary is)."""
    if THROUGH_PLUGIN:
        pytest.skip("this is that run")
    try:
        import nixl_cu12  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"nixl not installed (pip install --no-deps nixl-cu12==1.5.1 numpy): {exc}")
    import subprocess
    from test_nixl_plugin import build_plugin
    alias = build_plugin() / "alias"
    env = dict(os.environ, P2PHUB_STACKS_NIXL="plugin", NIXL_PLUGIN_DIR=str(alias),
               NIXL_LOG_LEVEL="ERROR")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "--basetemp", str(tmp_path / "run"), __file__,
                        "-k", "not through_the_plugin"],
                       capture_output=True, text=True, timeout=300, env=env,
                       cwd=Path(__file__).parent)
    out = p.stdout + p.stderr
    import re
    summary = re.search(r"^(\d+) passed(.*)$", out, re.M)
    assert summary and int(summary.group(1)) == 8 and "failed" not in summary.group(2) and \
        "error" not in summary.group(2), out[-4000:]
