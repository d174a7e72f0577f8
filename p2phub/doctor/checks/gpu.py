"""gpu.*, nvidia.*, amd.*: the GPU side: its P2P aperture and each vendor driver's switches."""

from __future__ import annotations

import re
from typing import Any

from .. import probes
from ..model import FAIL, INFO, PASS, SKIP, UNKNOWN, WARN, CheckResult
from .base import Context, R, check

@check("gpu.bar", "GPU BAR (P2P aperture) size")
def _bar(ctx: Context) -> CheckResult:
    """NVIDIA exposes GPU memory to peers through BAR1, AMD through BAR0 (VRAM). A small BAR (e.g.
    256 MiB) caps how much memory can be registered; enable Above-4G decoding and Resizable BAR."""
    if not ctx.top.gpus:
        return R(SKIP, "no GPUs")
    rows, small = {}, []
    for g in ctx.top.gpus:
        b = g.info.get("bar_bytes")
        rows[g.id] = b
        if not g.info.get("bar_covers_memory") and b is not None and 0 < b < (1 << 30):
            small.append(f"{g.id} BAR{g.info['p2p_bar']} {b >> 20} MiB")
    ev = ctx.ev(*(f"/sys/bus/pci/devices/{g.bdf}/resource" for g in ctx.top.gpus))
    desc = ", ".join(f"{i}: BAR {('%d MiB' % (v >> 20)) if v else 'unknown'}" for i, v in rows.items())
    if small:
        return R(WARN, "small P2P BAR: " + ", ".join(small),
                 "enable 'Above 4G decoding' and 'Resizable BAR' in the BIOS", ev, bars=rows)
    if any(v is None for v in rows.values()):
        return R(UNKNOWN, desc, evidence=ev, bars=rows)
    return R(PASS, desc, evidence=ev, bars=rows)



def _nvidia_gpus(ctx: Context) -> list[Any]:
    return [g for g in ctx.top.gpus if g.info.get("flavour") == "nvidia"]


def nvidia_version(ctx: Context) -> tuple[str | None, bool | None]:
    """(version, open) from /proc/driver/nvidia/version or /sys/module/nvidia."""
    text = ctx.sys.read("/proc/driver/nvidia/version")
    ver, is_open = None, None
    if text:
        first = text.splitlines()[0]
        is_open = "Open Kernel Module" in first
        m = re.search(r"(\d{3,}\.\d+(?:\.\d+)?)", first)
        ver = m.group(1) if m else None
    if ver is None:
        ver = ctx.sys.read("/sys/module/nvidia/version")
    if is_open is None and ctx.sys.exists("/sys/module/nvidia"):
        lic = ctx.sys.read("/sys/module/nvidia/license") if ctx.sys.exists("/sys/module/nvidia/license") else None
        if lic:
            is_open = "MIT" in lic or "GPL" in lic
    return ver, is_open


@check("nvidia.driver", "NVIDIA driver loaded")
def _nv_driver(ctx: Context) -> CheckResult:
    """The nvidia kernel module must be loaded for its GPUs to export memory (P2P API or dma-buf)."""
    gpus = _nvidia_gpus(ctx)
    if not gpus:
        return R(SKIP, "no NVIDIA GPUs")
    ver, _ = nvidia_version(ctx)
    ev = ctx.ev("/proc/driver/nvidia/version", "/sys/module/nvidia/version")
    unbound = [g.id for g in gpus if g.driver != "nvidia"]
    if ver is None and "nvidia" not in ctx.top.modules:
        return R(FAIL, "nvidia driver not loaded", "install and load the NVIDIA driver (modprobe nvidia)", ev,
                 [g.id for g in gpus])
    if unbound:
        return R(WARN, f"nvidia {ver} loaded but not bound to {', '.join(unbound)}",
                 "check dmesg for NVRM errors; bind the GPU to nvidia", ev, unbound)
    return R(PASS, f"nvidia {ver} bound to {', '.join(g.id for g in gpus)}", evidence=ev, version=ver)


@check("nvidia.flavour", "NVIDIA open vs proprietary kernel module")
def _nv_flavour(ctx: Context) -> CheckResult:
    """Only the open kernel module exports GPU memory as dma-buf (for RDMA NICs) and registers BAR1
    for P2PDMA (OpenRM >= 565.47 for GDS P2PDMA). The proprietary module still offers the NVIDIA P2P
    API (nvidia_p2p_get_pages), which p2phub.ko can use for NVMe."""
    if not _nvidia_gpus(ctx):
        return R(SKIP, "no NVIDIA GPUs")
    ver, is_open = nvidia_version(ctx)
    ev = ctx.ev("/proc/driver/nvidia/version", "/sys/module/nvidia/license")
    if ver is None:
        return R(SKIP, "nvidia driver not loaded (see nvidia.driver)")
    major = int(ver.split(".")[0]) if ver.split(".")[0].isdigit() else 0
    if is_open is None:
        return R(UNKNOWN, f"nvidia {ver}: flavour unknown", evidence=ev, version=ver)
    if not is_open:
        return R(WARN, f"proprietary nvidia {ver}: no dma-buf export (GPU<->NIC needs nvidia_peermem)",
                 "install the open kernel module (nvidia-open, default from R560)", ev, version=ver, open=False)
    if major < 515:
        return R(WARN, f"open nvidia {ver}: too old for dma-buf export (>= 515)", "upgrade the driver", ev,
                 version=ver, open=True)
    note = "" if major >= 565 else " (GDS P2PDMA needs >= 565.47)"
    return R(PASS, f"open kernel module {ver}{note}", evidence=ev, version=ver, open=True)


