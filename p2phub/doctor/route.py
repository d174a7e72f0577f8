"""P2P path classification between two PCI functions, as the doctor reports it.

The path classification mirrors the merged Linux ``calc_map_type_and_dist()`` in
``drivers/pci/p2pdma.c``: walk the provider's upstream bridges, find the first one that is also an
ancestor of the client, count hops on both sides, collect every port whose ACS Control has a redirect
bit (RR, CR or EC) set, and, when the route must go through the host bridge, apply the CPU rule (x86
AMD family >= 0x17) or the host-bridge allow list. Topology classes follow nvidia-smi's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .discovery import PciDev, Topology


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


def classify(top: Topology, p: PciDev, c: PciDev) -> PathResult:
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


def host_bridge_allowed(top: Topology, p: PciDev, c: PciDev) -> tuple[bool | None, str]:
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


def _topo_class(top: Topology, p: PciDev, c: PciDev, lca: str | None) -> str:
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


def _switch_levels(top: Topology, dev: PciDev, lca: str) -> int:
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
