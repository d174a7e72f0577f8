"""libplugin_P2PHUB.so under the real NIXL (the pip nixl_cu12 wheel, unchanged): loaded from
NIXL_PLUGIN_DIR under its own name and as GDS_MT / POSIX / GDS, DRAM <-> FILE through
p2phub's staged I/O engine, every byte checked from an independent read; NIXL's own storage
example run unchanged. NIXL runs in a subprocess that prints what it saw (its exit may crash)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TOP = HERE.parent.parent
PLUGIN = TOP / "p2phub" / "nixl" / "plugin"
# NIXL's own example, unmodified: NIXL's file, not p2phub's, so it is read where NIXL's examples
# were unpacked (NIXL_SRC, or .nixl-src in the checkout: tools/nixl-examples --help)
EXAMPLE = Path(os.environ.get("NIXL_SRC", TOP / ".nixl-src")) / "examples/python/nixl_gds_example.py"


def _nixl_missing() -> str | None:
    try:
        import nixl_cu12._api  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        return f"nixl not installed (pip install --no-deps nixl-cu12==1.5.1 numpy): {exc}"
    return None


needs_nixl = pytest.mark.skipif(_nixl_missing() is not None, reason=str(_nixl_missing()))


def build_plugin() -> Path:
    """The plugin built in the tree by its Makefile (tools/setup built it already; make redoes
    only what changed): PLUGIN/build, whose alias/ subdirectory holds it as
    libplugin_{P2PHUB,GDS_MT,GDS,POSIX}.so."""
    p = subprocess.run(["make", "-s", "-j2", "-C", str(PLUGIN), "aliases"],
                       capture_output=True, text=True)
    assert p.returncode == 0, f"make -C {PLUGIN} failed (needs g++ and make):\n{p.stderr}"
    return PLUGIN / "build"


@pytest.fixture(scope="module")
def build() -> Path:
    return build_plugin()


def _run(args: list[str], env: dict[str, str] | None = None, timeout: float = 180) -> str:
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "NIXL_LOG_LEVEL": "ERROR", **(env or {})})
    return p.stdout + "\n--- stderr ---\n" + p.stderr


def _last_json(text: str) -> dict:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no result line from the NIXL process:\n{text[-3000:]}")


def test_backend_vtable_matches_the_wheel(build: Path) -> None:
    """The plugin's engine has the 27 virtual slots NIXL 1.5.1's plugins have, and exports
    NIXL's entry points only."""
    p = subprocess.run(["make", "-s", "-C", str(PLUGIN), "check-abi"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    exported = subprocess.run(["nm", "-D", "--defined-only", str(build / "libplugin_P2PHUB.so")],
                              capture_output=True, text=True, check=True).stdout.split()
    assert sorted(s for s in exported if s.startswith("nixl")) == ["nixl_plugin_fini", "nixl_plugin_init"]
    # built from the tree alone: NIXL's headers are vendored and CUDA is opened at run time
    needed = subprocess.run(["readelf", "-d", str(build / "libplugin_P2PHUB.so")],
                            capture_output=True, text=True, check=True).stdout
    assert "libcuda" not in needed and "libnixl" not in needed


@needs_nixl
@pytest.mark.parametrize("name,n", [("P2PHUB", 4096), ("GDS_MT", 256), ("POSIX", 256)])
def test_real_nixl_reads_and_writes_files_through_the_plugin(build: Path, tmp_path: Path,
                                                            name: str, n: int) -> None:
    text = _run([str(HERE / "nixl_plugin_script.py"), "--plugin-dir", str(build / "alias"),
                 "--name", name, "--dir", str(tmp_path), "--n", str(n)])
    out = _last_json(text)
    # found in NIXL_PLUGIN_DIR under each name, with p2phub's parameters and memory types
    assert {"P2PHUB", "GDS_MT", "GDS", "POSIX"} <= set(out["plugins"])
    assert out["plugin_params"] == {"depth": "128", "slot_bytes": "524288", "slots": "256",
                                    "split_bytes": "131072", "inflight_bytes": "8388608"}
    assert out["plugin_mems"] == ["DRAM_SEG", "VRAM_SEG", "FILE_SEG"]
    assert out["unknown_param"] == "accepted", text    # ignored, as NIXL's plugins do
    assert out["unknown_param_strict"] == "EXC:nixlBackendError", text
    assert out["backend_params"]["depth"] == "64"
    assert out["odd_split"] == "EXC:nixlBackendError", text
    assert (out["backend_params"]["split_bytes"], out["backend_params"]["inflight_bytes"]) == (
        "65536", "1048576")
    if name == "GDS_MT":  # GDS_MT's own parameter is accepted where the plugin stands in for it
        assert out["backend_params"]["thread_count"] == "8"
    # n scattered 4 KiB READs and prepped WRITEs, every block checked
    assert (out["read_state"], out["read_bad_blocks"]) == ("DONE", 0), text
    assert (out["write_state"], out["write_bad_blocks"]) == ("DONE", 0), text
    # past the end of the registration: NIXL refuses; inside it but past the end of the file:
    # the plugin fails the whole request before any byte moves
    assert out["eof_state"].startswith("EXC:") and out["eof_memory_untouched"]
    assert out["eof_inside_registration_state"] in ("ERR", "EXC:nixlBackendError"), text
    assert out["eof_inside_registration_untouched"]
    # path mode: opened (created) by the backend, closed at deregistration
    assert (out["path_write_state"], out["path_write_ok"]) == ("DONE", True), text
    assert (out["path_read_state"], out["path_read_ok"]) == ("DONE", True), text
    assert out["query"][0]["size"] == str(16 * 4096) and out["query"][1] is None   # (NIXL's: size, mode, mtime)
    assert out["fds_closed"]


@needs_nixl
@pytest.mark.skipif(not EXAMPLE.exists(), reason=f"NIXL's examples are not unpacked at {EXAMPLE}")
def test_nixl_storage_example_runs_unchanged_as_gds(build: Path, tmp_path: Path) -> None:
    """NIXL's examples/python/nixl_gds_example.py, unmodified, creates backend "GDS": here
    that name is the plugin (NIXL names a backend after the file it loads)."""
    target = tmp_path / "example.bin"
    text = _run([str(HERE / "nixl_example_runner.py"), str(EXAMPLE), str(target)],
                env={"NIXL_PLUGIN_DIR": str(build / "alias"), "NIXL_LOG_LEVEL": "INFO"})
    assert "Test Complete." in text, text[-3000:]
    assert target.read_bytes() == b"\xba" * (16 * 4096)


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stand-in libcuda.so.1 (fake_libcuda.c and the context calls of fake_libcuda_ctx.c):
    device 0's memory is host memory, copies run only when their event is waited for."""
    d = tmp_path_factory.mktemp("fakecuda")
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"),
                    str(HERE / "fake_libcuda.c"), str(HERE / "fake_libcuda_ctx.c")], check=True)
    return d


