"""The doctor's checks. Each has a stable id, a status, the evidence behind it and a one-line fix.

A check is a function decorated with :func:`check`; its docstring is the long text ``--explain``
prints. Checks run in the order they are defined; the pair-level checks (``pcie.acs``,
``pcie.host_bridge``, ``pairs.*``) run after the pair verdicts are computed (see ``pairs.py``).
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from . import probes
from .discovery import Topology
from .model import FAIL, INFO, PASS, SKIP, UNKNOWN, WARN, CheckResult
from .pcie import ACS_TB, acs_bits_str
from .sysroot import SysRoot

KALLSYMS_NEEDLES = ("pci_p2pdma_add_resource", "p2pdma_pgmap_ops", "pci_p2pdma_distance")
KCONFIG_KEYS = ("PCI_P2PDMA", "ZONE_DEVICE", "DMA_SHARED_BUFFER", "DMABUF_MOVE_NOTIFY", "INFINIBAND_USER_MEM",
                "HSA_AMD_P2P", "IOMMU_DEFAULT_PASSTHROUGH", "IOMMU_DEFAULT_DMA_LAZY", "IOMMU_DEFAULT_DMA_STRICT",
                "MODULES", "MODULE_SIG", "MODULE_SIG_FORCE", "SECURITY_LOCKDOWN_LSM", "LOCK_DOWN_KERNEL_FORCE_INTEGRITY",
                "LOCK_DOWN_KERNEL_FORCE_CONFIDENTIALITY", "INFINIBAND", "PCI_ATS", "64BIT")
CMDLINE_KEYS = ("iommu", "intel_iommu", "amd_iommu", "iommu.passthrough", "iommu.strict", "pci",
                "pcie_acs_override", "module.sig_enforce", "lockdown", "nvidia.NVreg_RegistryDwords")


@dataclass
class Context:
    sys: SysRoot
    top: Topology
    active: bool = False
    active_opts: Any = None        # active.ActiveOptions with --active
    kconfig: dict[str, str] = field(default_factory=dict)
    kconfig_source: str | None = None
    cmdline: str = ""
    results: dict[str, CheckResult] = field(default_factory=dict)
    pairs: list[Any] = field(default_factory=list)

    def ev(self, *paths: str) -> list[dict[str, Any]]:
        out = []
        for p in paths:
            e = self.sys.log.get(p)
            if e is not None:
                out.append(e.as_dict())
        return out

    def ev_glob(self, prefix: str, limit: int = 30) -> list[dict[str, Any]]:
        return [e.as_dict() for k, e in self.sys.log.items() if k.startswith(prefix)][:limit]

    def status(self, cid: str) -> str | None:
        r = self.results.get(cid)
        return r.status if r else None

    def kc(self, key: str) -> str | None:
        """'y', 'm', 'n' (explicitly not set), or None (absent from the config / no config)."""
        return self.kconfig.get(key)


CheckFn = Callable[[Context], CheckResult]
REGISTRY: list[tuple[str, str, CheckFn, str]] = []   # (id, title, fn, phase)
EXPLAIN: dict[str, str] = {}


def check(cid: str, title: str, phase: str = "host") -> Callable[[Callable[..., Any]], CheckFn]:
    def deco(fn: Callable[..., Any]) -> CheckFn:
        def run(ctx: Context) -> CheckResult:
            r = fn(ctx)
            r.id, r.title = cid, title
            return r
        REGISTRY.append((cid, title, run, phase))
        EXPLAIN[cid] = f"{cid}: {title}\n\n" + inspect.cleandoc(fn.__doc__ or "")
        return run
    return deco


def R(status: str, summary: str, fix: str | None = None, evidence: list[dict[str, Any]] | None = None,
      applies_to: list[str] | None = None, **details: Any) -> CheckResult:
    return CheckResult("", "", status, summary, fix, evidence or [], applies_to or [], details)


# ------------------------------------------------------------------------------------------------
def load_kconfig(ctx: Context) -> None:
    sr = ctx.sys
    rel = sr.uname().get("release", "")
    text = None
    for path in ("/proc/config.gz", f"/boot/config-{rel}", f"/lib/modules/{rel}/config",
                 f"/lib/modules/{rel}/build/.config"):
        if path.endswith(".gz"):
            if not sr.exists(path):
                sr.read_bytes(path)  # records "absent"
                continue
            text = sr.read_gz(path)
        else:
            text = sr.read(path) if sr.exists(path) else (sr.read_bytes(path) and None)
        if text:
            ctx.kconfig_source = path
            break
    if not text:
        return
    for line in text.splitlines():
        m = re.match(r"^CONFIG_([A-Za-z0-9_]+)=(.*)$", line)
        if m:
            ctx.kconfig[m.group(1)] = m.group(2).strip('"')
            continue
        m = re.match(r"^# CONFIG_([A-Za-z0-9_]+) is not set", line)
        if m:
            ctx.kconfig[m.group(1)] = "n"
    # keep the evidence small: record the keys we use
    sr.log[ctx.kconfig_source].value = "; ".join(f"CONFIG_{k}={ctx.kconfig.get(k, 'absent')}" for k in KCONFIG_KEYS)


def cmdline_tokens(ctx: Context) -> dict[str, str]:
    out: dict[str, str] = {}
    for tok in ctx.cmdline.split():
        if tok == "--":
            break
        k, _, v = tok.partition("=")
        if k in CMDLINE_KEYS or k.startswith("pci") or "iommu" in k:
            out[k] = v if v else "(set)"
    return out


# ---------------------------------------------------------------------------------------- host
@check("host.arch", "Architecture")
def _arch(ctx: Context) -> CheckResult:
    """The PCIe P2PDMA story here is x86_64's. On aarch64 Grace systems GPU memory is reached over
    NVLink-C2C and nvidia-uvm does not register BAR1 for P2PDMA."""
    arch = ctx.top.cpu.get("arch")
    if arch == "x86_64":
        return R(PASS, "x86_64", evidence=ctx.ev("/proc/cpuinfo"))
    if arch is None:
        return R(UNKNOWN, "architecture unknown (no uname in the capture and no /proc/sys/kernel/arch)")
    return R(INFO, f"{arch}: PCIe P2P rules differ (Grace uses C2C; NVIDIA P2PDMA is x86-only)")


@check("host.cpu", "CPU vendor and family")
def _cpu(ctx: Context) -> CheckResult:
    """x86 AMD CPUs of family 0x17 (Zen) or newer let the kernel route P2P through the host bridge
    without consulting the host-bridge allow list."""
    c = ctx.top.cpu
    fam = c.get("family")
    desc = f"{c.get('vendor')} family {('0x%x' % fam) if isinstance(fam, int) else '?'} ({c.get('model_name')})"
    if c.get("vendor") == "AuthenticAMD" and isinstance(fam, int) and fam >= 0x17:
        return R(PASS, desc + ": the kernel allows P2P through AMD host bridges", evidence=ctx.ev("/proc/cpuinfo"))
    return R(INFO, desc + ": host-bridge routes need the kernel's allow list", evidence=ctx.ev("/proc/cpuinfo"))


@check("host.virt", "Virtualization")
def _virt(ctx: Context) -> CheckResult:
    """In a VM the PCIe tree is synthetic: whether P2P works depends on the host's ACS and ATS setup,
    which the guest cannot see."""
    sr = ctx.sys
    hints = []
    if ctx.top.cpu.get("hypervisor"):
        hints.append("cpuinfo hypervisor flag")
    vendor = sr.read("/sys/class/dmi/id/sys_vendor")
    product = sr.read("/sys/class/dmi/id/product_name")
    for word in ("QEMU", "KVM", "VMware", "Xen", "Amazon EC2", "Google Compute Engine", "Microsoft", "innotek",
                 "Firecracker", "Cloud Hypervisor"):
        if word.lower() in f"{vendor} {product}".lower():
            hints.append(f"DMI: {vendor} {product}")
            break
    if "firecracker" in ctx.cmdline.lower():
        hints.append("kernel command line mentions firecracker")
    ev = ctx.ev("/proc/cpuinfo", "/sys/class/dmi/id/sys_vendor", "/sys/class/dmi/id/product_name", "/proc/cmdline")
    if hints:
        kind = "Firecracker" if any("firecracker" in h.lower() for h in hints) else "VM"
        return R(INFO, f"virtual machine ({kind}: {', '.join(hints)}): the PCIe topology is synthetic; P2P depends "
                       "on the host's ACS/ATS setup", "ask the host admin for GPU and peer passthrough under one "
                       "PCIe switch with ACS redirect off", ev, virt=kind)
    return R(PASS, "bare metal (no hypervisor flag, no VM DMI strings)", evidence=ev, virt="none")


@check("host.container", "Container")
def _container(ctx: Context) -> CheckResult:
    """Inside a container, missing device nodes (/dev/nvidia*, /dev/infiniband, /dev/p2phub) make
    checks fail that would pass on the host."""
    sr = ctx.sys
    marks = [p for p in ("/.dockerenv", "/run/.containerenv") if sr.exists(p)]
    cg = sr.read("/proc/1/cgroup") or ""
    if any(w in cg for w in ("docker", "kubepods", "containerd", "libpod")):
        marks.append("/proc/1/cgroup")
    if marks:
        return R(INFO, "running in a container (" + ", ".join(marks) + "): device nodes may be hidden",
                 "pass /dev/p2phub, /dev/nvidia* and /dev/infiniband/* into the container", ctx.ev("/proc/1/cgroup"))
    return R(PASS, "not in a container", evidence=ctx.ev("/proc/1/cgroup"))


@check("host.privilege", "Privilege")
def _priv(ctx: Context) -> CheckResult:
    """Without CAP_SYS_ADMIN sysfs returns only the first 64 bytes of PCI config space, so ACS, ATS
    and port types are unknown; those checks report UNKNOWN rather than guess."""
    euid = ctx.sys.euid
    short = [b for b, d in ctx.top.pci.items() if d.cfg and d.cfg.reason and "64 bytes" in d.cfg.reason]
    if euid == 0 and not short:
        return R(PASS, "root: full config space readable")
    if short:
        return R(WARN, f"config space limited to 64 bytes on {len(short)} device(s): ACS/ATS unknown",
                 "run as root: sudo p2phub doctor", ctx.ev(*(f"/sys/bus/pci/devices/{b}/config" for b in short[:5])),
                 euid=euid)
    return R(INFO, f"euid {euid}", euid=euid)


# -------------------------------------------------------------------------------------- kernel
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


# ---------------------------------------------------------------------------------------- IOMMU
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


def _endpoints(ctx: Context) -> list[tuple[str, str]]:
    return [(d.id, d.bdf) for d in ctx.top.devices if d.bdf]


@check("iommu.domain", "IOMMU domain type per device")
def _iommu_domain(ctx: Context) -> CheckResult:
    """identity = passthrough; DMA / DMA-FQ = translated: P2P behind one switch still bypasses the
    IOMMU, but routes through the host bridge use IOVAs and are slower (and have silently dropped
    writes on some AMD-Vi systems)."""
    eps = _endpoints(ctx)
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
                 + desc, "boot with iommu=pt (or amd_iommu=pt / intel_iommu=on iommu=pt) for passthrough",
                 ev, translated, domains=per)
    if any(t == "unknown" for t in per.values()):
        return R(UNKNOWN, desc, evidence=ev, domains=per)
    return R(PASS, desc, evidence=ev, domains=per)


@check("iommu.groups", "IOMMU group sharing")
def _iommu_groups(ctx: Context) -> CheckResult:
    """A GPU and a peer in one IOMMU group means no ACS isolation between them (consistent with a
    direct P2P route)."""
    groups: dict[str, list[str]] = {}
    for ident, bdf in _endpoints(ctx):
        g = ctx.top.pci[bdf].iommu_group if bdf in ctx.top.pci else None
        if g:
            groups.setdefault(g, []).append(ident)
    shared = {g: ids for g, ids in groups.items() if len(ids) > 1}
    if not groups:
        return R(SKIP, "no IOMMU groups on the devices")
    if shared:
        return R(INFO, "shared groups: " + "; ".join(f"{g}: {', '.join(i)}" for g, i in shared.items()), groups=shared)
    return R(INFO, "every device in its own IOMMU group", groups={})


@check("pcie.ats", "ATS on GPUs and peers")
def _ats(ctx: Context) -> CheckResult:
    """A client with ATS enabled issues translated requests; ACS Translation Blocking on its path
    then blocks them, ACS Direct Translated routes them peer to peer."""
    rows = {}
    unknown = []
    for ident, bdf in _endpoints(ctx):
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
    ev = ctx.ev(*(f"/sys/bus/pci/devices/{b}/config" for _, b in _endpoints(ctx)))
    if tb:
        return R(WARN, "ATS-enabled client behind ACS Translation Blocking: " + "; ".join(tb),
                 "disable ATS on the client (pci=noats) or clear ACS TB on the listed ports", ev, ats=rows)
    if unknown:
        return R(UNKNOWN, desc + " (config space needs root)", "run as root", ev, ats=rows)
    return R(INFO, desc, evidence=ev, ats=rows)


# ------------------------------------------------------------------------------------- devices
@check("pcie.link", "Link training")
def _link(ctx: Context) -> CheckResult:
    """Current link speed/width below the maximum on a GPU, a peer or a bridge of a P2P path. GPUs
    lower their link speed when idle, so a GPU's speed alone is INFO; a narrower width is not."""
    bdfs: dict[str, str] = {}
    for ident, bdf in _endpoints(ctx):
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


