"""One NIXL-API script, two processes, run against real nixl or p2phub's adapter.

    python nixl_script.py --impl nixl|p2phub --role target|initiator --dir DIR

Metadata travels as files in DIR (a side channel, as vLLM uses ZMQ). The initiator
WRITEs 64 descriptors of 64 KiB into scattered places of the target's buffer through
prepared lists and indices, posts the same handle twice, sends a notification with
initialize_xfer (the target waits for it and checks every byte), then READs 8 pages back. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import sys
import time
from pathlib import Path

N, SZ = 64, 65536


def load(impl: str):
    if impl == "nixl":
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    else:
        from p2phub.nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def wait_file(p: Path, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    while not p.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{p} did not appear")
        time.sleep(0.02)
    time.sleep(0.05)
    return json.loads(p.read_text())


def put_file(p: Path, d: dict) -> None:
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(d))
    tmp.rename(p)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("nixl", "p2phub"), required=True)
    ap.add_argument("--role", choices=("target", "initiator"), required=True)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    import numpy as np

    nixl_agent, nixl_agent_config = load(args.impl)
    d = Path(args.dir)
    perm = random.Random(5).sample(range(N), N)
    pattern = np.frombuffer(random.Random(6).randbytes(N * SZ), dtype=np.uint8)
    agent = nixl_agent(args.role, nixl_agent_config(backends=["UCX"]))
    buf = np.zeros(N * SZ, dtype=np.uint8) if args.role == "target" else pattern.copy()
    addr = buf.ctypes.data
    reg = agent.register_memory([(addr, buf.nbytes, 0, "")], "DRAM")
    me = {"md": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": addr}
    result: dict = {"impl": args.impl, "role": args.role}

    if args.role == "target":
        put_file(d / "target.json", me)
        peer = wait_file(d / "initiator.json")
        agent.add_remote_agent(base64.b64decode(peer["md"]))
        deadline = time.monotonic() + 90
        got: list[bytes] = []
        while b"final" not in got and time.monotonic() < deadline:
            for name, msgs in agent.get_new_notifs().items():
                assert name == "initiator", name
                got.extend(msgs)
            time.sleep(0.001)
        expect = np.empty_like(pattern)
        for i, j in enumerate(perm):
            expect[j * SZ:(j + 1) * SZ] = pattern[i * SZ:(i + 1) * SZ]
        result.update(notifs=[m.decode() for m in got], bytes_ok=bool((buf == expect).all()))
        wait_file(d / "done.json")       # the initiator still READs from this buffer
    else:
        peer = wait_file(d / "target.json")
        name = agent.add_remote_agent(base64.b64decode(peer["md"]))
        put_file(d / "initiator.json", me)
        local = np.array([(addr + i * SZ, SZ, 0) for i in range(N)], dtype=np.uint64)
        remote = np.array([(peer["addr"] + i * SZ, SZ, 0) for i in range(N)], dtype=np.uint64)
        lh = agent.prep_xfer_dlist("", local, "DRAM")
        rh = agent.prep_xfer_dlist(name, remote, "DRAM")
        idx = np.arange(N, dtype=np.int32)
        states = []
        h = agent.make_prepped_xfer("WRITE", lh, idx, rh, np.array(perm, dtype=np.int32), b"")
        for _ in range(2):           # the same handle, posted twice
            st = agent.transfer(h)
            deadline = time.monotonic() + 90
            while st == "PROC" and time.monotonic() < deadline:
                st = agent.check_xfer_state(h)
            states.append(st)
        agent.release_xfer_handle(h)
        # one small transfer that carries the notification
        one = agent.get_xfer_descs([(addr, SZ, 0)], "DRAM")
        tgt = agent.get_xfer_descs([(peer["addr"] + perm[0] * SZ, SZ, 0)], "DRAM")
        h2 = agent.initialize_xfer("WRITE", one, tgt, name, b"final")
        st = agent.transfer(h2)
        deadline = time.monotonic() + 90
        while st == "PROC" and time.monotonic() < deadline:
            st = agent.check_xfer_state(h2)
        states.append(st)
        agent.release_xfer_handle(h2)
        # READ 8 pages back into a second, zeroed buffer: page i of `back` <- target page perm[i]
        back = np.zeros(8 * SZ, dtype=np.uint8)
        breg = agent.register_memory([(back.ctypes.data, back.nbytes, 0, "")], "DRAM")
        bh = agent.prep_xfer_dlist("", [(back.ctypes.data + i * SZ, SZ, 0) for i in range(8)], "DRAM")
        h3 = agent.make_prepped_xfer("READ", bh, list(range(8)), rh, perm[:8])
        st = agent.transfer(h3)
        deadline = time.monotonic() + 90
        while st == "PROC" and time.monotonic() < deadline:
            st = agent.check_xfer_state(h3)
        states.append(st)
        result["read_ok"] = bool((back == pattern[:8 * SZ]).all())
        agent.release_xfer_handle(h3)
        agent.release_dlist_handle(bh)
        agent.deregister_memory(breg)
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
        result["states"] = states
        put_file(d / "done.json", {})
        time.sleep(0.5)              # NIXL sends the notification from its progress path
    agent.deregister_memory(reg)
    print(json.dumps(result), flush=True)
    os._exit(0)                      # nixl 1.5.1 may crash at interpreter exit (LAB.md)


if __name__ == "__main__":
    sys.exit(main())
