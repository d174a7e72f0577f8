"""tools/lab's watch over a VM's boot: a VM that has not started the lab script within
BOOT_HANG_S is killed, with everything in its session (QEMU is vng's child), and reported as
a hang, so the runner boots again; one that started it runs to its end."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labkit"))
from p2phub_lab import runner  # noqa: E402


def test_a_vm_that_never_starts_the_lab_is_killed_with_its_children(tmp_path,
                                                                     monkeypatch) -> None:
    monkeypatch.setattr(runner, "BOOT_HANG_S", 1)
    pidfile = tmp_path / "child.pid"
    # a stand-in vng whose child (the stand-in QEMU) would outlive it
    cmd = ["bash", "-c", f"sleep 60 & echo $! > {pidfile}; wait"]
    t0 = time.monotonic()
    with pytest.raises(runner._BootHang):
        runner._run_relayed(cmd, {"PATH": "/usr/bin:/bin"}, 120, tmp_path / "guest.log")
    assert time.monotonic() - t0 < 30
    child = int(pidfile.read_text())
    assert _dies(child), "the VM's child outlived the kill"


def _dies(pid: int, within: float = 10.0) -> bool:
    """Whether pid is gone or dead within `within` s. The killed child is reparented to an
    init that may never reap it (a container's PID 1), so a zombie counts as dead."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            return True
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_a_vm_that_started_the_lab_runs_to_its_end(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(runner, "BOOT_HANG_S", 1)
    started = tmp_path / "guest.log"
    cmd = ["bash", "-c", f": > {started}; sleep 3; exit 7"]
    res = runner._run_relayed(cmd, {"PATH": "/usr/bin:/bin"}, 120, started)
    assert res.returncode == 7