@check("pcie.numa", "NUMA locality")
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


# --------------------------------------------------------------------------------------- NVIDIA
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


# ------------------------------------------------------------------------------------------ AMD
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


# ----------------------------------------------------------------------------------------- NVMe
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
    """Controller id -> reasons it is in use (mounted, holders, swap)."""
    sr = ctx.sys
    mounts = sr.read("/proc/mounts") or ""
    swaps = sr.read("/proc/swaps") or ""
    mounted = {ln.split()[0].rsplit("/", 1)[-1]: ln.split()[1] for ln in mounts.splitlines() if len(ln.split()) > 1
               and ln.startswith("/dev/")}
    swapped = {ln.split()[0].rsplit("/", 1)[-1] for ln in swaps.splitlines()[1:] if ln.split()}
    use: dict[str, list[str]] = {}
    for c in ctx.top.nvmes:
        reasons = []
        for ns in c.info.get("namespaces", []):
            for blk in [ns["name"]] + ns.get("partitions", []):
                if blk in mounted:
                    reasons.append(f"{blk} mounted on {mounted[blk]}")
                if blk in swapped:
                    reasons.append(f"{blk} is swap")
            for blk, hs in ns.get("holders", {}).items():
                reasons.append(f"{blk} held by {', '.join(hs)} (LVM/md/dm)")
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


