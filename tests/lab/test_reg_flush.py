"""No stale IOTLB entry outlives a registration's device map.

A lazily flushing IOMMU domain (DMA-FQ) clears the page tables at unmap and the IOTLB up to 10 ms
later. p2phub unmaps, flushes, then unpins, on every path that drops a map: here the one a
NVME_MAP_REG takes when it raced an NVME_UNMAP_REG and let go of the last hold. The controller,
still running, then reads a marker block to the address it was told: the marker must never land
in the memory (seen through the memfd behind the udmabuf, a side p2phub does not map). The DMA
faults on the IOMMU instead: those DMAR faults, for this controller, are this test's expected
outcome.

The emulated VT-d (caching mode) keeps a translation it served until the guest invalidates it,
which is what makes the stale entry visible; the kernel gives a caching-mode IOMMU strict domains
by default, so the test switches the controller's group to DMA-FQ (the sysfs DMA -> DMA-FQ
change works live) and back to strict afterwards.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

import uffd
from p2phub import nvme
from p2phub.nvme.errors import NvmeStatusError
from p2phub.hostmem import Udmabuf
from p2phub.hub import Hub
from p2phub.nvme import bind as nvme_bind
from p2phub.nvme import spec
from p2phub_lab import klog

pytestmark = pytest.mark.lab

KiB = 1 << 10
ROUNDS = 16
MARK_LBA = 64
MARK = b"p2phub-S2-marker"
WARM_LBA = 72
WARM = b"p2phub-S2-warmup"
PCI = Path("/sys/bus/pci/devices")


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
    cmd, fut = _command(qp, ns, lba, addr)
    qp.submit_raw([cmd], [fut])
    return _done(fut)


def _command(qp, ns, lba: int, addr: int) -> tuple[list[int], nvme.CommandFuture]:
    fut = nvme.CommandFuture(qp, spec.OPC_READ, 1, what=f"read lba {lba} to {addr:#x}")
    return spec.command(spec.OPC_READ, nsid=ns.nsid, prp1=addr, cdw10=lba & 0xFFFFFFFF,
                        cdw11=lba >> 32), fut


def _done(fut: nvme.CommandFuture) -> bool:
    """Whether the command completed without an error status."""
    try:
        fut.result(timeout=30)
    except NvmeStatusError:
        return False
    return True


def _fill(lba_size: int, mark: bytes) -> bytes:
    return (mark * (lba_size // len(mark) + 1))[:lba_size]


@contextmanager
def _lazy_domain(bdf: str) -> Iterator[str]:
    """The controller's IOMMU group with a flush queue (DMA-FQ) for the block; its type before."""
    typ = PCI / bdf / "iommu_group" / "type"
    before = typ.read_text().strip()
    if before == "DMA":
        typ.write_text("DMA-FQ")
    assert typ.read_text().strip() == "DMA-FQ", f"the controller's domain is {before}, not lazy"
    try:
        yield before
    finally:
        if before == "DMA":
            # Back to strict: allowed only without a driver, so the controller goes back to
            # nvme through a driverless moment.
            nvme_bind.unbind(bdf, driver="")
            typ.write_text("DMA")
            nvme_bind.unbind(bdf)


def test_no_stale_iotlb_after_map_reg_races_unmap_reg(bdf: str) -> None:
    if not Path("/dev/udmabuf").exists():
        pytest.skip("needs udmabuf (6.12): the memfd is the independent view")
    if not (PCI / bdf / "iommu_group").exists():
        pytest.skip("needs the emulated IOMMU (--iommu)")
    landed: list[int] = []
    with _lazy_domain(bdf), Hub() as hub, Udmabuf(64 * KiB) as buf, hub.register(buf) as reg, \
            nvme.open(bdf, hub=hub, io_queues=1) as ctrl:
        ns = ctrl.namespace(1)
        stage = ctrl.alloc_dma(4096, "marker")
        for lba, mark in ((MARK_LBA, MARK), (WARM_LBA, WARM)):
            stage.view[:ns.lba_size] = _fill(ns.lba_size, mark)
            ns.write(stage, lba=lba, nbytes=ns.lba_size)
        qp, kf = ctrl.io_qps[0], ctrl.kfile
        view = buf.mmap()
        zero = bytes(ns.lba_size)
        try:
            for i in range(ROUNDS):
                addrs = (ctypes.c_uint64 * 1)()
                kf.map_reg(reg.handle, ctypes.addressof(addrs), 0, 1, 0)
                iova = addrs[0]
                errs: list[BaseException] = []
                sent: list[bool] = []
                with uffd.HeldPages(1) as mem:
                    cmd, fut = _command(qp, ns, MARK_LBA, iova)

                    def racer() -> None:
                        try:
                            kf.map_reg(reg.handle, mem.addr, 0, 1, 0)
                        except BaseException as exc:  # reported below
                            errs.append(exc)
                            return
                        # The map's last hold is gone; the controller is told the stale address
                        # at once, well inside the flush queue's 10 ms.
                        qp.submit_raw([cmd], [fut])
                        sent.append(True)

                    t = threading.Thread(target=racer)
                    t.start()
                    assert mem.wait_fault(30), "MAP_REG never reached its copy"
                    kf.unmap_reg(reg.handle)        # returns while the racer holds the map
                    # Still held, so still mapped: this read is legal, and it warms the IOTLB
                    # after whatever UNMAP_REG flushed.
                    view[:ns.lba_size] = zero
                    assert _read(qp, ns, WARM_LBA, iova), "the read into the held map failed"
                    assert bytes(view[:len(WARM)]) == WARM, "the warm-up read did not arrive"
                    view[:ns.lba_size] = zero
                    mem.release_now()
                    t.join(30)
                assert not t.is_alive() and not errs, errs
                if sent:
                    _done(fut)          # the DMA faults; QEMU's NVMe may still report success
                if bytes(view[:len(MARK)]) == MARK:
                    landed.append(i)
        finally:
            view.close()
    assert not landed, (f"the marker landed in memory the controller no longer held, in rounds "
                        f"{landed} of {ROUNDS}: a stale IOTLB entry outlived the unmap")