@needs_nixl
def test_vram_goes_through_the_engines_cuda_path(build: Path, fake_libcuda: Path,
                                                 tmp_path: Path) -> None:
    """The same cases with the memory registered as VRAM: the plugin opens the (stand-in)
    driver, a context, a stream and pinned staging memory, and the engine's CUDA copies."""
    text = _run([str(HERE / "nixl_plugin_script.py"), "--plugin-dir", str(build / "alias"),
                 "--name", "P2PHUB", "--dir", str(tmp_path), "--n", "1024", "--mem", "VRAM"],
                env={"LD_LIBRARY_PATH": str(fake_libcuda)})
    out = _last_json(text)
    assert (out["read_state"], out["read_bad_blocks"]) == ("DONE", 0), text
    assert (out["write_state"], out["write_bad_blocks"]) == ("DONE", 0), text
    assert out["eof_inside_registration_state"] in ("ERR", "EXC:nixlBackendError"), text
    assert out["eof_inside_registration_untouched"]
    assert (out["path_read_state"], out["path_read_ok"]) == ("DONE", True), text


VRAM_WITHOUT_CUDA = """
import mmap, os, sys
os.environ["NIXL_PLUGIN_DIR"] = sys.argv[1]
from nixl_cu12._api import nixl_agent, nixl_agent_config
a = nixl_agent("me", nixl_agent_config(backends=[]))
a.create_backend("P2PHUB")
try:
    a.register_memory([(0x7f0000000000, 4096, 0, "")], "VRAM")
    print("VRAM registered")
except Exception as exc:
    print("refused:", type(exc).__name__)
sys.stdout.flush()
os._exit(0)
"""


@needs_nixl
def test_vram_without_a_cuda_driver_is_refused_by_name(build: Path, tmp_path: Path) -> None:
    empty = tmp_path / "nolibcuda"
    empty.mkdir()
    text = _run(["-c", VRAM_WITHOUT_CUDA, str(build / "alias")],
                env={"LD_LIBRARY_PATH": str(empty)})
    try:
        import ctypes
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has a CUDA driver")
    except OSError:
        pass
    # NIXL reports a backend's failed registration as its own backend error
    assert "refused: nixlBackendError" in text, text
    assert "VRAM registration: dlopen libcuda.so.1" in text, text
