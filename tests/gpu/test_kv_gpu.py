"""CUDA KV pools over the TCP agent on 127.0.0.1: torch CUDA tensors on both sides, pages
staged through pinned host memory, every byte checked on the GPU against the source."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytestmark = pytest.mark.gpu

torch = pytest.importorskip("torch")

from p2phub.errors import UsageError  # noqa: E402
from p2phub.kv import Agent, KVLayout, KVPool  # noqa: E402
from p2phub.ordering.errors import FenceError  # noqa: E402

LAY = KVLayout(num_layers=32, blocks_per_layer=256, block_bytes=64 << 10)


def _tensors(lay: KVLayout, seed: int | None, device: str = "cuda:0") -> list:
    out = []
    g = torch.Generator(device=device)
    for i in range(lay.num_segments):
        if seed is None:
            out.append(torch.zeros(lay.segment_bytes, dtype=torch.uint8, device=device))
        else:
            g.manual_seed(seed * 1000 + i)
            out.append(torch.randint(0, 256, (lay.segment_bytes,), dtype=torch.uint8, device=device,
                                     generator=g))
    torch.cuda.synchronize()
    return out


def _pages(t, lay: KVLayout):
    return t.view(lay.kv, lay.blocks_per_layer, lay.block_bytes)


def _verify(src: list, dst: list, lay: KVLayout, sids: list[int], dids: list[int], layers) -> None:
    si = torch.tensor(sids, device=src[0].device)
    di = torch.tensor(dids, device=dst[0].device)
    for ly in layers:
        a = _pages(src[ly], lay).index_select(1, si.to(src[ly].device))
        b = _pages(dst[ly], lay).index_select(1, di.to(dst[ly].device))
        assert torch.equal(a.to(b.device), b), f"layer {ly}: received pages differ from the source"


def _ids(n: int, seed: int) -> tuple[list[int], list[int]]:
    rnd = random.Random(seed)
    return rnd.sample(range(LAY.blocks_per_layer), n), rnd.sample(range(LAY.blocks_per_layer), n)


def test_gpu_to_gpu_32_layers_scattered_every_byte(tmp_path) -> None:
    src, dst = _tensors(LAY, 1), _tensors(LAY, None)
    sids, dids = _ids(200, 2)
    with Agent("prefill", KVPool.cuda(LAY, src), stall_timeout=20) as a, \
            Agent("decode", KVPool.cuda(LAY, dst), stall_timeout=20) as b:
        a.add_remote(b.metadata())
        r = b.expect("prefill", 5)
        seen: dict[str, object] = {}

        def on_layer0(_f) -> None:
            seen["t0"] = time.monotonic()
            seen["last_done_then"] = r.layer(LAY.num_layers - 1).done()

        r.layer(0).add_done_callback(on_layer0)
        x = a.send_request("decode", 5, sids, dids, notif=b"req-5")
        x.wait(60)
        r.done.wait(10)
        t_last = time.monotonic()
        assert seen.get("last_done_then") is False, "layer 0 became visible only after the last layer"
        assert seen["t0"] <= t_last
        _verify(src, dst, LAY, sids, dids, range(LAY.num_layers))
        untouched = sorted(set(range(LAY.blocks_per_layer)) - set(dids))
        ui = torch.tensor(untouched, device="cuda:0")
        for ly in (0, 31):
            assert int(_pages(dst[ly], LAY).index_select(1, ui).count_nonzero()) == 0
        assert b.get_new_notifs() == {"prefill": [b"req-5"]}
        # again, with other pages (the staging buffers are reused)
        sids2, dids2 = _ids(64, 3)
        r2 = b.expect("prefill", 6)
        a.send_request("decode", 6, sids2, dids2).wait(60)
        r2.done.wait(10)
        _verify(src, dst, LAY, sids2, dids2, range(LAY.num_layers))


@pytest.mark.parametrize("direction", ["host->cuda", "cuda->host"])
def test_host_and_cuda_pools_mix(direction) -> None:
    lay = KVLayout(num_layers=8, blocks_per_layer=128, block_bytes=16 << 10)
    sids, dids = random.Random(9).sample(range(128), 100), random.Random(10).sample(range(128), 100)
    gpu = _tensors(lay, 4 if direction.startswith("cuda") else None)
    host = KVPool.host(lay)
    if direction.startswith("host"):
        for ly in range(lay.num_layers):
            host.segments[ly].view[:] = torch.randint(0, 256, (lay.segment_bytes,), dtype=torch.uint8,
                                                      generator=torch.Generator().manual_seed(ly)).numpy().tobytes()
        sp, rp = host, KVPool.cuda(lay, gpu)
    else:
        sp, rp = KVPool.cuda(lay, gpu), host
    with Agent("s", sp) as a, Agent("r", rp) as b:
        a.add_remote(b.metadata())
        r = b.expect("s", 1)
        a.send_request("r", 1, sids, dids).wait(30)
        r.done.wait(10)
    host_t = [torch.frombuffer(bytearray(host.segments[ly].view), dtype=torch.uint8)
              for ly in range(lay.num_layers)]
    if direction.startswith("host"):
        _verify(host_t, gpu, lay, sids, dids, range(lay.num_layers))
    else:
        _verify(gpu, host_t, lay, sids, dids, range(lay.num_layers))


SENDER = textwrap.dedent("""
    import json, sys, time, torch
    from p2phub.kv import Agent, KVLayout, KVPool
    lay = KVLayout.from_dict(json.loads(sys.argv[1]))
    ts = []
    for i in range(lay.num_segments):
        g = torch.Generator(device="cuda:0"); g.manual_seed(7000 + i)
        ts.append(torch.randint(0, 256, (lay.segment_bytes,), dtype=torch.uint8, device="cuda:0", generator=g))
    torch.cuda.synchronize()
    a = Agent("prefill-proc", KVPool.cuda(lay, ts), stall_timeout=2)
    print(json.dumps({"md": a.metadata().decode()}), flush=True)
    m = json.loads(sys.stdin.readline())
    peer = a.add_remote(m["md"])
    for ly in range(lay.num_layers):            # paced: one layer at a time
        a.send_request(peer, 1, m["src"], m["dst"], layers=[ly], end=ly == lay.num_layers - 1).wait(30)
        print(json.dumps({"sent": ly}), flush=True)
        time.sleep(m["pace"])
