"""The path policy a Hub owns: which path a (memory, device) pair takes, decided when the
pair is first bound, from the capability facts (p2phub.capabilities).

- Staged memory reaches a PCI device only through host memory (PathKind.STAGED).
- Host memory pinned by p2phub.ko: the device DMAs to RAM (HOST_DMA).
- GPU memory pinned by p2phub.ko: P2P below a common switch (P2P_SWITCH) or up through a
  host bridge (P2P_HOST_BRIDGE). Through a host bridge, a pin that asks the kernel's
  P2PDMA core (an amdgpu dma-buf) is subject to its host-bridge allow list, checked by
  the kernel at attach; the NVIDIA P2P API and exporters that map peers themselves are
  not: the route works, slower than below a switch.
- An RDMA NIC: a dma-buf MR where the NIC registers dma-buf memory and the kernel holds a
  pin; else a peer-memory MR of CUDA memory where nvidia_peermem is loaded; else a
  CPU VA MR of host memory; else refused, naming why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import capabilities as caps
from .errors import P2PHubError
from .memory import Device, MemPath, NicTarget, PathKind

if TYPE_CHECKING:
    from .memory import Memory

__all__ = ["PathPolicy", "NoPathError", "MR_CHECK", "p2p_path"]

MR_CHECK = "nic.dmabuf_mr"


class NoPathError(P2PHubError):
    """No path joins this memory and this device; the message says why and names the check."""


def p2p_path(route: caps.Route, consults_allow_list: bool, pin: str) -> tuple[PathKind, str]:
    """(kind, why) of a peer-to-peer path over `route` for memory pinned through `pin`; the
    one rule the Hub binds by and the doctor renders its pair verdicts with."""
    if route is caps.Route.SWITCH:
        return PathKind.P2P_SWITCH, f"pinned through {pin}"
    if route is caps.Route.HOST_BRIDGE:
        if consults_allow_list:
            return PathKind.P2P_HOST_BRIDGE, (
                f"pinned through {pin}, which asks the kernel's P2PDMA core: its host-bridge "
                "allow list decides (pcie.host_bridge)")
        return PathKind.P2P_HOST_BRIDGE, (
            f"pinned through {pin}, which does not consult the kernel's P2PDMA allow list: it "
            "works, slower than below a switch (pcie.host_bridge)")
    return PathKind.P2P, f"pinned through {pin}"


class PathPolicy:
    """Chooses paths from the facts under `sysfs` (the live /sys by default)."""

    def __init__(self, sysfs: str = caps.SYSFS) -> None:
        self.sysfs = sysfs

    def choose(self, mem: "Memory", device: Device) -> MemPath:
        if isinstance(device, NicTarget):
            return self.mr_path(mem, device)
        return self.dma_path(mem, str(device).lower())

    # ------------------------------------------------------------------ PCI devices

    def dma_path(self, mem: "Memory", device: str) -> MemPath:
        what = mem.what
        if mem.mode == "staged":
            return MemPath(what, device, PathKind.STAGED,
                           f"bytes bounce through pinned host memory: {mem.reason}")
        iommu = caps.iommu_mode(device, self.sysfs)
        gpu = mem.gpu
        if gpu is None:
            return MemPath(what, device, PathKind.HOST_DMA, f"host memory; IOMMU {iommu}")
        provider = mem.pin_provider
        pin = "the NVIDIA P2P API" if provider == "nvidia" else f"a {gpu.backend} dma-buf"
        if not gpu.pci_bus_id:
            return MemPath(what, device, PathKind.P2P,
                           f"pinned through {pin}; the {gpu.backend} backend does not name the "
                           f"GPU's PCI address, so the route is unknown; IOMMU {iommu}")
        route = caps.pci_route(gpu.pci_bus_id, device, self.sysfs)
        kind, why = p2p_path(route.route, caps.consults_p2pdma_allow_list(gpu.backend, provider),
                             pin)
        return MemPath(what, device, kind,
                       f"{gpu.pci_bus_id.lower()} -> {device} {route}; {why}; IOMMU {iommu}")

    # ------------------------------------------------------------------ RDMA NICs

    def mr_path(self, mem: "Memory", nic: NicTarget) -> MemPath:
        what, dev = mem.what, str(nic)
        first = f"dma-buf MR: {nic.evidence}"
        if nic.dmabuf_mr and mem.mode == "p2p":
            return MemPath(what, dev, PathKind.DMABUF_MR, first)
        if mem.mode != "p2p":
            first = "dma-buf MR: this memory is staged, p2phub.ko holds no dma-buf of it"
        gpu = mem.gpu
        if gpu is not None:
            if gpu.backend == "cuda" and nic.peermem:
                return MemPath(what, dev, PathKind.PEERMEM_MR, f"{first}; nvidia_peermem is loaded")
            raise NoPathError(f"{mem}: no RDMA path to this GPU memory on {nic.name}: {first}; "
                              "peer-memory MR: nvidia_peermem is not loaded "
                              f"(see `p2phub doctor --explain {MR_CHECK}`)")
        return MemPath(what, dev, PathKind.HOST_VA_MR, f"{first}; host-backed memory, CPU-mapped")


def describe_paths(paths: list[MemPath]) -> list[dict[str, Any]]:
    """The rows ``p2phub`` prints for hub.paths(): memory, device, path, why."""
    return [{"memory": p.memory, "device": p.device, "path": p.kind.value, "why": p.reason}
            for p in paths]
