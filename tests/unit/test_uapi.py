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
from p2phub.errors import UsageError

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
    assert set(uapi.STRUCTS) - set(uapi.IOCTL_STRUCTS) == {uapi.NvmeStatus}
    for s in uapi.IOCTL_STRUCTS:
        names = [f[0] for f in s._fields_]
        assert names[:2] == ["argsz", "flags"], f"struct {s._c_name_} must start with argsz, flags"
        assert ctypes.sizeof(s) % 8 == 0, f"struct {s._c_name_} is not padded to 8 bytes"


@pytest.mark.parametrize("field,value", [
    ("devfn", 0x7F8), ("devfn", -1), ("bus", 256), ("domain", 1 << 32), ("count", 1 << 32),
])
def test_out_of_range_fields_are_refused_not_truncated(field: str, value: int) -> None:
    kw = {"domain": 0, "bus": 0, "devfn": 0, "handle": 1, "count": 1}
    kw[field] = value
    struct = uapi.DmaPages
    with pytest.raises(UsageError, match=f"p2phub_dma_pages.{field}: {value} is outside"):
        struct.new(**kw)


def test_checked_fields_in_every_struct() -> None:
    with pytest.raises(UsageError, match="length: 18446744073709555712 is outside"):
        uapi.Register.new(length=2**64 + 4096)
    with pytest.raises(UsageError, match="fd: 2147483648 is outside"):
        uapi.Register.new(fd=1 << 31)
    with pytest.raises(UsageError, match="reserved\\[1\\]"):
        uapi.Export.new(handle=1, reserved=(0, -1))
    with pytest.raises(UsageError, match="no field 'hande'"):
        uapi.Export.new(hande=1)
    a = uapi.NvmeMapReg.new(handle=(1 << 64) - 1, count=uapi.DMA_PAGES_MAX)
    assert a.handle == (1 << 64) - 1 and a.argsz == ctypes.sizeof(uapi.NvmeMapReg)
    a.out_slot = 3  # later assignments are checked too
    with pytest.raises(UsageError):
        a.page_size = -4096
