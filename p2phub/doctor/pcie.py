"""PCI config-space parsing (capabilities, ACS, ATS, port type) and P2P path classification.

The path classification mirrors the merged Linux ``calc_map_type_and_dist()`` in
``drivers/pci/p2pdma.c``: walk the provider's upstream bridges, find the first one that is also an
ancestor of the client, count hops on both sides, collect every port whose ACS Control has a redirect
bit (RR, CR or EC) set, and, when the route must go through the host bridge, apply the CPU rule (x86
AMD family >= 0x17) or the host-bridge allow list. Topology classes follow nvidia-smi's vocabulary.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .discovery import PciDev, Topology

# --- config-space constants (PCI Express Base spec; names as in pci_regs.h) -------------------
CAP_ID_PCIE = 0x10
ECAP_AER = 0x0001
ECAP_ACS = 0x000D
ECAP_ATS = 0x000F
ECAP_REBAR = 0x0015
ECAP_DPC = 0x001D

ACS_BITS = [("SV", "SrcValid"), ("TB", "TransBlk"), ("RR", "ReqRedir"), ("CR", "CmpltRedir"),
            ("UF", "UpstreamFwd"), ("EC", "EgressCtrl"), ("DT", "DirectTrans")]
ACS_REDIRECT_MASK = (1 << 2) | (1 << 3) | (1 << 5)  # RR | CR | EC, as the kernel tests
ACS_TB = 1 << 1
ACS_DT = 1 << 6

PORT_TYPES = {0: "endpoint", 1: "legacy-endpoint", 4: "root-port", 5: "upstream-port",
              6: "downstream-port", 7: "pcie-to-pci-bridge", 8: "pci-to-pcie-bridge",
              9: "rc-integrated-endpoint", 10: "rc-event-collector"}

UNPRIVILEGED_CFG = 64  # sysfs returns only the header to readers without CAP_SYS_ADMIN


def acs_bits_str(value: int, lspci: bool = True) -> str:
    """ACS bits in lspci's ``SrcValid+ TransBlk- ...`` form (or short names)."""
    return " ".join(f"{(lng if lspci else sh)}{'+' if value & (1 << i) else '-'}"
                    for i, (sh, lng) in enumerate(ACS_BITS))


@dataclass
class ConfigSpace:
    """What the doctor learns from one device's config space."""

    size: int = 0
    reason: str | None = None      # why the extended space is unknown (None: it was read)
    pcie: bool = False
    port_type: str | None = None
    ext_read: bool = False         # extended capabilities could be walked (>= 4096 bytes read)
    ext_caps: list[int] = field(default_factory=list)
    acs_cap: int | None = None     # None: no ACS capability (or unknown, see ``reason``)
    acs_ctrl: int | None = None
    ats_cap: bool = False
    ats_enabled: bool | None = None
    ats_stu: int | None = None
    rebar: list[tuple[int, int]] = field(default_factory=list)  # (bar index, current size bytes)
    link_speed_code: int | None = None
    link_width: int | None = None

    @property
    def acs_known(self) -> bool:
        """ACS is known (present with a value, or known to be absent)."""
        return self.reason is None

    @property
    def acs_redirect(self) -> bool | None:
        if not self.acs_known:
            return None
        return bool(self.acs_ctrl is not None and self.acs_ctrl & ACS_REDIRECT_MASK)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"size": self.size, "port_type": self.port_type}
        if self.reason:
            d["unknown_reason"] = self.reason
        d["acs"] = None if self.acs_ctrl is None else {
            "cap": f"0x{self.acs_cap or 0:04x}", "ctrl": f"0x{self.acs_ctrl:04x}",
            "ctrl_bits": acs_bits_str(self.acs_ctrl), "redirect": self.acs_redirect}
        d["ats"] = {"cap": self.ats_cap, "enabled": self.ats_enabled} if self.ats_cap else None
        return d


def _u16(b: bytes, off: int) -> int:
    return struct.unpack_from("<H", b, off)[0]


def _u32(b: bytes, off: int) -> int:
    return struct.unpack_from("<I", b, off)[0]


