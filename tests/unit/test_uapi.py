"""The Python mirror of the UAPI (p2phub/uapi.py) matches kmod/uapi/p2phub.h byte for byte.

A C probe is compiled against the header and prints every struct's size and every
field's offset and size, and the value of every constant; the mirror must agree.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

import cprobe
from p2phub import uapi

TOP = Path(__file__).resolve().parents[2]
HEADER = TOP / "kmod" / "uapi" / "p2phub.h"

# Macros that are not numbers or are part of the header's own plumbing.
NOT_MIRRORED = {"_UAPI_P2PHUB_H", "P2PHUB_DEVICE_NAME"}


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    return cprobe.probe(HEADER, uapi, tmp_path_factory.mktemp("uapi"))


def test_struct_layouts_match(probe: dict[str, int]) -> None:
    cprobe.assert_layouts_match(uapi, probe)


def test_constants_match(probe: dict[str, int]) -> None:
    cprobe.assert_constants_match(uapi, probe)


def test_every_header_struct_and_constant_is_mirrored() -> None:
    cprobe.assert_header_mirrored(HEADER, uapi, "p2phub_", NOT_MIRRORED)


def test_structs_carry_argsz_and_flags() -> None:
    for s in uapi.STRUCTS:
        names = [f[0] for f in s._fields_]
        assert names[:2] == ["argsz", "flags"], f"struct {s._c_name_} must start with argsz, flags"
        assert ctypes.sizeof(s) % 8 == 0, f"struct {s._c_name_} is not padded to 8 bytes"
