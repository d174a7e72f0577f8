"""Real NIXL (the pip nixl_cu12) with p2phub's plugin, one backend name per run:

    python nixl_plugin_script.py --plugin-dir DIR --name P2PHUB|GDS_MT|POSIX --dir TMP [--n N]
                                 [--mem DRAM|VRAM [--cuda]]

NIXL_PLUGIN_DIR=DIR is set before NIXL loads. Prints one JSON line with what each case saw;
the test judges those (real NIXL may crash at exit, so the exit status says nothing).

Cases: the plugin list and parameters; an unknown parameter refused; READ of N scattered
4 KiB blocks from an O_DIRECT file into 4 KiB-aligned memory (initialize_xfer), WRITE of N
blocks to other scattered places (prep_xfer_dlist + make_prepped_xfer), each checked against
an independent read of the file; a READ with one descriptor past the end of the file, whose
memory must stay untouched; a path-mode FILE registration ("rw,create:/path"), written and
read back; query_memory on an existing and a missing path.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import sys
import time
from pathlib import Path

BLOCK = 4096


class Mem:
    """The transfers' memory, sliced like bytes: page-aligned host memory (mmap), or with
    cuda=True a CUDA tensor (device 0) whose bytes are copied in and out to be checked."""

    def __init__(self, nbytes: int, cuda: bool) -> None:
        self.cuda = cuda
        if cuda:
            import torch
            self.torch = torch
            self.t = torch.zeros(nbytes, dtype=torch.uint8, device="cuda:0")
            self.addr = self.t.data_ptr()
        else:
            self.m = mmap.mmap(-1, nbytes)
            self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.m))

    def __getitem__(self, sl: slice) -> bytes:
        if self.cuda:
            return self.t[sl].cpu().numpy().tobytes()
        return self.m[sl]

    def __setitem__(self, sl: slice, data: bytes) -> None:
        if self.cuda:
            src = self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8)
            self.t[sl].copy_(src)
            self.torch.cuda.synchronize()
        else:
            self.m[sl] = data


def wait(agent, h, timeout: float = 60) -> str:
    """The transfer's end state: DONE, ERR, or EXC:<class> when NIXL raised."""
    try:
        state = agent.transfer(h)
        deadline = time.monotonic() + timeout
        while state == "PROC" and time.monotonic() < deadline:
            state = agent.check_xfer_state(h)
        return state
    except Exception as exc:  # noqa: BLE001 - the class name is what the test looks at
        return f"EXC:{type(exc).__name__}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plugin-dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--mem", choices=("DRAM", "VRAM"), default="DRAM",
                    help="VRAM: the memory is registered as device 0's")
    ap.add_argument("--cuda", action="store_true",
                    help="with --mem VRAM: real GPU memory (a torch CUDA tensor); without it "
                    "the VRAM is host memory, for a stand-in libcuda")
    args = ap.parse_args()
    os.environ["NIXL_PLUGIN_DIR"] = args.plugin_dir
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:  # a CUDA 13 machine carries nixl_cu13
        from nixl_cu13._api import nixl_agent, nixl_agent_config

    out: dict = {}
    name, n, mem = args.name, args.n, args.mem
    tmp = Path(args.dir)
    rnd = random.Random(29)

    agent = nixl_agent("store", nixl_agent_config(backends=[]))
    out["plugins"] = agent.get_plugin_list()
    out["plugin_params"] = agent.get_plugin_params(name)
    out["plugin_mems"] = agent.get_plugin_mem_types(name)
    try:
        nixl_agent("bad", nixl_agent_config(backends=[])).create_backend(name, {"no_such": "1"})
        out["unknown_param"] = "accepted"
    except Exception as exc:  # noqa: BLE001
        out["unknown_param"] = f"EXC:{type(exc).__name__}"
    os.environ["P2PHUB_NIXL_STRICT_PARAMS"] = "1"
    try:
        nixl_agent("strict", nixl_agent_config(backends=[])).create_backend(name, {"no_such": "1"})
        out["unknown_param_strict"] = "accepted"
    except Exception as exc:  # noqa: BLE001
        out["unknown_param_strict"] = f"EXC:{type(exc).__name__}"
    del os.environ["P2PHUB_NIXL_STRICT_PARAMS"]
    try:
        nixl_agent("odd", nixl_agent_config(backends=[])).create_backend(
            name, {"split_bytes": "4097"})
        out["odd_split"] = "accepted"
    except Exception as exc:  # noqa: BLE001
        out["odd_split"] = f"EXC:{type(exc).__name__}"
    params = {"depth": "64", "thread_count": "8"} if name == "GDS_MT" else {"depth": "64"}
    params["split_bytes"], params["inflight_bytes"] = "65536", "1048576"
    agent.create_backend(name, params)
    out["backend_params"] = agent.get_backend_params(name)

    # the file: 2n blocks of random bytes, opened O_DIRECT for the transfers
    path = tmp / "store.bin"
    content = rnd.randbytes(2 * n * BLOCK)
    path.write_bytes(content)
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    buf = Mem(n * BLOCK, args.cuda)  # page-aligned, as O_DIRECT wants
    base = buf.addr
    mreg = agent.register_memory([(base, n * BLOCK, 0, "")], mem)
    freg = agent.register_memory([(0, 2 * n * BLOCK, fd, "")], "FILE")

    # READ: block i of memory <- file block src[i]
    src = rnd.sample(range(2 * n), n)
    loc = agent.get_xfer_descs([(base + i * BLOCK, BLOCK, 0) for i in range(n)], mem)
    rem = agent.get_xfer_descs([(b * BLOCK, BLOCK, fd) for b in src], "FILE")
    h = agent.initialize_xfer("READ", loc, rem, "store")
    out["read_state"] = wait(agent, h)
    agent.release_xfer_handle(h)
    got = buf[:]
    out["read_bad_blocks"] = sum(
        got[i * BLOCK:(i + 1) * BLOCK] != content[b * BLOCK:(b + 1) * BLOCK] for i, b in enumerate(src))

    # WRITE (prepped): memory block i -> file block dst[i]
    fresh = rnd.randbytes(n * BLOCK)
    buf[:] = fresh
    dst = rnd.sample(range(2 * n), n)
    mem_h = agent.prep_xfer_dlist("", [(base + i * BLOCK, BLOCK, 0) for i in range(n)], mem)
    file_h = agent.prep_xfer_dlist("store", [(b * BLOCK, BLOCK, fd) for b in range(2 * n)], "FILE")
    h = agent.make_prepped_xfer("WRITE", mem_h, list(range(n)), file_h, dst)
    out["write_state"] = wait(agent, h)
    agent.release_xfer_handle(h)
    on_disk = bytearray(content)
    for i, b in enumerate(dst):
        on_disk[b * BLOCK:(b + 1) * BLOCK] = fresh[i * BLOCK:(i + 1) * BLOCK]
    with open(path, "rb") as f:  # an independent, buffered read of the whole file
        seen = f.read()
    out["write_bad_blocks"] = sum(
        seen[b * BLOCK:(b + 1) * BLOCK] != on_disk[b * BLOCK:(b + 1) * BLOCK] for b in range(2 * n))

    # a READ whose last descriptor lies past the end of the file: ERR, memory untouched
    buf[:] = b"\xee" * (n * BLOCK)
    k = min(n, 64)
    loc = agent.get_xfer_descs([(base + i * BLOCK, BLOCK, 0) for i in range(k)], mem)
    offs = [b * BLOCK for b in src[:k - 1]] + [2 * n * BLOCK]  # past the registration too
    rem = agent.get_xfer_descs([(o, BLOCK, fd) for o in offs], "FILE")
    try:
        h = agent.initialize_xfer("READ", loc, rem, "store")
        out["eof_state"] = wait(agent, h)
        agent.release_xfer_handle(h)
    except Exception as exc:  # noqa: BLE001 - NIXL may refuse it before the plugin sees it
        out["eof_state"] = f"EXC:{type(exc).__name__}"
    out["eof_memory_untouched"] = buf[:k * BLOCK] == b"\xee" * (k * BLOCK)

    # the same with the registration covering the offset but the file shorter than it
    os.ftruncate(fd, 2 * n * BLOCK)
    big = agent.register_memory([(0, 4 * n * BLOCK, fd, "")], "FILE")
    rem = agent.get_xfer_descs([(o, BLOCK, fd) for o in offs], "FILE")
    h = agent.initialize_xfer("READ", loc, rem, "store")
    out["eof_inside_registration_state"] = wait(agent, h)
    agent.release_xfer_handle(h)
    out["eof_inside_registration_untouched"] = buf[:k * BLOCK] == b"\xee" * (k * BLOCK)
    agent.deregister_memory(big)
    agent.deregister_memory(freg)
    os.close(fd)

    # path mode: the backend opens (and creates) the file and closes it at deregistration
    ppath = tmp / "paths" / "kv-000.bin"
    ppath.parent.mkdir()
    preg = agent.register_memory([(0, 16 * BLOCK, 7, f"rw,create:{ppath}")], "FILE")
    buf[:16 * BLOCK] = fresh[:16 * BLOCK]
    loc = agent.get_xfer_descs([(base + i * BLOCK, BLOCK, 0) for i in range(16)], mem)
    rem = agent.get_xfer_descs([((15 - i) * BLOCK, BLOCK, 7) for i in range(16)], "FILE")
    h = agent.initialize_xfer("WRITE", loc, rem, "store")
    out["path_write_state"] = wait(agent, h)
    agent.release_xfer_handle(h)
    data = ppath.read_bytes()
    out["path_write_ok"] = all(data[(15 - i) * BLOCK:(16 - i) * BLOCK] == fresh[i * BLOCK:(i + 1) * BLOCK]
                               for i in range(16))
    buf[:16 * BLOCK] = b"\0" * (16 * BLOCK)
    h = agent.initialize_xfer("READ", loc, rem, "store")
    out["path_read_state"] = wait(agent, h)
    agent.release_xfer_handle(h)
    out["path_read_ok"] = buf[:16 * BLOCK] == fresh[:16 * BLOCK]
    out["query"] = agent.query_memory([(0, 0, 0, str(ppath)), (0, 0, 0, str(tmp / "missing"))],
                                      name, "FILE")
    agent.deregister_memory(preg)
    out["fds_closed"] = not any(os.readlink(f"/proc/self/fd/{x}") == str(ppath)
                                for x in os.listdir("/proc/self/fd")
                                if os.path.islink(f"/proc/self/fd/{x}"))
    agent.deregister_memory(mreg)
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    os._exit(0)  # NIXL's own teardown is not what is under test


if __name__ == "__main__":
    sys.exit(main())
