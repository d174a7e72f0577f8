"""A PCI device leaves while registrations are mapped for it (M7).

Each registration is mapped for the lab's spare device (a pci-testdev that
the stand-in GPU module's do-nothing driver claims: p2phub maps only for
devices a driver drives) and for the NVMe target. Removing the spare through sysfs
must undo its maps at once, while its IOMMU state still exists, and leave
the target's maps alone; after a rescan the device maps afresh. The proof
comes from outside p2phub's own bookkeeping too: the source exporter's
attachment count and the stand-in NVIDIA driver's DMA-mapping count.
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path
from typing import Iterator

import pytest

from p2phub.errors import P2PHubOSError
from p2phub.hostmem import VgemBuffer
from p2phub.hub import Hub

import p2phub_fakegpu as fg
import regutil as ru

MiB = 1 << 20
PCI = Path("/sys/bus/pci")


SPARE_DRIVER = "p2phub_lab_spare"


def _driver(bdf: str) -> str | None:
    link = PCI / "devices" / bdf / "driver"
    return link.resolve().name if link.exists() else None


def _drive(bdf: str) -> None:
    """Bind the spare to its do-nothing driver unless a driver has it."""
    if _driver(bdf) is None:
        (PCI / "drivers" / SPARE_DRIVER / "bind").write_text(bdf)


@contextlib.contextmanager
def _driverless(bdf: str) -> Iterator[None]:
    """The spare with no driver for the block, driven again after."""
    (PCI / "devices" / bdf / "driver" / "unbind").write_text(bdf)
    try:
        yield
    finally:
        _drive(bdf)


@pytest.fixture
def spare(lab: dict[str, str]):
    bdf = lab.get("spare")
    assert bdf, "the lab has no spare PCI device (pci-testdev): tools/lab is out of date"
    assert (PCI / "devices" / bdf).exists()
    fg.ensure_loaded(lab["modules_dir"])
    _drive(bdf)
    assert _driver(bdf) == SPARE_DRIVER
    yield bdf
    if not (PCI / "devices" / bdf).exists():
        (PCI / "rescan").write_text("1")
        assert ru.wait_until(lambda: (PCI / "devices" / bdf).exists())
    _drive(bdf)


@pytest.fixture(autouse=True)
def no_leaks():
    yield
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


def _remove(bdf: str) -> None:
    (PCI / "devices" / bdf / "remove").write_text("1")
    assert ru.wait_until(lambda: not (PCI / "devices" / bdf).exists())


def _rescan(bdf: str) -> None:
    (PCI / "rescan").write_text("1")
    assert ru.wait_until(lambda: (PCI / "devices" / bdf).exists())


def test_removal_unmaps_a_dmabuf_registration_for_that_device_only(spare: str, lab: dict[str, str]) -> None:
    target = lab["nvme_target"]
    with Hub() as hub, VgemBuffer(1 * MiB) as buf, hub.register_dmabuf(buf.fd) as reg:
        before = ru.counters()["dmabuf_attachments"]
        target_pages = reg.dma_pages(target)
        assert len(reg.dma_pages(spare)) == 256
        assert reg.info().nr_devices == 2
        assert ru.counters()["dmabuf_attachments"] == before + 2

        _remove(spare)
        # Its attachment to the source is gone now, not at close.
        assert ru.counters()["dmabuf_attachments"] == before + 1
        assert reg.info().nr_devices == 1
        with pytest.raises(P2PHubOSError) as e:
            reg.dma_pages(spare)
        assert e.value.errno == errno.ENODEV
        assert reg.dma_pages(target) == target_pages

        _rescan(spare)                  # a new pci_dev at the same address
        assert len(reg.dma_pages(spare)) == 256
        assert reg.info().nr_devices == 2


def test_removal_unmaps_an_nvidia_registration_in_the_driver(spare: str, resident_gpu: fg.FakeGpu,
                                                             lab: dict[str, str]) -> None:
    target = lab["nvme_target"]
    c0 = resident_gpu.query()   # per module load: what earlier tests did is theirs
    with Hub() as hub:
        reg = hub.register_nvidia(resident_gpu.va(20 * MiB), 1 * MiB)
        reg.dma_pages(target)
        reg.dma_pages(spare)
        assert resident_gpu.query().dma_mappings == 2
        _remove(spare)
        # The driver's own count: nvidia_p2p_dma_unmap_pages ran for the spare.
        assert resident_gpu.query().dma_mappings == 1
        assert reg.info().nr_devices == 1 and not reg.info().revoked
        reg.close()
    c = resident_gpu.query()
    assert (c.page_tables, c.dma_mappings, c.misuse) == (0, 0, c0.misuse)


def test_a_map_made_after_the_removal_is_refused(spare: str) -> None:
    """The address no longer names a device: the page list is refused, nothing is mapped."""
    with Hub() as hub, VgemBuffer(64 * 1024) as buf, hub.register_dmabuf(buf.fd) as reg:
        _remove(spare)
        with pytest.raises(P2PHubOSError) as e:
            reg.dma_pages(spare)
        assert e.value.errno == errno.ENODEV
        assert reg.info().nr_devices == 0


def test_a_map_lives_while_a_driver_drives_the_device(spare: str) -> None:
    """Unbinding the device's driver undoes its maps (nothing drives it, and the DMA-API
    counts what is left as that driver's leak); a map for a device no driver drives is
    refused with ENODEV, saying so (nothing could use the addresses, and its DMA limits are
    only the PCI defaults, which exporters building long segments do not honour); a driver
    bound again gets a fresh map."""
    with Hub() as hub, VgemBuffer(1 * MiB) as buf, hub.register_dmabuf(buf.fd) as reg:
        before = ru.counters()["dmabuf_attachments"]
        first = reg.dma_pages(spare)
        assert len(first) == 256 and reg.info().nr_devices == 1
        assert ru.counters()["dmabuf_attachments"] == before + 1
        with _driverless(spare):
            # undone at the unbind itself, not at close
            assert ru.counters()["dmabuf_attachments"] == before
            assert reg.info().nr_devices == 0
            with pytest.raises(P2PHubOSError) as e:
                reg.dma_pages(spare)
            assert e.value.errno == errno.ENODEV
            assert "no driver is bound" in str(e.value)
            assert ru.counters()["dmabuf_attachments"] == before
            assert reg.info().nr_devices == 0
        assert len(reg.dma_pages(spare)) == 256      # driven again: mapped
        assert reg.info().nr_devices == 1


def test_unbinding_the_driver_unmaps_an_nvidia_registration_in_the_driver(
        spare: str, resident_gpu: fg.FakeGpu) -> None:
    with Hub() as hub:
        reg = hub.register_nvidia(resident_gpu.va(24 * MiB), 1 * MiB)
        base = resident_gpu.query().dma_mappings
        reg.dma_pages(spare)
        assert resident_gpu.query().dma_mappings == base + 1
        with _driverless(spare):
            # the driver's own count: nvidia_p2p_dma_unmap_pages ran at the unbind
            assert resident_gpu.query().dma_mappings == base
            assert reg.info().nr_devices == 0 and not reg.info().revoked
        assert len(reg.dma_pages(spare)) == 16        # 64 KiB GPU pages
        assert resident_gpu.query().dma_mappings == base + 1
        reg.close()
    assert resident_gpu.query().dma_mappings == base
