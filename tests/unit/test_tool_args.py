"""The scripts under tools/ refuse a bad argument as `p2phub` does (ToolParser): one line on
stderr, exit 4, before any work starts (no file made, no benchmark run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOP = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv", [
    ["request-split", "--count", "0"],
    ["nixl-file-bench", "--runs", "0"],
    ["nixl-plugin-bench", "--seed", "-1"],
])
def test_tool_bad_argument_is_one_line_and_exit_4(argv: list[str], tmp_path: Path) -> None:
    # a --file in tmp_path that must stay absent: the scripts would make it if they ran
    target = tmp_path / "never.bin"
    r = subprocess.run([sys.executable, str(TOP / "tools" / argv[0]), *argv[1:], "--file", str(target)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 4, r.stdout + r.stderr
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{argv[0]}: argument "), r.stderr
    assert not target.exists()