# ------------------------------------------------------------------------------------------ NIC
@check("nic.devices", "RDMA devices")
def _nics(ctx: Context) -> CheckResult:
    """RDMA devices with a PCI function are GPU<->NIC P2P candidates; soft devices (rxe, siw) have no
    PCI function and cannot do P2P. A port must be ACTIVE to carry traffic."""
    if not ctx.top.nics:
        return R(SKIP, "no RDMA devices", evidence=ctx.ev("/sys/class/infiniband"))
    rows, down = {}, []
    for n in ctx.top.nics:
        ports = n.info.get("ports", {})
        st = ",".join(f"{p}:{(v.get('state') or '?').split(':')[-1].strip()}" for p, v in ports.items())
        rows[n.id] = f"{n.name} ({'soft, ' if n.info.get('soft') else ''}{n.bdf or 'no PCI'}; "\
                     f"netdev {','.join(n.info.get('netdevs') or []) or '-'}; ports {st})"
        if not n.info.get("soft") and not any("ACTIVE" in (v.get("state") or "") for v in ports.values()):
            down.append(n.id)
    desc = "; ".join(rows.values())
    if all(n.info.get("soft") for n in ctx.top.nics):
        return R(INFO, "only soft RDMA devices (no P2P): " + desc, nics=rows)
    if down:
        return R(WARN, "no ACTIVE port on " + ", ".join(down) + ": " + desc, "bring the link up (cable, switch, "
                 "ip link set <netdev> up)", nics=rows)
    return R(PASS, desc, nics=rows)


