"""The Python mirror of the UAPI (p2phub/uapi.py) matches kmod/uapi/p2phub.h byte for byte.

A C probe is compiled against the header and prints every struct's size and every
field's offset and size, and the value of every constant; the mirror must agree.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from p2phub import uapi

TOP = Path(__file__).resolve().parents[2]
HEADER = TOP / "kmod" / "uapi" / "p2phub.h"

# Macros that are not numbers or are part of the header's own plumbing.
NOT_MIRRORED = {"_UAPI_P2PHUB_H", "P2PHUB_DEVICE_NAME"}


def _py_value(name: str) -> int:
    obj: object = uapi
    for part in name.split("."):
        obj = getattr(obj, part)
    return int(obj)  # type: ignore[call-overload]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: run tools/setup")
    lines = ['#include <stdio.h>', '#include <stddef.h>', f'#include "{HEADER}"', "int main(void) {"]
    for s in uapi.STRUCTS:
        c = f"struct {s._c_name_}"
        lines.append(f'printf("{s._c_name_} %zu\\n", sizeof({c}));')
        for fname, *_ in s._fields_:
            lines.append(f'printf("{s._c_name_}.{fname} %zu\\n", offsetof({c}, {fname}));')
            lines.append(f'printf("{s._c_name_}.{fname}#size %zu\\n", sizeof((({c} *)0)->{fname}));')
    for py, macro in uapi.CONSTANTS.items():
        lines.append(f'printf("{macro} %llu\\n", (unsigned long long)({macro}));')
    lines += ["return 0;", "}"]
    d = tmp_path_factory.mktemp("uapi")
    (d / "probe.c").write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-Wall", "-Werror", "-o", str(d / "probe"), str(d / "probe.c")], check=True)
    out = subprocess.run([str(d / "probe")], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_struct_layouts_match(probe: dict[str, int]) -> None:
    for s in uapi.STRUCTS:
        assert ctypes.sizeof(s) == probe[s._c_name_], f"sizeof(struct {s._c_name_})"
        for fname, *_ in s._fields_:
            field = getattr(s, fname)
            assert field.offset == probe[f"{s._c_name_}.{fname}"], f"offsetof({s._c_name_}, {fname})"
            assert field.size == probe[f"{s._c_name_}.{fname}#size"], f"sizeof({s._c_name_}.{fname})"


def test_constants_match(probe: dict[str, int]) -> None:
    for py, macro in uapi.CONSTANTS.items():
        assert _py_value(py) == probe[macro], f"{py} != {macro}"


def test_every_header_struct_is_mirrored() -> None:
    in_header = set(re.findall(r"^struct (p2phub_\w+) \{", HEADER.read_text(), re.M))
    mirrored = {s._c_name_ for s in uapi.STRUCTS}
    assert in_header - mirrored == set(), "structs in the header without a Python mirror"
    assert mirrored - in_header == set(), "Python mirrors of structs the header lacks"


def test_every_header_constant_is_mirrored() -> None:
    macros = set(re.findall(r"^#define\s+(P2PHUB_\w+)\b(?!\()", HEADER.read_text(), re.M))
    missing = macros - set(uapi.CONSTANTS.values()) - NOT_MIRRORED
    assert missing == set(), "constants in the header without a Python mirror"


def test_structs_carry_argsz_and_flags() -> None:
    for s in uapi.STRUCTS:
        names = [f[0] for f in s._fields_]
        assert names[:2] == ["argsz", "flags"], f"struct {s._c_name_} must start with argsz, flags"
        assert ctypes.sizeof(s) % 8 == 0, f"struct {s._c_name_} is not padded to 8 bytes"
