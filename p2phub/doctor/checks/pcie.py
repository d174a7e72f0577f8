"""pcie.*: ATS, link training, NUMA locality, and the P2P routing checks of the pair phase (ACS, host bridge)."""

from __future__ import annotations

from ..model import BLOCKED, FAIL, INFO, PASS, SKIP, UNKNOWN, WARN, CheckResult
from ..pcie import ACS_TB, acs_bits_str
from ..route import MAP_NOT_SUPPORTED, MAP_THRU_HOST_BRIDGE, MAP_UNKNOWN
from .base import Context, R, check, endpoints

@check("pcie.ats", "ATS on GPUs and peers", phase="pairs")
def _ats(ctx: Context) -> CheckResult:
    """A client with ATS enabled issues translated requests; ACS Translation Blocking on its path
    then blocks them, ACS Direct Translated routes them peer to peer."""
    rows = {}
    unknown = []
    for ident, bdf in endpoints(ctx):
        d = ctx.top.pci.get(bdf)
        if d is None or d.cfg is None:
            continue
        if d.cfg.reason:
            unknown.append(ident)
            rows[ident] = "unknown"
        elif d.cfg.ats_cap:
            rows[ident] = "enabled" if d.cfg.ats_enabled else "capable, disabled"
        else:
            rows[ident] = "no ATS"
    if not rows:
        return R(SKIP, "no GPUs or peers")
    tb = []
    for pv in ctx.pairs:
        client = ctx.top.device(pv.client)
        cd = ctx.top.pci.get(client.bdf) if client and client.bdf else None
        if cd and cd.cfg and cd.cfg.ats_enabled:
            for b in pv.path:
                bd = ctx.top.pci.get(b)
                if bd and bd.cfg and bd.cfg.acs_ctrl is not None and bd.cfg.acs_ctrl & ACS_TB:
                    tb.append(f"{pv.client} via {b}")
    desc = ", ".join(f"{i}: {s}" for i, s in rows.items())
    ev = ctx.ev(*(f"/sys/bus/pci/devices/{b}/config" for _, b in endpoints(ctx)))
    if tb:
        return R(WARN, "ATS-enabled client behind ACS Translation Blocking: " + "; ".join(tb),
                 "disable ATS on the client (pci=noats) or clear ACS TB on the listed ports", ev, ats=rows)
    if unknown:
        return R(UNKNOWN, desc + " (config space needs root)", "run as root", ev, ats=rows)
    return R(INFO, desc, evidence=ev, ats=rows)



@check("pcie.link", "Link training", phase="pairs")
def _link(ctx: Context) -> CheckResult:
    """Current link speed/width below the maximum on a GPU, a peer or a bridge of a P2P path. GPUs
    lower their link speed when idle, so a GPU's speed alone is INFO; a narrower width is not."""
    bdfs: dict[str, str] = {}
    for ident, bdf in endpoints(ctx):
        bdfs[bdf] = ident
    for pv in ctx.pairs:
        for b in pv.path:
            bdfs.setdefault(b, "bridge")
    down, idle = [], []
    for b, who in bdfs.items():
        d = ctx.top.pci.get(b)
        if d is None or not d.link:
            continue
        L = d.link
        sp_cur, sp_max = L.get("current_link_speed"), L.get("max_link_speed")
        w_cur, w_max = L.get("current_link_width"), L.get("max_link_width")
        try:
            sp_down = float(str(sp_cur).split()[0]) < float(str(sp_max).split()[0])
        except (ValueError, IndexError):
            sp_down = False
        w_down = isinstance(w_cur, int) and isinstance(w_max, int) and 0 < w_cur < w_max
        label = f"{who} {b}: {sp_cur} x{w_cur} (max {sp_max} x{w_max})"
        if w_down or (sp_down and not (who.startswith("GPU"))):
            down.append(label)
        elif sp_down:
            idle.append(label)
    if not bdfs:
        return R(SKIP, "no GPUs or peers")
    ev = ctx.ev(*(f"/sys/bus/pci/devices/{b}/current_link_width" for b in bdfs))
    if down:
        return R(WARN, "down-trained links: " + "; ".join(down),
                 "reseat the card / check the slot's lanes and BIOS link settings", ev, down=down)
    if idle:
        return R(INFO, "GPU link speed below max (GPUs downclock the link when idle): " + "; ".join(idle), evidence=ev)
    return R(PASS, "all links at their maximum speed and width", evidence=ev)


@check("pcie.numa", "NUMA locality", phase="pairs")
def _numa(ctx: Context) -> CheckResult:
    """A GPU and a peer on different NUMA nodes route P2P over the socket interconnect (SYS)."""
    nodes = {d.id: (ctx.top.pci[d.bdf].numa_node if d.bdf in ctx.top.pci else None) for d in ctx.top.devices if d.bdf}
    if not nodes:
        return R(SKIP, "no GPUs or peers")
    cross = [f"{p.provider}<->{p.client}" for p in ctx.pairs if p.cls == "SYS"]
    desc = ", ".join(f"{i}: {n}" for i, n in nodes.items())
    if cross:
        return R(WARN, "pairs across NUMA nodes: " + ", ".join(cross), "pick a peer on the GPU's NUMA node", nodes=nodes)
    return R(INFO, "numa_node " + desc + (" (-1: firmware gave no locality)" if -1 in nodes.values() else ""),
             nodes=nodes)




