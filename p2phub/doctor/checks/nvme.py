"""nvme.*: the NVMe controllers, and whether one can be handed to p2phub."""

from __future__ import annotations

from ...blockuse import BlockDev, usage_reasons
from ..model import FAIL, INFO, PASS, SKIP, UNKNOWN, WARN, CheckResult
from .base import Context, R, check

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




# The drivers a device sharing the controller's IOMMU group may have: p2phub.ko's gate allows PCI
# drivers that do no DMA API mappings (driver_managed_dma, which sysfs does not show; these are
# the upstream ones; kmod/p2phub_nvme_confine.c: p2phub_nvme_group_dev_ok); a driverless device
# is fine too.
GROUP_OK_DRIVERS = ("p2phub-nvme", "vfio-pci", "pci-stub", "pcieport")
UNSAFE_PARAM = "/sys/module/p2phub/parameters/allow_unsafe_noiommu"
TAINT_USER = 1 << 6


def msi_isolation(ctx: Context) -> tuple[bool | None, str]:
    """(isolated, evidence): interrupt remapping seen in /proc/interrupts (x86 "IR-" irq chips, an
    arm64 GIC ITS), False when MSIs are there without it, None when unreadable."""
    lines = ctx.sys.grep("/proc/interrupts", ("MSI", "IR-", "ITS"), limit=200)
    if lines is None:
        return None, "/proc/interrupts unreadable"
    remapped = [ln for ln in lines if "IR-" in ln or "ITS" in ln]
    if remapped:
        return True, "interrupt remapping in use (" + remapped[0].split()[-2] + " ...)" \
            if len(remapped[0].split()) > 1 else "interrupt remapping in use"
    if any("MSI" in ln for ln in lines):
        return False, "MSIs without interrupt remapping (no IR- irq chip in /proc/interrupts)"
    return None, "no MSI interrupts listed in /proc/interrupts"


def unconfined_reasons(ctx: Context, bdf: str) -> tuple[list[str], list[str]]:
    """(why the IOMMU does not confine this controller's DMA, what is unknown), in the order of
    p2phub.ko's own gate (kmod/p2phub_nvme_confine.c: p2phub_nvme_unconfined)."""
    d = ctx.top.pci.get(bdf)
    if d is None or d.iommu_group is None:
        return ["no IOMMU translates its DMA (no IOMMU group)"], []
    if d.iommu_type == "identity":
        return ["its IOMMU domain is identity (passthrough: iommu=pt or IOMMU_DEFAULT_PASSTHROUGH)"], []
    why: list[str] = []
    unknown: list[str] = []
    if d.iommu_type not in ("DMA", "DMA-FQ"):
        unknown.append(f"IOMMU domain type {d.iommu_type or 'unreadable'}")
    others = []
    for m in ctx.sys.listdir(f"/sys/kernel/iommu_groups/{d.iommu_group}/devices"):
        if m == bdf:
            continue
        drv = ctx.top.pci[m].driver if m in ctx.top.pci else ctx.sys.readlink_name(f"/sys/bus/pci/devices/{m}/driver")
        if drv and drv not in GROUP_OK_DRIVERS:
            others.append(f"{m} ({drv})")
    if others:
        why.append(f"its IOMMU group {d.iommu_group} holds devices bound to other drivers: {', '.join(others)}")
    iso, how = msi_isolation(ctx)
    if iso is False:
        why.append(f"its MSIs are not isolated: {how}")
    elif iso is None:
        unknown.append(f"MSI isolation ({how})")
    return why, unknown


# The reasons allow_unsafe_noiommu=1 overrides: nothing translates the controller's DMA. A translated
# controller whose group holds a DMA API driver, or whose MSIs are not isolated, is refused whatever it
# says (kmod/p2phub_nvme_confine.c).
_OVERRIDABLE = ("no IOMMU translates its DMA", "its IOMMU domain is identity")


def _overridable(why: list[str]) -> bool:
    return bool(why) and all(w.startswith(_OVERRIDABLE) for w in why)


