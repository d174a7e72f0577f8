"""`p2phub nixl install-plugin`: p2phub's plugin linked into the pip nixl's own plugins
directory, so that one process creates UCX, P2PHUB and NIXL's own POSIX with no
NIXL_PLUGIN_DIR; NIXL's own plugins are never replaced; --remove leaves the directory as it
was. The real NIXL runs in a process of its own (it may crash at exit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_nixl_plugin import build_plugin, needs_nixl

PROBE = r"""
import json, os
from nixl_cu12._api import nixl_agent, nixl_agent_config
a = nixl_agent("both", nixl_agent_config(backends=[]))
got = {}
for b in ("UCX", "P2PHUB", "POSIX"):
    try:
        a.create_backend(b)
        got[b] = "ok"
    except Exception as exc:
        got[b] = type(exc).__name__
print(json.dumps(got), flush=True)
os._exit(0)
"""


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2phub", "nixl", "install-plugin", *args],
                          capture_output=True, text=True, timeout=60)


@needs_nixl
def test_install_plugin_beside_nixls_own(tmp_path) -> None:
    build_plugin()
    from p2phub.nixl.plugins import nixl_plugins
    own = nixl_plugins()
    before = sorted(os.listdir(own))
    env = {k: v for k, v in os.environ.items() if k != "NIXL_PLUGIN_DIR"}
    env["NIXL_LOG_LEVEL"] = "ERROR"
    try:
        p = _cli("--json")
        assert p.returncode == 0, p.stderr
        assert "UCX" in json.loads(p.stdout)["nixl_own"]
        r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                           timeout=120, env=env, cwd=tmp_path)
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        assert line and json.loads(line[-1]) == {"UCX": "ok", "P2PHUB": "ok", "POSIX": "ok"}, \
            r.stdout + r.stderr
        # NIXL's own plugins are never replaced
        p = _cli("--as", "POSIX")
        assert p.returncode == 4 and "NIXL's own plugin" in p.stderr, p.stderr
        assert not (own / "libplugin_POSIX.so").is_symlink()
    finally:
        p = _cli("--remove")
    assert p.returncode == 0, p.stderr
    assert sorted(os.listdir(own)) == before
