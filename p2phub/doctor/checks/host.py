"""host.*: what machine this is (architecture, CPU, VM, container, privilege)."""

from __future__ import annotations

from ..model import INFO, PASS, UNKNOWN, WARN, CheckResult
from .base import Context, R, check

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