@check("nvme.confined", "NVMe ownership confined by the IOMMU")
def _nvme_confined(ctx: Context) -> CheckResult:
    """Owning an NVMe controller from user space lets its owner point the controller's DMA anywhere
    the IOMMU lets it go. It is confined only with a translated IOMMU domain (DMA or DMA-FQ; not
    identity, which iommu=pt gives), an IOMMU group whose other devices are driverless or bound to
    p2phub-nvme, vfio-pci, pci-stub or pcieport, and isolated MSIs (interrupt remapping). Without
    these the controller fd is worth root: p2phub.ko refuses to hand such a controller out; loaded with
    allow_unsafe_noiommu=1, which taints the kernel, it hands out one whose DMA nothing translates (no
    IOMMU, identity domain), never one with a driver-bound group sibling or MSIs not isolated. Under kernel lockdown
    (integrity or confidentiality) p2phub.ko refuses NVMe ownership altogether, as the kernel refuses
    root access to PCI BARs. DMA-FQ (lazy IOTLB flushing) leaves an unmapped IOVA reachable for a
    short while; iommu.strict=1 closes that window."""
    from .kmod import lockdown_mode

    ctrls = [c for c in ctx.top.nvmes if c.bdf]
    if not ctrls:
        return R(SKIP, "no PCIe NVMe controllers")
    sr = ctx.sys
    unsafe = sr.read(UNSAFE_PARAM)
    tainted = sr.read_int("/proc/sys/kernel/tainted")
    lock = lockdown_mode(ctx)
    ev = ctx.ev(UNSAFE_PARAM, "/proc/sys/kernel/tainted", "/sys/kernel/security/lockdown", "/proc/interrupts") + \
        ctx.ev(*(f"/sys/kernel/iommu_groups/{ctx.top.pci[c.bdf].iommu_group}/type" for c in ctrls
                 if c.bdf in ctx.top.pci and ctx.top.pci[c.bdf].iommu_group))
    per: dict[str, dict[str, list[str]]] = {}
    for c in ctrls:
        why, unknown = unconfined_reasons(ctx, c.bdf or "")
        per[c.id] = {"unconfined": why, "unknown": unknown}
    bad = {i: v["unconfined"] for i, v in per.items() if v["unconfined"]}
    unk = {i: v["unknown"] for i, v in per.items() if v["unknown"] and not v["unconfined"]}
    ok = [i for i in per if i not in bad and i not in unk]
    lazy = [c.id for c in ctrls if c.bdf in ctx.top.pci and ctx.top.pci[c.bdf].iommu_type == "DMA-FQ" and c.id in ok]
    d = dict(controllers=per, allow_unsafe_noiommu=unsafe, tainted=tainted, lockdown=lock,
             gate=sr.exists(UNSAFE_PARAM) if sr.exists("/sys/module/p2phub") else None)
    fix_iommu = ("boot with the IOMMU translating (intel_iommu=on or amd_iommu=on, no iommu=pt / "
                 "iommu.passthrough=1), give the controller an IOMMU group of its own (a slot behind an ACS port) "
                 "and keep interrupt remapping on; a test machine may instead load p2phub.ko with "
                 "allow_unsafe_noiommu=1, which taints the kernel and makes the controller fd worth root")
    if lock and lock.split()[0] in ("integrity", "confidentiality"):
        return R(FAIL, f"kernel lockdown={lock}: p2phub.ko refuses to hand NVMe controllers to user space",
                 "NVMe ownership needs a kernel without lockdown (PCI access is locked down)", ev,
                 [c.id for c in ctrls], **d)
    desc = "; ".join(f"{i}: {'; '.join(w)}" for i, w in bad.items())
    if bad and unsafe in ("Y", "1") and all(_overridable(w) for w in bad.values()):
        taint = f", kernel tainted ({tainted:#x})" if tainted else ""
        return R(WARN, f"NOT confined, handed out anyway (allow_unsafe_noiommu=Y{taint}): the owner of these "
                 f"controllers can DMA to any memory: {desc}", fix_iommu, ev, list(bad), **d)
    if bad and len(bad) == len(ctrls):
        return R(FAIL if d["gate"] is not False else WARN,
                 f"no NVMe controller is confined, so p2phub.ko will not hand one to user space: {desc}"
                 if d["gate"] is not False else
                 f"NOT confined, and this p2phub.ko predates the ownership gate (its owner can DMA to any "
                 f"memory): {desc}", fix_iommu, ev, list(bad), **d)
    if bad:
        return R(WARN, f"confined: {', '.join(ok) or 'none'}; not confined: {desc}", fix_iommu, ev, list(bad), **d)
    if unk:
        return R(UNKNOWN, "confinement unknown: " + "; ".join(f"{i}: {', '.join(u)}" for i, u in unk.items()),
                 "run as root on the live system (a capture may lack /proc/interrupts)", ev, list(unk), **d)
    note = f" ({', '.join(lazy)}: lazy IOTLB flush, DMA-FQ; iommu.strict=1 makes unmaps immediate)" if lazy else ""
    return R(PASS, f"translated IOMMU domain, viable group and isolated MSIs for {', '.join(ok)}{note}",
             evidence=ev, **d)


def ownership_refused(ctx: Context, ctrl_id: str) -> str | None:
    """Why p2phub.ko (this release's, or the loaded one when it has the gate) will not hand this
    controller to user space, from nvme.confined's findings; None when it will."""
    r = ctx.results.get("nvme.confined")
    if r is None or r.status in (SKIP, UNKNOWN) or "controllers" not in r.details:
        return None
    d = r.details
    lock = d.get("lockdown")
    if lock and lock.split()[0] in ("integrity", "confidentiality"):
        return f"kernel lockdown={lock}"
    why = d["controllers"].get(ctrl_id, {}).get("unconfined")
    if not why or d.get("gate") is False:
        return None
    if d.get("allow_unsafe_noiommu") in ("Y", "1") and _overridable(why):
        return None
    return "; ".join(why)
