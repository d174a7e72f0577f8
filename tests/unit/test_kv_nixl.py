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


def run_roles(script: str, impl: str, tmp_path: Path, roles: tuple[str, str],
              extra: tuple[str, ...] = (), ucx_tls: str = "tcp",
              timeout: float = 240, role_env: dict[str, dict[str, str]] | None = None
              ) -> list[tuple[int, str]]:
    """Run `script` once per role, both at once (UCX kept to TCP on lo for nixl), with
    `role_env[role]` added to that role's environment; returns (exit status, stdout) per role."""
    pytest.importorskip("numpy")
    env = dict(os.environ, UCX_TLS=ucx_tls, UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, str(HERE / script), "--impl", impl, "--dir", str(tmp_path), *extra]
    procs = [subprocess.Popen(cmd + ["--role", r], stdout=subprocess.PIPE, text=True,
                              env={**env, **(role_env or {}).get(r, {})})
             for r in roles]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in reversed(procs)][::-1]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, o) for p, o in zip(procs, outs)]


@pytest.mark.parametrize("impl", _impls())
def test_nixl_script_two_processes(impl: str, tmp_path: Path) -> None:
    (trc, tout), (irc, iout) = run_roles("nixl_script.py", impl, tmp_path, ("target", "initiator"))
    assert irc == 0 and trc == 0, (iout, tout)
    i, t = json.loads(iout.strip().splitlines()[-1]), json.loads(tout.strip().splitlines()[-1])
    assert i["states"] == ["DONE", "DONE", "DONE", "DONE"]
    assert i["read_ok"] is True
    assert t["notifs"] == ["final"]
    assert t["bytes_ok"] is True
