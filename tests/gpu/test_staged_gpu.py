"""The staged path on a real GPU: file -> tensor -> file, bytes verified from outside."""

from __future__ import annotations

import os
import threading

import pytest

from p2phub import staged
from p2phub.hub import Hub
from p2phub.staged import StagedModeError

MiB = 1 << 20


@pytest.fixture()
def src_file(tmp_path):
    data = os.urandom(40 * MiB + 12345)
    p = tmp_path / "src.bin"
    p.write_bytes(data)
    return p, data


def test_file_to_tensor_to_file(torch, src_file, tmp_path) -> None:
    path, data = src_file
    n = len(data)
    t = torch.zeros(n, dtype=torch.uint8, device="cuda")
    with Hub(mode="staged") as hub:
        staged.configure(hub, chunk=4 * MiB, lanes=4)   # many pieces per lane
        assert hub.mode == "staged" and "Hub(mode='staged')" in hub.mode_reason
        with hub.register(t) as reg:
            assert reg.mode == "staged"
            fence = hub.load(path, reg)
            fence.wait(60)
            assert fence.done() and fence.exception() is None
            assert bytes(t.cpu().numpy()) == data          # checked on the host, after the copy
            out = tmp_path / "out.bin"
            hub.save(reg, out).wait(60)
            assert out.read_bytes() == data
            with pytest.raises(StagedModeError, match="staged"):
                reg.dma_pages("0000:00:04.0")


def test_unaligned_offsets(torch, src_file) -> None:
    path, data = src_file
    t = torch.zeros(8 * MiB, dtype=torch.uint8, device="cuda")
    with Hub(mode="staged") as hub, hub.register(t) as reg:
        hub.load(path, reg, offset=4097, nbytes=5 * MiB + 3, dest_offset=11).wait(60)
        got = bytes(t[11:11 + 5 * MiB + 3].cpu().numpy())
        assert got == data[4097:4097 + 5 * MiB + 3]
        assert not t[:11].any().item()


def test_auto_mode_without_dev_p2phub_is_staged_and_says_why(torch) -> None:
    if os.path.exists("/dev/p2phub"):
        pytest.skip("/dev/p2phub exists here")
    with Hub() as hub:
        assert hub.mode == "staged"
        assert "kmod." in hub.mode_reason


@pytest.mark.parametrize("kind", ["torch", "cupy", "raw"])
def test_fence_on_stream_gates_a_kernel(torch, src_file, monkeypatch, kind) -> None:
    """A kernel enqueued behind fence.on_stream(s) while the load is still running sees the
    file's bytes (the reads are held back so the fence is pending when on_stream runs)."""
    path, data = src_file
    n = 32 * MiB
    t = torch.zeros(n, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    # Load the consumer's kernels first: with CUDA's lazy module loading, a kernel's first
    # launch waits for every stream, including `s` held by the pending fence (docs/ordering.md).
    with torch.cuda.stream(s):
        t.to(torch.int64).sum().item()
    if kind == "cupy":
        cupy = pytest.importorskip("cupy")
        handle = cupy.cuda.ExternalStream(s.cuda_stream)
    else:
        handle = s if kind == "torch" else s.cuda_stream
    with Hub(mode="staged") as hub, hub.register(t) as reg:
        tgt = reg.copy_target()
        engine = hub.engines.batch_engine(tgt.ops, tgt.ordinal)
        engine.lock.acquire()                   # the engine is busy: the load waits its turn
        threading.Timer(0.5, engine.lock.release).start()
        fence = hub.load(path, reg, nbytes=n)
        assert not fence.done()
        fence.on_stream(handle)                 # the kernel below runs after the bytes arrived
        with torch.cuda.stream(s):
            total = t.to(torch.int64).sum()
        s.synchronize()
        assert total.item() == sum(data[:n])
        fence.wait(60)


def test_short_file_fails_the_fence(torch, tmp_path) -> None:
    p = tmp_path / "short.bin"
    p.write_bytes(b"x" * 4096)
    t = torch.zeros(MiB, dtype=torch.uint8, device="cuda")
    with Hub(mode="staged") as hub, hub.register(t) as reg:
        with pytest.raises(ValueError, match="not inside"):
            hub.load(p, reg, nbytes=8192)
