"""Lab-tier fixtures. These tests run inside tools/lab's VM; outside it they fail, never skip."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "labkit"))
from p2phub_lab import klog, labenv  # noqa: E402


def _read_env() -> dict[str, str]:
    path = os.environ.get("P2PHUB_LAB_ENV")
    if not path or not Path(path).exists():
        pytest.fail(
            "not inside the p2phub lab (P2PHUB_LAB_ENV unset): run lab tests with "
            "`tools/lab run -- python -m pytest -m lab tests/lab`",
            pytrace=False,
        )
    return labenv.read(path)


@pytest.fixture(scope="session")
def lab() -> dict[str, str]:
    """The lab's description: PCI addresses, GPU backing file, node namespaces (see tools/lab)."""
    return _read_env()


@pytest.fixture(scope="session")
def lab_modules(lab: dict[str, str]) -> Path:
    return Path(lab["modules_dir"])


@pytest.fixture(autouse=True)
def klog_clean():
    """Fail the test that made the kernel log a WARN/BUG/Oops/leak report."""
    _read_env()
    before = len(klog.read())
    yield
    new = klog.read()[before:]
    bad = [f"{r.kind}: {r.line}" for r in klog.reports(new)]
    if bad:
        pytest.fail("kernel log reports during this test:\n" + "\n".join(bad), pytrace=False)
