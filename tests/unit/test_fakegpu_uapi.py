"""p2phub_fakegpu (tests/labkit/fakegpu) mirrors its kmod/p2phub_fakegpu.h (the stand-in GPU's ioctl ABI)
byte for byte."""

from __future__ import annotations

from pathlib import Path

import p2phub_fakegpu as fg
import pytest

import cprobe

pytestmark = pytest.mark.unit

TOP = Path(__file__).resolve().parents[2]
HEADER = TOP / "tests" / "labkit" / "fakegpu" / "kmod" / "p2phub_fakegpu.h"
NOT_MIRRORED = {"_UAPI_P2PHUB_FAKEGPU_H", "P2PHUB_FAKEGPU_DEVICE_NAME"}



@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    return cprobe.probe(HEADER, fg, tmp_path_factory.mktemp("fakegpu_uapi"))


def test_struct_layouts_match(probe: dict[str, int]) -> None:
    cprobe.assert_layouts_match(fg, probe)


def test_constants_match(probe: dict[str, int]) -> None:
    cprobe.assert_constants_match(fg, probe)


def test_everything_in_the_header_is_mirrored() -> None:
    cprobe.assert_header_mirrored(HEADER, fg, "p2phub_fakegpu_", NOT_MIRRORED)
