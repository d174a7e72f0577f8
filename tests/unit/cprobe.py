"""Compile a C probe against a UAPI header and compare a ctypes mirror with it, field by field.

A mirror module provides STRUCTS (ctypes.Structure classes, each naming its C twin in
``_c_name_``) and CONSTANTS (python attribute path -> C macro).
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest


def probe(header: Path, mirror: ModuleType, workdir: Path) -> dict[str, int]:
    """sizeof/offsetof of every mirrored struct and field, and every constant, as the compiler sees them."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: run tools/setup")
    lines = ["#include <stdio.h>", "#include <stddef.h>", f'#include "{header}"', "int main(void) {"]
    for s in mirror.STRUCTS:
        c = f"struct {s._c_name_}"
        lines.append(f'printf("{s._c_name_} %zu\\n", sizeof({c}));')
        for fname, *_ in s._fields_:
            lines.append(f'printf("{s._c_name_}.{fname} %zu\\n", offsetof({c}, {fname}));')
            lines.append(f'printf("{s._c_name_}.{fname}#size %zu\\n", sizeof((({c} *)0)->{fname}));')
    for macro in mirror.CONSTANTS.values():
        lines.append(f'printf("{macro} %llu\\n", (unsigned long long)({macro}));')
    lines += ["return 0;", "}"]
    (workdir / "probe.c").write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-Wall", "-Werror", "-o", str(workdir / "probe"), str(workdir / "probe.c")],
                   check=True)
    out = subprocess.run([str(workdir / "probe")], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def assert_layouts_match(mirror: ModuleType, seen: dict[str, int]) -> None:
    for s in mirror.STRUCTS:
        assert ctypes.sizeof(s) == seen[s._c_name_], f"sizeof(struct {s._c_name_})"
        for fname, *_ in s._fields_:
            field = getattr(s, fname)
            assert field.offset == seen[f"{s._c_name_}.{fname}"], f"offsetof({s._c_name_}, {fname})"
            assert field.size == seen[f"{s._c_name_}.{fname}#size"], f"sizeof({s._c_name_}.{fname})"


def assert_constants_match(mirror: ModuleType, seen: dict[str, int]) -> None:
    for py, macro in mirror.CONSTANTS.items():
        obj: object = mirror
        for part in py.split("."):
            obj = getattr(obj, part)
        assert int(obj) == seen[macro], f"{py} != {macro}"  # type: ignore[call-overload]


def assert_header_mirrored(header: Path, mirror: ModuleType, prefix: str, not_mirrored: set[str]) -> None:
    """Every struct and numeric macro of the header has a mirror, and no mirror lacks a twin."""
    text = header.read_text()
    in_header = set(re.findall(rf"^struct ({prefix}\w+) \{{", text, re.M))
    mirrored = {s._c_name_ for s in mirror.STRUCTS}
    assert in_header - mirrored == set(), "structs in the header without a Python mirror"
    assert mirrored - in_header == set(), "Python mirrors of structs the header lacks"
    macros = set(re.findall(rf"^#define\s+({prefix.upper()}\w+)\b(?!\()", text, re.M))
    assert macros - set(mirror.CONSTANTS.values()) - not_mirrored == set(), \
        "constants in the header without a Python mirror"
