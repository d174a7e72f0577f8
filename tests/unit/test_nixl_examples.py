"""NIXL's own storage examples (nixl_gds_example.py, remote_storage_example's utilities),
unchanged, against p2phub.nixl through tools/nixl-examples, on DRAM. They are NIXL's files, not
p2phub's: the test runs where they were unpacked (NIXL_SRC, or .nixl-src in the checkout; see
tools/nixl-examples --help) and is skipped elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


TOP = Path(__file__).resolve().parents[2]
SRC = Path(os.environ.get("NIXL_SRC", TOP / ".nixl-src"))


@pytest.mark.skipif(not (SRC / "examples/python/nixl_gds_example.py").exists(),
                    reason=f"NIXL's examples are not unpacked at {SRC} (tools/nixl-examples --help)")
def test_nixl_storage_examples_run_unchanged(tmp_path: Path) -> None:
    pytest.importorskip("torch")        # remote_storage_example's utilities import it
    r = subprocess.run([sys.executable, str(TOP / "tools/nixl-examples"), "--nixl-src", str(SRC),
                        "--mem", "DRAM", "--dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("ok  ") == 2, r.stdout
