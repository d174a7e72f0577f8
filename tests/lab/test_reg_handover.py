"""Registration maps made outside NVME_MAP_REG never reach a controller's next owner.

DMA_PAGES (and REGISTER with F_DEVICE) map a registration for a PCI device and keep the map until
teardown. When p2phub-nvme hands the controller (or another device of its IOMMU group) to an
owner, those addresses sit in the domain the owner's controller DMAs through: OPEN must unmap
them first. What is checked is the registration's own count of device maps (REG_INFO), and the
stand-in GPU exporter's count of mappings of its memory, an independent side.
"""

from __future__ import annotations

import fcntl
import os

import pytest

import p2phub_fakegpu as fg
import regutil
from p2phub import uapi
from p2phub.device import Device
from p2phub.hub import Hub
from p2phub.nvme import bind

pytestmark = pytest.mark.lab

MiB = 1 << 20


@pytest.fixture(scope="module")
def gpu_module(lab: dict[str, str]):
    with fg.loaded_module(lab["modules_dir"]):
        yield


def test_open_unmaps_what_dma_pages_mapped_for_the_controller(owned_bdf: str,
                                                              gpu_module: None) -> None:
    """DMA_PAGES maps the stand-in GPU's memory for the controller (bound to p2phub, not yet
    owned); OPEN then hands the controller over with that map gone, and the exporter counts its
    mapping gone too."""
    bind.bind(owned_bdf)
    with fg.FakeGpu() as gpu:
        dmabuf = gpu.export_dmabuf(0, 1 * MiB)
        try:
            base = gpu.query().mappings
            with Hub() as hub, hub.register_dmabuf(dmabuf, 0, 1 * MiB) as reg:
                assert len(reg.dma_pages(owned_bdf)) > 0
                assert (reg.info().nr_devices, gpu.query().mappings) == (1, base + 1)
                with Device() as dev:
                    fd = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, regutil.nvme_open_arg(owned_bdf), True)
                    try:
                        assert (reg.info().nr_devices, gpu.query().mappings) == (0, base), \
                            "a map DMA_PAGES made for the controller reached its new owner"
                    finally:
                        os.close(fd)
                # A later DMA_PAGES maps it afresh.
                assert len(reg.dma_pages(owned_bdf)) > 0
                assert reg.info().nr_devices == 1
        finally:
            os.close(dmabuf)
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}
