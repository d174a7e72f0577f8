"""Kernel log reports that mean something went wrong in the kernel.

Used by the lab runner (a whole run) and by lab tests (one test's share of the
log). Each pattern has a kind, so a failed run says what was seen: an IOMMU
fault (a device wrote where nothing was mapped), a KASAN or UBSAN report, a
lockdep report, a DMA-API debug error, a leak, or a WARN/BUG/Oops.

Patterns follow the kernel's own printk formats (6.1 and 6.12): the report's
headline line, never the informational lines the same subsystems print at
boot ("DMA-API: preallocated 65536 debug entries", "kmemleak: Kernel memory
leak detector initialized", lockdep's "Lock dependency validator").
DMABUF_DEBUG prints nothing itself: it scrambles the struct page pointers of
every mapped sg_table, so an importer that touches them faults, and the fault
is caught as an Oops, a general protection fault or a KASAN report.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

PATTERNS: list[tuple[str, str]] = [
    # IOMMU faults: a device DMA'd to an address its domain does not map.
    ("iommu", r"DMAR: \[(?:DMA (?:Read|Write)|INTR-REMAP)[^\]]*\] Request device"),
    ("iommu", r"DMAR: DRHD: handling fault status"),
    ("iommu", r"AMD-Vi: Event logged \[(?:IO_PAGE_FAULT|INVALID_DEVICE_REQUEST|DEV_TAB_HARDWARE_ERROR"
              r"|PAGE_TAB_HARDWARE_ERROR|ILLEGAL_DEV_TABLE_ENTRY|IOTLB_INV_TIMEOUT)"),
    ("iommu", r"\bIO_PAGE_FAULT\b"),
    ("iommu", r"arm-smmu.*Unhandled context fault"),
    # Oopses first: their headline also names KASAN on a KASAN kernel.
    ("oops", r"Oops|general protection fault|Kernel panic|stack-protector:"),
    # Memory-safety checkers.
    ("kasan", r"\bKASAN\b"),
    ("kfence", r"BUG: KFENCE: "),
    ("ubsan", r"UBSAN: "),
    ("slub", r"BUG [\w.-]+ \([^)]*\): "),
    # Locking and context checkers (lockdep, RCU, might_sleep).
    ("lockdep", r"possible recursive locking detected"),
    ("lockdep", r"possible circular locking dependency detected"),
    ("lockdep", r"inconsistent lock state"),
    ("lockdep", r"possible irq lock inversion dependency detected"),
    ("lockdep", r"bad unlock balance detected"),
    ("lockdep", r"held lock freed"),
    ("lockdep", r"lock held when returning to user space"),
    ("lockdep", r"[\w-]+/\d+ is leaving the kernel with locks still held"),
    ("lockdep", r"suspicious RCU usage"),
    ("lockdep", r"BUG: sleeping function called from invalid context"),
    ("lockdep", r"BUG: scheduling while atomic"),
    ("lockdep", r"BUG: workqueue leaked (?:lock|atomic)"),
    ("lockdep", r"DEBUG_LOCKS_WARN_ON"),
    # DMA-API debugging: "DMA-API: <driver> <device>: <what>" (printed inside a WARN),
    # and the debugger giving up.
    ("dma-api", r"DMA-API: \S+ \S+: "),
    ("dma-api", r"DMA-API: .*(?:out of memory|disabl|exceeded \d+ overlapping)"),
    # Leaks.
    ("kmemleak", r"kmemleak: \d+ new suspected memory leaks?|unreferenced object 0x"),
    ("leak", r"p2phub: leak"),
    # Corruption and hangs before the generic BUG:/WARNING: they print in.
    ("corruption", r"refcount_t:|list_add corruption|list_del corruption|Bad page (?:state|map)"),
    ("hang", r"INFO: task .* blocked|rcu: INFO: \w+ (?:self-)?detected stalls?|soft lockup|hard LOCKUP"),
    # Everything else the kernel calls a bug.
    ("warn", r"WARNING:"),
    ("bug", r"BUG:|kernel BUG at"),
    ("trace", r"Call Trace:"),
]

_COMPILED = [(kind, re.compile(rx)) for kind, rx in PATTERNS]
BAD = re.compile("|".join(f"(?:{rx})" for _, rx in PATTERNS))


@dataclass(frozen=True)
class Report:
    kind: str  # the first matching pattern's kind: iommu, kasan, lockdep, dma-api, ...
    line: str


def classify(line: str) -> str | None:
    """The kind of report this line belongs to, or None for a harmless line."""
    for kind, rx in _COMPILED:
        if rx.search(line):
            return kind
    return None


# A test whose expected outcome is an IOMMU fault of one device (a DMA aimed at an address
# just unmapped) brackets it with these lines in the kernel log (expect_iommu_faults()); faults
# of that device between them are not reports. Every other report still is.
_EXPECT = re.compile(r"p2phub-lab: expected iommu faults of (\S+) (begin|end)")


def reports(lines: list[str]) -> list[Report]:
    out = []
    expected: set[str] = set()
    for line in lines:
        m = _EXPECT.search(line)
        if m:
            (expected.add if m.group(2) == "begin" else expected.discard)(m.group(1))
            continue
        kind = classify(line)
        if kind is None:
            continue
        if kind == "iommu" and expected and ("handling fault status" in line or any(
                f"Request device [{dev}]" in line for dev in expected)):
            continue
        out.append(Report(kind, line))
    return out


def mark(text: str) -> None:
    """Write a line into the kernel log (needs root)."""
    with open("/dev/kmsg", "w") as f:
        f.write(f"p2phub-lab: {text}\n")


class expect_iommu_faults:
    """Within this block, IOMMU faults of PCI device `dev` ("00:0a.0", as DMAR names it) are
    the expected outcome, not reports; the fault lines the IOMMU logs a moment later are
    covered by a short wait before the block's end is marked."""

    def __init__(self, dev: str, settle_s: float = 1.0) -> None:
        self.dev, self.settle_s = dev, settle_s

    def __enter__(self) -> "expect_iommu_faults":
        mark(f"expected iommu faults of {self.dev} begin")
        return self

    def __exit__(self, *exc: object) -> None:
        import time
        time.sleep(self.settle_s)
        mark(f"expected iommu faults of {self.dev} end")


def bad_lines(lines: list[str]) -> list[str]:
    return [r.line for r in reports(lines)]


def summary(lines: list[str]) -> dict[str, int]:
    """Report lines per kind, e.g. {"lockdep": 2, "warn": 1, "trace": 1}."""
    counts: dict[str, int] = {}
    for r in reports(lines):
        counts[r.kind] = counts.get(r.kind, 0) + 1
    return counts


def read() -> list[str]:
    """The kernel ring buffer, one line per message (needs root)."""
    out = subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()
