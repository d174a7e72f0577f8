"""Pair verdicts for every GPU<->NVMe and GPU<->NIC pair, and the checks that summarise them."""

from __future__ import annotations

from typing import Any

from .checks import Context, R, check
from .model import (BLOCKED, DEGRADED, FAIL, INFO, OK, PASS, SKIP, UNKNOWN, WARN, CheckResult,
                    PairVerdict)
from .pcie import (MAP_BUS_ADDR, MAP_NOT_SUPPORTED, MAP_THRU_HOST_BRIDGE, MAP_UNKNOWN, acs_bits_str,
                   classify)
from .checks import nvidia_params, nvidia_version, nvme_usage


def _iommu_overlay(ctx: Context, map_type: str, bdfs: list[str]) -> str:
    types = [ctx.top.pci[b].iommu_type if b in ctx.top.pci else None for b in bdfs]
    groups = [ctx.top.pci[b].iommu_group if b in ctx.top.pci else None for b in bdfs]
    if map_type == MAP_BUS_ADDR:
        return "bypassed"  # TLPs turn around below the root complex
    if all(g is None for g in groups):
        return "none"
    if any(t in ("DMA", "DMA-FQ") for t in types):
        return "iova"
    if all(t == "identity" for t in types if t):
        return "passthrough"
    return "unknown"


def _gpu_gate(ctx: Context, gpu: Any, kind: str) -> tuple[bool | None, str | None, str | None]:
    """(ok, reason, check id) for the GPU driver side of a pair."""
    fl = gpu.info.get("flavour")
    if gpu.info.get("backend"):
        return True, None, None  # claimed by a backend plugin only while its exporting driver is bound
    if fl == "amd":
        r = ctx.results.get("amd.large_bar")
        if r and r.status == FAIL:
            return False, "AMD GPU without a large BAR", "amd.large_bar"
        r = ctx.results.get("amd.p2p_config")
        if r and r.status == FAIL:
            return False, "amdgpu P2P disabled", "amd.p2p_config"
        return True, None, None
    # NVIDIA
    ver, is_open = nvidia_version(ctx)
    if ver is None and "nvidia" not in ctx.top.modules:
        return False, "nvidia driver not loaded", "nvidia.driver"
    if kind == "gpu-nic":
        if nvidia_params(ctx).get("GrdmaPciTopoCheckOverride") == "2":
            return False, "GrdmaPciTopoCheckOverride=2 denies dma-buf attach", "nvidia.params"
        peermem = ctx.sys.exists("/sys/module/nvidia_peermem") or "nvidia_peermem" in ctx.top.modules
        if is_open is False and not peermem:
            return False, "proprietary driver: no dma-buf export and nvidia_peermem not loaded", "nvidia.flavour"
    return True, None, None


def _peer_gate(ctx: Context, peer: Any, kind: str) -> tuple[bool | None, str | None, str | None]:
    if kind == "gpu-nvme":
        use = nvme_usage(ctx).get(peer.id)
        if use:
            return False, f"{peer.name} is in use ({'; '.join(use)}): p2phub never takes it", "nvme.safety"
        return True, None, None
    r = ctx.results.get("nic.dmabuf_mr")
    if r and r.status == FAIL:
        peermem = ctx.sys.exists("/sys/module/nvidia_peermem") or "nvidia_peermem" in ctx.top.modules
        if not peermem:
            return False, "the NIC cannot register dma-buf MRs", "nic.dmabuf_mr"
    return True, None, None


