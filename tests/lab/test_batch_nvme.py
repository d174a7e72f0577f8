"""hub.load_batch / save_batch against QEMU's NVMe controller, checked from sides the batch
does not control:

- P2P through p2phub's NVMe engine: thousands of scattered 4 KiB reads and writes in one
  call each, into and out of two registrations (a vgem dma-buf and the stand-in GPU's BAR),
  checked through the vgem mapping, the host file behind the BAR and, once the controller is
  given back, the kernel nvme driver's view of the same LBAs; a batch with one bad entry
  submits nothing (the queue's submission and doorbell counters do not move).
- A namespace the kernel nvme driver owns, through the block layer (/dev/nvmeXnY, O_DIRECT
  io_uring into staging, then the registration's CPU mapping): the same checks from the
  other direction.
"""

from __future__ import annotations

import mmap
import os
from typing import Iterator

import numpy as np
import pytest

from p2phub import nvme
from p2phub.errors import UsageError
from p2phub.hostmem import VgemBuffer
from p2phub.hub import Hub
from p2phub.nvme import bind, kernel_io

import p2phub_fakegpu as fg

pytestmark = pytest.mark.lab

KiB, MiB = 1 << 10, 1 << 20
PAGE = 4096
READ_BASE, WRITE_BASE, REGION = 128 * MiB, 160 * MiB, 8 * MiB   # namespace 1, 512-byte LBAs
VGEM, GPU_OFF, GPU = 8 * MiB, 16 * MiB, 4 * MiB                 # registrations
N_READS, N_WRITES = 2048, 1024


@pytest.fixture(scope="module")
def bdf(lab: dict[str, str]) -> Iterator[str]:
    b = lab["nvme_target"]
    if bind.current_driver(b) != "nvme":   # the kernel's side writes first
        bind.unbind(b)
    yield b
    if bind.current_driver(b) != "nvme":
        bind.unbind(b)


