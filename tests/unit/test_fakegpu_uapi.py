"""tests/lab/fakegpu.py mirrors tests/kmod/p2phub_fakegpu.h (the stand-in GPU's ioctl ABI) byte for byte."""

from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

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
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.fail("no C compiler: run tools/setup")
    lines = ["#include <stdio.h>", "#include <stddef.h>", f'#include "{HEADER}"', "int main(void) {"]
    for s in fg.STRUCTS:
        c = f"struct {s._c_name_}"
        lines.append(f'printf("{s._c_name_} %zu\\n", sizeof({c}));')
        for fname, *_ in s._fields_:
            lines.append(f'printf("{s._c_name_}.{fname} %zu\\n", offsetof({c}, {fname}));')
            lines.append(f'printf("{s._c_name_}.{fname}#size %zu\\n", sizeof((({c} *)0)->{fname}));')
    for macro in fg.CONSTANTS.values():
        lines.append(f'printf("{macro} %llu\\n", (unsigned long long)({macro}));')
    lines += ["return 0;", "}"]
    d = tmp_path_factory.mktemp("fakegpu_uapi")
    (d / "probe.c").write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-Wall", "-Werror", "-o", str(d / "probe"), str(d / "probe.c")], check=True)
    out = subprocess.run([str(d / "probe")], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_struct_layouts_match(probe: dict[str, int]) -> None:
    for s in fg.STRUCTS:
        assert ctypes.sizeof(s) == probe[s._c_name_], f"sizeof(struct {s._c_name_})"
        for fname, *_ in s._fields_:
            field = getattr(s, fname)
            assert field.offset == probe[f"{s._c_name_}.{fname}"], f"offsetof({s._c_name_}, {fname})"
            assert field.size == probe[f"{s._c_name_}.{fname}#size"], f"sizeof({s._c_name_}.{fname})"


def test_constants_match(probe: dict[str, int]) -> None:
    for py, macro in fg.CONSTANTS.items():
        assert int(getattr(fg, py)) == probe[macro], f"{py} != {macro}"


def test_everything_in_the_header_is_mirrored() -> None:
    text = HEADER.read_text()
    structs = set(re.findall(r"^struct (p2phub_fakegpu_\w+) \{", text, re.M))
    assert structs == {s._c_name_ for s in fg.STRUCTS}
    macros = set(re.findall(r"^#define\s+(P2PHUB_FAKEGPU_\w+)\b(?!\()", text, re.M))
    assert macros - set(fg.CONSTANTS.values()) - NOT_MIRRORED == set()
