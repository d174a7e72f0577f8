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


# ---------------------------------------------------------------- shared fixtures
# The objects most lab tests need, defined once. A test module overrides one only where its
# tests need other semantics (and says why).

@pytest.fixture
def hub():
    """A Hub on /dev/p2phub, closed (and checked closable) after the test."""
    from p2phub.hub import Hub
    with Hub() as h:
        yield h


@pytest.fixture
def dev():
    """A bare /dev/p2phub fd for ioctl-level tests."""
    from p2phub.device import Device
    with Device() as d:
        yield d


@pytest.fixture(scope="module")
def pds(lab: dict[str, str]):
    """Protection domains on the two nodes' rxe devices (node A, node B)."""
    from p2phub.rdma import ProtectionDomain
    a, b = ProtectionDomain(lab["node_a_rdma"]), ProtectionDomain(lab["node_b_rdma"])
    yield a, b
    a.close()
    b.close()


@pytest.fixture(scope="module")
def bdf(lab: dict[str, str]):
    """The NVMe target; whoever took it in the module, it is back on the kernel nvme driver after."""
    from p2phub.nvme import bind
    b = lab["nvme_target"]
    yield b
    if bind.current_driver(b) != "nvme":
        bind.unbind(b)


@pytest.fixture(scope="module")
def owned_bdf(lab: dict[str, str]):
    """The NVMe target bound to p2phub for the module, then handed back to the kernel."""
    from p2phub.nvme import bind
    b = lab["nvme_target"]
    bind.bind(b)
    yield b
    bind.unbind(b)


@pytest.fixture(scope="module")
def gpu(lab: dict[str, str]):
    """The stand-in GPU (p2phub_fakegpu.ko loaded for the module, unloaded after if loaded here:
    an unload refused as busy is a leak of the code under test)."""
    import p2phub_fakegpu as fg
    with fg.loaded_module(lab["modules_dir"]), fg.FakeGpu() as g:
        yield g


@pytest.fixture(scope="module")
def resident_gpu(lab: dict[str, str]):
    """The stand-in GPU, its module loaded if it was not and left loaded after (for tests
    whose objects may outlive the module's own handle on it, such as a revocation fence)."""
    import p2phub_fakegpu as fg
    fg.ensure_loaded(lab["modules_dir"])
    with fg.FakeGpu() as g:
        yield g
