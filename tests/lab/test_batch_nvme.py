"""hub.load_batch / save_batch with an NVMe Namespace as the storage: thousands of scattered
4 KiB reads and writes through p2phub's NVMe engine into a registered buffer, checked from the
kernel nvme driver's side (it writes the data read, and reads the data written, once the
controller is given back); a batch with one bad entry submits nothing."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from p2phub import nvme
from p2phub.errors import UsageError
from p2phub.hostmem import VgemBuffer
from p2phub.hub import Hub
from p2phub.nvme import bind, kernel_io

pytestmark = pytest.mark.lab

KiB, MiB = 1 << 10, 1 << 20
READ_BASE, WRITE_BASE, REGION = 128 * MiB, 160 * MiB, 8 * MiB
BUF = 16 * MiB
N_READS, N_WRITES = 2048, 512


def test_batch_of_scattered_reads_and_writes_through_the_engine(lab: dict[str, str]) -> None:
    bdf = lab["nvme_target"]
    if bind.current_driver(bdf) != "nvme":   # the kernel's side writes first
        bind.unbind(bdf)
    try:
        _reads_and_writes(bdf)
    finally:
        if bind.current_driver(bdf) != "nvme":
            bind.unbind(bdf)


def _reads_and_writes(bdf: str) -> None:
    rng = np.random.default_rng(21)
    dev = kernel_io.require_namespace_device(bdf, 1)          # 512-byte LBAs
    data = rng.integers(0, 256, REGION, dtype=np.uint8).tobytes()
    kernel_io.write(dev, READ_BASE, data)                      # the kernel's side writes
    old = kernel_io.read(dev, WRITE_BASE, REGION)
    blocks = REGION // (4 * KiB)
    offs = READ_BASE + rng.integers(0, blocks, N_READS) * 4096
    dsts = rng.permutation(BUF // 4096)[:N_READS].astype(np.int64) * 4096
    woffs = WRITE_BASE + rng.permutation(blocks)[:N_WRITES].astype(np.int64) * 4096
    wsrc = dsts[:N_WRITES]
    vgem = VgemBuffer(BUF)
    view = mmap.mmap(vgem.fd, BUF, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    got = np.frombuffer(view, np.uint8)
    try:
        with Hub() as hub, nvme.open(bdf, hub=hub) as ctrl:
            reg = hub.register_dmabuf(vgem.fd, 0, BUF, device=bdf)
            ns = ctrl.namespace(1)
            # one bad entry: refused by index, nothing submitted (the buffer stays zero)
            bad = offs.copy()
            bad[1500] = ns.blocks * ns.lba_size
            with pytest.raises(UsageError, match=r"entry 1500: range .* past the end"):
                hub.load_batch(storage=ns, offsets=bad, lengths=4096, memory=reg,
                               mem_offsets=dsts)
            bad[1500] = offs[1500] + 100
            with pytest.raises(UsageError, match=r"entry 1500: .* not a multiple of"):
                hub.load_batch(storage=ns, offsets=bad, lengths=4096, memory=reg,
                               mem_offsets=dsts)
            assert not got.any(), "a refused batch moved bytes"
            f = hub.load_batch(storage=ns, offsets=offs, lengths=4096, memory=reg,
                               mem_offsets=dsts)
            f.wait(600)
            assert list(f.results) == [4096] * N_READS
            want = np.frombuffer(data, np.uint8)
            page = np.arange(4096)
            assert np.array_equal(got[(dsts[:, None] + page).ravel()],
                                  want[(offs - READ_BASE)[:, None] + page].ravel())
            wbad = woffs.copy()
            wbad[300] = -4096
            with pytest.raises(UsageError, match=r"entry 300: offset -4096 is negative"):
                hub.save_batch(storage=ns, offsets=wbad, lengths=4096, memory=reg,
                               mem_offsets=wsrc)
            hub.save_batch(storage=ns, offsets=woffs, lengths=4096, memory=reg,
                           mem_offsets=wsrc).wait(600)
            ns.flush()
            expect = np.frombuffer(old, np.uint8).copy()
            expect[((woffs - WRITE_BASE)[:, None] + page).ravel()] = got[(wsrc[:, None] + page).ravel()]
            assert nvme.quiesce_registration(reg, timeout=30)
            reg.close()
    finally:
        del got   # the numpy view of the mapping goes before the mapping
        view.close()
        vgem.close()
    bind.unbind(bdf)
    assert bind.current_driver(bdf) == "nvme"
    dev = kernel_io.require_namespace_device(bdf, 1)
    assert kernel_io.read(dev, WRITE_BASE, REGION) == expect.tobytes()   # the kernel's side reads
