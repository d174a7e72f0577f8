"""Pair verdicts for every GPU<->NVMe and GPU<->NIC pair (the checks that summarise them are in
``checks/pairs.py`` and ``checks/pcie.py``, phase "pairs")."""

from __future__ import annotations

from typing import Any

from .. import capabilities as caps
from ..policy import p2p_path
from .checks import Context
from .checks.gpu import nvidia_params, nvidia_version
from .checks.kernel import needs_p2pdma_core
from .checks.nvme import nvme_usage, ownership_refused
from .model import BLOCKED, DEGRADED, FAIL, OK, UNKNOWN, PairVerdict
from .route import (MAP_BUS_ADDR, MAP_NOT_SUPPORTED, MAP_THRU_HOST_BRIDGE, MAP_UNKNOWN, classify)


def _iommu_overlay(ctx: Context, map_type: str, bdfs: list[str]) -> str:
    if map_type == MAP_BUS_ADDR:
        return "bypassed"  # TLPs turn around below the root complex
    modes = [caps.iommu_mode(b, ctx.sys.host("/sys")) for b in bdfs]
    if all(m == "off" for m in modes):
        return "none"
    if "translated" in modes:
        return "iova"
    if all(m == "identity" for m in modes if m != "off"):
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
        refused = ownership_refused(ctx, peer.id)
        if refused:
            return False, f"p2phub.ko will not hand {peer.name} to user space: {refused}", "nvme.confined"
        return True, None, None
    r = ctx.results.get("nic.dmabuf_mr")
    if r and r.status == FAIL:
        peermem = ctx.sys.exists("/sys/module/nvidia_peermem") or "nvidia_peermem" in ctx.top.modules
        if not peermem:
            return False, "the NIC cannot register dma-buf MRs", "nic.dmabuf_mr"
    return True, None, None


def _pin_of(ctx: Context, gpu: Any) -> str:
    """How p2phub pins this GPU's memory, in the words of p2phub.policy."""
    be = gpu.info.get("backend")
    if be:
        return f"the {be} backend's dma-buf exporter"
    if gpu.info.get("flavour") == "amd":
        return "amdgpu's dma-buf exporter"
    _ver, is_open = nvidia_version(ctx)
    return "the NVIDIA P2P API" if is_open is False else "the NVIDIA P2P API or the open driver's dma-buf"


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
            # the path p2phub takes for this pair (p2phub.policy), and whether it consults the
            # kernel's host-bridge allow list at all
            consults = needs_p2pdma_core(gpu)
            # the route p2phub's policy binds by (ACS redirect sends even a pair below one
            # switch up through the root complex)
            route = caps.pci_route(gd.bdf, pd.bdf, ctx.sys.host("/sys"))
            kind_, why_ = p2p_path(route.route, consults, _pin_of(ctx, gpu))
            p2p = {"path": kind_.value, "why": why_, "consults_allow_list": consults}
            if pr.map_type == MAP_NOT_SUPPORTED and not consults:
                degraded = True
                because += ["pcie.acs"] if pr.acs_blockers else []
                because.append("pcie.host_bridge")
                reasons.append(f"the kernel's P2PDMA would refuse this route, but {why_}")
            elif pr.map_type == MAP_NOT_SUPPORTED:
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
            # kernel support: only where p2phub's path for this GPU goes through the P2PDMA core
            k_state = k_p2p.details.get("state") if k_p2p is not None else None
            if needs_p2pdma_core(gpu) and k_state == "absent":
                blocked = True
                because.append("kernel.p2pdma")
                reasons.append("the kernel has no PCI P2PDMA, which this GPU's exporter needs")
                fixes.append("boot a kernel with CONFIG_PCI_P2PDMA=y")
            elif needs_p2pdma_core(gpu) and k_state == "unknown":
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
                                   list(dict.fromkeys(fixes)), acs_unknown=list(pr.acs_unknown),
                                   p2p=p2p))
    return out


def _width_down(link: dict[str, Any]) -> bool:
    c, m = link.get("current_link_width"), link.get("max_link_width")
    return isinstance(c, int) and isinstance(m, int) and 0 < c < m
