"""vLLM NixlConnector's NIXL calls, replayed by one process per role (prefill / decode).

    python vllm_nixl_replay.py --impl p2phub|nixl --role prefill|decode --dir DIR [--mem DRAM|VRAM]

The calls and their order follow vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py
(vllm-project/vllm 002a1057e9ae674d7bdc9c4be95bc29d65d2e808) for both worker roles:

- agent: nixl_agent(uuid4(), nixl_agent_config(num_threads=4, capture_telemetry=True));
- register_kv_caches: per layer a [2, num_blocks, block_bytes] cache split into K and V
  regions; get_reg_descs([(base, size, dev, "")], mem) + register_memory(backends=["UCX"]);
  register_local_xfer_handler: one descriptor per (region, block), prep_xfer_dlist("NIXL_INIT_AGENT");
- handshake (vLLM: ZMQ; here: files in DIR): get_agent_metadata and the cache geometry;
  add_remote_agent; one descriptor per remote (region, block), prep_xfer_dlist(remote name);
- start_load_kv / _read_blocks (decode): block-id lists -> descriptor ids
  region * num_blocks + block; make_prepped_xfer("READ", ..., notif_msg=b"<req>:<tp size>");
  transfer; a full prefix hit sends that notification alone (send_notif); a partial hit reads
  the last len(local) remote blocks;
- while transfers run, decode sends b"HB:<req>,<req>" heartbeats (send_notif);
- get_finished: check_xfer_state until DONE, get_xfer_telemetry on DONE, release_xfer_handle;
  prefill's _get_new_notifs: b"HB:" keeps requests alive, b"<req>:<tp>" finishes them;
- push (prefill WRITEs a request into decode's cache), as a connector writing would;
- shutdown: release_xfer_handle, release_dlist_handle, remove_remote_agent, deregister_memory.

Every byte is checked on decode against a pattern both sides compute from (region, block),
and blocks no request named must stay zero. Prints one JSON line (with p2phub also the
transport each side used and the payload bytes each of its RDMA NICs carried; what the agent
listens on and which NICs it uses come from the environment, as a vLLM worker's would:
P2PHUB_NIXL_HOST, P2PHUB_NIXL_RDMA_DEVICES, P2PHUB_NIXL_TRANSPORT).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
import uuid
from pathlib import Path

from nixl_script import put_file, wait_file  # noqa: E402 - same folder: the file side channel

LAYERS, BLOCKS, BLOCK_BYTES, TP = 4, 32, 16384, 1
# request -> (decode's local block ids, prefill's block ids); [] local = full prefix hit
READS = {
    "req-a": ([3, 17, 4, 30, 9, 22], [11, 2, 28, 7, 19, 5]),
    "req-b": ([12, 0, 25], [14, 26, 1, 8, 31]),          # partial hit: reads the last 3
    "req-c": ([], [6, 13]),                              # full prefix hit: notification only
    "req-d": ([29, 15, 6, 20], [20, 21, 22, 23]),
}
PUSH = ("req-e", [10, 27], [24, 16])                     # prefill writes (its, decode's) blocks


def load(impl: str):
    if impl == "nixl":
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    else:
        from p2phub.nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def pattern(np, region: int, block: int):
    """The bytes prefill puts in (region, block): distinct per byte, region and block."""
    i = np.arange(BLOCK_BYTES, dtype=np.uint32)
    return ((i * 2654435761 + region * 97 + block * 131 + (i >> 8) * 7) & 0xFF).astype(np.uint8)


class Caches:
    """vLLM's per-layer caches: [2, num_blocks, block_bytes], K and V registered apart."""

    def __init__(self, np, mem: str) -> None:
        self.mem = mem
        if mem == "VRAM":
            import torch
            self.layers = [torch.zeros((2, BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda:0")
                           for _ in range(LAYERS)]
            self.dev = 0
        else:
            self.layers = [np.zeros((2, BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(LAYERS)]
            self.dev = 0

    def regions(self):
        for layer in self.layers:
            for kv in range(2):
                yield layer[kv]

    @staticmethod
    def ptr(t) -> int:
        return t.data_ptr() if hasattr(t, "data_ptr") else t.ctypes.data

    @staticmethod
    def nbytes(t) -> int:
        return t.numel() * t.element_size() if hasattr(t, "numel") else t.nbytes

    def fill(self, np) -> None:
        for r, t in enumerate(self.regions()):
            for b in range(BLOCKS):
                data = pattern(np, r, b)
                if self.mem == "VRAM":
                    import torch
                    t[b].copy_(torch.from_numpy(data))
                else:
                    t[b] = data

    def host(self, np):
        """Every region as a host array [region, block, bytes]."""
        if self.mem == "VRAM":
            import torch
            torch.cuda.synchronize()
            return np.stack([t.cpu().numpy() for t in self.regions()])
        return np.stack(list(self.regions()))


def desc_ids(np, block_ids: list[int], regions: int):
    """vLLM's _get_block_descs_ids: region_ids[:, None] * num_blocks + block_ids[None, :]."""
    return (np.arange(regions)[:, None] * BLOCKS + np.array(block_ids, dtype=np.int64)[None, :]).flatten()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("nixl", "p2phub"), required=True)
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--mem", choices=("DRAM", "VRAM"), default="DRAM")
    args = ap.parse_args()
    import numpy as np

    nixl_agent, nixl_agent_config = load(args.impl)
    d = Path(args.dir)
    res: dict = {"impl": args.impl, "role": args.role}

    # -- NixlConnectorWorker.__init__
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(num_threads=4, capture_telemetry=True))
    caches = Caches(np, args.mem)
    if args.role == "prefill":
        caches.fill(np)

    # -- register_kv_caches
    regions = list(caches.regions())
    caches_data = [(Caches.ptr(t), Caches.nbytes(t), caches.dev, "") for t in regions]
    block_len = Caches.nbytes(regions[0]) // BLOCKS
    reg = agent.get_reg_descs(caches_data, args.mem)
    agent.register_memory(reg, backends=["UCX"])
    blocks_data = [(Caches.ptr(t) + b * block_len, block_len, caches.dev) for t in regions for b in range(BLOCKS)]
    src_handle = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks_data, args.mem))
    me = {"md": base64.b64encode(agent.get_agent_metadata()).decode(),
          "base": [Caches.ptr(t) for t in regions], "num_blocks": BLOCKS,
          "block_lens": [block_len] * len(regions), "device_id": caches.dev}
    put_file(d / f"{args.role}.json", me)

    # -- _nixl_handshake / add_remote_agent
    peer_role = "decode" if args.role == "prefill" else "prefill"
    peer = wait_file(d / f"{peer_role}.json")
    remote_name = agent.add_remote_agent(base64.b64decode(peer["md"]))
    res["name_type"] = type(remote_name).__name__
    dst_data = [(base + b * peer["block_lens"][i], block_len, peer["device_id"])
                for i, base in enumerate(peer["base"]) for b in range(peer["num_blocks"])]
    dst_handle = agent.prep_xfer_dlist(remote_name, agent.get_xfer_descs(dst_data, args.mem))
    nreg = len(regions)

    if args.role == "decode":
        recving: dict[str, list] = {}
        telem: list[dict] = []
        # heartbeat for the requests this worker is about to pull (they stay alive on prefill)
        agent.send_notif(remote_name, ("HB:" + ",".join(sorted(READS))).encode())
        sent_hb = 1
        for req, (local, remote) in READS.items():
            notif_id = f"{req}:{TP}".encode()
            if not local:                                   # full prefix hit
                agent.send_notif(remote_name, notif_msg=notif_id)
                continue
            if len(local) < len(remote):                    # partial prefix hit
                remote = remote[-len(local):]
            h = agent.make_prepped_xfer("READ", src_handle, desc_ids(np, local, nreg), dst_handle,
                                        desc_ids(np, remote, nreg), notif_msg=notif_id)
            agent.transfer(h)
            recving[req] = [h]
        deadline = time.monotonic() + 60
        states: dict[str, str] = {}
        while recving and time.monotonic() < deadline:
            if sent_hb < 3:                                 # and while pulling
                agent.send_notif(remote_name, ("HB:" + ",".join(sorted(recving))).encode())
                sent_hb += 1
            for req, handles in list(recving.items()):
                left = []
                for h in handles:
                    st = agent.check_xfer_state(h)
                    if st == "DONE":
                        t = agent.get_xfer_telemetry(h)
                        telem.append({"req": req, "bytes": t.totalBytes, "descs": t.descCount,
                                      "post_us": t.postDuration, "xfer_us": t.xferDuration})
                        agent.release_xfer_handle(h)
                    elif st == "PROC":
                        left.append(h)
                    else:
                        states[req] = st
                        agent.release_xfer_handle(h)
                if left:
                    recving[req] = left
                else:
                    del recving[req]
                    states.setdefault(req, "DONE")
        res.update(states=states, heartbeats=sent_hb, telemetry=telem, pending=sorted(recving))
        # the push: prefill writes PUSH into our cache and notifies
        deadline = time.monotonic() + 60
        while not agent.check_remote_xfer_done(remote_name.decode() if isinstance(remote_name, bytes)
                                               else remote_name, f"{PUSH[0]}:".encode()):
            if time.monotonic() > deadline:
                res["push_notif"] = False
                break
            time.sleep(0.001)
        else:
            res["push_notif"] = True
        host = caches.host(np)
        bad, expected_touched = [], set()
        for req, (local, remote) in READS.items():
            remote = remote[-len(local):] if local else []
            for lb, rb in zip(local, remote):
                expected_touched.add(lb)
                for r in range(nreg):
                    if not (host[r, lb] == pattern(np, r, rb)).all():
                        bad.append((req, r, lb))
        for pb, db in zip(PUSH[1], PUSH[2]):
            expected_touched.add(db)
            for r in range(nreg):
                if not (host[r, db] == pattern(np, r, pb)).all():
                    bad.append((PUSH[0], r, db))
        untouched = [b for b in range(BLOCKS) if b not in expected_touched]
        stray = [(r, b) for r in range(nreg) for b in untouched if host[r, b].any()]
        res.update(bad=bad[:10], stray=stray[:10], checked_bytes=len(expected_touched) * nreg * BLOCK_BYTES)
        put_file(d / "decode.done", {})
    else:
        # -- prefill: _get_new_notifs until every request was read; heartbeats seen
        want = {f"{r}" for r in READS}
        done_sending: set[str] = set()
        heartbeats: list[str] = []
        deadline = time.monotonic() + 60
        while not want <= done_sending and time.monotonic() < deadline:
            for _name, notifs in agent.get_new_notifs().items():
                for notif in notifs:
                    if notif.startswith(b"HB:"):
                        heartbeats.append(notif[3:].decode())
                        continue
                    req_id, tp_size = notif.decode("utf-8").rsplit(":", 1)
                    assert int(tp_size) == TP
                    done_sending.add(req_id)
            time.sleep(0.001)
        # -- the push
        push_req, mine, theirs = PUSH
        h = agent.make_prepped_xfer("WRITE", src_handle, desc_ids(np, mine, nreg), dst_handle,
                                    desc_ids(np, theirs, nreg), notif_msg=f"{push_req}:{TP}".encode())
        st = agent.transfer(h)
        while st == "PROC":
            st = agent.check_xfer_state(h)
        t = agent.get_xfer_telemetry(h)
        res.update(done_sending=sorted(done_sending), heartbeats=heartbeats, push_state=st,
                   push_bytes=t.totalBytes, push_descs=t.descCount)
        agent.release_xfer_handle(h)
        wait_file(d / "decode.done")            # decode reads from this cache until then

    if args.impl == "p2phub":   # how its payload moved: "tcp" or "rdma", bytes per NIC
        res.update(transport=agent.transport_to(remote_name), rail_bytes=agent.kv.rail_bytes())

    # -- shutdown
    agent.release_dlist_handle(src_handle)
    agent.release_dlist_handle(dst_handle)
    agent.remove_remote_agent(remote_name)
    agent.deregister_memory(reg)
    print(json.dumps(res), flush=True)
    sys.stdout.flush()
    os._exit(0)     # nixl 1.5.1 may crash at interpreter exit in UCX's teardown


if __name__ == "__main__":
    sys.exit(main())
