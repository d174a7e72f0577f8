"""A PCI error recovery that never reaches resume() does not hold the controller for later owners.

The PCI core's recovery (pcie_do_recovery) stops before resume() when a device of the hierarchy it
walks has no error handler: it logs "device recovery failed" and leaves every driver's recovery
half done. p2phub-nvme's error_detected() marks the controller as in recovery (RESUME is EBUSY)
and only resume() unmarks it; a new OPEN clears a mark that no recovery is behind (the channel is
not offline) so that the next owner can RESUME.

The lab makes it happen with QEMU's own error injection (`pcie_aer_inject_error`, through the
runner's monitor relay): topology `switch` puts the target controller and the stand-in GPU (a
function without an error handler) under one switch; an uncorrectable, non-fatal error
(completion timeout, non-fatal by the AER severity default) reported by the switch's upstream
port makes the kernel's AER driver walk everything below the root port above it. Non-fatal: the
channel stays normal, so nothing but the mark stands in the next owner's way.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import time
from pathlib import Path

import pytest

from p2phub import uapi
from p2phub.device import Device
from p2phub.nvme import bind
from p2phub_lab import klog, monitor
from regutil import bus_master, errno_of, nvme_open_arg

pytestmark = pytest.mark.lab

PCI = Path("/sys/bus/pci/devices")
UPSTREAM_PORT = "sw-up"                 # the switch's upstream port (QEMU id, topology switch)
ERROR = "COMP_TIME"                     # completion timeout: uncorrectable, non-fatal by default severity
PCI_EXT_CAP_ID_ERR = 0x01
PCI_ERR_UNCOR_STATUS = 4
RECOVERY_S = 60.0                       # TCG on a shared host


def _aer_offset(bdf: str) -> int:
    """Offset of the AER extended capability in bdf's config space, or 0."""
    cfg = (PCI / bdf / "config").read_bytes()
    off = 0x100
    while len(cfg) >= off + 4 and off:
        hdr = int.from_bytes(cfg[off:off + 4], "little")
        if hdr & 0xFFFF == PCI_EXT_CAP_ID_ERR:
            return off
        off = hdr >> 20
    return 0


def _clear_uncorrectable(bdf: str) -> None:
    """Write-1-to-clear what the failed recovery left in the port's AER status."""
    off = _aer_offset(bdf) + PCI_ERR_UNCOR_STATUS
    with open(PCI / bdf / "config", "r+b") as f:
        f.seek(off)
        status = f.read(4)
        f.seek(off)
        f.write(status)


def _recovery_lines(since: int) -> list[str]:
    return [ln for ln in klog.read()[since:] if "device recovery" in ln]


class _Owner:
    """A raw controller fd with its status page."""

    def __init__(self, bdf: str) -> None:
        self.dev = Device()
        self.fd = fcntl.ioctl(self.dev.fd, uapi.NVME_OPEN, nvme_open_arg(bdf), True)
        self.status = mmap.mmap(self.fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ,
                                offset=uapi.NVME_MMAP_STATUS)

    @property
    def state(self) -> int:
        return uapi.NvmeStatus.from_buffer_copy(self.status[:ctypes.sizeof(uapi.NvmeStatus)]).state

    def resume(self) -> int:
        return errno_of(self.fd, uapi.NVME_RESUME, uapi.NvmeResume.new())

    def close(self) -> None:
        self.status.close()
        os.close(self.fd)
        self.dev.close()


def test_resume_works_after_a_recovery_that_never_resumed(lab: dict[str, str]) -> None:
    if lab.get("topology") != "switch":
        pytest.skip("needs the lab topology `switch` (the target and the stand-in GPU under one switch)")
    if not monitor.available(lab):
        pytest.skip("the lab runner relays no monitor commands")
    b, gpu = lab["nvme_target"], lab["gpu"]
    down = (PCI / b).resolve().parent                 # the switch's downstream port
    up = down.parent                                  # its upstream port
    root = up.parent                                  # the root port above the switch
    assert (PCI / gpu).resolve().is_relative_to(up), "the stand-in GPU is under the target's switch"
    if not (up / "aer_dev_nonfatal").exists() or not (root / f"{root.name}:pcie002").exists():
        pytest.skip(f"the kernel serves no AER here (CONFIG_PCIEAER, {root.name}'s AER service)")
    assert _aer_offset(up.name), f"{up.name} has no AER capability"

    bind.bind(b)
    o = _Owner(b)
    try:
        assert o.resume() == 0, "RESUME before any error"
        before = len(klog.read())
        monitor.hmp(lab, f"pcie_aer_inject_error {UPSTREAM_PORT} {ERROR}")
        deadline = time.monotonic() + RECOVERY_S
        while not _recovery_lines(before) and time.monotonic() < deadline:
            time.sleep(0.5)
        lines = _recovery_lines(before)
        assert lines, f"no AER recovery in the kernel log {RECOVERY_S:.0f} s after the injection"
        assert "device recovery failed" in lines[0], (
            f"the recovery reached resume(): {lines[0]} (the scenario needs a device without an "
            "error handler in the hierarchy)")
        assert o.state & uapi.NVME_ST_ERROR, f"the owner was not told: state {o.state:#x}"
        assert (PCI / b / "driver").resolve().name == "p2phub-nvme"
    finally:
        o.close()
        if _aer_offset(up.name):
            _clear_uncorrectable(up.name)

    o = _Owner(b)
    try:
        err = o.resume()
        assert err == 0, (f"RESUME of the next owner failed with {errno.errorcode.get(err, err)}: "
                          "the recovery that never resumed still holds the controller")
        assert bus_master(b)
        assert not o.state & uapi.NVME_ST_ERROR, hex(o.state)
    finally:
        o.close()
    bind.unbind(b)                      # back on nvme, which finds a working controller
    assert (PCI / b / "driver").resolve().name == "nvme"
