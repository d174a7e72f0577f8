"""Run discovery, the checks and the pair verdicts; compute the summary and the exit code."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..exitcodes import Exit
from . import SCHEMA
from . import pairs as _pairs
from .checks import PHASES, REGISTRY, Context, cmdline_tokens, load_kconfig
from .discovery import Topology, discover
from .model import BLOCKED, DEGRADED, FAIL, INFO, OK, PASS, SKIP, UNKNOWN, WARN, CheckResult, PairVerdict
from .sysroot import SysRoot

EXIT_OK, EXIT_FAIL, EXIT_WARN, EXIT_UNKNOWN, EXIT_USAGE = Exit.OK, Exit.FAIL, Exit.WARN, Exit.UNKNOWN, Exit.USAGE
# an UNKNOWN in one of these means the doctor could not tell whether P2P works
KEY_CHECKS = {"kernel.p2pdma", "pcie.acs", "pcie.host_bridge", "pairs.gpu_nvme", "pairs.gpu_nic"}


@dataclass
class Report:
    sys: SysRoot
    top: Topology
    ctx: Context
    checks: list[CheckResult] = field(default_factory=list)
    pairs: list[PairVerdict] = field(default_factory=list)

    def check(self, cid: str) -> CheckResult:
        for c in self.checks:
            if c.id == cid:
                return c
        raise KeyError(cid)

    def counts(self) -> dict[str, int]:
        out = {s.lower(): 0 for s in (PASS, INFO, WARN, FAIL, SKIP, UNKNOWN)}
        for c in self.checks:
            out[c.status.lower()] += 1
        return out

    @property
    def status(self) -> str:
        sts = {c.status for c in self.checks}
        if FAIL in sts:
            return FAIL
        if any(c.status == UNKNOWN and c.id in KEY_CHECKS for c in self.checks):
            return UNKNOWN
        if WARN in sts:
            return WARN
        return PASS

    def exit_code(self, strict: bool = False) -> int:
        s = self.status
        if s == FAIL:
            return EXIT_FAIL
        if s == UNKNOWN:
            return EXIT_UNKNOWN
        if s == WARN and strict:
            return EXIT_WARN
        return EXIT_OK

    def class_summary(self, kind: str) -> str:
        ps = [p for p in self.pairs if p.kind == kind]
        if not ps:
            return "none"
        v = {p.verdict for p in ps}
        if v == {OK}:
            return "ok"
        if OK in v or DEGRADED in v:
            return "partial" if (BLOCKED in v or UNKNOWN in v) else "degraded"
        if v == {UNKNOWN}:
            return "unknown"
        return "blocked"

    def why_not(self) -> list[str]:
        """One line per reason P2P cannot work here (the FAIL checks, most fundamental first)."""
        return [f"{c.id}: {c.summary}" for c in self.checks if c.status == FAIL]

    def as_dict(self, version: str) -> dict[str, Any]:
        t = self.top
        return {
            "schema": SCHEMA,
            "tool": {"name": "p2phub doctor", "version": version, "source": self.sys.source(),
                     "module_loaded": self.sys.exists("/sys/module/p2phub")},
            "host": {"kernel": t.cpu.get("kernel"), "arch": t.cpu.get("arch"),
                     "cpu": {"vendor": t.cpu.get("vendor"), "family": t.cpu.get("family"),
                             "model_name": t.cpu.get("model_name")},
                     "virt": self.check("host.virt").details.get("virt"),
                     "privileged": t.privileged, "euid": self.sys.euid,
                     "cmdline": cmdline_tokens(self.ctx),
                     "kconfig_source": self.ctx.kconfig_source,
                     "kconfig": {k: self.ctx.kconfig.get(k, "absent") for k in
                                 ("PCI_P2PDMA", "ZONE_DEVICE", "DMA_SHARED_BUFFER", "DMABUF_MOVE_NOTIFY",
                                  "INFINIBAND_USER_MEM", "HSA_AMD_P2P", "MODULE_SIG_FORCE")} if self.ctx.kconfig
                     else None,
                     "numa": t.numa},
            "devices": [d.as_dict(t) for d in t.devices],
            "host_bridges": {hb: (f"{i[0]:04x}:{i[1]:04x}" if i else None) for hb, i in t.host_bridge_ids.items()},
            "pairs": [p.as_dict() for p in self.pairs],
            "checks": [c.as_dict() for c in self.checks],
            "summary": {"status": self.status, "counts": self.counts(),
                        "gpu_nvme": self.class_summary("gpu-nvme"), "gpu_nic": self.class_summary("gpu-nic"),
                        "why_not": self.why_not()},
        }


def diagnose(sr: SysRoot, active: bool = False, active_opts: Any = None) -> Report:
    top = discover(sr)
    ctx = Context(sys=sr, top=top, active=active, active_opts=active_opts)
    ctx.cmdline = sr.read("/proc/cmdline") or ""
    load_kconfig(ctx)
    rep = Report(sys=sr, top=top, ctx=ctx)
    for phase in PHASES:
        if phase == "pairs":
            ctx.pairs = _pairs.compute_pairs(ctx)
            rep.pairs = ctx.pairs
        for cid, title, fn, ph in REGISTRY:
            if ph != phase:
                continue
            try:
                r = fn(ctx)
            except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
                r = CheckResult(cid, title, UNKNOWN, f"check crashed: {type(exc).__name__}: {exc}")
            ctx.results[cid] = r
    # every check ran once, in its phase; the report lists them in registration order
    rep.checks = [ctx.results[cid] for cid, _, _, _ in REGISTRY]
    return rep
