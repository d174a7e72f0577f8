"""One route classifier: the doctor's pair verdicts and the Hub's path policy name the same
path for every pair of every doctor fixture, ACS redirect included."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from p2phub import capabilities as caps
from p2phub.doctor.core import diagnose
from p2phub.doctor.sysroot import SysRoot
from p2phub.policy import PathPolicy

pytestmark = pytest.mark.unit

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "doctor")
NAMES = sorted(d for d in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, d)))


def _gpu_memory(bdf: str) -> SimpleNamespace:
    """What the policy reads of pinned GPU memory."""
    return SimpleNamespace(mode="p2p", what="gpu memory", pin_provider="dmabuf",
                           gpu=SimpleNamespace(pci_bus_id=bdf, backend="cuda"))


def _pairs(name: str) -> list[tuple[str, str, str]]:
    """(gpu bdf, peer bdf, the doctor's path) of every pair in fixture `name`."""
    rep = diagnose(SysRoot(os.path.join(FIXTURES, name)))
    bdf = {d.id: d.bdf for d in [*rep.top.gpus, *rep.top.nvmes, *rep.top.nics]}
    return [(bdf[p.provider], bdf[p.client], p.p2p["path"]) for p in rep.pairs]


@pytest.mark.parametrize("name", NAMES)
def test_the_doctor_and_the_policy_name_the_same_path(name: str) -> None:
    policy = PathPolicy(os.path.join(FIXTURES, name, "sys"))
    for gpu, peer, doctor_path in _pairs(name):
        got = policy.dma_path(_gpu_memory(gpu), peer)  # type: ignore[arg-type]
        assert got.kind.value == doctor_path, f"{name}: {gpu} -> {peer}: {got.reason}"


def test_the_fixtures_hold_pairs_and_an_acs_redirected_switch() -> None:
    paths = {name: _pairs(name) for name in NAMES}
    assert sum(len(p) for p in paths.values()) >= 4
    redirected = [(name, g, p) for name, ps in paths.items() for g, p, _ in ps
                  if "ACS redirect" in caps.pci_route(g, p, os.path.join(FIXTURES, name, "sys")).via]
    assert redirected, "no fixture has a switch whose ACS sends peer traffic up"
    for name, g, p in redirected:
        r = caps.pci_route(g, p, os.path.join(FIXTURES, name, "sys"))
        assert r.route is caps.Route.HOST_BRIDGE, r


def test_acs_control_is_read_from_the_extended_space() -> None:
    cfg = bytearray(4096)
    cfg[0x100:0x104] = (0x000D | (1 << 16) | (0x140 << 20)).to_bytes(4, "little")  # ACS, next 0x140
    cfg[0x106:0x108] = (1 << 2).to_bytes(2, "little")                                # RR
    assert caps.acs_ctrl(bytes(cfg)) == 1 << 2 and caps.acs_redirects(1 << 2)
    assert not caps.acs_redirects(1 << 0) and not caps.acs_redirects(None)   # SV only; absent
    assert caps.acs_ctrl(bytes(4096)) is None
    cfg[0x100:0x104] = (0x000F | (0x100 << 20)).to_bytes(4, "little")               # a loop, no ACS
    assert caps.acs_ctrl(bytes(cfg)) is None


def test_unreadable_config_space_leaves_acs_unknown(tmp_path) -> None:
    dev = tmp_path / "bus" / "pci" / "devices" / "0000:01:00.0"
    dev.mkdir(parents=True)
    (dev / "config").write_bytes(bytes(64))   # what a reader without CAP_SYS_ADMIN gets
    assert caps.acs_redirect("0000:01:00.0", str(tmp_path)) is None
    assert caps.acs_redirect("0000:02:00.0", str(tmp_path)) is None