def test_unmap_reg_of_a_registration_made_from_an_export_takes_the_source_away(bdf: str) -> None:
    """A registration made from p2phub's export of another one reaches the source's memory
    through the source's map for the controller. After NVME_UNMAP_REG the controller must reach
    neither: a read to the address it was told faults on the IOMMU, and the bytes never land in
    the source's memory (seen through the memfd behind the udmabuf)."""
    if not Path("/dev/udmabuf").exists():
        pytest.skip("needs udmabuf (6.12): the memfd is the independent view")
    if not (PCI / bdf / "iommu_group").exists():
        pytest.skip("needs the emulated IOMMU (--iommu)")
    with Hub() as hub, Udmabuf(64 * KiB) as buf, hub.register(buf) as src, \
            nvme.open(bdf, hub=hub, io_queues=1) as ctrl:
        efd = src.export()
        try:
            derived = hub.register_dmabuf(efd, 0, 64 * KiB)
        finally:
            os.close(efd)
        with derived:
            ns = ctrl.namespace(1)
            stage = ctrl.alloc_dma(4096, "marker")
            for lba, mark in ((MARK_LBA, MARK), (WARM_LBA, WARM)):
                stage.view[:ns.lba_size] = _fill(ns.lba_size, mark)
                ns.write(stage, lba=lba, nbytes=ns.lba_size)
            qp, kf = ctrl.io_qps[0], ctrl.kfile
            view = buf.mmap()
            zero = bytes(ns.lba_size)
            try:
                addrs = (ctypes.c_uint64 * 1)()
                kf.map_reg(derived.handle, ctypes.addressof(addrs), 0, 1, 0)
                iova = addrs[0]
                view[:ns.lba_size] = zero
                assert _read(qp, ns, WARM_LBA, iova), "the read into the mapped registration failed"
                assert bytes(view[:len(WARM)]) == WARM, "the read did not reach the source's memory"
                view[:ns.lba_size] = zero
                kf.unmap_reg(derived.handle)
                _read(qp, ns, MARK_LBA, iova)   # faults; QEMU's NVMe may still report success
                landed = bytes(view[:len(MARK)]) == MARK
            finally:
                view.close()
    assert not landed, ("the controller still wrote into the source's memory after NVME_UNMAP_REG "
                        "of the registration made from its export")


def test_dma_free_leaves_no_stale_iotlb_entry_to_the_freed_page(bdf: str) -> None:
    """With a lazily flushing domain: a buffer the controller wrote to, the controller disabled as
    DMA_FREE requires, DMA_FREE, a new buffer allocated at once (the page allocator hands out the
    page just freed first), the controller enabled again and told the freed buffer's address. The
    Identify data it writes must never show up in the new buffer, whose address it was never
    told: no stale IOTLB entry may outlive DMA_FREE. It faults on the IOMMU instead.

    The new buffer is twice the size, so that the IOVA allocator does not hand it the freed
    buffer's address (its cache is per size) once the flush queue let that go; a round in which
    the new buffer's addresses cover the old one anyway proves nothing and is not counted."""
    if not (PCI / bdf / "iommu_group").exists():
        pytest.skip("needs the emulated IOMMU (--iommu)")
    from p2phub import uapi
    from p2phub.nvme.errors import NvmeError
    landed: list[int] = []
    counted = 0
    with _lazy_domain(bdf), Hub() as hub, nvme.open(bdf, hub=hub, io_queues=1) as ctrl:
        kf = ctrl.kfile

        def identify(addr: int) -> list[int]:
            return spec.command(spec.ADM_IDENTIFY, prp1=addr, cdw10=spec.CNS_CONTROLLER)

        for i in range(ROUNDS):
            x = kf.alloc_dma(4096, "freed")
            ctrl.admin_cmd(identify(x.dma_addr), "Identify into the buffer")
            ident = bytes(x.view[4:64])                     # serial and model number
            assert any(ident), "Identify wrote nothing"
            x.close()
            ctrl.disable()
            fcntl.ioctl(kf.fd, uapi.NVME_DMA_FREE, uapi.NvmeDmaFree.new(id=x.id), True)
            y = kf.alloc_dma(8192, "new")
            # Enabled again and told the old address within the flush queue's 10 ms.
            ctrl.fail_outstanding(lambda *a: NvmeError("controller reset by the test"), True)
            ctrl._enable()
            _done(ctrl.admin_submit(identify(x.dma_addr), "Identify to the freed address"))
            if not y.dma_addr <= x.dma_addr < y.dma_addr + 8192:
                counted += 1
                if ident in (bytes(y.view[4:64]), bytes(y.view[4100:4160])):
                    landed.append(i)
            y.close()
    assert not landed, (f"Identify data sent to a freed buffer's address landed in a new buffer "
                        f"in rounds {landed} of {ROUNDS}: a stale IOTLB entry outlived DMA_FREE")
    assert counted, "every new buffer got the freed buffer's address: no round could tell"
