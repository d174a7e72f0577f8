"""One side of one KV bench method, in its own process (``python -m p2phub.commands.bench_kv_peer``).

Methods move the same bytes: TOTAL bytes per transfer as TOTAL / block pages, each page to
a scattered place (a seeded permutation) on the target, except ``raw``, one socket stream
of TOTAL bytes into one buffer, the ceiling. The initiator times `iters` transfers after one
warm-up and prints {"seconds", "bytes"}; the target checks every byte of the last transfer
after the method's own completion signal and prints {"bytes_ok"}.

With ``--device cuda`` p2phub moves between two CUDA pools (torch tensors on cuda:0) and the
``torch`` method is the plain baseline: one device-to-host copy into pinned memory, a socket
stream, one host-to-device copy.

Protocol with the parent, JSON lines: the target prints {"md", "addr"}; the parent starts
the initiator with that line on stdin; the initiator prints {"md"}, which the parent hands
to the target's stdin; the initiator prints its result, then the target its result.
"""

from __future__ import annotations

import argparse
import base64
import ctypes
import json
import mmap
import os
import random
import socket
import sys
import time

SEED = 20261130


def _say(d: dict) -> None:
    sys.stdout.write(json.dumps(d) + "\n")
    sys.stdout.flush()


def _hear() -> dict:
    line = sys.stdin.readline()
    if not line:
        raise SystemExit("parent went away")
    return json.loads(line)


