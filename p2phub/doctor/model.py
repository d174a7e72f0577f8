"""Result types shared by the checks, the pair verdicts and the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

PASS, INFO, WARN, FAIL, SKIP, UNKNOWN = "PASS", "INFO", "WARN", "FAIL", "SKIP", "UNKNOWN"
STATUSES = (PASS, INFO, WARN, FAIL, SKIP, UNKNOWN)
SEVERITY = {PASS: 0, SKIP: 0, INFO: 1, UNKNOWN: 2, WARN: 3, FAIL: 4}

OK, DEGRADED, BLOCKED = "OK", "DEGRADED", "BLOCKED"
VERDICTS = (OK, DEGRADED, BLOCKED, UNKNOWN)


@dataclass
class CheckResult:
    id: str
    title: str
    status: str
    summary: str
    fix: str | None = None
    evidence: list[dict[str, Any]] = field(default_factory=list)
    applies_to: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "title": self.title, "status": self.status, "summary": self.summary,
                "fix": self.fix, "applies_to": self.applies_to, "evidence": self.evidence,
                "details": self.details}


@dataclass
class PairVerdict:
    provider: str          # GPU id
    client: str            # NVMe / NIC id
    kind: str              # gpu-nvme | gpu-nic
    cls: str
    distance: int
    lca: str | None
    path: list[str]
    map_type: str
    acs_blockers: list[str]
    host_bridge: dict[str, Any]
    iommu: str
    gbps: float | None
    numa_aligned: bool | None
    gates: dict[str, Any]
    verdict: str
    because: list[str] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)
    active: dict[str, Any] = field(default_factory=dict)
    acs_unknown: list[str] = field(default_factory=list)   # ports of the path whose ACS could not be read
    p2p: dict[str, Any] = field(default_factory=dict)       # the path p2phub takes (p2phub.policy)

    def as_dict(self) -> dict[str, Any]:
        return {"provider": self.provider, "client": self.client, "kind": self.kind, "class": self.cls,
                "distance": self.distance, "lca": self.lca, "path": self.path,
                "kernel": {"map_type": self.map_type, "source": "emulated", "acs_blockers": self.acs_blockers,
                           "acs_unknown": self.acs_unknown,
                           "host_bridge": self.host_bridge},
                "iommu": self.iommu, "min_link_gbps": self.gbps, "numa_aligned": self.numa_aligned,
                "gates": self.gates, "verdict": self.verdict, "because": self.because,
                "reasons": self.reasons, "fixes": self.fixes, "active": self.active,
                "p2p_path": self.p2p}
