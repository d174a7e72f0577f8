"""vLLM NixlConnector's NIXL call sequence (vllm_nixl_replay.py), prefill and decode in two
processes on loopback: against p2phub.nixl, and against real NIXL (nixl-cu12, UCX over TCP on
lo) as the control. The control is skipped only where nixl cannot be imported; its process may
crash at exit in UCX's teardown, so its checks (the JSON it prints) are judged, not its exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vllm_nixl_replay as replay  # noqa: E402
from test_kv_nixl import _impls, run_roles  # noqa: E402,F401 - p2phub, and nixl where it imports


def _run(impl: str, tmp_path: Path, mem: str = "DRAM", ucx_tls: str = "tcp",
         role_env: dict[str, dict[str, str]] | None = None, timeout: float = 180) -> tuple[dict, dict]:
    (prc, pout), (drc, dout) = run_roles("vllm_nixl_replay.py", impl, tmp_path, ("prefill", "decode"),
                                         ("--mem", mem), ucx_tls, timeout=timeout, role_env=role_env)
    lines = [ln for ln in dout.splitlines() if ln.startswith("{")], [ln for ln in pout.splitlines() if ln.startswith("{")]
    assert lines[0] and lines[1], (dout, pout, drc, prc)
    if impl == "p2phub":
        assert drc == 0 and prc == 0
    return json.loads(lines[0][-1]), json.loads(lines[1][-1])


def check(dec: dict, pre: dict) -> None:
    reads = {r: v for r, v in replay.READS.items() if v[0]}
    assert dec["states"] == {r: "DONE" for r in reads}
    assert dec["pending"] == []
    assert dec["name_type"] == "bytes"                      # add_remote_agent returns bytes
    assert dec["bad"] == [] and dec["stray"] == []          # every byte, nothing elsewhere
    nreg = 2 * replay.LAYERS
    touched = sum(len(local) for local, _ in replay.READS.values()) + len(replay.PUSH[1])
    assert dec["checked_bytes"] == touched * nreg * replay.BLOCK_BYTES
    assert sorted(t["req"] for t in dec["telemetry"]) == sorted(reads)
    for t in dec["telemetry"]:
        n = len(replay.READS[t["req"]][0]) * nreg
        assert t["descs"] == n and t["bytes"] == n * replay.BLOCK_BYTES
        assert 0 < t["post_us"] <= t["xfer_us"]
    assert dec["push_notif"] is True
    assert pre["done_sending"] == sorted(replay.READS)      # full prefix hit included
    assert dec["heartbeats"] >= 1 and pre["heartbeats"][0] == ",".join(sorted(replay.READS))
    assert all(set(hb.split(",")) <= set(replay.READS) for hb in pre["heartbeats"])
    assert pre["push_state"] == "DONE"
    assert pre["push_descs"] == len(replay.PUSH[1]) * nreg
    assert pre["push_bytes"] == pre["push_descs"] * replay.BLOCK_BYTES


@pytest.mark.parametrize("impl", _impls())
def test_vllm_nixl_connector_sequence_dram(impl: str, tmp_path: Path) -> None:
    dec, pre = _run(impl, tmp_path)
    check(dec, pre)
