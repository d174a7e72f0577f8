"""The doctor's report for people: readable at 80 columns, short PCI addresses in domain 0000,
-v without repeated evidence, and no pair of fixes that would undo each other unexplained."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from p2phub.doctor.core import diagnose
from p2phub.doctor.report import CONFLICTS, reconcile, render_rich
from p2phub.doctor.sysroot import SysRoot

pytestmark = pytest.mark.unit

FIXTURES = sorted(p for p in (Path(__file__).resolve().parents[1] / "fixtures" / "doctor").iterdir() if p.is_dir())


def _render(root: Path, verbose: bool) -> tuple[object, list[str]]:
    rep = diagnose(SysRoot(str(root)))
    out = io.StringIO()
    render_rich(rep, verbose=verbose, color=False, out=out, width=80)
    return rep, out.getvalue().splitlines()


@pytest.mark.parametrize("root", FIXTURES, ids=lambda p: p.name)
def test_the_report_fits_80_columns_with_short_addresses(root: Path) -> None:
    for verbose in (False, True):
        rep, lines = _render(root, verbose)
        assert max(len(ln) for ln in lines) <= 80
        domains = {b.split(":")[0] for b in rep.top.pci}
        if domains <= {"0000"}:
            # only root bus names (pci0000:00) keep the domain
            assert not [ln for ln in lines if "0000:" in ln.replace("pci0000:", "")], "\n".join(lines)
        for d in rep.top.devices:
            if d.bdf:
                assert d.bdf[5:] in "\n".join(lines)


@pytest.mark.parametrize("root", FIXTURES, ids=lambda p: p.name)
def test_verbose_shows_each_piece_of_evidence_once(root: Path) -> None:
    _rep, lines = _render(root, verbose=True)
    text = "\n".join(lines)
    assert text.count("/proc/cpuinfo=") == 1
    assert len(lines) < 340   # each pair also names the path p2phub takes


def test_fixes_that_pull_apart_come_with_a_note() -> None:
    _rep, lines = _render(Path(__file__).resolve().parents[1] / "fixtures" / "doctor" / "lab-switch-6.12", False)
    text = " ".join(" ".join(lines).split())
    assert "[pcie.host_bridge] clear ACS redirect" in text and "an IOMMU group of its own" in text
    assert "note fixes 2 and 3 pull apart" in text
    left, right, _ = CONFLICTS[0]
    assert reconcile([next(iter(left))]) == [] and reconcile([next(iter(right))]) == []
    assert len(reconcile(["pcie.link", "pcie.acs", "nvme.confined"])) == 1
