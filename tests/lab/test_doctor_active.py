"""`p2phub doctor --active` in the lab: a real SSD -> stand-in GPU DMA, checked by checksum.

The doctor runs as its own process, as a user would run it. What it reports is checked against a
side it does not control: bytes this test wrote with the kernel nvme driver beforehand, and the
kernel driver's read of the same LBAs afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from p2phub.nvme import bind, kernel_io

import p2phub_fakegpu as fg

pytestmark = pytest.mark.lab

KiB = 1 << 10
UNPRIV = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def doctor(*args: str, user: list[str] | None = None) -> tuple[int, dict[str, Any], str]:
    res = subprocess.run([*(user or []), sys.executable, "-m", "p2phub", "doctor", "--json", *args],
                         capture_output=True, text=True, timeout=300)
    assert "Traceback" not in res.stderr, res.stderr
    assert res.returncode in (0, 1, 2, 3), (res.returncode, res.stderr)
    return res.returncode, json.loads(res.stdout), res.stderr


def active_check(rep: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in rep["checks"] if c["id"] == "pair.active")


@pytest.fixture(scope="module")
def target(lab: dict[str, str]) -> Iterator[str]:
    b = lab["nvme_target"]
    if bind.current_driver(b) != "nvme":
        bind.unbind(b)
    yield b
    if bind.current_driver(b) != "nvme":
        bind.unbind(b)


@pytest.fixture
def standin(lab: dict[str, str]) -> Iterator[None]:
    with fg.loaded_module(lab["modules_dir"]):
        yield


def test_read_only_dma_matches_the_kernel_driver(target: str, standin: None, lab: dict[str, str]) -> None:
    dev = kernel_io.require_namespace_device(target, 1)
    data = os.urandom(64 * KiB)
    kernel_io.write(dev, 0, data)
    gpu = fg.GpuFile(lab["gpu_file"])
    tail = os.path.getsize(lab["gpu_file"]) - 64 * KiB  # the doctor borrows the end of the BAR
    gpu_before = gpu.read(tail, 64 * KiB)
    rc, rep, _ = doctor("--active", "--active-nvme", target)
    c = active_check(rep)
    assert c["status"] == "PASS", c
    d = c["details"]
    assert d["mode"] == "read" and d["bytes"] == 64 * KiB and d["lba"] == 0 and d["nvme_bdf"] == target
    assert d["gpu_bdf"] == lab["gpu"]
    sha = hashlib.sha256(data).hexdigest()
    assert d["sha256_expected"] == d["sha256_gpu"] == d["sha256_kernel_after"] == sha
    assert d["dma_pages"] >= 1 and d["dma_addresses"] and all(a.startswith("0x") for a in d["dma_addresses"])
    # with the emulated IOMMU p2phub.ko maps an IOVA for the controller, without it the BAR's bus address
    assert d["dma_translated"] is (lab["iommu"] == "1")
    pair = next(p for p in rep["pairs"] if p["active"])
    assert pair["active"]["status"] == "PASS" and pair["client"] == d["nvme"]
    # the controller is back with the kernel, its data untouched; the stand-in's BAR bytes were restored
    assert bind.current_driver(target) == "nvme"
    assert kernel_io.read(kernel_io.require_namespace_device(target, 1), 0, 64 * KiB) == data
    assert gpu.read(tail, 64 * KiB) == gpu_before
    with fg.FakeGpu() as g:
        assert g.query().bufs == 0


def test_write_mode_moves_gpu_bytes_to_the_ssd_and_restores_the_range(target: str, standin: None) -> None:
    dev = kernel_io.require_namespace_device(target, 1)
    lba, n = 4096, 128 * KiB
    old = os.urandom(n)
    kernel_io.write(dev, lba * 512, old)
    rc, rep, _ = doctor("--active", "--active-nvme", target, "--active-write", "--active-lba", str(lba),
                        "--active-bytes", str(n))
    c = active_check(rep)
    assert c["status"] == "PASS", c
    d = c["details"]
    assert d["mode"] == "write+read" and d["bytes"] == n and d["lba"] == lba and d["restored"] is True
    assert d["sha256_expected"] == d["sha256_gpu"] == d["sha256_kernel_after"] != hashlib.sha256(old).hexdigest()
    assert d["sha256_kernel_before"] == hashlib.sha256(old).hexdigest()
    assert bind.current_driver(target) == "nvme"
    assert kernel_io.read(kernel_io.require_namespace_device(target, 1), lba * 512, n) == old


def test_refuses_a_controller_with_a_mounted_namespace(target: str, standin: None, tmp_path: Path) -> None:
    ns2 = kernel_io.require_namespace_device(target, 2)
    subprocess.run(["mkfs.ext4", "-q", "-F", ns2], check=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", ns2, str(mnt)], check=True)
    try:
        rc, rep, _ = doctor("--active", "--active-nvme", target, "--active-write", "--active-lba", "100")
        c = active_check(rep)
        assert c["status"] == "SKIP" and c["summary"].startswith("refused"), c
        assert any(f"{ns2} is mounted on {mnt}" in r for r in c["details"]["busy"])
        assert bind.current_driver(target) == "nvme" and os.path.ismount(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_active_without_a_named_controller_touches_nothing(target: str, standin: None) -> None:
    rc, rep, _ = doctor("--active")
    c = active_check(rep)
    assert c["status"] == "SKIP" and "--active-nvme" in c["summary"]
    assert bind.current_driver(target) == "nvme"


def test_active_needs_the_stand_in_driver_to_have_a_gpu(target: str) -> None:
    if fg.loaded():
        fg.rmmod()
    rc, rep, _ = doctor("--active", "--active-nvme", target)
    assert not [d for d in rep["devices"] if d["kind"] == "gpu"]
    c = active_check(rep)
    assert c["status"] == "SKIP" and "no GPU" in c["summary"], c
    assert bind.current_driver(target) == "nvme"


def test_active_unprivileged_is_a_skip(target: str, standin: None) -> None:
    rc, rep, _ = doctor("--active", "--active-nvme", target, user=UNPRIV)
    c = active_check(rep)
    assert c["status"] == "SKIP" and "root" in c["summary"], c
    assert bind.current_driver(target) == "nvme"


def test_an_unknown_controller_is_a_fail(standin: None) -> None:
    rc, rep, _ = doctor("--active", "--active-nvme", "0000:ff:1f.7")
    c = active_check(rep)
    assert c["status"] == "FAIL" and "not a PCIe NVMe controller" in c["summary"]
