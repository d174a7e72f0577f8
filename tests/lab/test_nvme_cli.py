"""`p2phub nvme list|bind|unbind|identify` inside the lab."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from p2phub.exitcodes import Exit
from p2phub.nvme import bind

pytestmark = pytest.mark.lab


def p2phub(*args: str) -> tuple[int, dict]:
    res = subprocess.run([sys.executable, "-m", "p2phub", "nvme", *args, "--json"],
                         capture_output=True, text=True)
    return res.returncode, json.loads(res.stdout)


def test_list_bind_identify_unbind(lab: dict[str, str]) -> None:
    bdf = lab["nvme_target"]
    rc, out = p2phub("list")
    assert rc == 0
    rows = {c["bdf"]: c for c in out["controllers"]}
    assert rows[bdf]["driver"] == "nvme" and rows[bdf]["serial"] == "p2phub-target"
    assert rows[lab["nvme_baseline"]]["driver"] == "nvme"

    rc, out = p2phub("bind", bdf)
    assert rc == 0 and out["driver"] == "p2phub-nvme" and out["previous"] == "nvme"
    try:
        rc, out = p2phub("identify", bdf)
        assert rc == 0
        assert out["controller"]["serial"] == "p2phub-target"
        assert [n["lba_size"] for n in out["namespaces"]] == [512, 4096]
        assert bind.current_driver(bdf) == "p2phub-nvme"  # it was bound before identify
    finally:
        rc, out = p2phub("unbind", bdf)
    assert rc == 0 and out["driver"] == "nvme"
    # identify of a kernel-driven controller borrows it and gives it back.
    rc, out = p2phub("identify", bdf)
    assert rc == 0 and bind.current_driver(bdf) == "nvme"


def test_bind_of_busy_controller_exits_busy_with_reasons(lab: dict[str, str]) -> None:
    bdf = lab["nvme_target"]
    dev = bind.block_devices(bdf)[0]
    fd = os.open(dev, os.O_RDONLY | os.O_EXCL)
    try:
        rc, out = p2phub("bind", bdf)
    finally:
        os.close(fd)
    assert rc == Exit.BUSY and out["busy"] and "exclusively" in out["busy"][0]
    assert bind.current_driver(bdf) == "nvme"
    rc, out = p2phub("bind", "zz:zz")
    assert rc == Exit.USAGE and "not a PCI address" in out["error"] and out["schema"] == "p2phub.error/1"
