"""The lab's monitor relay: a guest request reaches QEMU's QMP socket as an HMP command line, its
answer comes back, and only the allowed commands are relayed (a stand-in QMP server plays QEMU)."""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labkit"))
from p2phub_lab import monitor  # noqa: E402

pytestmark = pytest.mark.unit


class FakeQemu(threading.Thread):
    """Greets, accepts qmp_capabilities, sends an event, and answers human-monitor-command."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.srv.bind(str(path))
        self.srv.listen(1)
        self.lines: list[str] = []

    def run(self) -> None:
        conn, _ = self.srv.accept()
        f = conn.makefile("rwb")

        def send(msg: dict) -> None:
            f.write(json.dumps(msg).encode() + b"\n")
            f.flush()

        send({"QMP": {"version": {}, "capabilities": []}})
        for raw in f:
            cmd = json.loads(raw)
            if cmd["execute"] == "qmp_capabilities":
                send({"return": {}})
                continue
            line = cmd["arguments"]["command-line"]
            self.lines.append(line)
            send({"event": "SOMETHING", "data": {}})
            send({"return": "Error: invalid error status value\r\n" if "BOGUS" in line else ""})


@pytest.fixture
def relay(tmp_path: Path):
    qemu = FakeQemu(tmp_path / monitor.SOCKET)
    qemu.start()
    r = monitor.Relay(tmp_path)
    r.start()
    yield {"monitor_dir": str(tmp_path / monitor.REQUESTS)}, qemu
    r.stop()
    r.join(5)


def test_an_injection_is_relayed_and_answered(relay) -> None:
    lab, qemu = relay
    assert monitor.available(lab)
    assert monitor.hmp(lab, "pcie_aer_inject_error sw-up COMP_TIME", timeout=10) == ""
    assert qemu.lines == ["pcie_aer_inject_error sw-up COMP_TIME"]


def test_qemus_error_is_raised(relay) -> None:
    lab, _ = relay
    with pytest.raises(monitor.MonitorError, match="invalid error status"):
        monitor.hmp(lab, "pcie_aer_inject_error sw-up BOGUS", timeout=10)


def test_other_commands_are_not_relayed(relay) -> None:
    lab, qemu = relay
    with pytest.raises(monitor.MonitorError, match="not relayed"):
        monitor.hmp(lab, "quit", timeout=10)
    assert qemu.lines == []
