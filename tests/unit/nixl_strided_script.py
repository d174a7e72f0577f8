"""NIXL 1.5's strided (Nx5) descriptor lists between DRAM and FILE, through one NIXL API:

    python nixl_strided_script.py --impl adapter|plugin|posix --dir TMP [--plugin-dir DIR]

The memory side (address, len, dev, stride, count) picks every other 4 KiB block of a buffer,
the FILE side 4 blocks of the file back to back; a READ by index, then a WRITE of other
blocks back through the same lists. Prints one JSON line: which file block each memory block
holds after the READ, and which memory block each file block holds after the WRITE."""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os

import numpy as np
from nixl_impls import agent_api, finish

BLK = 4096


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("adapter", "plugin", "posix"), required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--plugin-dir")
    args = ap.parse_args()
    nixl_agent, nixl_agent_config = agent_api(args.impl, args.plugin_dir)  # noqa: N806
    path = os.path.join(args.dir, "blocks.bin")
    with open(path, "wb") as f:
        for b in range(8):
            f.write(bytes([0x10 + b]) * BLK)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    a = nixl_agent("strided", nixl_agent_config(backends=[]))
    a.create_backend("POSIX")
    m = mmap.mmap(-1, 8 * BLK)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    a.register_memory([(base, 8 * BLK, 0, "")], "DRAM")
    a.register_memory([(0, 8 * BLK, fd, "")], "FILE")
    mem = a.prep_xfer_dlist("", np.array([[base, BLK, 0, 2 * BLK, 4]], np.uint64), "DRAM")
    fil = a.prep_xfer_dlist(a.name, np.array([[2 * BLK, BLK, fd, BLK, 4]], np.uint64), "FILE")
    out: dict = {}

    def run(op: str, li: list[int], ri: list[int]) -> str:
        h = a.make_prepped_xfer(op, mem, li, fil, ri)
        st = finish(a, h)
        a.release_xfer_handle(h)
        return st

    out["read"] = run("READ", [0, 1, 2, 3], [3, 2, 1, 0])
    out["mem_blocks"] = [m[i * BLK] for i in range(8)]
    for i in range(8):
        m[i * BLK:(i + 1) * BLK] = bytes([0xA0 + i]) * BLK
    out["write"] = run("WRITE", [0, 1], [0, 3])
    with open(path, "rb") as f:
        data = f.read()
    out["file_blocks"] = [data[i * BLK] for i in range(8)]
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