def nvidia_params(ctx: Context) -> dict[str, str]:
    text = ctx.sys.read("/proc/driver/nvidia/params") or ""
    out = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        out[k.strip()] = v.strip().strip('"')
    return out


@check("nvidia.params", "NVIDIA registry keys for P2P")
def _nv_params(ctx: Context) -> CheckResult:
    """RMForceStaticBar1=1 and RmForceDisableIomapWC=1 in RegistryDwords let nvidia-uvm register BAR1
    as a kernel P2PDMA provider. GrdmaPciTopoCheckOverride=2 forces dma-buf attach denial."""
    if not _nvidia_gpus(ctx):
        return R(SKIP, "no NVIDIA GPUs")
    p = nvidia_params(ctx)
    ev = ctx.ev("/proc/driver/nvidia/params")
    if not p:
        return R(UNKNOWN if ctx.sys.exists("/sys/module/nvidia") else SKIP, "/proc/driver/nvidia/params unreadable",
                 evidence=ev)
    regs = p.get("RegistryDwords", "")
    keys = {k: (f"{k}=1" in regs.replace(" ", "")) for k in ("RMForceStaticBar1", "RmForceDisableIomapWC")}
    ov = p.get("GrdmaPciTopoCheckOverride")
    d = dict(registry=regs, override=ov, EnableResizableBar=p.get("EnableResizableBar"),
             DmaRemapPeerMmio=p.get("DmaRemapPeerMmio"))
    if ov == "2":
        return R(FAIL, "GrdmaPciTopoCheckOverride=2: the driver denies every dma-buf attach (GPU<->NIC)",
                 "remove NVreg_GrdmaPciTopoCheckOverride=2 from modprobe.d", ev, **d)
    if not all(keys.values()):
        return R(INFO, "P2PDMA registry keys absent (" + ", ".join(k for k, v in keys.items() if not v) +
                 "): the GPU is not a kernel P2PDMA provider; p2phub's NVIDIA P2P API path does not need it",
                 'options nvidia NVreg_RegistryDwords="RMForceStaticBar1=1;RmForceDisableIomapWC=1" in modprobe.d',
                 ev, **d)
    return R(PASS, "RMForceStaticBar1=1 and RmForceDisableIomapWC=1 set", evidence=ev, **d)


@check("nvidia.p2pmem", "GPU registered as a P2PDMA provider")
def _nv_p2pmem(ctx: Context) -> CheckResult:
    """The GPU's p2pmem/ directory appears only when nvidia-uvm registered BAR1 with the kernel's
    P2PDMA (the outcome the registry keys aim at)."""
    gpus = _nvidia_gpus(ctx)
    if not gpus:
        return R(SKIP, "no NVIDIA GPUs")
    rows = {g.id: ctx.top.pci[g.bdf].p2pmem for g in gpus if g.bdf in ctx.top.pci}
    ok = [i for i, v in rows.items() if v and (v.get("size") or 0) > 0]
    ev = ctx.ev(*(f"/sys/bus/pci/devices/{g.bdf}/p2pmem/size" for g in gpus))
    if ok and len(ok) == len(rows):
        return R(PASS, "p2pmem registered on " + ", ".join(ok), evidence=ev)
    uvm = "nvidia_uvm" in ctx.top.modules
    return R(INFO, "no p2pmem/ on " + ", ".join(i for i in rows if i not in ok) +
             ("" if uvm else " (nvidia_uvm not loaded)") + ": kernel P2PDMA provider route unavailable",
             evidence=ev, uvm_loaded=uvm)


