"""QEMU's monitor, reachable from inside the lab VM for the few commands tests may use.

The runner gives QEMU a QMP socket in the run directory and relays requests that tests in the
guest drop in `<run>/monitor/` (the run directory is shared with the guest):

    guest:  monitor.hmp("pcie_aer_inject_error sw-up COMP_TIME")   -> QEMU's answer (text)
    host:   Relay(run).start()                                          (tools/lab does this)

Only the commands in ALLOWED are relayed: a test may inject a PCIe error, nothing that could
stop or reconfigure the VM under the runner.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

ALLOWED = ("pcie_aer_inject_error ",)
SOCKET = "qmp.sock"
REQUESTS = "monitor"


def qemu_opts(run: Path) -> list[str]:
    """QEMU options for the QMP socket the relay talks to."""
    return ["-qmp", f"unix:{run / SOCKET},server=on,wait=off"]


# --------------------------------------------------------------------------- host side

class Relay(threading.Thread):
    """Serves `<run>/monitor/*.req` (one HMP command line each) with `*.out` (JSON: ok, output)."""

    def __init__(self, run: Path) -> None:
        super().__init__(daemon=True, name="qemu-monitor-relay")
        self.dir = run / REQUESTS
        self.dir.mkdir(exist_ok=True)
        self.dir.chmod(0o777)          # tests may run as another user in the guest
        self.sock_path = run / SOCKET
        self._stopping = threading.Event()
        self._qmp: socket.socket | None = None
        self._rx = b""

    def stop(self) -> None:
        self._stopping.set()

    def run(self) -> None:
        while not self._stopping.wait(0.2):
            for req in sorted(self.dir.glob("*.req")):
                try:
                    line = req.read_text().strip()
                except OSError:
                    continue
                answer = self._serve(line)
                tmp = req.with_suffix(".tmp")
                tmp.write_text(json.dumps(answer))
                tmp.chmod(0o666)
                tmp.rename(req.with_suffix(".out"))
                req.unlink(missing_ok=True)
        if self._qmp is not None:
            self._qmp.close()

    def _serve(self, line: str) -> dict[str, object]:
        if not line.startswith(ALLOWED):
            return {"ok": False, "output": f"not relayed (allowed: {', '.join(a.strip() for a in ALLOWED)})"}
        try:
            reply = self._execute({"execute": "human-monitor-command",
                                   "arguments": {"command-line": line}})
        except OSError as exc:
            self._qmp = None
            return {"ok": False, "output": f"QMP: {exc}"}
        if "error" in reply:
            return {"ok": False, "output": reply["error"].get("desc", str(reply["error"]))}
        return {"ok": True, "output": reply.get("return", "")}

    def _execute(self, cmd: dict[str, object]) -> dict:
        if self._qmp is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(str(self.sock_path))
            self._qmp, self._rx = s, b""
            self._message()                                   # the greeting
            self._qmp.sendall(json.dumps({"execute": "qmp_capabilities"}).encode() + b"\n")
            self._message()
        self._qmp.sendall(json.dumps(cmd).encode() + b"\n")
        return self._message()

    def _message(self) -> dict:
        """The next reply (events, which QEMU sends unasked, are skipped)."""
        assert self._qmp is not None
        while True:
            while b"\n" not in self._rx:
                chunk = self._qmp.recv(65536)
                if not chunk:
                    raise ConnectionError("QEMU closed the QMP socket")
                self._rx += chunk
            raw, self._rx = self._rx.split(b"\n", 1)
            msg = json.loads(raw)
            if "event" not in msg:
                return msg


# --------------------------------------------------------------------------- guest side

class MonitorError(RuntimeError):
    pass


def available(lab: dict[str, str]) -> bool:
    return bool(lab.get("monitor_dir")) and Path(lab["monitor_dir"]).is_dir()


def hmp(lab: dict[str, str], line: str, timeout: float = 60.0) -> str:
    """Run one HMP command line in the lab's QEMU; its output. MonitorError when it failed."""
    d = Path(lab["monitor_dir"])
    name = f"{os.getpid()}-{time.monotonic_ns()}"
    tmp, req, out = d / f"{name}.tmp-req", d / f"{name}.req", d / f"{name}.out"
    tmp.write_text(line + "\n")
    tmp.rename(req)
    deadline = time.monotonic() + timeout
    while not out.exists():
        if time.monotonic() > deadline:
            req.unlink(missing_ok=True)
            raise MonitorError(f"no answer from the lab's monitor relay in {timeout:.0f} s: {line}")
        time.sleep(0.1)
    answer = json.loads(out.read_text())
    out.unlink(missing_ok=True)
    text = str(answer.get("output", ""))
    if not answer.get("ok") or "error" in text.lower():
        raise MonitorError(f"{line}: {text.strip() or 'failed'}")
    return text
