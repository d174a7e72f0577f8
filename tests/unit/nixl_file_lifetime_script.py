"""A FILE registration's lifetime against the transfers that use it, through one NIXL API:

    python nixl_file_lifetime_script.py --impl adapter|plugin --dir TMP [--plugin-dir DIR]

adapter: p2phub.nixl (POSIX backend). plugin: the real NIXL (the pip nixl_cu12) loading
libplugin_P2PHUB.so from DIR as POSIX. Prints one JSON line of what each case saw; the test
judges it (real NIXL may crash at exit, so the exit status says nothing).

Cases, each a WRITE of MiB blocks from DRAM posted and, while it may still be in flight, its
file deregistered and another file registered in its place:
- path: "rw,create:A" (id 7), then "rw:B" with the same id
- fd: A's fd, then A's fd closed and B opened (the kernel hands out the same number) and
  registered by that number
- closed: A registered by fd and the fd closed at once: a READ still reads A, never B
The bytes of A are read back from disk, and B is checked untouched.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import time
from pathlib import Path

from nixl_impls import agent_api

MiB = 1 << 20


def wait(agent, h, timeout: float = 60.0) -> str:
    try:
        deadline = time.monotonic() + timeout
        st = agent.check_xfer_state(h)
        while st == "PROC" and time.monotonic() < deadline:
            time.sleep(0.0005)
            st = agent.check_xfer_state(h)
        return st
    except Exception as exc:  # noqa: BLE001 - the class name is what the test looks at
        return f"EXC:{type(exc).__name__}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("adapter", "plugin"), required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--plugin-dir")
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    nixl_agent, nixl_agent_config = agent_api(args.impl, args.plugin_dir)  # noqa: N806
    tmp = Path(args.dir)
    size = args.mib * MiB
    agent = nixl_agent("store", nixl_agent_config(backends=[]))
    agent.create_backend("POSIX")
    m = mmap.mmap(-1, size)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    data = os.urandom(MiB) * args.mib
    m[:] = data
    mreg = agent.register_memory([(base, size, 0, "")], "DRAM")
    blocks = [(base + i * MiB, MiB, 0) for i in range(args.mib)]
    out: dict = {}
    b_bytes = b"\xbb" * size

    def write_then_swap(case: str, reg_a, dev_a: int, swap) -> None:
        loc = agent.get_xfer_descs(blocks, "DRAM")
        rem = agent.get_xfer_descs([(i * MiB, MiB, dev_a) for i in range(args.mib)], "FILE")
        h = agent.initialize_xfer("WRITE", loc, rem, "store")
        try:
            out[f"{case}.posted"] = agent.transfer(h)
        except Exception as exc:  # noqa: BLE001
            out[f"{case}.posted"] = f"EXC:{type(exc).__name__}"
        t0 = time.monotonic()
        agent.deregister_memory(reg_a)
        out[f"{case}.deregister_s"] = round(time.monotonic() - t0, 3)
        reg_b = swap()
        out[f"{case}.state"] = wait(agent, h)
        agent.release_xfer_handle(h)
        out[f"{case}.a_ok"] = (tmp / f"{case}-A.bin").read_bytes() == data
        out[f"{case}.b_untouched"] = (tmp / f"{case}-B.bin").read_bytes() == b_bytes
        agent.deregister_memory(reg_b)

    # path mode: the backend's own open file
    for case in ("path", "fd", "closed"):
        (tmp / f"{case}-B.bin").write_bytes(b_bytes)
    a_path, b_path = tmp / "path-A.bin", tmp / "path-B.bin"
    reg_a = agent.register_memory([(0, size, 7, f"rw,create:{a_path}")], "FILE")
    write_then_swap("path", reg_a, 7, lambda: agent.register_memory(
        [(0, size, 7, f"rw:{b_path}")], "FILE"))

    # fd mode: the caller's fd number, closed and handed out again
    (tmp / "fd-A.bin").write_bytes(b"")
    fd_a = os.open(tmp / "fd-A.bin", os.O_RDWR)
    reg_a = agent.register_memory([(0, size, fd_a, "")], "FILE")
    held: dict = {}

    def swap_fd():
        os.close(fd_a)
        fd_b = os.open(tmp / "fd-B.bin", os.O_RDWR)
        held["fd_b"] = fd_b
        out["fd.same_number"] = fd_b == fd_a
        return agent.register_memory([(0, size, fd_b, "")], "FILE")

    write_then_swap("fd", reg_a, fd_a, swap_fd)
    os.close(held["fd_b"])

    # the caller closes its fd while registered, and the number goes to B: a READ reads A
    (tmp / "closed-A.bin").write_bytes(data)
    fd_a = os.open(tmp / "closed-A.bin", os.O_RDONLY)
    reg_a = agent.register_memory([(0, size, fd_a, "")], "FILE")
    os.close(fd_a)
    fd_b = os.open(tmp / "closed-B.bin", os.O_RDONLY)
    out["closed.same_number"] = fd_b == fd_a
    m[:] = b"\0" * size
    loc = agent.get_xfer_descs(blocks, "DRAM")
    rem = agent.get_xfer_descs([(i * MiB, MiB, fd_a) for i in range(args.mib)], "FILE")
    h = agent.initialize_xfer("READ", loc, rem, "store")
    try:
        agent.transfer(h)
        out["closed.state"] = wait(agent, h)
    except Exception as exc:  # noqa: BLE001
        out["closed.state"] = f"EXC:{type(exc).__name__}"
    agent.release_xfer_handle(h)
    got = m[:]
    out["closed.read_a"] = got == data
    out["closed.read_b"] = got == b_bytes
    agent.deregister_memory(reg_a)
    os.close(fd_b)
    agent.deregister_memory(mreg)
    print(json.dumps(out), flush=True)
    if args.impl == "adapter":
        agent.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
