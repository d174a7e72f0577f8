"""VRAM <-> FILE through p2phub.nixl on a GPU: torch CUDA tensors registered as VRAM with an
agent built with backends=[] and GDS_MT (then GDS, POSIX refusing VRAM), scattered blocks
written to a file and read back into other blocks, with initialize_xfer and with prepared
lists; LMCache's CUDA buffer shape (registered page by page, prepared once); NIXL's
remote_storage_example utilities on VRAM (tools/nixl-examples, where NIXL's examples are
unpacked). Every byte checked on disk (plain reads) and in GPU memory (copied back by torch)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")

BLK, N = 65536, 32
TOP = Path(__file__).resolve().parents[2]


def _wait(a, h) -> str:
    st = a.transfer(h)
    deadline = time.monotonic() + 60
    while st == "PROC" and time.monotonic() < deadline:
        st = a.check_xfer_state(h)
    return st


@pytest.mark.parametrize("plugin", ["GDS_MT", "GDS", "P2PHUB"])
@pytest.mark.parametrize("form", ["initialize_xfer", "prepped"])
def test_vram_file_write_then_read(tmp_path: Path, plugin: str, form: str) -> None:
    from p2phub.nixl._api import nixl_agent, nixl_agent_config
    from p2phub.nixl.errors import nixlNotFoundError
    a = nixl_agent("gpu-store", nixl_agent_config(backends=[]))
    try:
        if plugin == "GDS":
            a.create_backend("POSIX")
            with pytest.raises(nixlNotFoundError, match="no backend for VRAM"):
                a.register_memory([(0x1000, BLK, 0, "")], "VRAM")
        a.create_backend(plugin)
        pattern = torch.randint(0, 256, (N * BLK,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        src = pattern.to("cuda:0")
        dst = torch.zeros(N * BLK, dtype=torch.uint8, device="cuda:0")
        a.register_memory([src, dst], "VRAM")
        path = tmp_path / "vram.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
        try:
            a.register_memory([(0, N * BLK, fd, "")], "FILE")
            perm = np.random.default_rng(6).permutation(N)
            srows = [(src.data_ptr() + i * BLK, BLK, 0) for i in range(N)]
            frows = [(int(perm[i]) * BLK, BLK, fd) for i in range(N)]
            drows = [(dst.data_ptr() + i * BLK, BLK, 0) for i in range(N)][::-1]   # reversed
            if form == "initialize_xfer":
                w = a.initialize_xfer("WRITE", a.get_xfer_descs(srows, "VRAM"), a.get_xfer_descs(frows, "FILE"), a.name)
                assert _wait(a, w) == "DONE"
                r = a.initialize_xfer("READ", a.get_xfer_descs(drows, "VRAM"), a.get_xfer_descs(frows, "FILE"), a.name)
                assert _wait(a, r) == "DONE"
            else:
                fh = a.prep_xfer_dlist(a.name, frows, "FILE")
                sh = a.prep_xfer_dlist("NIXL_INIT_AGENT", srows, "VRAM")
                dh = a.prep_xfer_dlist("NIXL_INIT_AGENT", drows, "VRAM")
                idx = list(range(N))
                assert _wait(a, a.make_prepped_xfer("WRITE", sh, idx, fh, idx)) == "DONE"
                r = a.make_prepped_xfer("READ", dh, idx, fh, idx)
                assert _wait(a, r) == "DONE"
            assert a.query_xfer_backend(r) == plugin
            disk = path.read_bytes()
            want = pattern.numpy()
            for i in range(N):
                p = int(perm[i])
                assert disk[p * BLK:(p + 1) * BLK] == want[i * BLK:(i + 1) * BLK].tobytes()
            got = dst.cpu().numpy().reshape(N, BLK)[::-1]
            assert np.array_equal(got, want.reshape(N, BLK))
        finally:
            os.close(fd)
    finally:
        a.close()


def test_nixl_remote_storage_utilities_on_vram(tmp_path: Path) -> None:
    src = Path(os.environ.get("NIXL_SRC", TOP / ".nixl-src"))
    if not (src / "examples/python/nixl_gds_example.py").exists():
        pytest.skip(f"NIXL's examples are not unpacked at {src} (tools/nixl-examples --help)")
    r = subprocess.run([sys.executable, str(TOP / "tools/nixl-examples"), "--nixl-src", str(src),
                        "--mem", "VRAM", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "VRAM <-> O_DIRECT files" in r.stdout


def test_back_to_back_allocations_are_registered_apart(tmp_path: Path) -> None:
    """cuMemAlloc buffers that sit back to back in the address space (as the caching
    allocator's segments can) stay two registrations for the storage engine: a FILE read
    whose blocks land in both fills every byte, where one merged range would span two
    allocations and be refused."""
    try:
        from cuda.bindings import driver as cu  # type: ignore[import-not-found]
    except ImportError:
        from cuda import cuda as cu  # type: ignore[import-not-found,no-redef]
    from p2phub.nixl._api import nixl_agent, nixl_agent_config

    size = 2 << 20
    assert int(cu.cuInit(0)[0]) == 0
    err, ctx = cu.cuDevicePrimaryCtxRetain(0)
    assert int(err) == 0 and int(cu.cuCtxSetCurrent(ctx)[0]) == 0
    ptrs: list[int] = []
    try:
        pair = None
        for _ in range(64):
            err, p = cu.cuMemAlloc(size)
            assert int(err) == 0
            ptrs.append(int(p))
            pair = next(((x, y) for x in ptrs for y in ptrs if x + size == y), None)
            if pair is not None:
                break
        if pair is None:
            pytest.skip("no two of 64 cuMemAlloc buffers came back to back")
        first, second = pair
        pattern = np.random.default_rng(9).integers(0, 256, 2 * size, dtype=np.uint8)
        path = tmp_path / "pair.bin"
        path.write_bytes(pattern.tobytes())
        a = nixl_agent("gpu-pair", nixl_agent_config(backends=[]))
        try:
            a.create_backend("GDS_MT")
            a.register_memory([(first, size, 0, ""), (second, size, 0, "")], "VRAM")
            fd = os.open(path, os.O_RDWR)
            try:
                a.register_memory([(0, 2 * size, fd, "")], "FILE")
                n = 2 * size // BLK                      # blocks across both buffers
                vrows = [(first + i * BLK, BLK, 0) for i in range(n)]
                frows = [(i * BLK, BLK, fd) for i in range(n)]
                r = a.initialize_xfer("READ", a.get_xfer_descs(vrows, "VRAM"),
                                      a.get_xfer_descs(frows, "FILE"), a.name)
                assert _wait(a, r) == "DONE"
                spans = [(s.addr, s.length) for s in a.agent.storage.spans]
                assert spans == [(first, size), (second, size)]
            finally:
                os.close(fd)
        finally:
            a.close()
        got = np.empty(2 * size, np.uint8)
        for k, p in enumerate((first, second)):
            assert int(cu.cuMemcpyDtoH(got[k * size:].ctypes.data, p, size)[0]) == 0
        assert np.array_equal(got, pattern)
    finally:
        for p in ptrs:
            cu.cuMemFree(p)
        cu.cuDevicePrimaryCtxRelease(0)