def parse_config(data: bytes | None, reason: str | None = None) -> ConfigSpace:
    """Parse a config-space dump as read from ``/sys/bus/pci/devices/<bdf>/config``."""
    cs = ConfigSpace()
    if data is None:
        cs.reason = reason or "config space unreadable"
        return cs
    cs.size = len(data)
    if len(data) <= UNPRIVILEGED_CFG:
        cs.reason = (f"only {len(data)} bytes of config space readable: capabilities need "
                     "CAP_SYS_ADMIN (run as root)")
        return cs
    # standard capability list
    status = _u16(data, 0x06)
    pcie_off = None
    if status & 0x10 and len(data) > 0x34:
        ptr = data[0x34] & 0xFC
        seen = 0
        while ptr and ptr + 2 <= len(data) and seen < 48:
            cap_id = data[ptr]
            if cap_id == CAP_ID_PCIE:
                pcie_off = ptr
            ptr = data[ptr + 1] & 0xFC
            seen += 1
    if pcie_off is not None and pcie_off + 0x14 <= len(data):
        cs.pcie = True
        flags = _u16(data, pcie_off + 0x02)
        cs.port_type = PORT_TYPES.get((flags >> 4) & 0xF, f"type-{(flags >> 4) & 0xF}")
        lnksta = _u16(data, pcie_off + 0x12)
        cs.link_speed_code = lnksta & 0xF
        cs.link_width = (lnksta >> 4) & 0x3F
    if len(data) < 4096:
        # conventional PCI or a function without extended space: no ACS/ATS exist
        cs.ext_read = False
        if cs.pcie and len(data) == 256:
            cs.ext_read = True  # PCIe function whose config is 256 bytes: no extended caps at all
        return cs
    cs.ext_read = True
    off = 0x100
    seen = 0
    while 0x100 <= off <= 4096 - 4 and seen < 128:
        hdr = _u32(data, off)
        if hdr in (0, 0xFFFFFFFF):
            break
        cap_id = hdr & 0xFFFF
        cs.ext_caps.append(cap_id)
        if cap_id == ECAP_ACS and off + 8 <= 4096:
            cs.acs_cap = _u16(data, off + 4)
            cs.acs_ctrl = _u16(data, off + 6)
        elif cap_id == ECAP_ATS and off + 8 <= 4096:
            cs.ats_cap = True
            ctrl = _u16(data, off + 6)
            cs.ats_enabled = bool(ctrl & 0x8000)
            cs.ats_stu = ctrl & 0x1F
        elif cap_id == ECAP_REBAR and off + 8 <= 4096:
            nbars = (_u32(data, off + 8) >> 5) & 0x7 or 1
            for i in range(min(nbars, 6)):
                ctl = _u32(data, off + 8 + 8 * i)
                cs.rebar.append((ctl & 0x7, 1 << (((ctl >> 8) & 0x3F) + 20)))
        nxt = (hdr >> 20) & 0xFFC
        if nxt <= off:  # lists only go forward; stop on loops
            break
        off = nxt
        seen += 1
    return cs


# --- kernel P2PDMA host-bridge allow list (drivers/pci/p2pdma.c) ---------------------------
SAME_HB = "same-host-bridge"
HOST_BRIDGE_ALLOW: dict[tuple[int, int | None], str | None] = {
    # Intel Xeon E5 / Core i7 (Sandy Bridge-EP), Xeon E5/E7 v3 (Haswell): same host bridge only
    (0x8086, 0x3C00): SAME_HB, (0x8086, 0x3C01): SAME_HB,
    (0x8086, 0x2F00): SAME_HB, (0x8086, 0x2F01): SAME_HB,
    # Intel Sky Lake-E and later
    (0x8086, 0x2030): None, (0x8086, 0x2031): None, (0x8086, 0x2032): None, (0x8086, 0x2033): None,
    (0x8086, 0x2020): None, (0x8086, 0x09A2): None,
    # Google: any device
    (0x1AE0, None): None,
    # NVIDIA CPUs (Grace family root complexes)
    (0x10DE, 0x2F95): None, (0x10DE, 0x2F96): None, (0x10DE, 0x2F97): None, (0x10DE, 0x2F98): None,
    # Zhaoxin
    (0x1D17, 0x1003): SAME_HB, (0x1D17, 0x1005): SAME_HB, (0x1D17, 0x1006): SAME_HB,
    (0x1D17, 0x1007): SAME_HB, (0x1D17, 0x1008): None,
}
# Older kernels (< the Zen CPU-family rule) listed AMD root complexes individually.
AMD_LEGACY_ALLOW = {0x1450, 0x15D0, 0x1630, 0x1480}


