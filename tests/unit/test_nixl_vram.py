"""p2phub.nixl with VRAM: ("VRAM", descriptors) and CUDA array objects registered through NIXL's
API become CUDA segments of the KV agent (register_memory(..., device=N)); READ and WRITE
between any mix of VRAM on two devices and DRAM, to a peer and to the agent's own name; every
byte checked in the buffers themselves. On a host without a GPU, over the stand-in CUDA driver
of test_kv_cuda_staging (its "device" memory is host memory, its copies memmove); real GPUs:
tests/gpu/test_nixl_vllm_vram.py."""

from __future__ import annotations

import ctypes
import json
import random
from typing import Iterator

import pytest

np = pytest.importorskip("numpy")

from p2phub.nixl._api import nixl_agent, nixl_agent_config  # noqa: E402
from p2phub.nixl.errors import nixlInvalidParamError, nixlNotSupportedError  # noqa: E402

from test_kv_cuda_staging import DeviceBuf, fake  # noqa: E402,F401 - fake: the stand-in driver fixture
from test_nixl_api_adapter import _notified, _wait  # noqa: E402

BLK, NBLK = 4096, 16
KINDS = ("DRAM", "cuda:0", "cuda:1")


class _Dev:
    def __init__(self, ordinal: int) -> None:
        self.id = ordinal


class CudaBuf(DeviceBuf):
    """A stand-in CUDA array object on a given device (as CuPy: ``.device.id``)."""

    def __init__(self, n: int, ordinal: int) -> None:
        super().__init__(n)
        self.device = _Dev(ordinal)


class Mem:
    """One agent's memory: a DRAM numpy buffer, a CUDA array object on cuda:0 (registered as
    an object) and a range of cuda:1 (registered as a ("VRAM", descriptors) list)."""

    def __init__(self, agent: nixl_agent) -> None:
        n = BLK * NBLK
        self.host = np.zeros(n, dtype=np.uint8)
        self.d0 = CudaBuf(n, 0)
        self.d1 = CudaBuf(n, 1)
        self.addr = {"DRAM": self.host.ctypes.data, "cuda:0": self.d0.addr, "cuda:1": self.d1.addr}
        agent.register_memory(self.host)
        agent.register_memory(self.d0)
        agent.register_memory([(self.d1.addr, n, 1, "")], "VRAM")

    def fill(self, seed: int) -> None:
        for k, a in self.addr.items():
            ctypes.memmove(a, random.Random(f"{seed}{k}").randbytes(BLK * NBLK), BLK * NBLK)

    def get(self, kind: str, blk: int) -> bytes:
        return ctypes.string_at(self.addr[kind] + blk * BLK, BLK)

    def descs(self, kind: str, blocks: list[int]) -> tuple[list[tuple[int, int, int]], str]:
        dev = 0 if kind == "DRAM" else int(kind[-1])
        return ([(self.addr[kind] + b * BLK, BLK, dev) for b in blocks],
                "DRAM" if kind == "DRAM" else "VRAM")


@pytest.fixture
def two(fake) -> Iterator[tuple[nixl_agent, nixl_agent, Mem, Mem]]:
    a = nixl_agent("A", nixl_agent_config(stall_timeout=5.0))
    b = nixl_agent("B", nixl_agent_config(stall_timeout=5.0))
    ma, mb = Mem(a), Mem(b)
    assert a.add_remote_agent(b.get_agent_metadata()) == b"B"
    assert b.add_remote_agent(a.get_agent_metadata()) == b"A"
    yield a, b, ma, mb
    a.close()
    b.close()


def test_vram_is_a_memory_type_and_registers_as_cuda_segments(two) -> None:
    a, _b, _ma, _mb = two
    assert a.get_plugin_mem_types("P2PHUB") == ["DRAM", "VRAM", "FILE"]
    assert a.get_backend_mem_types("P2PHUB") == ["DRAM", "VRAM", "FILE"]
    assert json.loads(a.get_agent_metadata())["devices"] == [-1, 0, 1]
    assert a.query_memory([(_ma.d1.addr, BLK, 1, "")], "P2PHUB", "VRAM")[0]["mem_type"] == "VRAM"


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_read_and_write_between_any_mix_of_vram_and_dram(two, fake, op) -> None:
    a, b, ma, mb = two
    rnd = random.Random(7)
    for lk in KINDS:
        for rk in KINDS:
            ma.fill(1)
            mb.fill(2)
            src, dst = rnd.sample(range(NBLK), 6), rnd.sample(range(NBLK), 6)
            ld, lm = ma.descs(lk, src)
            rd, rm = mb.descs(rk, dst)
            lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", ld, lm)
            rh = a.prep_xfer_dlist("B", rd, rm)
            copies = fake.copies
            tag = f"{op} {lk}>{rk}".encode()
            h = a.make_prepped_xfer(op, lh, list(range(6)), rh, list(range(6)), tag)
            assert a.transfer(h) in ("PROC", "DONE")
            assert _wait(a, h) == "DONE", (lk, rk)
            _notified(b, "A", tag)
            assert (fake.copies > copies) == (lk != "DRAM" or rk != "DRAM"), (lk, rk)
            for s_, d_ in zip(src, dst):
                if op == "WRITE":
                    assert mb.get(rk, d_) == ma.get(lk, s_), (lk, rk, s_, d_)
                else:
                    assert ma.get(lk, s_) == mb.get(rk, d_), (lk, rk, s_, d_)
            a.release_xfer_handle(h)
            a.release_dlist_handle(lh)
            a.release_dlist_handle(rh)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_transfers_to_the_agents_own_name_copy_vram(two, op) -> None:
    a, _b, ma, _mb = two
    for lk, rk in (("cuda:0", "DRAM"), ("DRAM", "cuda:1"), ("cuda:0", "cuda:1")):
        ma.fill(3)
        ld, lm = ma.descs(lk, [0, 5])
        rd, rm = ma.descs(rk, [9, 2])
        h = a.initialize_xfer(op, a.get_xfer_descs(ld, lm), a.get_xfer_descs(rd, rm), "A", b"own")
        assert a.transfer(h) == "DONE"
        for s_, d_ in ((0, 9), (5, 2)):
            if op == "WRITE":
                assert ma.get(rk, d_) == ma.get(lk, s_), (lk, rk)
            else:
                assert ma.get(lk, s_) == ma.get(rk, d_), (lk, rk)
        assert a.get_new_notifs()["A"] == [b"own"]


def test_vram_refusals(two) -> None:
    a, _b, ma, _mb = two
    with pytest.raises(nixlInvalidParamError, match="CUDA device 2 does not exist"):
        a.register_memory([(ma.d0.addr, BLK, 2, "")], "VRAM")
    for storage in ("BLOCK", "OBJ"):
        with pytest.raises(nixlNotSupportedError, match=f"{storage} needs a storage plugin"):
            a.register_memory([(ma.host.ctypes.data, BLK, 0, "")], storage)