def _buf(n: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, n, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    c = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(c)
    del c
    return m, addr


def pattern(total: int) -> bytes:
    return random.Random(SEED).randbytes(total)


def perm(n: int) -> list[int]:
    return random.Random(SEED + n).sample(range(n), n)


def _check_scattered(buf: memoryview, src: bytes, block: int, p: list[int]) -> bool:
    return all(buf[j * block:(j + 1) * block] == src[i * block:(i + 1) * block]
               for i, j in enumerate(p))


# ---------------------------------------------------------------------------- raw
def raw(role: str, total: int, block: int, iters: int) -> None:
    if role == "target":
        m, _ = _buf(total)
        ls = socket.create_server(("127.0.0.1", 0))
        _say({"md": "", "addr": 0, "port": ls.getsockname()[1]})
        _hear()
        s, _ = ls.accept()
        view = memoryview(m)
        for _ in range(iters + 1):
            got = 0
            while got < total:
                n = s.recv_into(view[got:], total - got)
                if not n:
                    raise SystemExit("initiator closed")
                got += n
            s.sendall(b"k")
        ok = bytes(view) == pattern(total)
        view.release()
        _say({"bytes_ok": ok})
        return
    peer = _hear()
    src = pattern(total)
    m, _ = _buf(total)
    m[:] = src
    s = socket.create_connection(("127.0.0.1", peer["port"]))
    _say({"md": ""})
    view = memoryview(m)
    t0 = 0.0
    for i in range(iters + 1):
        if i == 1:
            t0 = time.perf_counter()
        s.sendall(view)
        if s.recv(1) != b"k":
            raise SystemExit("target closed")
    _say({"seconds": time.perf_counter() - t0, "bytes": iters * total})


# ---------------------------------------------------------------------------- p2phub
def _kv_layout(total: int, block: int):
    from ..kv.layout import KVLayout
    pages = total // block
    layers = 4 if pages >= 8 else 1
    return KVLayout(num_layers=layers, blocks_per_layer=pages // (2 * layers), block_bytes=block,
                    dtype="uint8")


def _initiate(agent, peer: dict, bpl: int, p: list[int], iters: int, total: int) -> None:
    """The initiator's side of a p2phub method: every page of each layer to its place in the
    permutation `p`, one request per transfer, timed after one warm-up."""
    name = agent.add_remote(base64.b64decode(peer["md"]))
    _say({"md": ""})
    ids = list(range(bpl))
    t0 = 0.0
    for i in range(iters + 1):
        if i == 1:
            t0 = time.perf_counter()
        agent.send_request(name, i, ids, p).wait(120)
    _say({"seconds": time.perf_counter() - t0, "bytes": iters * total})
    agent.close()


def p2phub(role: str, total: int, block: int, iters: int, device: str = "cpu") -> None:
    if device == "cuda":
        return p2phub_cuda(role, total, block, iters)
    from ..kv.agent import Agent
    from ..kv.pool import KVPool
    lay = _kv_layout(total, block)
    bpl = lay.blocks_per_layer
    pool = KVPool.host(lay)
    agent = Agent(role, pool, stall_timeout=30)
    src = pattern(total)
    p = perm(bpl)

    def page_src(ly: int, kv: int, b: int) -> bytes:
        g = (ly * 2 + kv) * bpl + b
        return src[g * block:(g + 1) * block]

    if role == "target":
        _say({"md": base64.b64encode(agent.metadata()).decode(), "addr": 0})
        _hear()
        r = agent.expect("initiator", iters)
        r.done.wait(120)
        ok = all(bytes(pool.block(ly, kv, p[b])) == page_src(ly, kv, b)
                 for ly in range(lay.num_layers) for kv in range(2) for b in range(bpl))
        _say({"bytes_ok": ok})
        agent.close()
        return
    peer = _hear()
    for ly in range(lay.num_layers):
        for kv in range(2):
            for b in range(bpl):
                pool.block(ly, kv, b)[:] = page_src(ly, kv, b)
    _initiate(agent, peer, bpl, p, iters, total)


def p2phub_cuda(role: str, total: int, block: int, iters: int) -> None:
    """p2phub.kv.Agent between two CUDA pools (torch tensors on cuda:0, one per layer),
    staged through pinned host memory; the target checks every page on the GPU."""
    import torch
    from ..kv.agent import Agent
    from ..kv.pool import KVPool
    lay = _kv_layout(total, block)
    bpl, seg = lay.blocks_per_layer, lay.segment_bytes
    src = pattern(total)
    p = perm(bpl)
    if role == "target":
        ts = [torch.zeros(seg, dtype=torch.uint8, device="cuda:0") for _ in range(lay.num_layers)]
    else:
        ts = [torch.frombuffer(bytearray(src[i * seg:(i + 1) * seg]), dtype=torch.uint8).cuda()
              for i in range(lay.num_layers)]
    torch.cuda.synchronize()
    agent = Agent(role, KVPool.cuda(lay, ts), stall_timeout=30)
    if role == "target":
        _say({"md": base64.b64encode(agent.metadata()).decode(), "addr": 0})
        _hear()
        r = agent.expect("initiator", iters)
        r.done.wait(120)
        pi = torch.tensor(p, device="cuda:0")
        ok = all(torch.equal(ts[ly].view(2, bpl, block).index_select(1, pi),
                             torch.frombuffer(bytearray(src[ly * seg:(ly + 1) * seg]),
                                              dtype=torch.uint8).cuda().view(2, bpl, block))
                 for ly in range(lay.num_layers))
        _say({"bytes_ok": ok})
        agent.close()
        return
    peer = _hear()
    _initiate(agent, peer, bpl, p, iters, total)


def p2phub_read(role: str, total: int, block: int, iters: int) -> None:
    """p2phub.kv.Agent READ of VRAM descriptors: the target's bytes are one CUDA tensor on
    cuda:0, registered as (addr, len, dev) with no KV layout; the initiator pulls every page
    into a scattered place of its own VRAM (make_xfer op="READ"), staged through pinned
    memory on both sides, and checks every page on its GPU (it holds the result)."""
    import torch
    from ..kv.agent import Agent
    n = total // block
    if role == "target":
        t = torch.frombuffer(bytearray(pattern(total)), dtype=torch.uint8).cuda()
        torch.cuda.synchronize()
        agent = Agent(role, stall_timeout=30)
        agent.register_memory(t.data_ptr(), total, device=t.device.index)
        _say({"md": base64.b64encode(agent.metadata()).decode(), "addr": t.data_ptr()})
        _hear()
        res = _hear()
        _say({"bytes_ok": bool(res.get("ok"))})
        agent.close()
        return
    peer = _hear()
    d = torch.zeros(total, dtype=torch.uint8, device="cuda:0")
    agent = Agent(role, stall_timeout=30)
    agent.register_memory(d.data_ptr(), total, device=d.device.index)
    name = agent.add_remote(base64.b64decode(peer["md"]))
    _say({"md": ""})
    p = perm(n)
    loc = agent.prep_local([(d.data_ptr() + j * block, block) for j in p])
    rem = agent.prep_remote(name, [(peer["addr"] + i * block, block) for i in range(n)])
    x = agent.make_xfer(name, loc, range(n), rem, range(n), op="READ")
    t0 = 0.0
    for i in range(iters + 1):
        if i == 1:
            t0 = time.perf_counter()
        agent.post(x)
        x.wait(120)
    secs = time.perf_counter() - t0
    src = torch.frombuffer(bytearray(pattern(total)), dtype=torch.uint8).cuda().view(n, block)
    got = d.view(n, block).index_select(0, torch.tensor(p, device=d.device))
    _say({"seconds": secs, "bytes": iters * total, "ok": bool(torch.equal(src, got))})
    agent.close()


# ---------------------------------------------------------------------------- torch staging
def torch_staged(role: str, total: int, block: int, iters: int) -> None:
    """The plain way to move GPU bytes over TCP: one contiguous device-to-host copy into a
    pinned tensor, a socket stream of it, one host-to-device copy, each step waiting for the
    one before (no page scatter: a generous baseline)."""
    import torch
    stage = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    view = memoryview(stage.numpy()).cast("B")
    if role == "target":
        dev = torch.zeros(total, dtype=torch.uint8, device="cuda:0")
        ls = socket.create_server(("127.0.0.1", 0))
        _say({"md": "", "addr": 0, "port": ls.getsockname()[1]})
        _hear()
        s, _ = ls.accept()
        for _ in range(iters + 1):
            got = 0
            while got < total:
                n = s.recv_into(view[got:], total - got)
                if not n:
                    raise SystemExit("initiator closed")
                got += n
            dev.copy_(stage, non_blocking=True)
            torch.cuda.synchronize()
            s.sendall(b"k")
        ok = torch.equal(dev.cpu(), torch.frombuffer(bytearray(pattern(total)), dtype=torch.uint8))
        _say({"bytes_ok": ok})
        return
    peer = _hear()
    dev = torch.frombuffer(bytearray(pattern(total)), dtype=torch.uint8).cuda()
    s = socket.create_connection(("127.0.0.1", peer["port"]))
    _say({"md": ""})
    t0 = 0.0
    for i in range(iters + 1):
        if i == 1:
            t0 = time.perf_counter()
        stage.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        s.sendall(view)
        if s.recv(1) != b"k":
            raise SystemExit("target closed")
    _say({"seconds": time.perf_counter() - t0, "bytes": iters * total})


# ---------------------------------------------------------------------------- p2phub, NIXL-like calls
def p2phub_xfer(role: str, total: int, block: int, iters: int) -> None:
    """p2phub's own API the way the NIXL methods use theirs: one registered buffer, lists
    prepared once (prep_local / prep_remote), one transfer by index (make_xfer), posted and
    its state polled until done, `iters` times, as the nixl method polls check_xfer_state.
    The same wire work and the same waiting as p2phub-nixl, without the adapter."""
    from ..kv.agent import Agent
    n = total // block
    p = perm(n)
    agent = Agent(role, stall_timeout=30)
    m, addr = _buf(total)
    if role == "initiator":
        m[:] = pattern(total)
    agent.register_memory(addr, total)
    if role == "target":
        _say({"md": base64.b64encode(agent.metadata()).decode(), "addr": addr})
        _hear()
        agent.wait_notif("initiator", b"final", 120)
        _say({"bytes_ok": _check_scattered(memoryview(m), pattern(total), block, p)})
        agent.close()
        return
    peer = _hear()
    name = agent.add_remote(base64.b64decode(peer["md"]))
    _say({"md": ""})
    lh = agent.prep_local([(addr + i * block, block) for i in range(n)])
    rh = agent.prep_remote(name, [(peer["addr"] + j * block, block) for j in p])
    idx = list(range(n))
    x = agent.make_xfer(name, lh, idx, rh, idx)
    t0 = 0.0
    for i in range(iters + 1):
        if i == 1:
            t0 = time.perf_counter()
        st = agent.post(x)
        while st == "PROC":
            time.sleep(0)      # what check_xfer_state does between polls
            st = x.state
        if st != "DONE":
            raise SystemExit(f"p2phub-xfer transfer: {x.error}")
    secs = time.perf_counter() - t0
    agent.send_notif(name, b"final")
    _say({"seconds": secs, "bytes": iters * total})
    agent.close()


# ---------------------------------------------------------------------------- nixl
def p2phub_nixl(role: str, total: int, block: int, iters: int) -> None:
    """The nixl method's calls, unchanged, on p2phub.nixl (NIXL's API over p2phub)."""
    nixl(role, total, block, iters, impl="p2phub")


def nixl(role: str, total: int, block: int, iters: int, impl: str = "nixl") -> None:
    import numpy as np
    if impl == "nixl":
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    else:
        from ..nixl._api import nixl_agent, nixl_agent_config
    n = total // block
    p = perm(n)
    agent = nixl_agent(role, nixl_agent_config(backends=["UCX"]))
    m, addr = _buf(total)
    if role == "initiator":
        m[:] = pattern(total)
    reg = agent.register_memory([(addr, total, 0, "")], "DRAM")
    if role == "target":
        _say({"md": base64.b64encode(agent.get_agent_metadata()).decode(), "addr": addr})
        peer = _hear()
        agent.add_remote_agent(base64.b64decode(peer["md"]))
        deadline = time.monotonic() + 120
        while not agent.check_remote_xfer_done("initiator", b"final") and time.monotonic() < deadline:
            time.sleep(0.001)
        ok = _check_scattered(memoryview(m), pattern(total), block, p)
        _say({"bytes_ok": ok})
        agent.deregister_memory(reg)
        os._exit(0)
    peer = _hear()
    name = agent.add_remote_agent(base64.b64decode(peer["md"]))
    _say({"md": base64.b64encode(agent.get_agent_metadata()).decode()})
    local = np.array([(addr + i * block, block, 0) for i in range(n)], dtype=np.uint64)
    remote = np.array([(peer["addr"] + j * block, block, 0) for j in p], dtype=np.uint64)
    lh = agent.prep_xfer_dlist("", local, "DRAM")
    rh = agent.prep_xfer_dlist(name, remote, "DRAM")
    idx = np.arange(n, dtype=np.int32)
    h = agent.make_prepped_xfer("WRITE", lh, idx, rh, idx, b"")
    t0 = 0.0
    for i in range(iters + 1):
        if i == 1:
            t0 = time.perf_counter()
        st = agent.transfer(h)
        while st == "PROC":
            st = agent.check_xfer_state(h)
        if st != "DONE":
            raise SystemExit(f"nixl transfer: {st}")
    secs = time.perf_counter() - t0
    hn = agent.make_prepped_xfer("WRITE", lh, idx[:1], rh, idx[:1], b"final")
    st = agent.transfer(hn)
    while st == "PROC":
        st = agent.check_xfer_state(hn)
    _say({"seconds": secs, "bytes": iters * total})
    time.sleep(1.0)  # the notification leaves from NIXL's progress path
    os._exit(0)      # nixl 1.5.1 may crash at interpreter exit


# ---------------------------------------------------------------------------- mooncake
def mooncake(role: str, total: int, block: int, iters: int) -> None:
    from mooncake.engine import TransferEngine
    n = total // block
    p = perm(n)
    eng = TransferEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake initialize failed")
    m, addr = _buf(total)
    if role == "initiator":
        m[:] = pattern(total)
    if eng.register_memory(addr, total) != 0:
        raise SystemExit("mooncake register_memory failed")
    if role == "target":
        _say({"md": f"127.0.0.1:{eng.get_rpc_port()}", "addr": addr})
        _hear()
        _hear()  # the initiator's result went to the parent: the data has landed
        ok = _check_scattered(memoryview(m), pattern(total), block, p)
        _say({"bytes_ok": ok})
        os._exit(0)
    peer = _hear()
    session = peer["md"]
    _say({"md": ""})
    batch = 512   # mooncake's TCP transport rejects more than ~1024 queued per peer
    loc = [addr + i * block for i in range(n)]
    rem = [peer["addr"] + j * block for j in p]
    lens = [block] * n
    t0 = 0.0
    for i in range(iters + 1):
        if i == 1:
            t0 = time.perf_counter()
        for k in range(0, n, batch):
            rc = eng.batch_transfer_sync_write(session, loc[k:k + batch], rem[k:k + batch],
                                               lens[k:k + batch])
            if rc != 0:
                raise SystemExit(f"mooncake batch_transfer_sync_write: {rc}")
    _say({"seconds": time.perf_counter() - t0, "bytes": iters * total})
    os._exit(0)


METHODS = {"raw": raw, "p2phub": p2phub, "nixl": nixl, "mooncake": mooncake, "torch": torch_staged,
           "p2phub-xfer": p2phub_xfer, "p2phub-nixl": p2phub_nixl, "p2phub-read": p2phub_read}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", choices=sorted(METHODS), required=True)
    ap.add_argument("--role", choices=("target", "initiator"), required=True)
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = ap.parse_args()
    if a.method == "p2phub":
        p2phub(a.role, a.total, a.block, a.iters, a.device)
    else:
        METHODS[a.method](a.role, a.total, a.block, a.iters)


if __name__ == "__main__":
    main()
