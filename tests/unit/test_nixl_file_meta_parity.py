"""FILE registration metas: one grammar (p2phub/staged_io/_sio_file.c) on both p2phub routes,
compared row by row with the real NIXL's own POSIX plugin. Each meta is registered with
devId = an fd of file X while its path names file Y; a READ shows which file it reads.

p2phub's two routes give the same answer on every row. They give POSIX's answer wherever
POSIX reads a file, except where p2phub is stricter on purpose: a meta that starts like path
mode but is malformed is refused (POSIX silently reads the devId's file instead), a symbolic
link is refused, and a created file is 0600 (POSIX: 0644)."""

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

# rows where p2phub deliberately differs from NIXL POSIX: (p2phub, POSIX)
STRICTER = {
    "ro,rw:d/Y.bin": ("refused", "fd"),
    "rw,fast:d/Y.bin": ("refused", "fd"),
    "ro:": ("refused", "fd"),
    "ro:d/link.bin": ("refused", "path"),
    "new.mode": ("0o600", "0o644"),
}


def _outcomes(impl: str, tmp: Path, plugin_dir: Path | None) -> dict[str, str]:
    run = tmp / impl
    (run / "d").mkdir(parents=True)
    args = [sys.executable, str(HERE / "nixl_file_meta_script.py"), "--impl", impl,
            "--dir", str(run / "d")]
    if plugin_dir is not None:
        args += ["--plugin-dir", str(plugin_dir)]
    env = dict(os.environ, NIXL_LOG_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(TOP), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(args, capture_output=True, text=True, timeout=180, env=env, cwd=run)
    raw = _last_json(p.stdout + "\n" + p.stderr)
    norm = {"nixlInvalidParamError": "refused", "nixlBackendError": "refused"}
    return {k.replace(str(run) + "/", ""): norm.get(v, v) for k, v in raw.items()}


@needs_nixl
def test_one_grammar_on_both_routes_and_nixl_posix_where_it_reads(tmp_path: Path) -> None:
    adapter = _outcomes("adapter", tmp_path, None)
    plugin = _outcomes("plugin", tmp_path, build_plugin() / "alias")
    posix = _outcomes("posix", tmp_path, None)
    table = json.dumps({k: (adapter[k], plugin.get(k), posix.get(k)) for k in adapter}, indent=1)
    assert adapter == plugin, table
    assert set(adapter) == set(posix), table
    for meta, ours in adapter.items():
        want = STRICTER.get(meta)
        if want is not None:
            assert (ours, posix[meta]) == want, f"{meta!r}\n{table}"
        else:
            assert ours == posix[meta], f"{meta!r}\n{table}"
    # the rows that name a file the plain way read it on every route
    assert adapter["rw:d/Y.bin"] == adapter["ro,direct:d/Y.bin"] == "path"
    assert adapter["direct,rw:d/Y.bin"] == adapter[""] == "fd"


def test_the_adapter_reads_the_engines_grammar() -> None:
    pytest.importorskip("numpy")
    from p2phub.nixl._storage import parse_path_meta
    from p2phub.nixl.errors import nixlInvalidParamError
    assert parse_path_meta("ro,direct:/x")[0] == "/x"
    assert parse_path_meta(b"rw:rel/x")[0] == "rel/x"
    assert parse_path_meta("direct,rw:/x") is None and parse_path_meta("/x") is None
    for bad in ("ro:", "rw,fast:/x", "ro,rw:/x"):
        with pytest.raises(nixlInvalidParamError):
            parse_path_meta(bad)


@needs_nixl
def test_strided_nx5_lists_between_dram_and_file_on_every_route(tmp_path: Path) -> None:
    """NIXL 1.5's (address, len, dev, stride, count) lists for both sides of a FILE transfer:
    the adapter, the plugin under the pip nixl and NIXL's own POSIX move the same blocks."""
    want = {"read": "DONE", "mem_blocks": [0x15, 0, 0x14, 0, 0x13, 0, 0x12, 0], "write": "DONE",
            "file_blocks": [0x10, 0x11, 0xA0, 0x13, 0x14, 0xA2, 0x16, 0x17]}
    plugin = build_plugin() / "alias"
    for impl in ("adapter", "plugin", "posix"):
        d = tmp_path / impl
        d.mkdir()
        env = dict(os.environ, NIXL_LOG_LEVEL="ERROR",
                   PYTHONPATH=os.pathsep.join([str(TOP), os.environ.get("PYTHONPATH", "")]))
        p = subprocess.run([sys.executable, str(HERE / "nixl_strided_script.py"), "--impl", impl,
                            "--dir", str(d), "--plugin-dir", str(plugin)],
                           capture_output=True, text=True, timeout=120, env=env)
        assert _last_json(p.stdout + "\n" + p.stderr) == want, f"{impl}\n{p.stdout}{p.stderr}"