class Vgem:
    def __init__(self, size: int) -> None:
        self.buf = VgemBuffer(size)
        self.map = mmap.mmap(self.buf.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    def array(self) -> np.ndarray:
        return np.frombuffer(self.map, np.uint8).copy()

    def close(self) -> None:
        self.map.close()
        self.buf.close()


def _device_size(dev: str) -> int:
    fd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.lseek(fd, 0, os.SEEK_END)
    finally:
        os.close(fd)


def _pages(base: np.ndarray) -> np.ndarray:
    """Byte indices of the 4 KiB pages starting at `base` (one row per page)."""
    return (base[:, None] + np.arange(PAGE)).ravel()


def test_batch_through_the_engine_checked_by_the_kernel(bdf: str, lab: dict[str, str]) -> None:
    rng = np.random.default_rng(21)
    dev = kernel_io.require_namespace_device(bdf, 1)
    disk = rng.integers(0, 256, REGION, dtype=np.uint8)
    kernel_io.write(dev, READ_BASE, disk.tobytes())          # the kernel's side writes
    old = np.frombuffer(kernel_io.read(dev, WRITE_BASE, REGION), np.uint8).copy()
    blocks = REGION // PAGE
    # reads: 2,048 pages of the region, each to its own page of one of the registrations
    offs = READ_BASE + rng.integers(0, blocks, N_READS) * PAGE
    places = rng.permutation((VGEM + GPU) // PAGE)[:N_READS] * PAGE   # over both, end to end
    midx = (places >= VGEM).astype(np.int64)
    moffs = np.where(midx == 1, places - VGEM, places)
    gpu_file = fg.GpuFile(lab["gpu_file"])
    gpu_file.write(GPU_OFF, b"\xee" * GPU)
    v = Vgem(VGEM)
    try:
        with fg.loaded_module(lab["modules_dir"]), fg.FakeGpu() as gpu, Hub() as hub, \
                nvme.open(bdf, hub=hub, io_queues=1, queue_depth=64) as ctrl:
            fd = gpu.export_dmabuf(GPU_OFF, GPU)
            try:
                regs = [hub.register_dmabuf(v.buf.fd, 0, VGEM, device=bdf),
                        hub.register_dmabuf(fd, 0, GPU, device=bdf)]
            finally:
                os.close(fd)
            ns, qp = ctrl.namespace(1), ctrl.io_qps[0]
            cols = dict(storage=ns, lengths=PAGE, memory=regs, memory_index=midx,
                        mem_offsets=moffs)

            # one bad entry refuses the whole batch, by index, before the device sees any
            st0 = qp.stats()
            bad = offs.copy()
            bad[1500] = ns.blocks * ns.lba_size
            with pytest.raises(UsageError, match=r"entry 1500: range .* past the end"):
                hub.load_batch(offsets=bad, **cols)
            bad[1500] = offs[1500] + 512 + 100
            with pytest.raises(UsageError, match=r"entry 1500: .* not a multiple of"):
                hub.load_batch(offsets=bad, **cols)
            bad_m = moffs.copy()
            bad_m[7] = (VGEM if midx[7] == 0 else GPU) - 512   # runs off its registration
            with pytest.raises(UsageError, match=r"entry 7: memory range"):
                hub.load_batch(offsets=offs, **{**cols, "mem_offsets": bad_m})
            st1 = qp.stats()
            assert (st1["submitted"], st1["doorbells"]) == (st0["submitted"], st0["doorbells"])
            assert not v.array().any(), "a refused batch moved bytes"
            assert gpu_file.read(GPU_OFF, GPU) == b"\xee" * GPU

            f = hub.load_batch(offsets=offs, per_entry=True, **cols)
            f.wait(300)
            assert list(f.results) == [PAGE] * N_READS and all(e.done() for e in f.entries)
            st2 = qp.stats()
            assert st2["submitted"] - st1["submitted"] == N_READS
            assert st2["doorbells"] > st1["doorbells"]
            # the bytes the kernel wrote, where each entry put them: through the vgem
            # mapping and the file behind the BAR (a device-to-device DMA)
            mem = np.concatenate([v.array(),
                                  np.frombuffer(gpu_file.read(GPU_OFF, GPU), np.uint8)])
            assert np.array_equal(mem[_pages(places)], disk[_pages(offs - READ_BASE)])

            # writes: 1,024 pages out of both registrations to distinct pages of another region
            woffs = WRITE_BASE + rng.permutation(blocks)[:N_WRITES] * PAGE
            wsrc = places[rng.permutation(N_READS)[:N_WRITES]]
            wcols = dict(storage=ns, offsets=woffs, lengths=PAGE, memory=regs,
                         memory_index=(wsrc >= VGEM).astype(np.int64),
                         mem_offsets=np.where(wsrc >= VGEM, wsrc - VGEM, wsrc))
            wbad = woffs.copy()
            wbad[300] = -PAGE
            with pytest.raises(UsageError, match=r"entry 300: offset -4096 is negative"):
                hub.save_batch(**{**wcols, "offsets": wbad})
            assert qp.stats()["submitted"] == st2["submitted"]
            hub.save_batch(**wcols).wait(300)
            assert qp.stats()["submitted"] - st2["submitted"] == N_WRITES
            ns.flush()
            expect = old.copy()
            expect[_pages(woffs - WRITE_BASE)] = mem[_pages(wsrc)]
            for reg in regs:
                assert nvme.quiesce_registration(reg, timeout=30)
                reg.close()
    finally:
        v.close()
    bind.unbind(bdf)   # the kernel's side reads what the engine wrote
    assert bind.current_driver(bdf) == "nvme"
    got = np.frombuffer(kernel_io.read(kernel_io.require_namespace_device(bdf, 1),
                                       WRITE_BASE, REGION), np.uint8)
    assert np.array_equal(got, expect)   # every write landed, and nothing else changed


def test_batch_on_a_namespace_the_kernel_owns(bdf: str) -> None:
    """The block device of a namespace the nvme driver keeps: O_DIRECT io_uring reads and
    writes through the block layer, staged through a vgem registration's CPU mapping."""
    if bind.current_driver(bdf) != "nvme":
        bind.unbind(bdf)
    rng = np.random.default_rng(5)
    dev = kernel_io.require_namespace_device(bdf, 1)
    base, region = 64 * MiB, 4 * MiB
    disk = rng.integers(0, 256, region, dtype=np.uint8)
    kernel_io.write(dev, base, disk.tobytes())
    n = 1024
    offs = base + rng.integers(0, region // PAGE, n) * PAGE
    places = rng.permutation(VGEM // PAGE)[:n] * PAGE
    v = Vgem(VGEM)
    try:
        with Hub() as hub:
            reg = hub.register_dmabuf(v.buf.fd, 0, VGEM)
            bad = offs.copy()
            bad[900] = _device_size(dev)
            with pytest.raises(UsageError, match=r"entry 900: range .* past the end"):
                hub.load_batch(storage=dev, offsets=bad, lengths=PAGE, memory=reg,
                               mem_offsets=places)
            assert not v.array().any(), "a refused batch moved bytes"
            f = hub.load_batch(storage=dev, offsets=offs, lengths=PAGE, memory=reg,
                               mem_offsets=places)
            f.wait(300)
            assert f.stats["io"] == {dev: "O_DIRECT"} and list(f.results) == [PAGE] * n
            mem = v.array()
            assert np.array_equal(mem[_pages(places)], disk[_pages(offs - base)])
            # and back: scattered pages of the mapping to distinct pages of the device
            woffs = base + rng.permutation(region // PAGE)[:n] * PAGE
            v.map[:] = rng.integers(0, 256, VGEM, dtype=np.uint8).tobytes()
            src = v.array()
            hub.save_batch(storage=dev, offsets=woffs, lengths=PAGE, memory=reg,
                           mem_offsets=places).wait(300)
            reg.close()
    finally:
        v.close()
    expect = disk.copy()
    expect[_pages(woffs - base)] = src[_pages(places)]
    got = np.frombuffer(kernel_io.read(dev, base, region), np.uint8)
    assert np.array_equal(got, expect)
