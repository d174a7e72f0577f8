"""kernel.*: the running (or captured) kernel's version, build options and command line."""

from __future__ import annotations

import re

from ..model import FAIL, INFO, PASS, UNKNOWN, WARN, CheckResult
from . import KALLSYMS_NEEDLES, Context, R, check, cmdline_tokens

def _version_tuple(rel: str) -> tuple[int, int]:
    m = re.match(r"^(\d+)\.(\d+)", rel or "")
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@check("kernel.version", "Kernel version gates")
def _kver(ctx: Context) -> CheckResult:
    """4.20: P2PDMA core. 5.12: RDMA dma-buf MRs. 6.0: dma-iommu maps P2PDMA pages (P2P through an
    IOMMU). ~6.2: userspace p2pmem allocation. Backports exist; these are advisory."""
    rel = ctx.sys.uname().get("release", "")
    v = _version_tuple(rel)
    ev = ctx.ev("/proc/sys/kernel/osrelease")
    if v == (0, 0):
        return R(UNKNOWN, "kernel release unknown", evidence=ev)
    missing = [what for ver, what in (((4, 20), "P2PDMA"), ((5, 12), "RDMA dma-buf MRs"),
                                       ((6, 0), "P2PDMA through an IOMMU")) if v < ver]
    if (4, 20) > v:
        return R(FAIL, f"kernel {rel} predates P2PDMA (4.20)", "boot a kernel >= 6.2", ev, release=rel)
    if missing:
        return R(WARN, f"kernel {rel} lacks: {', '.join(missing)}", "boot a kernel >= 6.2", ev, release=rel)
    return R(PASS, f"kernel {rel} (>= 6.0: P2PDMA, RDMA dma-buf, IOMMU-mapped P2P)", evidence=ev, release=rel)


def _kc_missing(ctx: Context) -> CheckResult | None:
    if not ctx.kconfig:
        return R(UNKNOWN, "kernel config not found (/proc/config.gz, /boot/config-$(uname -r))",
                 "load the configs module (modprobe configs) or install the kernel's config file",
                 [e.as_dict() for k, e in ctx.sys.log.items() if "config" in k and e.error][:4])
    return None


@check("kernel.p2pdma", "CONFIG_PCI_P2PDMA")
def _p2pdma(ctx: Context) -> CheckResult:
    """The kernel's PCI peer-to-peer DMA support: the P2P routing decision (ACS, host bridge allow
    list), P2P pages for NVMe, and dma-buf peer mappings all need it. It is a bool option: enabling it
    means booting another kernel."""
    syms = ctx.sys.grep("/proc/kallsyms", KALLSYMS_NEEDLES, limit=5)
    ev = ctx.ev(ctx.kconfig_source or "", "/proc/kallsyms")
    v = ctx.kc("PCI_P2PDMA")
    fix = "boot a kernel built with CONFIG_PCI_P2PDMA=y (needs ZONE_DEVICE, 64BIT)"
    if v == "y":
        return R(PASS, "CONFIG_PCI_P2PDMA=y", evidence=ev)
    if v in ("n", None) and ctx.kconfig:
        if syms:
            return R(PASS, "P2PDMA symbols present in kallsyms", evidence=ev)
        return R(FAIL, "the kernel has no PCI P2PDMA (CONFIG_PCI_P2PDMA " + ("is not set" if v == "n" else "absent")
                 + "): GPU<->NVMe and GPU<->NIC peer-to-peer DMA cannot be set up by this kernel", fix, ev)
    if syms:
        return R(PASS, "P2PDMA symbols present in kallsyms (no kernel config found)", evidence=ev)
    if syms is not None and ctx.sys.euid == 0:
        return R(FAIL, "no kernel config and no P2PDMA symbols in kallsyms: P2PDMA is not built in", fix, ev)
    return _kc_missing(ctx) or R(UNKNOWN, "P2PDMA state unknown", evidence=ev)


@check("kernel.zone_device", "CONFIG_ZONE_DEVICE")
def _zone(ctx: Context) -> CheckResult:
    """P2PDMA depends on ZONE_DEVICE (struct pages for device memory)."""
    miss = _kc_missing(ctx)
    if miss:
        return miss
    v = ctx.kc("ZONE_DEVICE")
    ev = ctx.ev(ctx.kconfig_source or "")
    if v == "y":
        return R(PASS, "CONFIG_ZONE_DEVICE=y", evidence=ev)
    return R(FAIL, "CONFIG_ZONE_DEVICE is not set: P2PDMA cannot be built", "boot a kernel with ZONE_DEVICE=y", ev)


