"""Capability facts read from a sysfs tree, and the path policy that decides from them: the
route between two PCI functions, the IOMMU mode, and the path each kind of memory takes to
a device or a NIC (p2phub.capabilities, p2phub.policy)."""

from __future__ import annotations

import os

import pytest

from p2phub import capabilities as caps
from p2phub.backend import GpuRange
from p2phub.hub import Hub
from p2phub.memory import Memory, MemoryInfo, MemoryShare, NicTarget, PathKind
from p2phub.policy import NoPathError, PathPolicy

GPU, SSD_SWITCH, SSD_ROOT, NIC_OTHER_HB = "0000:03:00.0", "0000:04:00.0", "0000:05:00.0", "0000:80:00.0"


@pytest.fixture()
def sysfs(tmp_path) -> str:
    """A host bridge pci0000:00 with a root port 00:01.0 above a switch (02:00.0 up,
    03:x / 04:x behind downstream ports 02:01.0 / 02:02.0), a second root port 00:02.0 above
    05:00.0, and a second host bridge pci0000:80 with 80:00.0 on its root bus."""
    root = tmp_path / "sys"
    dev = root / "devices"
    sw = dev / "pci0000:00" / "0000:00:01.0" / "0000:01:00.0"
    places = {
        GPU: sw / "0000:02:01.0" / GPU,
        SSD_SWITCH: sw / "0000:02:02.0" / SSD_SWITCH,
        SSD_ROOT: dev / "pci0000:00" / "0000:00:02.0" / SSD_ROOT,
        NIC_OTHER_HB: dev / "pci0000:80" / NIC_OTHER_HB,
    }
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    for bdf, place in places.items():
        place.mkdir(parents=True)
        os.symlink(place, links / bdf)
    grp = root / "kernel" / "iommu_groups" / "7"
    grp.mkdir(parents=True)
    (grp / "type").write_text("DMA-FQ\n")
    os.symlink(grp, places[SSD_SWITCH] / "iommu_group")
    return str(root)


def test_routes_from_the_sysfs_tree(sysfs) -> None:
    r = caps.pci_route(GPU, SSD_SWITCH, sysfs)
    assert r.route is caps.Route.SWITCH and "0000:01:00.0" in r.via
    r = caps.pci_route(GPU, SSD_ROOT, sysfs)
    assert r.route is caps.Route.HOST_BRIDGE and r.via == "pci0000:00"
    r = caps.pci_route(GPU, NIC_OTHER_HB, sysfs)
    assert r.route is caps.Route.HOST_BRIDGE and "pci0000:80" in r.via
    r = caps.pci_route(GPU, "0000:09:00.0", sysfs)
    assert r.route is caps.Route.UNKNOWN and "0000:09:00.0" in r.via
    assert caps.pci_route(GPU, GPU.upper(), sysfs).route is caps.Route.SAME


def test_iommu_modes(sysfs) -> None:
    assert caps.iommu_mode(SSD_SWITCH, sysfs) == "translated"
    assert caps.iommu_mode(SSD_ROOT, sysfs) == "off"
    assert caps.iommu_mode("0000:09:00.0", sysfs) == "unknown"


def test_kmod_facts_name_the_check(tmp_path) -> None:
    node = tmp_path / "p2phub"
    facts = caps.kmod_facts(str(node), sysfs=str(tmp_path))
    assert not facts.usable and caps.staged_reason(facts).startswith("kmod.loaded:")
    (tmp_path / "module" / "p2phub").mkdir(parents=True)
    facts = caps.kmod_facts(str(node), sysfs=str(tmp_path))
    assert caps.staged_reason(facts).startswith("kmod.devnode:") and "missing" in caps.staged_reason(facts)
    node.write_bytes(b"")
    assert caps.staged_reason(caps.kmod_facts(str(node), sysfs=str(tmp_path))) is None


class Pinned(Memory):
    """The memory contract over nothing: GPU memory of `backend` at PCI `bdf` pinned through
    `provider`, or host memory (backend None)."""

    mode = "p2p"
    source = None

    def __init__(self, hub: Hub, backend: str | None, provider: str = "dmabuf",
                 bdf: str = GPU) -> None:
        self._owner = hub
        self._share = MemoryShare()
        self.length = 1 << 20
        self.what = f"{backend or 'host'} memory"
        self._gpu = None if backend is None else GpuRange(backend, 0, 0x10000, self.length,
                                                           0x10000, self.length, pci_bus_id=bdf)
        self._provider = provider

    @property
    def gpu(self) -> GpuRange | None:  # type: ignore[override]
        return self._gpu

    @property
    def pin_provider(self) -> str:
        return self._provider

    def info(self) -> MemoryInfo:
        return MemoryInfo(self.length, self.mode)

    def close(self, force: bool = False, timeout: float | None = None) -> None:
        self._closed = True


@pytest.fixture()
def hub(sysfs):
    with Hub(mode="staged") as h:
        h.policy = PathPolicy(sysfs)
        yield h


def test_gpu_memory_paths_follow_the_route_and_the_pin(hub) -> None:
    cuda = Pinned(hub, "cuda", "nvidia")
    p = cuda.path(SSD_SWITCH)
    assert p.kind is PathKind.P2P_SWITCH and "IOMMU translated" in p.reason
    p = cuda.path(SSD_ROOT)
    assert p.kind is PathKind.P2P_HOST_BRIDGE and "does not consult" in p.reason
    rocm = Pinned(hub, "rocm", "dmabuf")
    p = rocm.path(SSD_ROOT)
    assert p.kind is PathKind.P2P_HOST_BRIDGE and "allow list decides" in p.reason
    assert Pinned(hub, None).path(SSD_ROOT).kind is PathKind.HOST_DMA
    nobdf = Pinned(hub, "cuda", "nvidia", bdf="")
    assert nobdf.path(SSD_ROOT).kind is PathKind.P2P and "route is unknown" in nobdf.path(SSD_ROOT).reason


def test_a_path_is_chosen_once_per_device_and_listed(hub) -> None:
    mem = Pinned(hub, "cuda", "nvidia")
    first = mem.bind(SSD_SWITCH.upper()).path
    hub.policy = PathPolicy("/nonexistent")      # the facts change; the bound path does not
    assert mem.bind(SSD_SWITCH).path is first
    assert mem.paths() == [first] and first.device == SSD_SWITCH


def test_nic_paths(hub) -> None:
    dmabuf = NicTarget("mlx5_0", True, "EBADF: supported", peermem=False)
    none = NicTarget("rxe0", False, "EOPNOTSUPP", peermem=False)
    peer = NicTarget("mlx5_1", False, "EOPNOTSUPP", peermem=True)
    assert Pinned(hub, "cuda").path(dmabuf).kind is PathKind.DMABUF_MR
    assert Pinned(hub, "cuda").path(peer).kind is PathKind.PEERMEM_MR
    assert Pinned(hub, None).path(none).kind is PathKind.HOST_VA_MR
    with pytest.raises(NoPathError, match="nic.dmabuf_mr") as ei:
        Pinned(hub, "rocm").path(none)
    assert "rxe0" in str(ei.value) and "nvidia_peermem is not loaded" in str(ei.value)
    # staged host memory: no dma-buf, but a CPU VA MR
    with hub.alloc_host(4096) as staged:
        p = staged.path(dmabuf)
        assert p.kind is PathKind.HOST_VA_MR and "staged" in p.reason
        assert staged.path(SSD_ROOT).kind is PathKind.STAGED