@check("nic.dmabuf_mr", "RDMA dma-buf MR support")
def _nic_dmabuf(ctx: Context) -> CheckResult:
    """ibv_reg_dmabuf_mr with fd -1: EOPNOTSUPP/EPROTONOSUPPORT means the kernel or provider cannot
    register dma-buf memory; any other error (EBADF) means it can."""
    hw = [n for n in ctx.top.nics if not n.info.get("soft")]
    if not hw:
        return R(SKIP, "no PCI RDMA devices")
    res = probes.ibv_dmabuf(ctx.sys)
    if res.get("error"):
        return R(UNKNOWN, f"probe unavailable: {res['error']}", probe=res)
    bad = [d for d, v in res.get("devices", {}).items() if v is False]
    if bad:
        return R(FAIL, "no dma-buf MR support on " + ", ".join(bad), "use a kernel >= 5.12 and a provider with "
                 "dma-buf support (mlx5, efa, bnxt_re)", probe=res)
    return R(PASS, "dma-buf MRs supported on " + ", ".join(res.get("devices", {})), probe=res)


# ----------------------------------------------------------------------------------- p2phub.ko
def _kmod_info(ctx: Context) -> dict[str, Any]:
    if "_kmod" not in ctx.__dict__:
        ctx.__dict__["_kmod"] = probes.kmod_info(ctx.sys)
    return ctx.__dict__["_kmod"]