def compute_pairs(ctx: Context) -> list[PairVerdict]:
    top = ctx.top
    out: list[PairVerdict] = []
    peers = [(p, "gpu-nvme") for p in top.nvmes if p.bdf] + \
            [(p, "gpu-nic") for p in top.nics if p.bdf and not p.info.get("soft")]
    k_p2p = ctx.results.get("kernel.p2pdma")
    for gpu in top.gpus:
        gd = top.pci.get(gpu.bdf or "")
        for peer, kind in peers:
            pd = top.pci.get(peer.bdf or "")
            if gd is None or pd is None:
                continue
            pr = classify(top, gd, pd)
            because: list[str] = []
            reasons = list(pr.reasons)
            fixes: list[str] = []
            gates: dict[str, Any] = {}
            blocked = unknown = degraded = False
            if pr.map_type == MAP_NOT_SUPPORTED:
                blocked = True
                because += ["pcie.acs"] if pr.acs_blockers else []
                because.append("pcie.host_bridge")
            elif pr.map_type == MAP_UNKNOWN:
                unknown = True
                because.append("host.privilege" if pr.acs_unknown else "pcie.host_bridge")
            elif pr.map_type == MAP_THRU_HOST_BRIDGE:
                degraded = True
                because.append("pcie.acs" if pr.acs_blockers else "pcie.host_bridge")
            if pr.acs_blockers:
                fixes.append("pci=disable_acs_redir=" + ";".join(pr.acs_blockers) +
                             " (kernel command line; removes ACS isolation on those ports)")
            # kernel support
            if k_p2p is not None and k_p2p.status == FAIL:
                blocked = True
                because.append("kernel.p2pdma")
                reasons.append("the kernel has no PCI P2PDMA")
                fixes.append("boot a kernel with CONFIG_PCI_P2PDMA=y")
            elif k_p2p is not None and k_p2p.status == UNKNOWN:
                unknown = True
                because.append("kernel.p2pdma")
            for name, (ok, why, cid) in (("gpu", _gpu_gate(ctx, gpu, kind)), ("peer", _peer_gate(ctx, peer, kind))):
                gates[name] = {"ok": ok, "reason": why}
                if ok is False:
                    blocked = True
                    reasons.append(why or "")
                    if cid:
                        because.append(cid)
            iommu = _iommu_overlay(ctx, pr.map_type, [gpu.bdf, peer.bdf])
            if iommu == "iova" and pr.map_type == MAP_THRU_HOST_BRIDGE:
                degraded = True
                because.append("iommu.domain")
                reasons.append("through the host bridge with a translated IOMMU domain (IOVA-mapped)")
            if pr.cls in ("NODE", "SYS"):
                degraded = True
                because.append("pcie.numa" if pr.cls == "SYS" else "pcie.host_bridge")
            bdfs = [gpu.bdf] + [b for b in pr.path if b in top.pci] + [peer.bdf]
            gbps = top.path_gbps(bdfs)
            links_down = [b for b in bdfs if b in top.pci and _width_down(top.pci[b].link)]
            if links_down:
                degraded = True
                because.append("pcie.link")
                reasons.append("down-trained link on " + ", ".join(links_down))
            na, nb = gd.numa_node, pd.numa_node
            numa_aligned = None if na is None or nb is None or na < 0 or nb < 0 else na == nb
            verdict = BLOCKED if blocked else UNKNOWN if unknown else DEGRADED if degraded else OK
            if pr.map_type == MAP_BUS_ADDR and not blocked and not unknown:
                because.insert(0, "pcie.acs")
            hb = {"allowed": pr.host_bridge_allowed, "rule": pr.host_bridge_rule,
                  "provider": gd.host_bridge, "client": pd.host_bridge}
            out.append(PairVerdict(gpu.id, peer.id, kind, pr.cls, pr.distance, pr.lca, pr.path, pr.map_type,
                                   pr.acs_blockers, hb, iommu, gbps, numa_aligned, gates, verdict,
                                   list(dict.fromkeys(because)), [r for r in reasons if r],
                                   list(dict.fromkeys(fixes)), acs_unknown=list(pr.acs_unknown)))
    return out


def _width_down(link: dict[str, Any]) -> bool:
    c, m = link.get("current_link_width"), link.get("max_link_width")
    return isinstance(c, int) and isinstance(m, int) and 0 < c < m


