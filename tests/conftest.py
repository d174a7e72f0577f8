"""Test tiers: unit (host), lab (inside tools/lab's VM), gpu (a CUDA machine), labrunner (host, boots VMs)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TOP = Path(__file__).resolve().parent.parent
# The checkout and its vendor backends, importable without an install (GPU machine).
for _p in (TOP, TOP / "backends" / "cuda", TOP / "backends" / "rocm"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

TIER_DIRS = {"unit": "unit", "lab": "lab", "gpu": "gpu", "labrunner": "labrunner"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A test's tier follows from its directory, so a test can never run in the wrong place
    # just because someone forgot the marker.
    for item in items:
        parts = Path(str(item.fspath)).relative_to(TOP / "tests").parts
        if parts and parts[0] in TIER_DIRS:
            item.add_marker(getattr(pytest.mark, TIER_DIRS[parts[0]]))


def in_lab() -> bool:
    return bool(os.environ.get("P2PHUB_LAB_ENV"))