@check("kmod.loaded", "p2phub.ko loaded")
def _kmod_loaded(ctx: Context) -> CheckResult:
    """p2phub.ko pins GPU memory, maps it for each device and owns NVMe controllers; nothing P2P
    happens through p2phub without it."""
    sr = ctx.sys
    if sr.exists("/sys/module/p2phub"):
        st = sr.read("/sys/module/p2phub/initstate")
        ver = sr.read("/sys/module/p2phub/version")
        return R(PASS, f"loaded ({st or 'live'}; version {ver or '?'})", evidence=ctx.ev("/sys/module/p2phub/initstate",
                 "/sys/module/p2phub/version"))
    return R(WARN, "p2phub.ko is not loaded", "build and load it: make -C kmod && sudo insmod kmod/p2phub.ko "
             "(or dkms install)", [{"path": "/sys/module/p2phub", "error": "absent"}])


@check("kmod.devnode", "/dev/p2phub")
def _kmod_dev(ctx: Context) -> CheckResult:
    """The character device the library talks to; the user needs read/write access."""
    st, why = ctx.sys.stat("/dev/p2phub")
    ev = ctx.ev("/dev/p2phub")
    if st is None:
        if ctx.status("kmod.loaded") == PASS:
            return R(FAIL, f"/dev/p2phub missing ({why}) although the module is loaded",
                     "check udev rules / devtmpfs", ev)
        return R(SKIP, "module not loaded", evidence=ev)
    if not st.is_chr:
        return R(FAIL, "/dev/p2phub is not a character device", "remove it and reload p2phub.ko", ev)
    access = ctx.sys.live and os.access("/dev/p2phub", os.R_OK | os.W_OK)
    if ctx.sys.live and not access:
        return R(WARN, f"/dev/p2phub mode {st.perms} not accessible to this user",
                 "add a udev rule: KERNEL==\"p2phub\", GROUP=\"p2phub\", MODE=\"0660\"", ev, mode=st.perms)
    return R(PASS, f"character device, mode {st.perms}", evidence=ev, mode=st.perms)


