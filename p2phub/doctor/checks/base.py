"""What every check is made of: the context it reads, the registry it joins, its result helper."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from ..discovery import Topology
from ..model import CheckResult
from ..sysroot import SysRoot

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
REGISTRY: list[tuple[str, str, CheckFn, str]] = []   # (id, title, fn, phase), in report order
PHASES = ("host", "pairs")
EXPLAIN: dict[str, str] = {}


def check(cid: str, title: str, phase: str = "host") -> Callable[[Callable[..., Any]], CheckFn]:
    """Register a check. ``phase="pairs"`` for checks that read ``ctx.pairs``."""
    if phase not in PHASES:
        raise ValueError(f"check {cid}: unknown phase {phase!r}")
    if cid in EXPLAIN:
        raise ValueError(f"check {cid} registered twice")

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




def endpoints(ctx: Context) -> list[tuple[str, str]]:
    """(id, bdf) of every GPU and peer with a PCI function."""
    return [(d.id, d.bdf) for d in ctx.top.devices if d.bdf]


