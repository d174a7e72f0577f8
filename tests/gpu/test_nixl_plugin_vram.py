"""Real NIXL (the installed nixl_cu12 or nixl_cu13 wheel, unchanged) with libplugin_P2PHUB.so:
4,096 scattered 4 KiB READs from an O_DIRECT file into GPU memory and prepped WRITEs back,
a past-EOF READ that leaves the GPU memory untouched, path-mode FILE registrations; every byte
checked on disk and (copied back) from the GPU. Also NIXL's storage example unchanged as GDS.
The cases are those of tests/unit/test_nixl_plugin.py, on a torch CUDA tensor of cuda:0."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

UNIT = Path(__file__).resolve().parent.parent / "unit"
sys.path.insert(0, str(UNIT))
import test_nixl_plugin as unit  # noqa: E402


def _wheel() -> str | None:
    for name in ("nixl_cu12", "nixl_cu13"):
        try:
            __import__(f"{name}._api")
            return name
        except Exception:  # noqa: BLE001
            continue
    return None


@pytest.fixture(scope="module")
def build() -> Path:
    """The plugin as built in the tree (carried there where the machine has no g++), else
    built now."""
    built = unit.PLUGIN / "build"
    if (built / "alias" / "libplugin_P2PHUB.so").exists():
        return built
    return unit.build_plugin()


def test_real_nixl_moves_vram_and_files_through_the_plugin(torch, build: Path, tmp_path: Path) -> None:
    if _wheel() is None:
        pytest.skip("no NIXL wheel (nixl_cu12 / nixl_cu13) installed")
    text = unit._run([str(UNIT / "nixl_plugin_script.py"), "--plugin-dir", str(build / "alias"),
                      "--name", "P2PHUB", "--dir", str(tmp_path), "--n", "4096",
                      "--mem", "VRAM", "--cuda"])
    out = unit._last_json(text)
    assert (out["read_state"], out["read_bad_blocks"]) == ("DONE", 0), text
    assert (out["write_state"], out["write_bad_blocks"]) == ("DONE", 0), text
    assert out["eof_inside_registration_state"] in ("ERR", "EXC:nixlBackendError"), text
    assert out["eof_inside_registration_untouched"]
    assert (out["path_write_state"], out["path_write_ok"]) == ("DONE", True), text
    assert (out["path_read_state"], out["path_read_ok"]) == ("DONE", True), text


def test_nixl_storage_example_unchanged_as_gds_here(build: Path, tmp_path: Path) -> None:
    if _wheel() is None:
        pytest.skip("no NIXL wheel (nixl_cu12 / nixl_cu13) installed")
    if not unit.EXAMPLE.exists():
        pytest.skip(f"NIXL's examples are not unpacked at {unit.EXAMPLE}")
    unit.test_nixl_storage_example_runs_unchanged_as_gds(build, tmp_path)
