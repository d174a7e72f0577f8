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
                                 'kernel.p2pdma': 'INFO',
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
                                 'nvme.confined': 'SKIP',
                                 'nic.devices': 'SKIP',
                                 'nic.dmabuf_mr': 'SKIP',
                                 'kmod.loaded': 'WARN',
                                 'kmod.devnode': 'SKIP',
                                 'kmod.abi': 'SKIP',
                                 'kmod.caps': 'SKIP',
                                 'kmod.loadable': 'FAIL',
                                 'kmod.signature': 'WARN',
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
                                   'kernel.p2pdma': 'WARN',
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
                                   'nvme.confined': 'SKIP',
                                   'nic.devices': 'SKIP',
                                   'nic.dmabuf_mr': 'SKIP',
                                   'kmod.loaded': 'WARN',
                                   'kmod.devnode': 'SKIP',
                                   'kmod.abi': 'SKIP',
                                   'kmod.caps': 'SKIP',
                                   'kmod.loadable': 'FAIL',
                                   'kmod.signature': 'SKIP',
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
                                  'nvme.confined': 'UNKNOWN',
                                  'nic.devices': 'PASS',
                                  'nic.dmabuf_mr': 'PASS',
                                  'kmod.loaded': 'WARN',
                                  'kmod.devnode': 'SKIP',
                                  'kmod.abi': 'SKIP',
                                  'kmod.caps': 'SKIP',
                                  'kmod.loadable': 'PASS',
                                  'kmod.signature': 'SKIP',
                                  'topology.peers': 'PASS',
                                  'pcie.acs': 'FAIL',
                                  'pcie.host_bridge': 'WARN',
                                  'pairs.gpu_nvme': 'WARN',
                                  'pairs.gpu_nic': 'WARN',
                                  'pair.active': 'SKIP'},
                       'pairs': {'GPU0<->NVMe0': ('PIX', 4, 'NOT_SUPPORTED', 'DEGRADED'),
                                 'GPU0<->NVMe1': ('SYS', 6, 'NOT_SUPPORTED', 'BLOCKED'),
                                 'GPU0<->NIC0': ('PHB', 8, 'NOT_SUPPORTED', 'DEGRADED'),
                                 'GPU1<->NVMe0': ('PHB', 8, 'NOT_SUPPORTED', 'DEGRADED'),
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
                              'nvme.confined': 'WARN',
                              'nic.devices': 'PASS',
                              'nic.dmabuf_mr': 'PASS',
                              'kmod.loaded': 'PASS',
                              'kmod.devnode': 'PASS',
                              'kmod.abi': 'PASS',
                              'kmod.caps': 'INFO',
                              'kmod.loadable': 'PASS',
                              'kmod.signature': 'PASS',
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
                   'exit': 0},
 'lab-switch-6.12': {'checks': {'host.arch': 'PASS',
                                'host.cpu': 'INFO',
                                'host.virt': 'INFO',
                                'host.container': 'INFO',
                                'host.privilege': 'PASS',
                                'kernel.version': 'PASS',
                                'kernel.p2pdma': 'INFO',
                                'kernel.zone_device': 'PASS',
                                'kernel.dmabuf': 'INFO',
                                'kernel.iommu_default': 'INFO',
                                'kernel.cmdline': 'INFO',
                                'iommu.present': 'INFO',
                                'iommu.domain': 'PASS',
                                'iommu.groups': 'SKIP',
                                'pcie.ats': 'INFO',
                                'pcie.link': 'WARN',
                                'pcie.numa': 'INFO',
                                'gpu.bar': 'PASS',
                                'nvidia.driver': 'SKIP',
                                'nvidia.flavour': 'SKIP',
                                'nvidia.params': 'SKIP',
                                'nvidia.p2pmem': 'SKIP',
                                'nvidia.dmabuf': 'SKIP',
                                'nvidia.peermem': 'SKIP',
                                'amd.kfd_links': 'SKIP',
                                'amd.large_bar': 'SKIP',
                                'amd.p2p_config': 'SKIP',
                                'nvme.controllers': 'PASS',
                                'nvme.multipath': 'INFO',
                                'nvme.safety': 'PASS',
                                'nvme.confined': 'WARN',
                                'nic.devices': 'INFO',
                                'nic.dmabuf_mr': 'SKIP',
                                'kmod.loaded': 'PASS',
                                'kmod.devnode': 'PASS',
                                'kmod.abi': 'PASS',
                                'kmod.caps': 'INFO',
                                'kmod.loadable': 'PASS',
                                'kmod.signature': 'PASS',
                                'topology.peers': 'PASS',
                                'pcie.acs': 'PASS',
                                'pcie.host_bridge': 'WARN',
                                'pairs.gpu_nvme': 'WARN',
                                'pairs.gpu_nic': 'SKIP',
                                'pair.active': 'SKIP'},
                     'pairs': {'GPU0<->NVMe0': ('PIX', 4, 'BUS_ADDR', 'OK'),
                               'GPU0<->NVMe1': ('PHB', 6, 'NOT_SUPPORTED', 'DEGRADED')},
                     'exit': 0},
 'lab-rootports-6.1': {'checks': {'host.arch': 'PASS',
                                  'host.cpu': 'INFO',
                                  'host.virt': 'INFO',
                                  'host.container': 'INFO',
                                  'host.privilege': 'PASS',
                                  'kernel.version': 'PASS',
                                  'kernel.p2pdma': 'INFO',
                                  'kernel.zone_device': 'PASS',
                                  'kernel.dmabuf': 'INFO',
                                  'kernel.iommu_default': 'INFO',
                                  'kernel.cmdline': 'INFO',
                                  'iommu.present': 'INFO',
                                  'iommu.domain': 'PASS',
                                  'iommu.groups': 'SKIP',
                                  'pcie.ats': 'INFO',
                                  'pcie.link': 'WARN',
                                  'pcie.numa': 'INFO',
                                  'gpu.bar': 'PASS',
                                  'nvidia.driver': 'SKIP',
                                  'nvidia.flavour': 'SKIP',
                                  'nvidia.params': 'SKIP',
                                  'nvidia.p2pmem': 'SKIP',
                                  'nvidia.dmabuf': 'SKIP',
                                  'nvidia.peermem': 'SKIP',
                                  'amd.kfd_links': 'SKIP',
                                  'amd.large_bar': 'SKIP',
                                  'amd.p2p_config': 'SKIP',
                                  'nvme.controllers': 'PASS',
                                  'nvme.multipath': 'INFO',
                                  'nvme.safety': 'PASS',
                                  'nvme.confined': 'WARN',
                                  'nic.devices': 'INFO',
                                  'nic.dmabuf_mr': 'SKIP',
                                  'kmod.loaded': 'PASS',
                                  'kmod.devnode': 'PASS',
                                  'kmod.abi': 'PASS',
                                  'kmod.caps': 'INFO',
                                  'kmod.loadable': 'PASS',
                                  'kmod.signature': 'PASS',
                                  'topology.peers': 'PASS',
                                  'pcie.acs': 'PASS',
                                  'pcie.host_bridge': 'WARN',
                                  'pairs.gpu_nvme': 'WARN',
                                  'pairs.gpu_nic': 'SKIP',
                                  'pair.active': 'SKIP'},
                       'pairs': {'GPU0<->NVMe0': ('PHB', 4, 'NOT_SUPPORTED', 'DEGRADED'),
                                 'GPU0<->NVMe1': ('PHB', 4, 'NOT_SUPPORTED', 'DEGRADED')},
                       'exit': 0},
 'lab-rootports-iommu-6.12': {'checks': {'host.arch': 'PASS',
                                         'host.cpu': 'INFO',
                                         'host.virt': 'INFO',
                                         'host.container': 'INFO',
                                         'host.privilege': 'PASS',
                                         'kernel.version': 'PASS',
                                         'kernel.p2pdma': 'INFO',
                                         'kernel.zone_device': 'PASS',
                                         'kernel.dmabuf': 'INFO',
                                         'kernel.iommu_default': 'INFO',
                                         'kernel.cmdline': 'INFO',
                                         'iommu.present': 'INFO',
                                         'iommu.domain': 'WARN',
                                         'iommu.groups': 'INFO',
                                         'pcie.ats': 'INFO',
                                         'pcie.link': 'WARN',
                                         'pcie.numa': 'INFO',
                                         'gpu.bar': 'PASS',
                                         'nvidia.driver': 'SKIP',
                                         'nvidia.flavour': 'SKIP',
                                         'nvidia.params': 'SKIP',
                                         'nvidia.p2pmem': 'SKIP',
                                         'nvidia.dmabuf': 'SKIP',
                                         'nvidia.peermem': 'SKIP',
                                         'amd.kfd_links': 'SKIP',
                                         'amd.large_bar': 'SKIP',
                                         'amd.p2p_config': 'SKIP',
                                         'nvme.controllers': 'PASS',
                                         'nvme.multipath': 'INFO',
                                         'nvme.safety': 'PASS',
                                         'nvme.confined': 'UNKNOWN',
                                         'nic.devices': 'INFO',
                                         'nic.dmabuf_mr': 'SKIP',
                                         'kmod.loaded': 'PASS',
                                         'kmod.devnode': 'PASS',
                                         'kmod.abi': 'PASS',
                                         'kmod.caps': 'INFO',
                                         'kmod.loadable': 'PASS',
                                         'kmod.signature': 'PASS',
                                         'topology.peers': 'PASS',
                                         'pcie.acs': 'WARN',
                                         'pcie.host_bridge': 'WARN',
                                         'pairs.gpu_nvme': 'WARN',
                                         'pairs.gpu_nic': 'SKIP',
                                         'pair.active': 'SKIP'},
                              'pairs': {'GPU0<->NVMe0': ('PHB', 4, 'NOT_SUPPORTED', 'DEGRADED'),
                                        'GPU0<->NVMe1': ('PHB', 4, 'NOT_SUPPORTED', 'DEGRADED')},
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


# ---------------------------------------------------------------------------- the lab captures, in detail
def _lab(name: str):
    return diagnose(SysRoot(os.path.join(FIXTURES, name)))


@pytest.mark.parametrize("name", ["lab-switch-6.12", "lab-rootports-6.1", "lab-rootports-iommu-6.12"])
def test_lab_devices(name: str) -> None:
    rep = _lab(name)
    assert [(g.id, g.vendor, g.driver, g.info["flavour"], g.info["bar_bytes"]) for g in rep.top.gpus] == \
        [("GPU0", "p2phub stand-in", "p2phub_fakegpu", "standin", 64 << 20)]
    assert [(n.id, n.driver) for n in rep.top.nvmes] == [("NVMe0", "nvme"), ("NVMe1", "nvme")]
    assert [(n.name, n.bdf, n.info["soft"]) for n in rep.top.nics] == [("rxe-a", None, True), ("rxe-b", None, True)]
    assert all(p.kind == "gpu-nvme" for p in rep.pairs)  # soft-RoCE devices are never paired
    assert rep.top.host_bridge_ids == {"pci0000:00": (0x8086, 0x29C0)}
    # Debian's 6.1 and 6.12 kernels have CONFIG_PCI_P2PDMA off; the stand-in's exporter maps peers
    # itself, as p2phub's NVIDIA path does, so that is no reason to block its pairs
    k = rep.check("kernel.p2pdma")
    assert k.status == "INFO" and "not needed by p2phub's path for GPU0" in k.summary
    assert all("kernel.p2pdma" not in p.because for p in rep.pairs)
    assert rep.check("kmod.loaded").status == "PASS"


def test_lab_switch_pix_pair_is_direct() -> None:
    rep = _lab("lab-switch-6.12")
    p = {x.client: x for x in rep.pairs}
    pix = p["NVMe0"]
    assert (pix.lca, pix.acs_blockers, pix.iommu) == ("0000:01:00.0", [], "bypassed")
    assert pix.path == ["0000:02:01.0", "0000:01:00.0", "0000:02:00.0"]
    assert (pix.verdict, pix.because) == ("OK", ["pcie.acs"])  # below one switch, no ACS redirect
    phb = p["NVMe1"]
    assert phb.lca is None and phb.host_bridge and "8086:29c0" in " ".join(phb.reasons)
    assert "pcie.host_bridge" in phb.because


def test_lab_rootports_without_iommu_has_no_acs_blockers() -> None:
    rep = _lab("lab-rootports-6.1")
    assert rep.top.cpu["kernel"].startswith("6.1.")
    assert rep.check("pcie.acs").status == "PASS"
    assert {(x.client, x.cls, x.iommu, tuple(x.acs_blockers)) for x in rep.pairs} == \
        {("NVMe0", "PHB", "none", ()), ("NVMe1", "PHB", "none", ())}


def test_lab_iommu_root_ports_redirect_and_translate() -> None:
    rep = _lab("lab-rootports-iommu-6.12")
    assert rep.check("iommu.present").status == "INFO" and "dmar0" in rep.check("iommu.present").summary
    assert rep.check("iommu.domain").status == "WARN"
    assert {rep.top.pci[d.bdf].iommu_type for d in rep.top.devices if d.bdf} == {"DMA"}
    acs = rep.check("pcie.acs")
    assert acs.status == "WARN" and "ReqRedir+ CmpltRedir+" in acs.summary
    for x in rep.pairs:
        # the kernel checks ACS on the provider's side only when the devices share no bridge
        assert (x.iommu, x.acs_blockers, x.map_type) == ("iova", ["0000:00:0b.0"], "NOT_SUPPORTED")
        assert "ACS redirect is set on 0000:00:0b.0" in x.reasons
        assert any("disable_acs_redir=" in f for f in x.fixes)


def test_fixture_trees_keep_their_empty_directories() -> None:
    # git stores no empty directory; an empty holders/ or lib/modules/ is evidence, so each
    # one carries a .p2phub-keep marker that SysRoot.listdir() never reports.
    empty = [d for d, subdirs, files in os.walk(FIXTURES) if not subdirs and not files]
    assert empty == [], "add an empty .p2phub-keep file to: " + ", ".join(empty[:5])


def test_a_gpu_whose_exporter_asks_the_p2pdma_core_is_blocked_by_a_kernel_without_it(monkeypatch) -> None:
    # amdgpu (or a backend that declares p2pdma_core) needs CONFIG_PCI_P2PDMA: same tree, other verdict
    from p2phub.doctor import core

    real = core.discover

    def discover(sr):
        top = real(sr)
        for g in top.gpus:
            g.info["p2pdma_core"] = True
        return top

    monkeypatch.setattr(core, "discover", discover)
    rep = _lab("lab-switch-6.12")
    k = rep.check("kernel.p2pdma")
    assert k.status == "FAIL" and k.applies_to == ["GPU0"] and k.fix
    assert {p.client: (p.verdict, "kernel.p2pdma" in p.because) for p in rep.pairs} == \
        {"NVMe0": ("BLOCKED", True), "NVMe1": ("BLOCKED", True)}
    assert rep.exit_code() == 1
