"""A FILE registration keeps its own reference to its file for as long as a transfer may use
it, on both NIXL routes (p2phub.nixl, and the real NIXL loading libplugin_P2PHUB.so): a WRITE
in flight on file A, A deregistered and B registered in its place (same path-mode id, or the
same fd number handed out again) lands in A and leaves B untouched; a READ of a registration
whose caller closed its fd reads that file, not the one that took the number. The bytes are
read back from disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_nixl_plugin import _last_json, build_plugin, needs_nixl

HERE = Path(__file__).resolve().parent
TOP = HERE.parent.parent


def _run(impl: str, d: Path, plugin_dir: Path | None = None) -> dict:
    d.mkdir()
    args = [sys.executable, str(HERE / "nixl_file_lifetime_script.py"), "--impl", impl,
            "--dir", str(d)]
    if plugin_dir is not None:
        args += ["--plugin-dir", str(plugin_dir)]
    env = dict(os.environ, NIXL_LOG_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(TOP), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    return _last_json(p.stdout + "\n" + p.stderr)


def _check(out: dict) -> None:
    text = json.dumps(out, indent=1)
    for case in ("path", "fd"):
        assert out[f"{case}.state"] == "DONE", text
        assert out[f"{case}.a_ok"], f"{case}: the WRITE did not land whole in A\n{text}"
        assert out[f"{case}.b_untouched"], f"{case}: bytes meant for A reached B\n{text}"
    assert out["closed.state"] == "DONE", text
    assert out["closed.read_a"] and not out["closed.read_b"], text


def test_adapter_file_registrations_outlive_their_callers_fd(tmp_path: Path) -> None:
    pytest.importorskip("numpy")
    out = _run("adapter", tmp_path / "adapter")
    assert out["fd.same_number"], "the kernel did not hand A's fd number to B: case not shown"
    _check(out)


@needs_nixl
def test_plugin_file_registrations_outlive_their_callers_fd(tmp_path: Path) -> None:
    out = _run("plugin", tmp_path / "plugin", build_plugin() / "alias")
    assert out["fd.same_number"], "the kernel did not hand A's fd number to B: case not shown"
    _check(out)
