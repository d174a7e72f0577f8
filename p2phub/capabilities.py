"""Capability facts: what this machine offers a (memory, device) pair, read from sysfs.

The data path and the doctor read the same facts here; the Hub's path policy
(p2phub.policy) decides from them when memory is first bound to a device, and the
doctor renders them. Each fact names the doctor check that explains it.

- ``kmod_facts(path)``: is p2phub.ko loaded, is its device node usable by this user
  (checks kmod.loaded, kmod.devnode); ``staged_reason(path)`` says it in one line;
- ``pci_route(a, b)``: the PCIe route between two functions: below a common switch,
  or up through a root port / host bridge, also where ACS redirects peer traffic on a port
  of the walk (checks pcie.host_bridge, pcie.acs);
- ``iommu_mode(bdf)``: how DMA addresses of a function are translated (iommu.domain);
- ``consults_p2pdma_allow_list(backend)``: whether an exporter asks the kernel's P2PDMA
  core (and so its host-bridge allow list) before it maps memory for a peer
  (kernel.p2pdma, pcie.host_bridge).

Everything here only reads files; nothing opens /dev/p2phub or runs the doctor.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["KmodFacts", "Route", "RouteFacts", "kmod_facts", "staged_reason", "pci_route",
           "acs_redirect", "acs_ctrl", "acs_redirects", "ACS_REDIRECT_MASK", "ECAP_ACS",
           "iommu_mode", "consults_p2pdma_allow_list", "P2PDMA_CORE_BACKENDS", "SYSFS"]

SYSFS = "/sys"
_BDF = re.compile(r"^[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]$")

# Exporters that ask the P2PDMA core (pci_p2pdma_distance) before mapping for a peer: amdgpu.
# The NVIDIA P2P API and exporters that map peers themselves do not.
P2PDMA_CORE_BACKENDS = frozenset({"rocm"})


# ------------------------------------------------------------------ p2phub.ko


@dataclass(frozen=True)
class KmodFacts:
    """p2phub.ko as this process sees it."""

    path: str               # the device node
    loaded: bool            # /sys/module/p2phub exists
    node: bool              # the device node exists
    accessible: bool        # ... and this user may read and write it

    @property
    def usable(self) -> bool:
        return self.node and self.accessible


def kmod_facts(path: str, sysfs: str = SYSFS) -> KmodFacts:
    node = os.path.exists(path)
    return KmodFacts(path, os.path.exists(f"{sysfs}/module/p2phub"), node,
                     node and os.access(path, os.R_OK | os.W_OK))


def staged_reason(facts: KmodFacts) -> str | None:
    """One line naming the doctor checks why `facts` rule peer-to-peer mode out; None when
    the device node is usable."""
    if facts.usable:
        return None
    if facts.node:
        return (f"kmod.devnode: {facts.path} is not readable and writable by this user "
                "(add a udev rule or join its group)")
    if facts.loaded:
        return (f"kmod.devnode: {facts.path} is missing although p2phub.ko is loaded "
                "(check udev / devtmpfs)")
    return (f"kmod.loaded: p2phub.ko is not loaded, so there is no {facts.path} "
            "(build and load it: make -C kmod && sudo insmod kmod/p2phub.ko; "
            "`p2phub doctor` checks kmod.loadable)")


# ------------------------------------------------------------------ PCIe route


class Route(enum.Enum):
    """How DMA between two PCI functions travels."""

    SAME = "the same function"
    SWITCH = "through a PCIe switch"            # a common bridge below the root port
    HOST_BRIDGE = "through a host bridge"       # up to the root complex and back down
    UNKNOWN = "route unknown"


@dataclass(frozen=True)
class RouteFacts:
    route: Route
    via: str        # the common bridge, the host bridge(s), or why unknown

    def __str__(self) -> str:
        return f"{self.route.value} ({self.via})" if self.via else self.route.value


def _chain(bdf: str, sysfs: str) -> list[str] | None:
    """[host bridge, bridges..., bdf] from the function's sysfs path, or None when absent."""
    try:
        real = os.path.realpath(f"{sysfs}/bus/pci/devices/{bdf}")
    except OSError:
        return None
    if not os.path.exists(real):
        return None
    parts = Path(real).parts
    host = next((i for i, p in enumerate(parts) if p.startswith("pci") and ":" in p), None)
    if host is None:
        return None
    return [parts[host]] + [p for p in parts[host + 1:] if _BDF.match(p)]


