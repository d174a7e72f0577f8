"""Every check id and every pair verdict on every fixture tree (captured and hand-built)."""

from __future__ import annotations

import os

import pytest

from p2phub.doctor.checks import REGISTRY
from p2phub.doctor.core import diagnose
from p2phub.doctor.sysroot import SysRoot

pytestmark = pytest.mark.unit

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "doctor")

# fixture -> expected {check id: status}, {pair: (class, distance, kernel map type, verdict)}, exit code
EXPECTED = {'h200-firecracker': {'checks': {'host.arch': 'PASS',
                                 'host.cpu': 'INFO',
                                 'host.virt': 'INFO',
                                 'host.container': 'INFO',
                                 'host.privilege': 'PASS',
                                 'kernel.version': 'PASS',
                                 'kernel.p2pdma': 'FAIL',
                                 'kernel.zone_device': 'PASS',
                                 'kernel.dmabuf': 'INFO',
                                 'kernel.iommu_default': 'INFO',
                                 'kernel.cmdline': 'INFO',
                                 'iommu.present': 'INFO',
                                 'iommu.domain': 'PASS',
                                 'iommu.groups': 'SKIP',
                                 'pcie.ats': 'INFO',
                                 'pcie.link': 'PASS',
                                 'pcie.numa': 'INFO',
                                 'gpu.bar': 'PASS',
                                 'nvidia.driver': 'PASS',
                                 'nvidia.flavour': 'PASS',
                                 'nvidia.params': 'INFO',
                                 'nvidia.p2pmem': 'INFO',
                                 'nvidia.dmabuf': 'PASS',
                                 'nvidia.peermem': 'INFO',
                                 'amd.kfd_links': 'SKIP',
                                 'amd.large_bar': 'SKIP',
                                 'amd.p2p_config': 'SKIP',
                                 'nvme.controllers': 'SKIP',
                                 'nvme.multipath': 'SKIP',
                                 'nvme.safety': 'SKIP',
                                 'nic.devices': 'SKIP',
                                 'nic.dmabuf_mr': 'SKIP',
                                 'kmod.loaded': 'WARN',
                                 'kmod.devnode': 'SKIP',
                                 'kmod.abi': 'SKIP',
                                 'kmod.caps': 'SKIP',
                                 'kmod.loadable': 'FAIL',
                                 'topology.peers': 'FAIL',
                                 'pcie.acs': 'SKIP',
                                 'pcie.host_bridge': 'SKIP',
                                 'pairs.gpu_nvme': 'SKIP',
                                 'pairs.gpu_nic': 'SKIP',
                                 'pair.active': 'SKIP'},
                      'pairs': {},
                      'exit': 1},
 'devbox-firecracker': {'checks': {'host.arch': 'PASS',
                                   'host.cpu': 'PASS',
                                   'host.virt': 'INFO',
                                   'host.container': 'INFO',
                                   'host.privilege': 'PASS',
                                   'kernel.version': 'PASS',
                                   'kernel.p2pdma': 'FAIL',
                                   'kernel.zone_device': 'PASS',
                                   'kernel.dmabuf': 'INFO',
                                   'kernel.iommu_default': 'INFO',
                                   'kernel.cmdline': 'INFO',
                                   'iommu.present': 'INFO',
                                   'iommu.domain': 'SKIP',
                                   'iommu.groups': 'SKIP',
                                   'pcie.ats': 'SKIP',
                                   'pcie.link': 'SKIP',
                                   'pcie.numa': 'SKIP',
                                   'gpu.bar': 'SKIP',
                                   'nvidia.driver': 'SKIP',
                                   'nvidia.flavour': 'SKIP',
                                   'nvidia.params': 'SKIP',
                                   'nvidia.p2pmem': 'SKIP',
                                   'nvidia.dmabuf': 'SKIP',
                                   'nvidia.peermem': 'SKIP',
                                   'amd.kfd_links': 'SKIP',
                                   'amd.large_bar': 'SKIP',
                                   'amd.p2p_config': 'SKIP',
                                   'nvme.controllers': 'SKIP',
                                   'nvme.multipath': 'SKIP',
                                   'nvme.safety': 'SKIP',
                                   'nic.devices': 'SKIP',
                                   'nic.dmabuf_mr': 'SKIP',
                                   'kmod.loaded': 'WARN',
                                   'kmod.devnode': 'SKIP',
                                   'kmod.abi': 'SKIP',
                                   'kmod.caps': 'SKIP',
                                   'kmod.loadable': 'FAIL',
                                   'topology.peers': 'FAIL',
                                   'pcie.acs': 'SKIP',
                                   'pcie.host_bridge': 'SKIP',
                                   'pairs.gpu_nvme': 'SKIP',
                                   'pairs.gpu_nic': 'SKIP',
                                   'pair.active': 'SKIP'},
                        'pairs': {},
                        'exit': 1},
 'broadwell-plx-acs': {'checks': {'host.arch': 'PASS',
                                  'host.cpu': 'INFO',
                                  'host.virt': 'PASS',
                                  'host.container': 'PASS',
                                  'host.privilege': 'PASS',
                                  'kernel.version': 'WARN',
                                  'kernel.p2pdma': 'PASS',
                                  'kernel.zone_device': 'PASS',
                                  'kernel.dmabuf': 'INFO',
                                  'kernel.iommu_default': 'INFO',
                                  'kernel.cmdline': 'INFO',
                                  'iommu.present': 'INFO',
                                  'iommu.domain': 'WARN',
                                  'iommu.groups': 'INFO',
                                  'pcie.ats': 'INFO',
                                  'pcie.link': 'WARN',
                                  'pcie.numa': 'WARN',
                                  'gpu.bar': 'PASS',
                                  'nvidia.driver': 'PASS',
                                  'nvidia.flavour': 'PASS',
                                  'nvidia.params': 'INFO',
                                  'nvidia.p2pmem': 'INFO',
                                  'nvidia.dmabuf': 'PASS',
                                  'nvidia.peermem': 'INFO',
                                  'amd.kfd_links': 'SKIP',
                                  'amd.large_bar': 'SKIP',
                                  'amd.p2p_config': 'SKIP',
                                  'nvme.controllers': 'PASS',
                                  'nvme.multipath': 'INFO',
                                  'nvme.safety': 'WARN',
                                  'nic.devices': 'PASS',
                                  'nic.dmabuf_mr': 'PASS',
                                  'kmod.loaded': 'WARN',
                                  'kmod.devnode': 'SKIP',
                                  'kmod.abi': 'SKIP',
                                  'kmod.caps': 'SKIP',
                                  'kmod.loadable': 'PASS',
                                  'topology.peers': 'PASS',
                                  'pcie.acs': 'FAIL',
                                  'pcie.host_bridge': 'FAIL',
                                  'pairs.gpu_nvme': 'FAIL',
                                  'pairs.gpu_nic': 'WARN',
                                  'pair.active': 'SKIP'},
                       'pairs': {'GPU0<->NVMe0': ('PIX', 4, 'NOT_SUPPORTED', 'BLOCKED'),
                                 'GPU0<->NVMe1': ('SYS', 6, 'NOT_SUPPORTED', 'BLOCKED'),
                                 'GPU0<->NIC0': ('PHB', 8, 'NOT_SUPPORTED', 'BLOCKED'),
                                 'GPU1<->NVMe0': ('PHB', 8, 'NOT_SUPPORTED', 'BLOCKED'),
                                 'GPU1<->NVMe1': ('SYS', 6, 'NOT_SUPPORTED', 'BLOCKED'),
                                 'GPU1<->NIC0': ('PIX', 4, 'BUS_ADDR', 'OK')},
                       'exit': 1},
 'epyc-rome-gpp': {'checks': {'host.arch': 'PASS',
                              'host.cpu': 'PASS',
                              'host.virt': 'PASS',
                              'host.container': 'PASS',
                              'host.privilege': 'PASS',
                              'kernel.version': 'PASS',
                              'kernel.p2pdma': 'PASS',
                              'kernel.zone_device': 'PASS',
                              'kernel.dmabuf': 'PASS',
                              'kernel.iommu_default': 'INFO',
                              'kernel.cmdline': 'INFO',
                              'iommu.present': 'INFO',
                              'iommu.domain': 'PASS',
                              'iommu.groups': 'INFO',
                              'pcie.ats': 'INFO',
                              'pcie.link': 'PASS',
                              'pcie.numa': 'INFO',
                              'gpu.bar': 'PASS',
                              'nvidia.driver': 'SKIP',
                              'nvidia.flavour': 'SKIP',
                              'nvidia.params': 'SKIP',
                              'nvidia.p2pmem': 'SKIP',
                              'nvidia.dmabuf': 'SKIP',
                              'nvidia.peermem': 'SKIP',
                              'amd.kfd_links': 'INFO',
                              'amd.large_bar': 'PASS',
                              'amd.p2p_config': 'PASS',
                              'nvme.controllers': 'PASS',
                              'nvme.multipath': 'INFO',
                              'nvme.safety': 'PASS',
                              'nic.devices': 'PASS',
                              'nic.dmabuf_mr': 'PASS',
                              'kmod.loaded': 'PASS',
                              'kmod.devnode': 'PASS',
                              'kmod.abi': 'PASS',
                              'kmod.caps': 'INFO',
                              'kmod.loadable': 'PASS',
                              'topology.peers': 'PASS',
                              'pcie.acs': 'WARN',
                              'pcie.host_bridge': 'PASS',
                              'pairs.gpu_nvme': 'WARN',
                              'pairs.gpu_nic': 'WARN',
                              'pair.active': 'SKIP'},
                   'pairs': {'GPU0<->NVMe0': ('PHB', 4, 'THRU_HOST_BRIDGE', 'DEGRADED'),
                             'GPU0<->NVMe1': ('PHB', 6, 'THRU_HOST_BRIDGE', 'DEGRADED'),
                             'GPU0<->NIC0': ('NODE', 4, 'THRU_HOST_BRIDGE', 'DEGRADED'),
                             'GPU1<->NVMe0': ('PHB', 6, 'THRU_HOST_BRIDGE', 'DEGRADED'),
                             'GPU1<->NVMe1': ('PIX', 4, 'BUS_ADDR', 'OK'),
                             'GPU1<->NIC0': ('NODE', 6, 'THRU_HOST_BRIDGE', 'DEGRADED')},
                   'exit': 0}}


