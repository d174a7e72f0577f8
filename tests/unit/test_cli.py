"""The `p2phub` command: every subcommand has --help, usage errors exit 4."""

from __future__ import annotations

import subprocess
import sys

import pytest

from p2phub import cli


def _p2phub(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "p2phub", *args], capture_output=True, text=True)


def test_top_level_help_lists_every_subcommand() -> None:
    res = _p2phub("--help")
    assert res.returncode == 0
    for name in cli.SUBCOMMANDS:
        assert name in res.stdout


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_subcommand_help(name: str) -> None:
    res = _p2phub(name, "--help")
    assert res.returncode == 0, res.stderr
    assert "usage: p2phub " + name in res.stdout


def test_unknown_subcommand_is_a_usage_error() -> None:
    assert _p2phub("no-such-command").returncode == 4


def test_no_subcommand_is_a_usage_error() -> None:
    assert _p2phub().returncode == 4


def test_info_without_the_module_says_so(tmp_path) -> None:
    res = _p2phub("info", "--device", str(tmp_path / "p2phub"))
    assert res.returncode == 5  # Exit.NOT_LOADED
    assert "not loaded" in res.stdout
    res = _p2phub("info", "--json", "--device", str(tmp_path / "p2phub"))
    assert res.returncode == 5  # Exit.NOT_LOADED
    assert '"loaded": false' in res.stdout


def test_one_exit_code_table_for_every_command_and_its_documentation() -> None:
    import re
    from pathlib import Path

    from p2phub.exitcodes import MEANING, USED_BY, Exit

    assert len({int(c) for c in Exit}) == len(Exit) and set(MEANING) == set(Exit)
    assert set(USED_BY) == {"p2phub", *cli.SUBCOMMANDS}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| `(\w+)` \|", doc, flags=re.M))
    assert rows == {str(int(c)): c.name for c in Exit}, "docs/cli.md's exit-code table is out of date"


def test_argparse_usage_errors_are_exit_4_for_every_subcommand() -> None:
    for name in cli.SUBCOMMANDS:
        assert _p2phub(name, "--no-such-option").returncode == 4, name
