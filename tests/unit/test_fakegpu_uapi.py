"""tests/lab/fakegpu.py mirrors tests/kmod/p2phub_fakegpu.h (the stand-in GPU's ioctl ABI) byte for byte."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

import cprobe

pytestmark = pytest.mark.unit

TOP = Path(__file__).resolve().parents[2]
HEADER = TOP / "tests" / "kmod" / "p2phub_fakegpu.h"
NOT_MIRRORED = {"_UAPI_P2PHUB_FAKEGPU_H", "P2PHUB_FAKEGPU_DEVICE_NAME"}


def _load_mirror() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fakegpu_mirror", TOP / "tests" / "lab" / "fakegpu.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


fg = _load_mirror()


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    return cprobe.probe(HEADER, fg, tmp_path_factory.mktemp("fakegpu_uapi"))


def test_struct_layouts_match(probe: dict[str, int]) -> None:
    cprobe.assert_layouts_match(fg, probe)


def test_constants_match(probe: dict[str, int]) -> None:
    cprobe.assert_constants_match(fg, probe)


def test_everything_in_the_header_is_mirrored() -> None:
    cprobe.assert_header_mirrored(HEADER, fg, "p2phub_fakegpu_", NOT_MIRRORED)
