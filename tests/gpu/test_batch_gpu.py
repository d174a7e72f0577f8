"""hub.load_batch / save_batch with CUDA memory: thousands of scattered reads land in a GPU
buffer (checked on the GPU against the file uploaded through torch), writes from the GPU land
in a file (checked against the file), with the driver's batched copy and without it."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from p2phub import batch
from p2phub.errors import UsageError
from p2phub.hub import Hub

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture()
def src(tmp_path):
    data = np.random.default_rng(7).integers(0, 256, 64 * MiB + 4321, dtype=np.uint8)
    p = tmp_path / "src.bin"
    data.tofile(p)
    return str(p), data


def _check_on_gpu(torch, t, gpu_file, offs, dsts, size) -> bool:
    ar = torch.arange(size, device="cuda")
    o = torch.as_tensor(offs, device="cuda")[:, None] + ar
    d = torch.as_tensor(dsts, device="cuda")[:, None] + ar
    return bool(torch.equal(t[d.flatten()], gpu_file[o.flatten()]))


@pytest.mark.parametrize("size,io_thread", [(4 * KiB, True), (4 * KiB, False), (64 * KiB, True),
                                            (1 * MiB + 4 * KiB, True)])
def test_scattered_reads_into_gpu_memory(torch, src, size, io_thread) -> None:
    path, data = src
    gpu_file = torch.from_numpy(data).cuda()          # the independent side, on the GPU
    n = 4096 if size <= 64 * KiB else 48
    rng = np.random.default_rng(size)
    offs = rng.integers(0, (data.size - size) // 4096, n) * 4096
    offs[::7] += 123                                     # some unaligned: O_DIRECT skips bytes
    dsts = rng.permutation(n).astype(np.int64) * size
    t = torch.zeros(n * size, dtype=torch.uint8, device="cuda")
    with Hub(mode="staged") as hub:
        batch.configure_batch(hub, io_thread=io_thread)
        with hub.register(t) as reg:
            f = hub.load_batch(storage=path, offsets=offs, lengths=size, memory=reg,
                               mem_offsets=dsts, per_entry=True)
            f.wait(120)
            assert f.stats["io"] == {path: "O_DIRECT"}
            # 1 MiB entries get 1 MiB slots (two base slots each), smaller ones the base slots
            carved = (MiB, batch.DEFAULT_SLOTS // 2) if size > MiB else \
                (batch.DEFAULT_SLOT, batch.DEFAULT_SLOTS)
            assert (f.stats["slot_bytes"], f.stats["slots"]) == carved
            assert all(e.done() and e.exception() is None for e in f.entries)
            torch.cuda.synchronize()
            assert _check_on_gpu(torch, t, gpu_file, offs, dsts, size)
            assert f.stats["copies"] >= 1 and f.stats["io_thread"] is io_thread


@pytest.mark.parametrize("n", [1, 2])
def test_a_batch_of_few_small_reads_into_gpu_memory_goes_as_requests(torch, src, n) -> None:
    path, data = src
    t = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    offs, lens, dsts = [5 * MiB, 123][:n], [64 * KiB, 4096][:n], [256 * KiB, 8][:n]
    with Hub(mode="staged") as hub, hub.register(t) as reg:
        f = hub.load_batch(storage=path, offsets=offs, lengths=lens, memory=reg,
                           mem_offsets=dsts)
        f.wait(60)
        assert f.stats["requests"] == n and list(f.results) == lens
        for o, ln, d in zip(offs, lens, dsts):
            assert bytes(t[d:d + ln].cpu().numpy()) == data[o:o + ln].tobytes()
        # the same on a hub.open() file: its own fd, no planning
        t.zero_()
        with hub.open(path) as opened:
            f = hub.load_batch(storage=opened, offsets=offs, lengths=lens, memory=reg,
                               mem_offsets=dsts)
            f.wait(60)
            assert f.stats["requests"] == n and list(f.results) == lens
        for o, ln, d in zip(offs, lens, dsts):
            assert bytes(t[d:d + ln].cpu().numpy()) == data[o:o + ln].tobytes()
        assert reg.holds == 0


def test_mixed_gpu_and_host_registrations_and_save(torch, src, tmp_path) -> None:
    path, data = src
    t = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    host = bytearray(MiB)
    with Hub(mode="staged") as hub:
        batch.configure_batch(hub, depth=32, slot=64 * KiB, slots=48)
        rg, rh = hub.register(t), hub.register(host)
        f = hub.load_batch([(path, 0, 300 * KiB, rg, 4096), (path, 5, 1000, rh, 17),
                            (path, MiB, 64 * KiB, rg, 2 * MiB)])
        f.wait(60)
        assert bytes(t[4096:4096 + 300 * KiB].cpu().numpy()) == data[:300 * KiB].tobytes()
        assert bytes(t[2 * MiB:2 * MiB + 64 * KiB].cpu().numpy()) == data[MiB:MiB + 64 * KiB].tobytes()
        assert bytes(host[17:1017]) == data[5:1005].tobytes()
        # save: GPU -> scattered places of a file
        out = str(tmp_path / "out.bin")
        np.zeros(4 * MiB, np.uint8).tofile(out)
        offs = [0, 3 * MiB, MiB + 4096]
        moffs = [4096, 2 * MiB, 4096 + 8192]
        hub.save_batch(storage=out, offsets=offs, lengths=64 * KiB, memory=rg,
                       mem_offsets=moffs).wait(60)
        got = np.fromfile(out, np.uint8)
        cpu = t.cpu().numpy()
        for o, m in zip(offs, moffs):
            assert np.array_equal(got[o:o + 64 * KiB], cpu[m:m + 64 * KiB])
        # a bad entry: nothing lands
        t.zero_()
        with pytest.raises(UsageError, match=r"entry 2: memory range"):
            hub.load_batch([(path, 0, 4096, rg, 0), (path, 0, 4096, rg, 4096),
                            (path, 0, 4096, rg, 8 * MiB)])
        torch.cuda.synchronize()
        assert not t.any().item()
        rg.close(), rh.close()


def test_without_the_driver_batch_copy(torch, src) -> None:
    """P2PHUB_NO_BATCH_COPY: one cuMemcpyHtoDAsync per run instead of cuMemcpyBatchAsync."""
    path, _ = src
    code = (
        "import numpy as np, torch, sys\n"
        "from p2phub.hub import Hub\n"
        f"path = {path!r}\n"
        "data = np.fromfile(path, np.uint8)\n"
        "n, size = 2000, 4096\n"
        "rng = np.random.default_rng(1)\n"
        "offs = rng.integers(0, (data.size - size) // 4096, n) * 4096\n"
        "dsts = rng.permutation(n) * size\n"
        "t = torch.zeros(n * size, dtype=torch.uint8, device='cuda')\n"
        "with Hub(mode='staged') as hub, hub.register(t) as reg:\n"
        "    f = hub.load_batch(storage=path, offsets=offs, lengths=size, memory=reg, mem_offsets=dsts)\n"
        "    f.wait(60)\n"
        "    assert not f.stats['batch_copy_api'], f.stats\n"
        "cpu = t.cpu().numpy()\n"
        "for o, d in zip(offs, dsts):\n"
        "    assert np.array_equal(cpu[d:d + size], data[o:o + size])\n"
        "print('ok')\n")
    env = dict(os.environ, P2PHUB_NO_BATCH_COPY="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def test_per_request_loads_and_saves_of_an_open_file(torch, src, tmp_path) -> None:
    """hub.open() once, then hub.load per request into GPU memory (checked on the GPU) and
    hub.save per request back to a file (checked against the file)."""
    path, data = src
    gpu_file = torch.from_numpy(data).cuda()
    size, n = 4 * KiB, 2048
    rng = np.random.default_rng(11)
    offs = rng.integers(0, (data.size - size) // 4096, n) * 4096
    offs[::5] += 77                                      # some unaligned
    dsts = rng.permutation(n).astype(np.int64) * size
    t = torch.zeros(n * size, dtype=torch.uint8, device="cuda")
    out = tmp_path / "out.bin"
    with Hub(mode="staged") as hub, hub.register(t) as reg:
        with hub.open(path) as f:
            fences = [hub.load(f, reg, int(o), size, int(d)) for o, d in zip(offs, dsts)]
            for fe in fences:
                fe.wait(120)
        torch.cuda.synchronize()
        assert _check_on_gpu(torch, t, gpu_file, offs, dsts, size)
        with hub.open(out, "w") as g:
            saves = [hub.save(reg, g, k * size, size, int(dsts[k]), sync=False)
                     for k in range(64)]
            for fe in saves:
                fe.wait(120)
    got = np.fromfile(out, np.uint8)
    for k in range(64):
        o = int(offs[k])
        assert np.array_equal(got[k * size:(k + 1) * size], data[o:o + size])
