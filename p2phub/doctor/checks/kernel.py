"""kernel.*: the running (or captured) kernel's version, build options and command line."""

from __future__ import annotations

import re
from typing import Any

from ..model import FAIL, INFO, PASS, UNKNOWN, WARN, CheckResult
from .base import KALLSYMS_NEEDLES, Context, R, check, cmdline_tokens

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


def p2pdma_state(ctx: Context) -> tuple[str, str]:
    """("present" | "absent" | "unknown", how it was decided) for the kernel's PCI P2PDMA."""
    syms = ctx.sys.grep("/proc/kallsyms", KALLSYMS_NEEDLES, limit=5)
    v = ctx.kc("PCI_P2PDMA")
    if v == "y":
        return "present", "CONFIG_PCI_P2PDMA=y"
    if syms:
        return "present", "P2PDMA symbols present in kallsyms" + ("" if ctx.kconfig else " (no kernel config found)")
    if ctx.kconfig:
        return "absent", "CONFIG_PCI_P2PDMA " + ("is not set" if v == "n" else "absent from the kernel config")
    if syms is not None and ctx.sys.euid == 0:
        return "absent", "no kernel config and no P2PDMA symbols in kallsyms"
    return "unknown", "no kernel config found, and kallsyms gave no answer (unprivileged)"


def needs_p2pdma_core(gpu: Any) -> bool:
    """Whether the path p2phub would use for this GPU's memory goes through the kernel's P2PDMA core.

    amdgpu's dma-buf exporter asks the P2PDMA core (pci_p2pdma_distance) before it maps VRAM for a
    peer, so AMD GPUs need CONFIG_PCI_P2PDMA. p2phub's NVIDIA path (the NVIDIA P2P API, and the open
    driver's dma-buf exporter) and exporters that map peers themselves do not. A GPU backend plugin
    may say which it is with ``p2pdma_core`` in its claim's info.
    """
    declared = gpu.info.get("p2pdma_core")
    if declared is not None:
        return bool(declared)
    return gpu.info.get("flavour") == "amd"


@check("kernel.p2pdma", "CONFIG_PCI_P2PDMA")
def _p2pdma(ctx: Context) -> CheckResult:
    """The kernel's PCI peer-to-peer DMA support (a bool option: enabling it means booting another
    kernel). It is needed for the kernel's own P2PDMA (NVMe CMB / p2pmem, GDS's P2PDMA mode, the
    GPU as a P2PDMA provider) and for exporters that ask the P2PDMA core before mapping for a peer
    (amdgpu). p2phub's NVIDIA path (the NVIDIA P2P API, and the open driver's dma-buf exporter) and
    exporters that map peers themselves do not need it, so it is a FAIL only where a GPU here needs
    it, and INFO where none does."""
    state, how = p2pdma_state(ctx)
    ev = ctx.ev(ctx.kconfig_source or "", "/proc/kallsyms")
    fix = "boot a kernel built with CONFIG_PCI_P2PDMA=y (needs ZONE_DEVICE, 64BIT)"
    if state == "present":
        return R(PASS, how, evidence=ev, state=state)
    needing = [g.id for g in ctx.top.gpus if needs_p2pdma_core(g)]
    others = [g.id for g in ctx.top.gpus if not needs_p2pdma_core(g)]
    if state == "unknown" and not ctx.top.gpus:
        return _kc_missing(ctx) or R(UNKNOWN, "P2PDMA state unknown", evidence=ev, state=state)
    if needing:
        what = "the kernel has no PCI P2PDMA" if state == "absent" else "P2PDMA state unknown"
        return R(FAIL if state == "absent" else UNKNOWN,
                 f"{what} ({how}): {', '.join(needing)} export through the P2PDMA core (amdgpu), so their "
                 "peer-to-peer DMA cannot be set up by this kernel", fix, ev, needing, state=state, needing=needing)
    if others:
        return R(INFO, f"no PCI P2PDMA in this kernel ({how}): not needed by p2phub's path for "
                       f"{', '.join(others)} (NVIDIA P2P API / an exporter that maps peers itself); the kernel's "
                       "own P2PDMA users (NVMe CMB p2pmem, GDS P2PDMA mode) are unavailable" if state == "absent"
                 else f"P2PDMA state unknown ({how}): not needed by p2phub's path for {', '.join(others)}",
                 evidence=ev, state=state, needing=[])
    return R(WARN, f"the kernel has no PCI P2PDMA ({how}); no GPU found, so whether p2phub's path needs it is "
                   "unknown (AMD GPUs do)", fix, ev, state=state, needing=[])


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