# ------------------------------------------------------------------------- pair-level checks
@check("topology.peers", "GPUs and P2P peers present", phase="pairs")
def _peers(ctx: Context) -> CheckResult:
    """P2P needs a GPU and at least one PCIe NVMe controller or PCI RDMA NIC."""
    t = ctx.top
    gpus = len(t.gpus)
    nvme = len([n for n in t.nvmes if n.bdf])
    nics = len([n for n in t.nics if n.bdf and not n.info.get("soft")])
    desc = f"{gpus} GPU(s), {nvme} PCIe NVMe controller(s), {nics} PCI RDMA NIC(s)"
    ev = ctx.ev("/sys/class/nvme", "/sys/class/infiniband")
    if not gpus and not (nvme or nics):
        return R(FAIL, f"no GPU and no P2P peers ({desc})", "run on a machine with a GPU and an NVMe SSD or RDMA NIC",
                 ev, gpus=gpus, nvme=nvme, nics=nics)
    if not gpus:
        return R(FAIL, f"no GPU: nothing to do P2P from ({desc})", "run on a machine with a GPU", ev,
                 gpus=gpus, nvme=nvme, nics=nics)
    if not (nvme or nics):
        return R(FAIL, f"no P2P peers: no PCIe NVMe controller and no PCI RDMA NIC ({desc})",
                 "attach an NVMe SSD or RDMA NIC (in a VM: pass them through next to the GPU)", ev,
                 gpus=gpus, nvme=nvme, nics=nics)
    return R(PASS, desc, gpus=gpus, nvme=nvme, nics=nics)


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
        if pv.map_type == MAP_NOT_SUPPORTED and pv.acs_blockers:
            blocked_by_acs = True
        for b in [pv.provider, pv.client]:
            pass
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
    bad = [pv for pv in needing if pv.host_bridge.get("allowed") is False]
    rule = needing[0].host_bridge.get("rule")
    ev = ctx.ev(*(f"/sys/bus/pci/devices/{b[3:7]}:{b[8:10]}:00.0/device" for b in hbs))
    if bad:
        return R(FAIL, f"{len(bad)} pair(s) need the host bridge and it is not allowed: {bad[0].host_bridge.get('rule')}",
                 "clear ACS redirect so the pair stays below a switch, or use a platform whose host bridge allows P2P "
                 "(the kernel's allow list, or AMD Zen)", ev, [f"{p.provider}<->{p.client}" for p in bad], hosts=hbs)
    return R(PASS if rule else INFO, f"{len(needing)} pair(s) route through the host bridge: {rule}", evidence=ev,
             hosts=hbs)


def _pairs_check(ctx: Context, kind: str, label: str) -> CheckResult:
    ps = [p for p in ctx.pairs if p.kind == kind]
    if not ps:
        return R(SKIP, f"no {label} pairs")
    counts: dict[str, int] = {}
    for p in ps:
        counts[p.verdict] = counts.get(p.verdict, 0) + 1
    desc = ", ".join(f"{n} {v}" for v, n in counts.items())
    usable = counts.get(OK, 0) + counts.get(DEGRADED, 0)
    worst = [p for p in ps if p.verdict == BLOCKED]
    fix = next((f for p in worst + [p for p in ps if p.verdict == DEGRADED] for f in p.fixes), None)
    if fix is None and any(p.verdict != OK for p in ps):
        fix = "see the checks named in each pair's 'because' list"
    if not usable and counts.get(UNKNOWN):
        return R(UNKNOWN, f"{label}: {desc}", "run as root", counts=counts)
    if not usable:
        why = "; ".join(dict.fromkeys(r for p in worst for r in p.reasons))
        return R(FAIL, f"{label}: no usable pair ({desc}): {why}", fix, counts=counts)
    if counts.get(BLOCKED) or counts.get(DEGRADED) or counts.get(UNKNOWN):
        return R(WARN, f"{label}: {desc}", fix, counts=counts)
    return R(PASS, f"{label}: {desc}", counts=counts)


@check("pairs.gpu_nvme", "GPU<->NVMe pairs", phase="pairs")
def _pairs_nvme(ctx: Context) -> CheckResult:
    """Summary of the GPU<->NVMe pair verdicts: FAIL when no pair is usable."""
    return _pairs_check(ctx, "gpu-nvme", "GPU<->NVMe")


@check("pairs.gpu_nic", "GPU<->NIC pairs", phase="pairs")
def _pairs_nic(ctx: Context) -> CheckResult:
    """Summary of the GPU<->NIC pair verdicts: FAIL when no pair is usable."""
    return _pairs_check(ctx, "gpu-nic", "GPU<->NIC")


@check("pair.active", "Active P2P DMA test", phase="pairs")
def _active(ctx: Context) -> CheckResult:
    """With p2phub.ko loaded, --active --active-nvme BDF moves a small buffer between a GPU and that
    NVMe controller with a real DMA and compares checksums with the kernel driver's read: it catches
    routes that the capability checks call OK but that silently drop data, and confirms routes p2phub.ko
    can use that the kernel's P2PDMA model rejects. Read-only unless --active-write."""
    if not ctx.active:
        return R(SKIP, "not requested (use --active)")
    if not ctx.sys.live:
        return R(SKIP, "--active needs the live system, not a captured tree")
    from .active import ActiveOptions, run_active
    return run_active(ctx, ctx.active_opts or ActiveOptions())
