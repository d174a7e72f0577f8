"""topology.peers, pairs.*, pair.active: the pair phase's summaries (they read ``ctx.pairs``)."""

from __future__ import annotations

from ..model import BLOCKED, DEGRADED, FAIL, OK, PASS, SKIP, UNKNOWN, WARN, CheckResult
from .base import Context, R, check


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
    from ..active import ActiveOptions, run_active
    return run_active(ctx, ctx.active_opts or ActiveOptions())