# ------------------------------------------------------------ routing (phase: pairs)
@check("pcie.acs", "ACS redirect on P2P paths", phase="pairs")
def _acs(ctx: Context) -> CheckResult:
    """ACS Control with P2P Request Redirect, Completion Redirect or Egress Control on any port of a
    pair's path makes the kernel send the traffic up to the root complex (then the host-bridge rule
    decides). SV and UF do not redirect. Reads config space (root only)."""
    if not ctx.pairs:
        return R(SKIP, "no GPU<->peer pairs")
    ports: dict[str, list[str]] = {}
    unknown: set[str] = set()
    blocked_by_acs = False
    for pv in ctx.pairs:
        for b in pv.acs_blockers:
            ports.setdefault(b, []).append(f"{pv.provider}<->{pv.client}")
        if pv.map_type == MAP_NOT_SUPPORTED and pv.acs_blockers and pv.verdict == BLOCKED:
            blocked_by_acs = True   # only where p2phub's path consults the kernel's allow list
    for pv in ctx.pairs:
        if pv.map_type == MAP_UNKNOWN and "host.privilege" in pv.because:
            unknown.update(b for b in pv.path)
    ev = []
    for b in ports:
        d = ctx.top.pci.get(b)
        e = ctx.ev(f"/sys/bus/pci/devices/{b}/config")
        if d and d.cfg and d.cfg.acs_ctrl is not None:
            for x in e:
                x["acs_ctrl"] = f"0x{d.cfg.acs_ctrl:04x}"
                x["ACSCtl"] = acs_bits_str(d.cfg.acs_ctrl)
        ev += e
    if ports:
        lst = ";".join(ports)
        fix = (f"add pci=disable_acs_redir={lst} to the kernel command line (or at run time: "
               + " ; ".join(f"setpci -s {b} ECAP_ACS+0x6.w=0000" for b in ports)
               + "); this removes ACS isolation on those ports")
        desc = "; ".join(f"{b} ({acs_bits_str(ctx.top.pci[b].cfg.acs_ctrl or 0)}) on {', '.join(v)}"  # type: ignore[union-attr]
                         for b, v in ports.items())
        return R(FAIL if blocked_by_acs else WARN, "ACS redirect set: " + desc, fix, ev, list(ports), ports=ports)
    if any(pv.map_type == MAP_UNKNOWN and "host.privilege" in pv.because for pv in ctx.pairs):
        return R(UNKNOWN, "ACS control unreadable on the P2P paths (config space needs root)", "run as root")
    unread = sorted({b for pv in ctx.pairs for b in pv.acs_unknown})
    if unread:
        # the map type did not depend on them (e.g. no common bridge and a host bridge that is not
        # allowed), but "no ACS redirect" would be a guess
        return R(UNKNOWN, "ACS control unreadable on " + ", ".join(unread) + " (config space needs root)",
                 "run as root", ctx.ev(*(f"/sys/bus/pci/devices/{b}/config" for b in unread)), unread)
    return R(PASS, "no ACS redirect on any pair's path", evidence=ev)


@check("pcie.host_bridge", "Host-bridge P2P rule", phase="pairs")
def _hb(ctx: Context) -> CheckResult:
    """A route through the host bridge is allowed on x86 AMD Zen and newer, or when the first device
    of the host bridge's root bus is in the kernel's P2PDMA allow list (some entries only within one
    host bridge)."""
    hbs = {hb: (f"{ids[0]:04x}:{ids[1]:04x}" if ids else None) for hb, ids in ctx.top.host_bridge_ids.items()}
    needing = [pv for pv in ctx.pairs if pv.map_type in (MAP_THRU_HOST_BRIDGE, MAP_NOT_SUPPORTED)
               or (pv.map_type == MAP_UNKNOWN and pv.host_bridge.get("rule"))]
    if not ctx.pairs:
        return R(SKIP, "no GPU<->peer pairs", hosts=hbs)
    if not needing:
        return R(PASS, "no pair needs the host bridge", hosts=hbs)
    refused = [pv for pv in needing if pv.host_bridge.get("allowed") is False]
    # the allow list blocks only the pairs whose path consults it (the kernel's P2PDMA core)
    bad = [pv for pv in refused if pv.p2p.get("consults_allow_list", True)]
    slow = [pv for pv in refused if pv not in bad]
    rule = needing[0].host_bridge.get("rule")
    ev = ctx.ev(*(f"/sys/bus/pci/devices/{b[3:7]}:{b[8:10]}:00.0/device" for b in hbs))
    fix = ("clear ACS redirect so the pair stays below a switch, or use a platform whose host bridge allows P2P "
           "(the kernel's allow list, or AMD Zen)")
    if bad:
        return R(FAIL, f"{len(bad)} pair(s) need the host bridge and it is not allowed: {bad[0].host_bridge.get('rule')}",
                 fix, ev, [f"{p.provider}<->{p.client}" for p in bad], hosts=hbs)
    if slow:
        return R(WARN, f"{len(slow)} pair(s) route through a host bridge outside the kernel's P2PDMA allow list "
                 f"({slow[0].host_bridge.get('rule')}); p2phub's path for them does not consult it "
                 f"({slow[0].p2p.get('path')}: slower than below a switch)",
                 fix, ev, [f"{p.provider}<->{p.client}" for p in slow], hosts=hbs)
    return R(PASS if rule else INFO, f"{len(needing)} pair(s) route through the host bridge: {rule}", evidence=ev,
             hosts=hbs)
