"""No stale IOTLB entry outlives a registration's device map.

A lazily flushing IOMMU domain (DMA-FQ; with the emulated VT-d's caching mode, one flush queue
flushed up to a second later) clears the page tables at unmap and the IOTLB later. p2phub unmaps,
flushes, then unpins, on every path that drops a map: here the one a NVME_MAP_REG takes when it
raced an NVME_UNMAP_REG and let go of the last hold. The controller, still running, then reads a
marker block to the address it was told: the marker must never land in the memory (seen through
the memfd behind the udmabuf, a side p2phub does not map). The DMA faults on the IOMMU instead:
those DMAR faults, for this controller, are this test's expected outcome.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import pytest

import uffd
from p2phub import nvme
from p2phub.nvme.errors import NvmeStatusError
from p2phub.hostmem import Udmabuf
from p2phub.hub import Hub
from p2phub.nvme import spec
from p2phub_lab import klog

pytestmark = pytest.mark.lab

KiB = 1 << 10
ROUNDS = 12
MARK_LBA = 64
MARK = b"p2phub-S2-marker"


@pytest.fixture(autouse=True)
def klog_clean(lab: dict[str, str]):
    """conftest's check, but DMAR faults of the controller under test are expected here (and
    marked so in the kernel log, for the lab runner's scan of the whole boot)."""
    dev = lab["nvme_target"].split(":", 1)[1]          # DMAR names it without the domain
    before = len(klog.read())
    with klog.expect_iommu_faults(dev):
        yield
    bad = [f"{r.kind}: {r.line}" for r in klog.reports(klog.read()[before:])]
    if bad:
        pytest.fail("kernel log reports during this test:\n" + "\n".join(bad), pytrace=False)


def _read(qp, ns, lba: int, addr: int) -> bool:
    """One block read to bus address `addr`; False when the controller reports an error."""
    fut = nvme.CommandFuture(qp, spec.OPC_READ, 1, what=f"read lba {lba} to {addr:#x}")
    qp.submit_raw([spec.command(spec.OPC_READ, nsid=ns.nsid, prp1=addr, cdw10=lba & 0xFFFFFFFF,
                                cdw11=lba >> 32)], [fut])
    try:
        fut.result(timeout=30)
    except NvmeStatusError:
        return False
    return True


def test_no_stale_iotlb_after_map_reg_races_unmap_reg(bdf: str) -> None:
    if not Path("/dev/udmabuf").exists():
        pytest.skip("needs udmabuf (6.12): the memfd is the independent view")
    with Hub() as hub, Udmabuf(64 * KiB) as buf, hub.register(buf) as reg, \
            nvme.open(bdf, hub=hub, io_queues=1) as ctrl:
        ns = ctrl.namespace(1)
        stage = ctrl.alloc_dma(4096, "marker")
        stage.view[:ns.lba_size] = (MARK * (ns.lba_size // len(MARK) + 1))[:ns.lba_size]
        ns.write(stage, lba=MARK_LBA, nbytes=ns.lba_size)
        qp, kf = ctrl.io_qps[0], ctrl.kfile
        view = buf.mmap()
        landed = []
        try:
            for i in range(ROUNDS):
                addrs = (ctypes.c_uint64 * 1)()
                kf.map_reg(reg.handle, ctypes.addressof(addrs), 0, 1, 0)
                iova = addrs[0]
                assert _read(qp, ns, 0, iova), "the warm-up read into the mapped page failed"
                view[:ns.lba_size] = bytes(ns.lba_size)
                errs: list[BaseException] = []
                with uffd.HeldPages(1) as mem:
                    def racer() -> None:
                        try:
                            kf.map_reg(reg.handle, mem.addr, 0, 1, 0)
                        except BaseException as exc:  # reported below
                            errs.append(exc)
                    t = threading.Thread(target=racer)
                    t.start()
                    assert mem.wait_fault(30), "MAP_REG never reached its copy"
                    kf.unmap_reg(reg.handle)        # returns while the racer holds the map
                    mem.release()
                    t.join(30)
                assert not t.is_alive() and not errs, errs
                _read(qp, ns, MARK_LBA, iova)       # the controller is told a stale address
                if bytes(view[:len(MARK)]) == MARK:
                    landed.append(i)
        finally:
            view.close()
        assert not landed, (f"the marker landed in memory the controller no longer held, in rounds "
                            f"{landed} of {ROUNDS}: a stale IOTLB entry outlived the unmap")