# ACS (PCI Express Base spec; names as in pci_regs.h): a port whose ACS Control sets request
# redirect, completion redirect or egress control sends peer requests up to the root complex.
ECAP_ACS = 0x000D
ACS_REDIRECT_MASK = (1 << 2) | (1 << 3) | (1 << 5)  # RR | CR | EC, as the kernel tests
_CFG_EXT = 0x100
_CFG_SIZE = 4096


def acs_ctrl(config: bytes) -> int | None:
    """The ACS Control word of a config-space dump, or None when it has no ACS capability.
    The dump must hold the extended space (4096 bytes: readable by root only)."""
    off, seen = _CFG_EXT, 0
    while _CFG_EXT <= off <= len(config) - 8 and seen < 128:
        hdr = int.from_bytes(config[off:off + 4], "little")
        if hdr in (0, 0xFFFFFFFF):
            return None
        if hdr & 0xFFFF == ECAP_ACS:
            return int.from_bytes(config[off + 6:off + 8], "little")
        nxt = (hdr >> 20) & 0xFFC
        if nxt <= off:      # lists only go forward; stop on loops
            return None
        off, seen = nxt, seen + 1
    return None


def acs_redirects(ctrl: int | None) -> bool:
    """Whether an ACS Control word redirects peer traffic upstream."""
    return bool(ctrl is not None and ctrl & ACS_REDIRECT_MASK)


def acs_redirect(bdf: str, sysfs: str = SYSFS) -> bool | None:
    """True when ACS at function `bdf` redirects peer traffic upstream; None when its
    extended config space cannot be read (it needs root)."""
    try:
        with open(f"{sysfs}/bus/pci/devices/{bdf}/config", "rb") as f:
            data = f.read(_CFG_SIZE)
    except OSError:
        return None
    if len(data) < _CFG_SIZE:
        return None
    return acs_redirects(acs_ctrl(data))


def pci_route(a: str, b: str, sysfs: str = SYSFS) -> RouteFacts:
    """The route between PCI functions `a` and `b` (lower-case BDFs), as the kernel's P2PDMA
    walks it: below their common bridge, unless ACS on a port of the walk (either function
    up to the common bridge) redirects peer traffic up through the root complex."""
    a, b = str(a).lower(), str(b).lower()
    if a == b:
        return RouteFacts(Route.SAME, a)
    ca, cb = _chain(a, sysfs), _chain(b, sysfs)
    if ca is None or cb is None:
        missing = a if ca is None else b
        return RouteFacts(Route.UNKNOWN, f"{missing} is not in {sysfs}/bus/pci/devices")
    if ca[0] != cb[0]:
        return RouteFacts(Route.HOST_BRIDGE, f"{ca[0]} and {cb[0]}")
    common = 0
    for x, y in zip(ca[1:-1], cb[1:-1]):
        if x != y:
            break
        common += 1
    if common == 0:
        return RouteFacts(Route.HOST_BRIDGE, ca[0])
    if common == 1:   # the first bridge below the host bridge is the root port
        return RouteFacts(Route.HOST_BRIDGE, f"root port {ca[1]} of {ca[0]}")
    walk = ca[:common:-1] + [ca[common]] + cb[:common:-1]
    redirect = [x for x in walk if acs_redirect(x, sysfs)]
    if redirect:
        return RouteFacts(Route.HOST_BRIDGE, f"ACS redirect on {', '.join(redirect)} sends it "
                                             f"up from common bridge {ca[common]}")
    return RouteFacts(Route.SWITCH, f"common bridge {ca[common]}")


# ------------------------------------------------------------------ IOMMU


def iommu_mode(bdf: str, sysfs: str = SYSFS) -> str:
    """"off" (no IOMMU group: bus addresses), "identity" (passthrough), "translated" (IOVAs),
    or "unknown"."""
    grp = f"{sysfs}/bus/pci/devices/{str(bdf).lower()}/iommu_group"
    if not os.path.exists(f"{sysfs}/bus/pci/devices/{str(bdf).lower()}"):
        return "unknown"
    if not os.path.exists(grp):
        return "off"
    try:
        kind = Path(grp, "type").read_text().strip()
    except OSError:
        return "unknown"
    if kind == "identity":
        return "identity"
    if kind.startswith("DMA"):
        return "translated"
    return "unknown"


# ------------------------------------------------------------------ exporters


def consults_p2pdma_allow_list(backend: str | None, provider: str) -> bool:
    """Whether pinning memory of `backend` through `provider` ("dmabuf", "nvidia") asks the
    kernel's P2PDMA core, whose host-bridge allow list then decides a route through a host
    bridge. The NVIDIA P2P API never does; a dma-buf exporter does where it is amdgpu's."""
    return provider == "dmabuf" and backend in P2PDMA_CORE_BACKENDS