@check("kmod.abi", "p2phub.ko ABI version")
def _kmod_abi(ctx: Context) -> CheckResult:
    """P2PHUB_GET_INFO's abi_version must match the library's uapi mirror."""
    info = _kmod_info(ctx)
    if info.get("skip"):
        return R(SKIP, info["skip"])
    if info.get("error"):
        return R(UNKNOWN, f"GET_INFO unavailable: {info['error']}")
    want = info.get("expected_abi")
    got = info.get("abi_version")
    if want is not None and got != want:
        return R(FAIL, f"module ABI {got}, library expects {want}", "rebuild and reload p2phub.ko from this release",
                 details_info=info)
    return R(PASS, f"ABI {got} (module {info.get('version')})")


@check("kmod.caps", "p2phub.ko capabilities")
def _kmod_caps(ctx: Context) -> CheckResult:
    """The capabilities p2phub.ko reports: dma-buf import/export, NVIDIA P2P API, NVMe ownership."""
    info = _kmod_info(ctx)
    if info.get("skip"):
        return R(SKIP, info["skip"])
    if info.get("error"):
        return R(UNKNOWN, f"GET_INFO unavailable: {info['error']}")
    caps = info.get("caps_names", [])
    return R(INFO, "caps: " + (", ".join(caps) or "none"), caps=caps)


@check("kmod.loadable", "Module loadability")
def _kmod_loadable(ctx: Context) -> CheckResult:
    """Lockdown, enforced module signatures (module.sig_enforce or CONFIG_MODULE_SIG_FORCE) and
    kernel.modules_disabled stop an unsigned out-of-tree p2phub.ko from loading."""
    sr = ctx.sys
    rel = sr.uname().get("release", "")
    lock = sr.read("/sys/kernel/security/lockdown")
    sig = sr.read("/sys/module/module/parameters/sig_enforce")
    dis = sr.read("/proc/sys/kernel/modules_disabled")
    build = sr.exists(f"/lib/modules/{rel}/build")
    ev = ctx.ev("/sys/kernel/security/lockdown", "/sys/module/module/parameters/sig_enforce",
                "/proc/sys/kernel/modules_disabled", ctx.kconfig_source or "")
    lock_mode = None
    if lock:
        m = re.search(r"\[(\w+)\]", lock)
        lock_mode = m.group(1) if m else lock
    blockers = []
    if ctx.kc("MODULES") == "n":
        blockers.append("kernel built without module support (CONFIG_MODULES off)")
    if dis == "1":
        blockers.append("kernel.modules_disabled=1")
    if sig == "Y" or ctx.kc("MODULE_SIG_FORCE") == "y":
        src = "module.sig_enforce=Y" if sig == "Y" else "CONFIG_MODULE_SIG_FORCE=y"
        blockers.append(f"signed modules only ({src}): an unsigned p2phub.ko is refused")
    if lock_mode is None and lock is None:
        if ctx.kc("LOCK_DOWN_KERNEL_FORCE_CONFIDENTIALITY") == "y":
            lock_mode = "confidentiality"
        elif ctx.kc("LOCK_DOWN_KERNEL_FORCE_INTEGRITY") == "y":
            lock_mode = "integrity"
        if lock_mode:
            lock_mode += " (forced by the kernel config; securityfs not mounted)"
    if lock_mode and lock_mode.split()[0] in ("integrity", "confidentiality"):
        blockers.append(f"kernel lockdown={lock_mode}: unsigned modules are refused")
    d = dict(lockdown=lock_mode, sig_enforce=sig, modules_disabled=dis, headers=build)
    loaded = ctx.status("kmod.loaded") == PASS
    if blockers and not loaded and ctx.kc("MODULES") == "n":
        return R(FAIL, "; ".join(blockers), "boot a kernel built with CONFIG_MODULES=y", ev, **d)
    if blockers and not loaded:
        return R(FAIL, "; ".join(blockers), "sign p2phub.ko with a key the kernel trusts (enroll it with mokutil) "
                 "or boot a kernel that accepts unsigned modules", ev, **d)
    if loaded:
        return R(PASS, "already loaded" + (f" ({'; '.join(blockers)})" if blockers else ""), evidence=ev, **d)
    if not build:
        return R(WARN, f"loadable, but no kernel headers at /lib/modules/{rel}/build to build it",
                 f"install the headers for {rel}", ev, **d)
    return R(PASS, "unsigned modules can load; kernel headers present", evidence=ev, **d)