""")


def _sender_tensors(lay: KVLayout) -> list:
    out = []
    for i in range(lay.num_segments):
        g = torch.Generator(device="cuda:0")
        g.manual_seed(7000 + i)
        out.append(torch.randint(0, 256, (lay.segment_bytes,), dtype=torch.uint8, device="cuda:0",
                                 generator=g))
    return out


def test_two_processes_killed_sender_leaves_no_partial_layer_visible() -> None:
    lay = KVLayout(num_layers=32, blocks_per_layer=64, block_bytes=64 << 10)
    dst = _tensors(lay, None)
    sids, dids = random.Random(11).sample(range(64), 48), random.Random(12).sample(range(64), 48)
    p = subprocess.Popen([sys.executable, "-c", SENDER, json.dumps(lay.to_dict())],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        with Agent("decode-proc", KVPool.cuda(lay, dst), stall_timeout=2) as b:
            line = p.stdout.readline()  # type: ignore[union-attr]
            assert line, "the sender process did not start"
            b.add_remote(json.loads(line)["md"])
            r = b.expect("prefill-proc", 1)
            p.stdin.write(json.dumps({"md": b.metadata().decode(), "src": sids, "dst": dids,  # type: ignore[union-attr]
                                      "pace": 0.2}) + "\n")
            p.stdin.flush()  # type: ignore[union-attr]
            r.layer(0).wait(60)                    # layer 0 is usable while the sender goes on
            assert not r.layer(lay.num_layers - 1).done()
            r.layer(2).wait(30)
            os.kill(p.pid, signal.SIGKILL)
            t_kill = time.monotonic()
            with pytest.raises(FenceError):
                r.done.wait(15)
            assert time.monotonic() - t_kill < 10, "the dead sender was not noticed in time"
            landed = r.landed_layers()
            assert landed == list(range(len(landed))) and 3 <= len(landed) < lay.num_layers
            for ly in range(len(landed), lay.num_layers):
                assert r.layer(ly).failed() and r.visible_blocks(ly) == []
            _verify(_sender_tensors(lay), dst, lay, sids, dids, landed)
            # never-landed layers hold no bytes at all
            for ly in range(len(landed) + 1, lay.num_layers):
                assert int(dst[ly].count_nonzero()) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_cuda_pool_refusals_on_a_gpu() -> None:
    lay = KVLayout(num_layers=2, blocks_per_layer=4, block_bytes=4096)
    t = torch.zeros(2 * lay.segment_bytes, dtype=torch.uint8, device="cuda:0")
    with pytest.raises(UsageError, match="tensor 0 is not contiguous"):
        KVPool.cuda(lay, [t[::2], t[1::2]])
    with pytest.raises(UsageError, match="tensor 1 is on cpu"):
        KVPool.cuda(lay, [t[:lay.segment_bytes], torch.zeros(lay.segment_bytes, dtype=torch.uint8)])
    with pytest.raises(UsageError, match="segment 0 has 100 bytes"):
        KVPool.cuda(lay, [t[:100], t[:lay.segment_bytes]])
    if torch.cuda.device_count() > 1:
        u = torch.zeros(lay.segment_bytes, dtype=torch.uint8, device="cuda:1")
        with pytest.raises(UsageError, match="different CUDA devices"):
            KVPool.cuda(lay, [t[:lay.segment_bytes], u])


def test_cupy_arrays_through_cuda_array_interface() -> None:
    cp = pytest.importorskip("cupy")
    lay = KVLayout(num_layers=4, blocks_per_layer=32, block_bytes=8192)
    src = [cp.random.randint(0, 256, lay.segment_bytes, dtype=cp.uint8) for _ in range(4)]
    dst = [cp.zeros(lay.segment_bytes, dtype=cp.uint8) for _ in range(4)]
    cp.cuda.runtime.deviceSynchronize()
    ids = list(range(0, 32, 2))
    with Agent("s", KVPool.cuda(lay, src)) as a, Agent("r", KVPool.cuda(lay, dst)) as b:
        a.add_remote(b.metadata())
        r = b.expect("s", 1)
        a.send_request("r", 1, ids, ids).wait(30)
        r.done.wait(10)
    for ly in range(4):
        s = src[ly].reshape(2, 32, 8192)[:, ids]
        d = dst[ly].reshape(2, 32, 8192)[:, ids]
        assert bool((s == d).all())


def test_staging_freed_and_threads_end_on_close() -> None:
    lay = KVLayout(num_layers=2, blocks_per_layer=8, block_bytes=4096)
    src, dst = _tensors(lay, 5), _tensors(lay, None)
    before = {t.name for t in threading.enumerate()}
    with Agent("s", KVPool.cuda(lay, src)) as a, Agent("r", KVPool.cuda(lay, dst)) as b:
        a.add_remote(b.metadata())
        r = b.expect("s", 1)
        a.send_request("r", 1, [0, 1], [2, 3]).wait(30)
        r.done.wait(10)
    time.sleep(0.5)
    left = {t.name for t in threading.enumerate()} - before
    assert not {n for n in left if n.startswith(("kv-tx-", "kv-rx-", "kv-land-"))}, left


def _long_run_ids() -> tuple[list[int], list[int]]:
    """120 distinct pages each side: 40 consecutive ones first (one merged run), then scattered."""
    rest_s = random.Random(13).sample(range(40, 128), 80)
    rest_d = random.Random(14).sample([b for b in range(128) if not 50 <= b < 90], 80)
    return list(range(40)) + rest_s, list(range(50, 90)) + rest_d


def test_odd_staging_chunks_cut_runs_anywhere() -> None:
    lay = KVLayout(num_layers=8, blocks_per_layer=128, block_bytes=16 << 10)
    src, dst = _tensors(lay, 6), _tensors(lay, None)
    sids, dids = _long_run_ids()
    with Agent("s", KVPool.cuda(lay, src)) as a, Agent("r", KVPool.cuda(lay, dst)) as b:
        a.stage_chunk, b.stage_chunk = 100_003, 77_777
        a.add_remote(b.metadata())
        r = b.expect("s", 1)
        a.send_request("r", 1, sids, dids).wait(30)
        r.done.wait(10)
    _verify(src, dst, lay, sids, dids, range(lay.num_layers))


# ---------------------------------------------------------------------- VRAM descriptors
BLK, NBLK, LAYERS = 64 << 10, 128, 4


def _kv_tensors(where: str, seed: int | None) -> list:
    """4 layers x (K, V): one tensor of NBLK blocks each, on `where` ("cpu", "cuda:N")."""
    out = []
    for i in range(LAYERS * 2):
        if seed is None:
            out.append(torch.zeros(NBLK * BLK, dtype=torch.uint8, device=where))
        else:
            g = torch.Generator(device="cpu").manual_seed(seed * 100 + i)
            out.append(torch.randint(0, 256, (NBLK * BLK,), dtype=torch.uint8, generator=g).to(where))
    torch.cuda.synchronize()
    return out


def _register(agent: Agent, ts: list) -> None:
    for t in ts:   # (addr, len, dev) descriptors, no KVLayout
        agent.register_memory(t.data_ptr(), t.numel(), device=t.device.index if t.is_cuda else None)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_vram_descriptors_read_and_write_cuda_and_host_4_layers_scattered(op) -> None:
    devs = [f"cuda:{i}" for i in range(min(2, torch.cuda.device_count()))]
    kinds = [("cuda", "cuda"), ("cuda", "host"), ("host", "cuda")]
    with Agent("prefill", stall_timeout=20) as a, Agent("decode", stall_timeout=20) as b:
        mem = {("a", "cuda"): _kv_tensors(devs[0], None), ("a", "host"): _kv_tensors("cpu", None),
               ("b", "cuda"): _kv_tensors(devs[-1], None), ("b", "host"): _kv_tensors("cpu", None)}
        _register(a, mem[("a", "cuda")] + mem[("a", "host")])
        _register(b, mem[("b", "cuda")] + mem[("b", "host")])
        a.add_remote(b.metadata())
        b.add_remote(a.metadata())
        rnd = random.Random(9)
        for n, (ak, bk) in enumerate(kinds):
            src_side, dst_side = (("a", ak), ("b", bk)) if op == "WRITE" else (("b", bk), ("a", ak))
            src_ts, dst_ts = mem[src_side], mem[dst_side]
            for t, new in zip(src_ts, _kv_tensors("cpu", 10 + n)):   # registered memory, new bytes
                t.copy_(new)
            for t in dst_ts:
                t.zero_()
            torch.cuda.synchronize()     # NIXL's contract: the bytes are ready when posted
            sids, dids = rnd.sample(range(NBLK), 48), rnd.sample(range(NBLK), 48)
            a_ts, b_ts = mem[("a", ak)], mem[("b", bk)]
            a_ids, b_ids = (sids, dids) if op == "WRITE" else (dids, sids)
            ld = [(t.data_ptr() + i * BLK, BLK) for t in a_ts for i in a_ids]
            rd = [(t.data_ptr() + i * BLK, BLK) for t in b_ts for i in b_ids]
            idx = list(range(len(ld)))
            x = a.make_xfer("decode", a.prep_local(ld), idx, a.prep_remote("decode", rd), idx,
                            notif=f"{op}-{n}".encode(), op=op)
            a.post(x)
            x.wait(60)
            b.wait_notif("prefill", f"{op}-{n}".encode(), 10)
            si = torch.tensor(sids)
            di = torch.tensor(dids)
            for s_t, d_t in zip(src_ts, dst_ts):
                want = s_t.view(NBLK, BLK).index_select(0, si.to(s_t.device))
                got = d_t.view(NBLK, BLK).index_select(0, di.to(d_t.device))
                assert torch.equal(want.to(got.device), got), f"{op} {ak}<->{bk}: bytes differ"
