"""vLLM NixlConnector's NIXL call sequence (tests/unit/vllm_nixl_replay.py, the same replay
the host tier runs over TCP) between the lab's two RDMA nodes: prefill on node A
(169.254.77.1, rxe-a), decode on node B (169.254.77.2, rxe-b), two processes, p2phub.nixl
told its NICs through the environment as a vLLM worker would be (P2PHUB_NIXL_HOST,
P2PHUB_NIXL_RDMA_DEVICES). Block-id lists, READ pulled by decode and answered over RDMA, a
notification per request, HB heartbeats, the full-prefix-hit notification, telemetry on
DONE, a push (WRITE), release and shutdown, every byte checked by decode; the bytes counted
per NIC by the agents and seen on the NIC's own packet counter. Told "tcp", the same
agents move the same bytes over the control connection and no NIC carries any."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from p2phub_lab import rails

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
import test_nixl_vllm_sequence as seq  # noqa: E402
import vllm_nixl_replay as replay  # noqa: E402

pytest.importorskip("numpy")


def _env(lab: dict, transport: str) -> dict[str, dict[str, str]]:
    # listening beyond loopback: both roles share a configured secret, as a deployment would
    return {role: {"P2PHUB_KV_SECRET": "the lab's KV secret, the same for both roles",
                   "P2PHUB_NIXL_HOST": lab[f"node_{n}_addr"],
                   "P2PHUB_NIXL_RDMA_DEVICES": lab[f"node_{n}_rdma"],
                   "P2PHUB_NIXL_TRANSPORT": transport}
            for role, n in (("prefill", "a"), ("decode", "b"))}


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_vllm_nixl_connector_sequence_between_the_rxe_nodes(lab, tmp_path: Path, transport: str) -> None:
    if lab.get("rdma") == "0":
        pytest.fail("this lab has no rxe devices (debug kernel): run it on --kernel 6.12", pytrace=False)
    ra, rb = lab["node_a_rdma"], lab["node_b_rdma"]
    before = {d: rails.sent_packets(d) for d in (ra, rb)}
    dec, pre = seq._run("p2phub", tmp_path, role_env=_env(lab, transport), timeout=600)
    after = {d: rails.sent_packets(d) for d in (ra, rb)}
    seq.check(dec, pre)
    read = sum(t["bytes"] for t in dec["telemetry"])
    moved = read + pre["push_bytes"]
    nreg = 2 * replay.LAYERS
    assert read == sum(len(loc) for loc, _ in replay.READS.values()) * nreg * replay.BLOCK_BYTES
    if transport == "auto":
        # both ends have a NIC: RDMA, and every payload byte went over rxe-a: the READ answers
        # WRITTEN by prefill into decode's cache, and the push; decode WROTE nothing
        assert dec["transport"] == pre["transport"] == "rdma"
        assert pre["rail_bytes"] == {ra: moved}
        assert dec["rail_bytes"] == {rb: 0}
        assert after[ra] - before[ra] >= moved // 1024, (before, after, moved)   # 1024-byte MTU
    else:
        assert dec["transport"] == pre["transport"] == "tcp"
        assert pre["rail_bytes"] == {} and dec["rail_bytes"] == {}
        assert after[ra] - before[ra] < moved // 1024 // 10, (before, after)