def fixture_names() -> list[str]:
    return sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))


def test_every_fixture_has_expectations() -> None:
    assert sorted(EXPECTED) == fixture_names()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_checks(name: str) -> None:
    rep = diagnose(SysRoot(os.path.join(FIXTURES, name)))
    got = {c.id: c.status for c in rep.checks}
    assert set(got) == {cid for cid, *_ in REGISTRY}, "every check id runs on every tree"
    assert got == EXPECTED[name]["checks"]
    for c in rep.checks:
        assert c.summary, c.id
        if c.status in ("FAIL", "WARN"):
            assert c.fix, f"{name}: {c.id} {c.status} without a fix"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_pairs(name: str) -> None:
    rep = diagnose(SysRoot(os.path.join(FIXTURES, name)))
    got = {f"{p.provider}<->{p.client}": (p.cls, p.distance, p.map_type, p.verdict) for p in rep.pairs}
    assert got == EXPECTED[name]["pairs"]
    for p in rep.pairs:
        assert p.because, p
        if p.verdict in ("BLOCKED", "DEGRADED"):
            assert p.reasons


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_exit_code(name: str) -> None:
    rep = diagnose(SysRoot(os.path.join(FIXTURES, name)))
    assert rep.exit_code() == EXPECTED[name]["exit"]
