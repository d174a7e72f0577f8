"""Product code (p2phub/, backends/) names no lab, no stand-in GPU and none of its ids.

The stand-in GPU reaches p2phub as a backend plugin (tests/labkit/fakegpu, entry point group
p2phub.backends), the way a vendor's GPU does; the lab's own tools live in the lab wing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TOP = Path(__file__).resolve().parents[2]
PRODUCT = ("p2phub", "backends")

FORBIDDEN = [
    r"fake_?gpu", r"ivshmem", r"\bstand[- ]?ins?\b", r"\b0x1110\b", r"1af4:1110", r"\(0x1af4, 0x1110\)",
    r"\blabenv\b", r"\bp2phub_lab\b", r"\blabkit\b", r"tests/lab\b", r"tools/lab\b", r"\bP2PHUB_LAB_",
    r"the lab's", r"\brxe-a\b",
]
PATTERN = re.compile("|".join(FORBIDDEN), re.IGNORECASE)

def _product_files() -> list[Path]:
    out = []
    for root in PRODUCT:
        for p in sorted((TOP / root).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".c", ".h", ".toml", ".md", ".txt", ".cfg") \
                    and "__pycache__" not in p.parts and ".egg-info" not in str(p):
                out.append(p)
    return out


def test_the_product_tree_is_scanned() -> None:
    names = {p.relative_to(TOP).as_posix() for p in _product_files()}
    assert {"p2phub/hub.py", "p2phub/backend.py", "p2phub/doctor/discovery.py",
            "backends/cuda/p2phub_cuda/backend.py"} <= names


def test_no_lab_or_stand_in_knowledge_in_product_code() -> None:
    hits = []
    for p in _product_files():
        rel = p.relative_to(TOP).as_posix()
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            m = PATTERN.search(line)
            if m:
                hits.append(f"{rel}:{n}: {m.group(0)!r}: {line.strip()}")
    assert not hits, "lab / stand-in GPU knowledge in product code:\n" + "\n".join(hits)


@pytest.mark.parametrize("text", ["p2phub_fakegpu", "ivshmem-plain", "the stand-in GPU", "standin",
                                  "IVSHMEM = (0x1AF4, 0x1110)", "from p2phub import labenv",
                                  "P2PHUB_LAB_ENV"])
def test_the_pattern_catches(text: str) -> None:
    assert PATTERN.search(text)


@pytest.mark.parametrize("text", ["outstanding", "commands outstanding on a registration",
                                  "0x1AF4: \"Red Hat (virtio)\"", "label", "collaborate"])
def test_the_pattern_spares(text: str) -> None:
    assert not PATTERN.search(text)