@check("nvidia.dmabuf", "CUDA dma-buf support")
def _nv_dmabuf(ctx: Context) -> CheckResult:
    """CUDA device attribute 124 (DMA_BUF_SUPPORTED): whether the driver exports GPU memory as a
    dma-buf, which RDMA NICs import with ibv_reg_dmabuf_mr."""
    gpus = _nvidia_gpus(ctx)
    if not gpus:
        return R(SKIP, "no NVIDIA GPUs")
    res = probes.cuda_dmabuf(ctx.sys)
    if res.get("error"):
        return R(UNKNOWN, f"CUDA dma-buf probe unavailable: {res['error']}", probe=res)
    vals = res.get("devices", [])
    if vals and all(v.get("dmabuf") for v in vals):
        return R(PASS, f"CUDA {res.get('driver_version')}: dma-buf supported on {len(vals)} GPU(s)", probe=res)
    return R(FAIL, f"CUDA reports no dma-buf support ({vals})", "use the open kernel module >= 515 and CUDA >= 11.7",
             probe=res)


@check("nvidia.peermem", "nvidia_peermem (legacy PeerDirect)")
def _peermem(ctx: Context) -> CheckResult:
    """nvidia_peermem lets RDMA NICs register GPU virtual addresses (PeerDirect). dma-buf is the
    preferred path; peermem is the fallback for the proprietary driver."""
    if not _nvidia_gpus(ctx):
        return R(SKIP, "no NVIDIA GPUs")
    paths = ["/sys/module/nvidia_peermem/version", "/sys/kernel/mm/memory_peers/nv_mem/version"]
    found = [p for p in paths if ctx.sys.exists(p)]
    if found or "nvidia_peermem" in ctx.top.modules:
        return R(INFO, "nvidia_peermem loaded", evidence=ctx.ev(*found))
    return R(INFO, "nvidia_peermem not loaded (dma-buf is the preferred GPU<->NIC path)")



def _amd_gpus(ctx: Context) -> list[Any]:
    return [g for g in ctx.top.gpus if g.info.get("flavour") == "amd"]


@check("amd.kfd_links", "AMD KFD topology P2P links")
def _kfd(ctx: Context) -> CheckResult:
    """amdgpu creates KFD p2p_links only for peers it can reach over PCIe P2P."""
    if not _amd_gpus(ctx):
        return R(SKIP, "no AMD GPUs")
    base = "/sys/class/kfd/kfd/topology/nodes"
    nodes = ctx.sys.listdir(base)
    if not nodes:
        return R(UNKNOWN, "no KFD topology (amdgpu/KFD not loaded?)", "modprobe amdgpu")
    links = {n: ctx.sys.listdir(f"{base}/{n}/p2p_links") for n in nodes}
    n_links = sum(len(v) for v in links.values())
    return R(INFO, f"{len(nodes)} KFD node(s), {n_links} p2p link(s)", links=links)


@check("amd.large_bar", "AMD large BAR")
def _amd_bar(ctx: Context) -> CheckResult:
    """amdgpu allows PCIe P2P only when all VRAM is CPU-visible (large BAR)."""
    gpus = _amd_gpus(ctx)
    if not gpus:
        return R(SKIP, "no AMD GPUs")
    bad, unk = [], []
    for g in gpus:
        v, t = g.info.get("vis_vram_total"), g.info.get("vram_total")
        if v is None or t is None:
            unk.append(g.id)
        elif v < t:
            bad.append(f"{g.id} visible {v >> 20} MiB of {t >> 20} MiB")
    ev = ctx.ev(*(f"/sys/bus/pci/devices/{g.bdf}/mem_info_vis_vram_total" for g in gpus))
    if bad:
        return R(FAIL, "not a large BAR: " + "; ".join(bad), "enable Above 4G decoding and Resizable BAR in the BIOS",
                 ev, [g.id for g in gpus])
    if unk:
        return R(UNKNOWN, "VRAM totals unreadable on " + ", ".join(unk), evidence=ev)
    return R(PASS, "all VRAM visible through the BAR", evidence=ev)


@check("amd.p2p_config", "amdgpu P2P switches")
def _amd_cfg(ctx: Context) -> CheckResult:
    """HSA_AMD_P2P in the kernel config and the amdgpu.pcie_p2p parameter gate AMD GPU P2P."""
    if not _amd_gpus(ctx):
        return R(SKIP, "no AMD GPUs")
    v = ctx.sys.read("/sys/module/amdgpu/parameters/pcie_p2p")
    k = ctx.kc("HSA_AMD_P2P")
    ev = ctx.ev("/sys/module/amdgpu/parameters/pcie_p2p", ctx.kconfig_source or "")
    if k == "n" or v in ("N", "0"):
        return R(FAIL, f"HSA_AMD_P2P={k or 'absent'}, amdgpu.pcie_p2p={v}",
                 "boot a kernel with HSA_AMD_P2P=y and amdgpu.pcie_p2p=1", ev)
    if k is None or v is None:
        return R(UNKNOWN, f"HSA_AMD_P2P={k or 'unknown'}, amdgpu.pcie_p2p={v or 'unknown'}", evidence=ev)
    return R(PASS, f"HSA_AMD_P2P={k}, amdgpu.pcie_p2p={v}", evidence=ev)