@check("kernel.dmabuf", "dma-buf options")
def _dmabuf(ctx: Context) -> CheckResult:
    """DMA_SHARED_BUFFER is required for every dma-buf path. DMABUF_MOVE_NOTIFY off means importers
    must pin (and older kernels cannot enable AMD P2P); newer kernels drop the symbol and always have
    it. INFINIBAND_USER_MEM is needed for RDMA dma-buf MRs; HSA_AMD_P2P for AMD GPU P2P."""
    miss = _kc_missing(ctx)
    if miss:
        return miss
    ev = ctx.ev(ctx.kconfig_source or "")
    vals = {k: ctx.kc(k) or "absent" for k in ("DMA_SHARED_BUFFER", "DMABUF_MOVE_NOTIFY", "INFINIBAND_USER_MEM",
                                                 "HSA_AMD_P2P")}
    desc = ", ".join(f"{k}={v}" for k, v in vals.items())
    if vals["DMA_SHARED_BUFFER"] != "y":
        return R(FAIL, "no dma-buf support (DMA_SHARED_BUFFER): " + desc, "boot a kernel with DMA_SHARED_BUFFER=y",
                 ev, **vals)
    amd = any(g.info.get("flavour") == "amd" for g in ctx.top.gpus)
    if amd and vals["HSA_AMD_P2P"] != "y":
        return R(FAIL, "AMD GPUs present but HSA_AMD_P2P is off: " + desc,
                 "boot a kernel with HSA_AMD_P2P=y (and DMABUF_MOVE_NOTIFY=y on kernels that have it)", ev, **vals)
    if ctx.top.nics and vals["INFINIBAND_USER_MEM"] != "y":
        return R(WARN, "RDMA devices present but INFINIBAND_USER_MEM is off (no user MRs): " + desc,
                 "boot a kernel with INFINIBAND_USER_MEM=y", ev, **vals)
    if vals["DMABUF_MOVE_NOTIFY"] == "n":
        return R(INFO, "dma-buf present; DMABUF_MOVE_NOTIFY off (importers pin): " + desc, evidence=ev, **vals)
    return R(PASS, desc, evidence=ev, **vals)


@check("kernel.iommu_default", "IOMMU build default")
def _iommu_default(ctx: Context) -> CheckResult:
    """When the command line says nothing, CONFIG_IOMMU_DEFAULT_{PASSTHROUGH,DMA_LAZY,DMA_STRICT}
    decides whether devices get identity or translated DMA domains."""
    miss = _kc_missing(ctx)
    if miss:
        return miss
    mode = next((m for m in ("PASSTHROUGH", "DMA_LAZY", "DMA_STRICT") if ctx.kc(f"IOMMU_DEFAULT_{m}") == "y"), None)
    ev = ctx.ev(ctx.kconfig_source or "")
    if mode is None:
        return R(INFO, "no IOMMU default in the kernel config", evidence=ev)
    return R(INFO, f"IOMMU default domain: {mode.lower()} (used when the command line says nothing)",
             evidence=ev, mode=mode)


@check("kernel.cmdline", "Kernel command line")
def _cmdline(ctx: Context) -> CheckResult:
    """IOMMU and ACS switches on the command line are intent; the per-device checks decide.
    pcie_acs_override= is an out-of-tree patch that fakes ACS isolation: IOMMU groups then lie."""
    toks = cmdline_tokens(ctx)
    ev = ctx.ev("/proc/cmdline")
    if not ctx.cmdline:
        return R(UNKNOWN, "/proc/cmdline unreadable", evidence=ev)
    if "pcie_acs_override" in toks:
        return R(WARN, "pcie_acs_override= is set: IOMMU groups do not reflect real isolation",
                 "remove pcie_acs_override from the kernel command line", ev, tokens=toks)
    desc = " ".join(f"{k}={v}" for k, v in toks.items()) or "no IOMMU/ACS/PCI switches"
    return R(INFO, desc, evidence=ev, tokens=toks)


