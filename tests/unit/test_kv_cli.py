"""`p2phub kv serve` and `p2phub kv send` as a user runs them, two processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TOP = Path(__file__).resolve().parent.parent.parent
SMALL = ["--layers", "4", "--blocks", "64", "--block-bytes", "8192"]


def _p2phub(*args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOP), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "p2phub", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def test_serve_and_send_verify_every_byte() -> None:
    srv = _p2phub("kv", "serve", "--count", "1", "--json", *SMALL)
    try:
        first = json.loads(srv.stdout.readline())
        assert first["event"] == "listening"
        snd = _p2phub("kv", "send", "--to", f"127.0.0.1:{first['port']}", "--pages", "40",
                      "--seed", "3", "--json", *SMALL)
        out, err = snd.communicate(timeout=60)
        assert snd.returncode == 0, err
        sent = json.loads(out)
        assert sent["state"] == "DONE" and sent["bytes"] == 40 * 2 * 4 * 8192
        sout, serr = srv.communicate(timeout=30)
        assert srv.returncode == 0, serr
        got = json.loads(sout.strip().splitlines()[-1])
        assert got == {"schema": "p2phub.kv/1", "event": "request", "peer": "prefill", "req": 1, "bytes": sent["bytes"],
                       "pages": 320, "bad_pages": 0, "complete": True}
    finally:
        if srv.poll() is None:
            srv.kill()


def test_mismatched_layouts_and_bad_usage() -> None:
    srv = _p2phub("kv", "serve", "--count", "1", "--json", *SMALL)
    try:
        port = json.loads(srv.stdout.readline())["port"]
        snd = _p2phub("kv", "send", "--to", f"127.0.0.1:{port}", "--layers", "8", "--blocks", "64", "--pages", "8",
                      "--block-bytes", "8192")
        _, err = snd.communicate(timeout=60)
        assert snd.returncode == 4 and "num_layers: 8 here, 4 there" in err
    finally:
        srv.kill()
        srv.wait()
    p = _p2phub("kv", "send", "--pages", "0", *SMALL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 4 and "--pages" in err and "got 0" in err
    p = _p2phub("kv", "send", "--pages", "8", *SMALL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 4 and "exactly one of --to" in err
    p = _p2phub("kv", "send", "--to", "127.0.0.1:1", "--pages", "8", *SMALL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "unreachable" in err and "refused" in err
    p = _p2phub("kv", "serve", "--layers", "0")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 4 and "--layers" in err and "got 0" in err
