"""nvme.*: the NVMe controllers, and whether one can be handed to p2phub."""

from __future__ import annotations

from ...blockuse import BlockDev, usage_reasons
from ..model import FAIL, INFO, PASS, SKIP, WARN, CheckResult
from . import Context, R, check

@check("nvme.controllers", "NVMe controllers")
def _nvme(ctx: Context) -> CheckResult:
    """Only PCIe-attached NVMe controllers can be GPU<->NVMe P2P peers."""
    if not ctx.top.nvmes:
        return R(SKIP, "no NVMe controllers", evidence=ctx.ev("/sys/class/nvme"))
    rows = {c.id: f"{c.name} {c.info.get('transport')} {c.bdf or ''} {c.info.get('model') or ''}".strip()
            for c in ctx.top.nvmes}
    pcie = [c for c in ctx.top.nvmes if c.bdf]
    if not pcie:
        return R(INFO, "no PCIe NVMe controllers (fabrics only): " + "; ".join(rows.values()), controllers=rows)
    return R(PASS, "; ".join(rows.values()), controllers=rows)


@check("nvme.multipath", "NVMe native multipath")
def _mpath(ctx: Context) -> CheckResult:
    """nvme_core multipath=Y hides per-controller namespaces behind a subsystem device; GDS P2PDMA
    does not support it. p2phub takes whole controllers, so it is informational here."""
    if not ctx.top.nvmes:
        return R(SKIP, "no NVMe controllers")
    v = ctx.sys.read("/sys/module/nvme_core/parameters/multipath")
    return R(INFO, f"nvme_core.multipath={v if v is not None else 'unknown'}",
             evidence=ctx.ev("/sys/module/nvme_core/parameters/multipath"))


def nvme_usage(ctx: Context) -> dict[str, list[str]]:
    """Controller id -> reasons it is in use: the rule of ``p2phub.blockuse``, on what SysRoot reads."""
    sr = ctx.sys
    mounts = sr.read("/proc/mounts") or ""
    swaps = sr.read("/proc/swaps") or ""
    use: dict[str, list[str]] = {}
    for c in ctx.top.nvmes:
        devs = []
        for ns in c.info.get("namespaces", []):
            held = ns.get("holders", {})
            for blk in [ns["name"]] + ns.get("partitions", []):
                devs.append(BlockDev(blk, holders=tuple((h, None) for h in held.get(blk, []))))
        reasons = usage_reasons(devs, mounts=mounts, swaps=swaps)
        if reasons:
            use[c.id] = reasons
    return use


@check("nvme.safety", "NVMe controllers in use")
def _nvme_safety(ctx: Context) -> CheckResult:
    """p2phub.ko takes a whole controller away from the kernel's nvme driver. A controller with a
    mounted filesystem, a swap area, or LVM/md/dm holders on any namespace must never be handed to it."""
    if not ctx.top.nvmes:
        return R(SKIP, "no NVMe controllers")
    use = nvme_usage(ctx)
    ev = ctx.ev("/proc/mounts", "/proc/swaps") + ctx.ev_glob("/sys/block/nvme", 10)
    free = [c.id for c in ctx.top.nvmes if c.id not in use and c.bdf]
    if use:
        desc = "; ".join(f"{c}: {', '.join(r)}" for c, r in use.items())
        status = WARN if free else FAIL
        return R(status, f"in use, never give to p2phub: {desc}" + (f"; free: {', '.join(free)}" if free else
                 "; no free controller"), "use a controller with no filesystem, swap or LVM/md on it", ev,
                 list(use), in_use=use, free=free)
    return R(PASS, "no NVMe namespace is mounted, swap or held: " + ", ".join(free), evidence=ev, free=free)


