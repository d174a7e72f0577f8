"""`p2phub doctor` on the live lab VM, as root and unprivileged: no traceback, a complete report."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Iterator

import pytest

from p2phub.doctor import core  # noqa: F401  (importing it registers the pair-level checks)
from p2phub.doctor.checks import REGISTRY

import p2phub_fakegpu as fg

pytestmark = pytest.mark.lab

UNPRIV = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
USERS = {"root": [], "nobody": UNPRIV}


def run(user: str, *args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run([*USERS[user], sys.executable, "-m", "p2phub", "doctor", "--no-color", *args],
                         capture_output=True, text=True, timeout=300)
    assert "Traceback" not in res.stderr + res.stdout, res.stderr
    assert res.returncode in (0, 1, 2, 3), (res.returncode, res.stderr)
    return res


@pytest.fixture(params=["standin", "bare"])
def gpu_driver(request: pytest.FixtureRequest, lab: dict[str, str]) -> Iterator[str]:
    if request.param == "standin":
        with fg.loaded_module(lab["modules_dir"]):
            yield request.param
    else:
        if fg.loaded():
            fg.rmmod()
        yield request.param


def check(rep: dict[str, Any], cid: str) -> dict[str, Any]:
    return next(c for c in rep["checks"] if c["id"] == cid)


@pytest.mark.parametrize("user", sorted(USERS))
def test_doctor_text_and_json(user: str, gpu_driver: str, lab: dict[str, str]) -> None:
    text = run(user)
    # every device is in PCI domain 0000 here, so the table prints short addresses (00:0a.0)
    assert "p2phub doctor" in text.stdout and lab["nvme_target"].removeprefix("0000:") in text.stdout
    res = run(user, "--json")
    rep = json.loads(res.stdout)
    assert rep["schema"] == "p2phub.doctor/1" and rep["tool"]["source"] == "live"
    assert rep["tool"]["module_loaded"] is True
    assert {c["id"] for c in rep["checks"]} == {cid for cid, *_ in REGISTRY}
    assert not [c for c in rep["checks"] if "crashed" in c["summary"]]
    assert rep["host"]["privileged"] is (user == "root")
    assert check(rep, "kmod.loaded")["status"] == "PASS"
    nvmes = {d["bdf"] for d in rep["devices"] if d["kind"] == "nvme"}
    assert {lab["nvme_target"], lab["nvme_baseline"]} <= nvmes
    gpus = [d for d in rep["devices"] if d["kind"] == "gpu"]
    if gpu_driver == "standin":
        # found through the stand-in's backend plugin, as a vendor's GPU would be
        assert [(g["bdf"], g["vendor"], g["driver"], g["backend"]) for g in gpus] == \
            [(lab["gpu"], "p2phub stand-in", "p2phub_fakegpu", "fakegpu")]
        assert {p["client"] for p in rep["pairs"] if p["kind"] == "gpu-nvme"} == \
            {d["id"] for d in rep["devices"] if d["kind"] == "nvme"}
        assert not [p for p in rep["pairs"] if p["kind"] == "gpu-nic"]  # rxe devices are not PCI
    else:
        assert gpus == [] and rep["pairs"] == []
    # the soft-RoCE devices are listed but never paired
    nics = {d["name"] for d in rep["devices"] if d["kind"] == "nic"}
    assert {lab["node_a_rdma"], lab["node_b_rdma"]} <= nics
    assert check(rep, "nic.devices")["status"] == "INFO"
    if user == "nobody":
        assert check(rep, "host.privilege")["status"] == "WARN"
        # 64 bytes of config space: ACS is unknown on the ports of every pair's path (the GPU included)
        assert check(rep, "pcie.acs")["status"] == ("UNKNOWN" if rep["pairs"] else "SKIP")
        assert all(p["kernel"]["acs_unknown"] for p in rep["pairs"])
        assert check(rep, "pair.active")["status"] == "SKIP"
