"""iommu.*: whether DMA is translated, and how devices share IOMMU groups."""

from __future__ import annotations

from ..model import INFO, PASS, SKIP, UNKNOWN, WARN, CheckResult
from .base import Context, R, check, endpoints

@check("iommu.present", "IOMMU present")
def _iommu_present(ctx: Context) -> CheckResult:
    """No IOMMU means DMA is untranslated and P2P never faults in an IOMMU."""
    sr = ctx.sys
    units = sr.listdir("/sys/class/iommu")
    groups = sr.listdir("/sys/kernel/iommu_groups")
    if not units and not groups:
        return R(INFO, "no IOMMU (no /sys/class/iommu units, 0 groups): DMA is untranslated", units=[], groups=0)
    return R(INFO, f"IOMMU units: {', '.join(units) or 'none listed'}; {len(groups)} group(s)", units=units,
             groups=len(groups))


@check("iommu.domain", "IOMMU domain type per device")
def _iommu_domain(ctx: Context) -> CheckResult:
    """identity = passthrough; DMA / DMA-FQ = translated: P2P behind one switch still bypasses the
    IOMMU, but routes through the host bridge use IOVAs and are slower (and have silently dropped
    writes on some AMD-Vi systems). Passthrough (iommu=pt) is not a free fix: it gives up DMA
    confinement, and p2phub.ko then refuses to hand NVMe controllers to user space unless loaded
    with allow_unsafe_noiommu=1 (see nvme.confined)."""
    eps = endpoints(ctx)
    if not eps:
        return R(SKIP, "no GPUs or peers")
    per: dict[str, str] = {}
    ev = []
    for ident, bdf in eps:
        d = ctx.top.pci[bdf] if bdf in ctx.top.pci else None
        if d is None:
            continue
        per[ident] = d.iommu_type or ("no group (untranslated)" if d.iommu_group is None else "unknown")
        if d.iommu_group:
            ev += ctx.ev(f"/sys/kernel/iommu_groups/{d.iommu_group}/type")
    translated = [i for i, t in per.items() if t in ("DMA", "DMA-FQ")]
    desc = ", ".join(f"{i}: {t}" for i, t in per.items())
    if translated:
        return R(WARN, f"translated DMA domains ({', '.join(translated)}): host-bridge P2P routes are IOVA-mapped; "
                 + desc, "leave translation on where p2phub owns NVMe controllers: iommu=pt (passthrough) would "
                 "let host-bridge P2P skip IOVA mapping, but it removes the IOMMU's confinement of every device's "
                 "DMA, so an owned controller could then reach any memory (see nvme.confined); prefer a GPU and "
                 "peer below one PCIe switch, where P2P bypasses the IOMMU anyway",
                 ev, translated, domains=per)
    if any(t == "unknown" for t in per.values()):
        return R(UNKNOWN, desc, evidence=ev, domains=per)
    return R(PASS, desc, evidence=ev, domains=per)


@check("iommu.groups", "IOMMU group sharing")
def _iommu_groups(ctx: Context) -> CheckResult:
    """A GPU and a peer in one IOMMU group means no ACS isolation between them (consistent with a
    direct P2P route)."""
    groups: dict[str, list[str]] = {}
    for ident, bdf in endpoints(ctx):
        g = ctx.top.pci[bdf].iommu_group if bdf in ctx.top.pci else None
        if g:
            groups.setdefault(g, []).append(ident)
    shared = {g: ids for g, ids in groups.items() if len(ids) > 1}
    if not groups:
        return R(SKIP, "no IOMMU groups on the devices")
    if shared:
        return R(INFO, "shared groups: " + "; ".join(f"{g}: {', '.join(i)}" for g, i in shared.items()), groups=shared)
    return R(INFO, "every device in its own IOMMU group", groups={})


