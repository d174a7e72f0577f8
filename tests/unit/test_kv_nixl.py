"""One NIXL-API script (nixl_script.py) passes against real nixl (UCX over TCP) and against
p2phub's adapter, two processes on loopback each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _impls() -> list:
    out = [pytest.param("p2phub")]
    try:
        import nixl_cu12._api  # noqa: F401
        out.append(pytest.param("nixl"))
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        out.append(pytest.param("nixl", marks=pytest.mark.skip(
            reason=f"nixl not installed (pip install --no-deps nixl-cu12 numpy): {exc}")))
    return out


@pytest.mark.parametrize("impl", _impls())
def test_nixl_script_two_processes(impl: str, tmp_path: Path) -> None:
    pytest.importorskip("numpy")
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(HERE / "nixl_script.py"), "--impl", impl, "--dir", str(tmp_path)]
    tgt = subprocess.Popen(cmd + ["--role", "target"], stdout=subprocess.PIPE, text=True, env=env)
    ini = subprocess.Popen(cmd + ["--role", "initiator"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        iout, _ = ini.communicate(timeout=240)
        tout, _ = tgt.communicate(timeout=240)
    finally:
        for p in (tgt, ini):
            if p.poll() is None:
                p.kill()
    assert ini.returncode == 0 and tgt.returncode == 0, (iout, tout)
    i, t = json.loads(iout.strip().splitlines()[-1]), json.loads(tout.strip().splitlines()[-1])
    assert i["states"] == ["DONE", "DONE", "DONE", "DONE"]
    assert i["read_ok"] is True
    assert t["notifs"] == ["final"]
    assert t["bytes_ok"] is True