def allow_entry(vendor: int | None, device: int | None) -> tuple[bool, str | None]:
    """(listed, flag) for a host bridge's first device."""
    if vendor is None:
        return False, None
    for (v, d), flag in HOST_BRIDGE_ALLOW.items():
        if v == vendor and (d is None or d == device):
            return True, flag
    return False, None


# --- topology classes ----------------------------------------------------------------------
CLASS_ORDER = ["X", "PIX", "PXB", "PHB", "NODE", "SYS"]

MAP_BUS_ADDR = "BUS_ADDR"
MAP_THRU_HOST_BRIDGE = "THRU_HOST_BRIDGE"
MAP_NOT_SUPPORTED = "NOT_SUPPORTED"
MAP_UNKNOWN = "UNKNOWN"


@dataclass
class PathResult:
    provider: str
    client: str
    cls: str
    distance: int
    lca: str | None
    path: list[str]                       # bridges between the two devices (provider side first)
    map_type: str
    acs_blockers: list[str] = field(default_factory=list)
    acs_unknown: list[str] = field(default_factory=list)   # ports whose ACS could not be read
    host_bridge_allowed: bool | None = None
    host_bridge_rule: str | None = None
    reasons: list[str] = field(default_factory=list)


def classify(top: "Topology", p: "PciDev", c: "PciDev") -> PathResult:
    """Topology class, kernel map type and distance for provider ``p`` and client ``c``."""
    if p.bdf == c.bdf:
        return PathResult(p.bdf, c.bdf, "X", 0, p.bdf, [], MAP_BUS_ADDR)
    # the kernel's pci_upstream_bridge() walk: a device on a root bus has no upstream bridge
    up_p = [p.bdf] + p.chain
    up_c = [c.bdf] + c.chain
    blockers: list[str] = []
    unknown: list[str] = []

    def acs_check(bdf: str) -> None:
        d = top.pci.get(bdf)
        if d is None or d.cfg is None:
            unknown.append(bdf)
            return
        r = d.cfg.acs_redirect
        if r is None:
            unknown.append(bdf)
        elif r:
            blockers.append(bdf)

    lca = None
    dist_a = 0
    dist_b = 0
    for a in up_p:
        acs_check(a)
        if a in up_c:
            lca = a
            dist_b = up_c.index(a)
            break
        dist_a += 1
    if lca is not None:
        for bb in up_c[:dist_b]:
            acs_check(bb)
        distance = dist_a + dist_b
        path = up_p[1:dist_a] + [lca] + list(reversed(up_c[1:dist_b]))
    else:
        dist_b = len(up_c)
        distance = dist_a + dist_b
        path = up_p[1:] + [p.host_bridge or "?", c.host_bridge or "?"] + list(reversed(up_c[1:]))
        if p.host_bridge == c.host_bridge:
            path = up_p[1:] + [p.host_bridge or "?"] + list(reversed(up_c[1:]))
    path = [x for i, x in enumerate(path) if x and (i == 0 or path[i - 1] != x)]

    # topology class
    cls = _topo_class(top, p, c, lca)
    res = PathResult(p.bdf, c.bdf, cls, distance, lca, path, MAP_UNKNOWN, blockers, unknown)

    if lca is not None and not blockers and not unknown:
        res.map_type = MAP_BUS_ADDR
        return res
    if lca is not None and not blockers and unknown:
        res.map_type = MAP_UNKNOWN
        res.reasons.append("ACS control unreadable on " + ", ".join(unknown) +
                           " (config space needs root)")
        return res
    if blockers:
        res.reasons.append("ACS redirect is set on " + ", ".join(blockers))
    # through the host bridge: the CPU rule, else the allow list
    allowed, rule = host_bridge_allowed(top, p, c)
    res.host_bridge_allowed = allowed
    res.host_bridge_rule = rule
    if allowed is None:
        res.map_type = MAP_UNKNOWN
        res.reasons.append(rule or "host bridge identity unknown")
    elif allowed:
        res.map_type = MAP_THRU_HOST_BRIDGE if not unknown else MAP_UNKNOWN
        if unknown:
            res.reasons.append("ACS control unreadable on " + ", ".join(unknown))
    else:
        res.map_type = MAP_NOT_SUPPORTED
        res.reasons.append(rule or "host bridge not allowed")
    return res


