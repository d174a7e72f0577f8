"""tools/lab itself: exit statuses travel back from the VM, kernel-log faults fail a run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

TOP = Path(__file__).resolve().parents[2]
LAB = [str(TOP / "tools" / "lab"), "run", "--kernel", "6.12"]


def _lab(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAB, "--", *cmd], capture_output=True, text=True, timeout=900)


# Exit 0 travels back in every lab tier; one nonzero status here shows the rest do.
def test_exit_status_travels_back() -> None:
    res = _lab("bash", "-c", "echo from-the-guest; exit 7")
    assert res.returncode == 7, res.stderr
    assert "from-the-guest" in res.stdout


def test_a_planted_warn_fails_the_run() -> None:
    res = _lab("bash", "-c", "insmod $P2PHUB_LAB_MODULES/p2phub_selftest.ko warn=1")
    assert res.returncode == 126, res.stderr
    assert "WARNING:" in res.stderr
    assert "p2phub_selftest" in res.stderr


def test_a_module_left_in_use_is_a_leak() -> None:
    # Holding /dev/p2phub open in a process that outlives the command keeps
    # p2phub.ko in use when the runner unloads it.
    res = _lab("bash", "-c", "setsid sleep 600 </dev/p2phub >/dev/null 2>&1 & sleep 1")
    assert res.returncode == 126, res.stderr
    assert "leak" in res.stderr


# --------------------------------------------------------------------------- the debug lab kernel

DEBUG = [str(TOP / "tools" / "lab"), "run", "--kernel", "debug"]


def _debug_kernel_built() -> bool:
    return subprocess.run([str(TOP / "tools" / "lab"), "kernels"], capture_output=True,
                          text=True).stdout.find("debug\t") >= 0


@pytest.mark.skipif(not _debug_kernel_built(), reason="no debug lab kernel (tools/setup --debug-kernel)")
def test_a_planted_lockdep_report_fails_the_run() -> None:
    # p2phub_labcheck takes two mutexes in both orders: only a lockdep kernel sees it, and the
    # scan must name it as lockdep.
    res = subprocess.run([*DEBUG, "--", "bash", "-c",
                          "insmod $P2PHUB_LAB_MODULES/p2phub_labcheck.ko lockdep=1 sleep_atomic=1"],
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 126, res.stderr
    assert "lockdep: " in res.stderr and "circular locking dependency" in res.stderr
    assert "sleeping function called from invalid context" in res.stderr
