"""One FILE-memory script for real NIXL (its POSIX plugin) and p2phub.nixl alike.

    python nixl_file_script.py --impl nixl|p2phub --dir DIR

Each step's outcome ("DONE", "ERR", None for a call that returned, or the name of the
exception class a call raised, and where) and its byte checks go into one JSON object on the
last line of stdout, for tests/unit/test_nixl_file_vs_nixl.py to compare.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import time
from typing import Any, Callable


def load(impl: str) -> tuple[Any, Any]:
    if impl == "nixl":
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    else:
        from p2phub.nixl._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("nixl", "p2phub"), required=True)
    ap.add_argument("--dir", required=True)
    args = ap.parse_args()
    nixl_agent, nixl_agent_config = load(args.impl)
    d = args.dir
    out: dict[str, Any] = {}

    def call(key: str, fn: Callable[[], Any]) -> Any:
        try:
            r = fn()
            out[key] = None
            return r
        except Exception as exc:  # noqa: BLE001 - the class is the outcome
            out[key] = type(exc).__name__
            return None

    N = 4 * 4096
    libc = ctypes.CDLL(None)
    libc.aligned_alloc.restype = ctypes.c_void_p
    src = libc.aligned_alloc(4096, N)
    dst = libc.aligned_alloc(4096, N)
    pattern = random.Random(7).randbytes(N)
    ctypes.memmove(src, pattern, N)
    ctypes.memset(dst, 0, N)

    bare = nixl_agent("bare", nixl_agent_config(backends=[]))
    call("register_dram_without_backend", lambda: bare.register_memory([(src, N, 0, "")], "DRAM"))
    a = nixl_agent("me", nixl_agent_config(backends=[]))
    a.create_backend("POSIX")
    out["plugin_params_posix"] = sorted(a.get_plugin_params("POSIX"))
    call("register_dram", lambda: a.register_memory([(src, N, 0, ""), (dst, N, 0, "")], "DRAM"))
    path = os.path.join(d, "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    freg = call("register_file_fd", lambda: a.register_memory([(0, N, fd, "x")], "FILE"))

    def run(key: str, op: str, mem: list, fil: list) -> None:
        h = call(key + ".init", lambda: a.initialize_xfer(op, a.get_xfer_descs(mem, "DRAM"),
                                                          a.get_xfer_descs(fil, "FILE"), "me"))
        if h is None:
            return
        st = call(key + ".transfer", lambda: a.transfer(h))
        deadline = time.monotonic() + 30
        while st == "PROC" and time.monotonic() < deadline:
            st = call(key + ".check", lambda: a.check_xfer_state(h))
        if out.get(key + ".check") is None:
            # asked once more whatever transfer() answered (a failure: how it is reported),
            # so that the outcome's keys do not depend on whether the read took a while
            call(key + ".check", lambda: a.check_xfer_state(h))
        out[key] = st if st in ("DONE", "ERR", "PROC") else out.get(key + ".check")
        call(key + ".release", lambda: a.release_xfer_handle(h))

    run("write", "WRITE", [(src, N, 0)], [(0, N, fd)])
    out["write.disk_ok"] = open(path, "rb").read() == pattern
    run("read", "READ", [(dst, N, 0)], [(0, N, fd)])
    out["read.mem_ok"] = ctypes.string_at(dst, N) == pattern
    ctypes.memset(dst, 0, N)
    run("outside_registration", "READ", [(dst, 4096, 0)], [(N, 4096, fd)])
    run("unregistered_fd", "READ", [(dst, 4096, 0)], [(0, 4096, 9999)])
    # a registration longer than its file: a read past the file's end
    short = os.path.join(d, "short")
    with open(short, "wb") as f:
        f.write(b"\x22" * 4096)
    sfd = os.open(short, os.O_RDWR)
    call("register_file_longer_than_file", lambda: a.register_memory([(0, N, sfd, "")], "FILE"))
    run("past_eof", "READ", [(dst, 8192, 0)], [(0, 8192, sfd)])
    out["past_eof.mem_untouched"] = ctypes.string_at(dst, N) == b"\0" * N
    # O_DIRECT
    dpath = os.path.join(d, "direct")
    with open(dpath, "wb") as f:
        f.write(b"\x11" * N)
    dfd = os.open(dpath, os.O_RDWR | os.O_DIRECT)
    call("register_file_direct", lambda: a.register_memory([(0, N, dfd, "")], "FILE"))
    run("direct_misaligned_write", "WRITE", [(src + 1, 100, 0)], [(1, 100, dfd)])
    out["direct_misaligned_write.disk_untouched"] = open(dpath, "rb").read() == b"\x11" * N
    run("direct_misaligned_read", "READ", [(dst + 1, 4096, 0)], [(1, 4096, dfd)])
    run("direct_aligned_read", "READ", [(dst, 4096, 0)], [(0, 4096, dfd)])
    out["direct_aligned_read.mem_ok"] = ctypes.string_at(dst, 4096) == b"\x11" * 4096
    # path mode
    call("path_missing", lambda: a.register_memory([(0, N, 100, "rw:" + os.path.join(d, "nope"))], "FILE"))
    call("path_probe", lambda: a.register_memory(a.get_reg_descs([(0, 4096, 1, "rw:/nonexistent-nixl-probe")], "FILE")))
    pm = os.path.join(d, "pm")
    preg = call("path_create", lambda: a.register_memory([(0, N, 777, "rw,create:" + pm)], "FILE"))
    out["path_create.exists"] = os.path.exists(pm)
    out["path_create.open"] = sum(1 for f in os.listdir("/proc/self/fd")
                                  if os.path.realpath(f"/proc/self/fd/{f}") == pm)
    run("path_write", "WRITE", [(src, N, 0)], [(0, N, 777)])
    out["path_write.disk_ok"] = open(pm, "rb").read() == pattern
    call("path_duplicate_id", lambda: a.register_memory([(0, N, 777, "rw:" + pm)], "FILE"))
    out["query"] = a.query_memory([(0, 0, 0, pm), (0, 0, 0, os.path.join(d, "nope")), (0, 0, 0, "rw:" + pm)],
                                  "POSIX", "FILE")
    out["query"] = [None if q is None else sorted(q) for q in out["query"]]
    call("query_unknown_backend", lambda: a.query_memory([(0, 0, 0, pm)], "GDS", "FILE"))
    if preg is not None:
        call("path_deregister", lambda: a.deregister_memory(preg))
    out["path_deregister.open"] = sum(1 for f in os.listdir("/proc/self/fd")
                                      if os.path.realpath(f"/proc/self/fd/{f}") == pm)
    # prepared lists, indices crossing
    fh = a.prep_xfer_dlist("me", [(0, 4096, fd), (4096, 4096, fd)], "FILE")
    mh = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(dst, 4096, 0), (dst + 4096, 4096, 0)], "DRAM")
    ctypes.memset(dst, 0, N)
    h = a.make_prepped_xfer("READ", mh, [0, 1], fh, [1, 0])
    st = a.transfer(h)
    while st == "PROC":
        st = a.check_xfer_state(h)
    out["prepped_read"] = st
    out["prepped_read.mem_ok"] = ctypes.string_at(dst, 8192) == pattern[4096:8192] + pattern[:4096]
    out["prepped_read.backend"] = a.query_xfer_backend(h)
    a.release_xfer_handle(h)
    call("unknown_parameter", lambda: nixl_agent("p", nixl_agent_config(backends=[])).create_backend(
        "POSIX", {"no_such_parameter": "1"}))
    if freg is not None:
        call("deregister_file", lambda: a.deregister_memory(freg))
    for f in (fd, sfd, dfd):
        os.close(f)
    print(json.dumps(out), flush=True)
    os._exit(0)        # real NIXL's teardown is not what is compared


if __name__ == "__main__":
    main()