def host_bridge_allowed(top: "Topology", p: "PciDev", c: "PciDev") -> tuple[bool | None, str]:
    cpu = top.cpu
    if cpu.get("arch") in ("x86_64", "i686", "x86") and cpu.get("vendor") == "AuthenticAMD":
        fam = cpu.get("family")
        if isinstance(fam, int) and fam >= 0x17:
            return True, f"AMD CPU family 0x{fam:x} (Zen or newer): the kernel allows P2P through the host bridge"
    hb_p = top.host_bridge_ids.get(p.host_bridge or "")
    hb_c = top.host_bridge_ids.get(c.host_bridge or "")

    def name(hb: str | None, ids: tuple[int, int] | None) -> str:
        return f"{hb} ({ids[0]:04x}:{ids[1]:04x})" if ids else f"{hb} (first device unknown)"

    if p.host_bridge == c.host_bridge:
        listed, flag = allow_entry(*(hb_p or (None, None)))
        if listed:
            return True, f"host bridge {name(p.host_bridge, hb_p)} is in the kernel's P2PDMA allow list"
        if hb_p is None:
            return False, f"host bridge {p.host_bridge} has no device at 00.0: not in the P2PDMA allow list"
        return False, f"Host bridge not in P2PDMA whitelist: {hb_p[0]:04x}:{hb_p[1]:04x} ({p.host_bridge})"
    lp, fp = allow_entry(*(hb_p or (None, None)))
    lc, fc = allow_entry(*(hb_c or (None, None)))
    if lp and lc and fp != SAME_HB and fc != SAME_HB:
        return True, (f"host bridges {name(p.host_bridge, hb_p)} and {name(c.host_bridge, hb_c)} are both in "
                      "the P2PDMA allow list")
    bad = [name(h, i) for h, i, ok, f in ((p.host_bridge, hb_p, lp, fp), (c.host_bridge, hb_c, lc, fc))
           if not ok or f == SAME_HB]
    return False, ("client and provider do not share an upstream bridge or whitelisted host bridge: "
                   + ", ".join(bad) + " not allowed across host bridges")


def _topo_class(top: "Topology", p: "PciDev", c: "PciDev", lca: str | None) -> str:
    if p.host_bridge != c.host_bridge:
        np_, nc = p.numa_node, c.numa_node
        if np_ is not None and nc is not None and np_ >= 0 and nc >= 0 and np_ != nc:
            return "SYS"
        if (np_ is None or np_ < 0) and (nc is None or nc < 0):
            # no NUMA information: distinct host bridges on one socket is the usual case
            return "NODE"
        return "NODE"
    if lca is None:
        return "PHB"
    d = top.pci.get(lca)
    port_type = d.cfg.port_type if d is not None and d.cfg is not None else None
    if port_type == "root-port" or (port_type is None and d is not None and not d.chain):
        # the common bridge is a root port (or, without port types, a bridge on the root bus)
        return "PHB"
    levels = max(_switch_levels(top, p, lca), _switch_levels(top, c, lca))
    return "PIX" if levels <= 1 else "PXB"


def _switch_levels(top: "Topology", dev: "PciDev", lca: str) -> int:
    """Number of switches between ``dev`` and the common ancestor (the LCA's own switch counts)."""
    chain = dev.chain
    if lca not in chain:
        return 0
    below = chain[: chain.index(lca) + 1]
    n = 0.0
    for b in below:
        d = top.pci.get(b)
        pt = d.cfg.port_type if d is not None and d.cfg is not None else None
        if pt == "upstream-port":
            n += 1
        elif pt is None:
            n += 0.5  # no port types: a switch shows as two bridges (upstream + downstream port)
    return int(n + 0.5)


LINK_GTS = {"2.5": 2.5, "5.0": 5.0, "5": 5.0, "8.0": 8.0, "16.0": 16.0, "32.0": 32.0, "64.0": 64.0}


def link_gbps(speed: str | None, width: int | None) -> float | None:
    """Usable GB/s of a link from sysfs ``current_link_speed`` text and width."""
    if not speed or not width:
        return None
    try:
        gts = float(speed.split()[0])
    except (ValueError, IndexError):
        return None
    eff = 0.8 if gts <= 5.0 else (128 / 130 if gts < 64 else 242 / 256)
    return round(gts * eff * width / 8, 1)
