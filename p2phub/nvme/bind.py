"""Hand an NVMe controller to p2phub.ko and give it back, through sysfs.

Binding goes: find the controller's namespaces (block devices, partitions),
refuse if any is mounted, used as swap, held by a stacked device (LVM, md,
dm-crypt, ...), open by any process (exclusively or not, through the block
device, its /dev/ngXnY or the controller's /dev/nvmeX), or reachable through
another controller of its NVMe subsystem (p2phub.blockuse); then open each one
exclusively ourselves, so nothing can mount or claim it between the check and
the unbind; unbind from the kernel nvme driver, set driver_override to
"p2phub-nvme", bind. Unbinding reverses it and lets the kernel nvme driver
probe the controller again.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..blockuse import (device_nodes, open_reasons, read_attr, read_blockdev, sibling_reasons,
                        usage_reasons)
from ..errors import P2PHubOSError, UsageError
from ..pci import PciAddress, normalize

log = logging.getLogger(__name__)
from .errors import ControllerBusyError

DRIVER = "p2phub-nvme"
PCI_DEVICES = Path("/sys/bus/pci/devices")
PCI_DRIVERS = Path("/sys/bus/pci/drivers")
NVME_CLASS = 0x010802
OPENER_GRACE_S = 3.0

def split_bdf(bdf: "str | PciAddress") -> tuple[int, int, int]:
    """(domain, bus, devfn) of a PCI address, as the UAPI structs carry it (p2phub.pci parses)."""
    a = PciAddress.parse(bdf)
    return a.domain, a.bus, a.devfn


def current_driver(bdf: str) -> str | None:
    link = PCI_DEVICES / bdf / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else None


@dataclass(frozen=True)
class ControllerInfo:
    bdf: str
    driver: str | None
    vendor: str
    device: str
    ctrl: str | None  # nvmeN, when the kernel driver has it
    model: str
    serial: str
    namespaces: list[str]

    def as_dict(self) -> dict:
        return {"bdf": self.bdf, "driver": self.driver, "vendor": self.vendor, "device": self.device,
                "kernel_name": self.ctrl, "model": self.model, "serial": self.serial,
                "namespaces": self.namespaces}


def list_controllers() -> list[ControllerInfo]:
    out = []
    for dev in sorted(PCI_DEVICES.iterdir()) if PCI_DEVICES.exists() else []:
        try:
            cls = int(read_attr(dev / "class"), 16)
        except ValueError:
            continue
        if cls != NVME_CLASS:
            continue
        ctrl = _kernel_ctrl(dev.name)
        cdir = dev / "nvme" / ctrl if ctrl else None
        out.append(ControllerInfo(
            bdf=dev.name, driver=current_driver(dev.name), vendor=read_attr(dev / "vendor"),
            device=read_attr(dev / "device"), ctrl=ctrl,
            model=read_attr(cdir / "model") if cdir else "", serial=read_attr(cdir / "serial") if cdir else "",
            namespaces=[b for b, _ in _block_devices(dev.name)]))
    return out


def _kernel_ctrl(bdf: str) -> str | None:
    d = PCI_DEVICES / bdf / "nvme"
    if not d.is_dir():
        return None
    names = sorted(p.name for p in d.iterdir() if re.fullmatch(r"nvme\d+", p.name))
    return names[0] if names else None


def _block_devices(bdf: str) -> list[tuple[str, Path]]:
    """(name, sysfs dir) of every block device and partition backed by this controller.

    Without native multipath the namespaces sit under the controller; with it,
    the visible disk is a subsystem "head" whose multipath/ links name our
    controller's hidden path devices (nvmeXcYnZ).
    """
    ctrl = _kernel_ctrl(bdf)
    if ctrl is None:
        return []
    cdir = (PCI_DEVICES / bdf / "nvme" / ctrl).resolve()
    found: dict[str, Path] = {}
    for blk in Path("/sys/class/block").iterdir():
        real = blk.resolve()
        mine = str(real).startswith(str(cdir) + "/")
        mp = real / "multipath"
        if not mine and mp.is_dir():
            mine = any(re.fullmatch(rf"nvme\d+c{ctrl[4:]}n\d+", p.name) for p in mp.iterdir())
        if mine and not re.fullmatch(r"nvme\d+c\d+n\d+", blk.name):
            found[blk.name] = real
            for part in real.iterdir():
                if (part / "partition").exists():
                    found[part.name] = part
    return sorted(found.items())


def busy_reasons(bdf: str, *, allow_shared_subsystem: bool = False) -> list[str]:
    """Why the controller cannot be taken from the kernel (empty: free).

    ``allow_shared_subsystem`` accepts a controller whose NVMe subsystem has other controllers when
    nothing visible uses its namespaces through them; it cannot be told from here which namespaces
    those controllers (or other hosts) share.
    """
    bdf = normalize(bdf)
    ctrl = _kernel_ctrl(bdf)
    if ctrl is None:
        return []
    names = [name for name, _d in _block_devices(bdf)]
    with open("/proc/self/mountinfo") as f:
        mountinfo = f.read()
    try:
        with open("/proc/swaps") as f:
            swaps = f.read()
    except FileNotFoundError:  # a kernel built without swap support
        swaps = ""
    reasons = usage_reasons([read_blockdev(n) for n in names], mountinfo=mountinfo, swaps=swaps,
                            resolve=os.path.realpath)
    if not reasons:  # a mounted or stacked device is also held exclusively: say it once
        for name in names:
            path = f"/dev/{name}"
            try:
                fd = os.open(path, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    reasons.append(f"{path} is open exclusively by another user (a filesystem, "
                                   "RAID or volume manager, or a program)")
                continue
            os.close(fd)
    # Scanned before bind's own exclusive opens below: every opener found is someone else's use.
    # udev probes a namespace (blkid) for a moment after anything closes it from writing: wait
    # that out, so only a process that keeps it open refuses the bind.
    nodes = device_nodes(ctrl, names)
    openers = open_reasons(nodes)
    deadline = time.monotonic() + OPENER_GRACE_S
    while openers and time.monotonic() < deadline:
        time.sleep(0.1)
        openers = open_reasons(nodes)
    reasons += openers
    reasons += sibling_reasons(ctrl, names, mountinfo=mountinfo, swaps=swaps, resolve=os.path.realpath,
                               allow_shared=allow_shared_subsystem)
    return reasons


def _write(path: Path, value: str, what: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as exc:
        raise P2PHubOSError(exc.errno or errno.EIO, what, f"writing {value.strip()!r} to {path}") from None


def bind(bdf: str, *, timeout_s: float = 10.0, allow_shared_subsystem: bool = False) -> str:
    """Hand the controller to p2phub.ko. Returns the driver it had before.

    Refused (ControllerBusyError) while ``busy_reasons`` has any; ``allow_shared_subsystem`` is passed on.
    """
    bdf = normalize(bdf)
    dev = PCI_DEVICES / bdf
    if not dev.exists():
        raise UsageError(f"no PCI device {bdf}")
    if int(read_attr(dev / "class") or "0", 16) != NVME_CLASS:
        raise UsageError(f"{bdf} is not an NVMe controller (class {read_attr(dev / 'class')})")
    before = current_driver(bdf)
    if before == DRIVER:
        return before
    if not (PCI_DRIVERS / DRIVER).is_dir():
        raise P2PHubOSError(errno.ENODEV, "bind", f"no PCI driver {DRIVER}: is p2phub.ko loaded?")
    reasons = busy_reasons(bdf, allow_shared_subsystem=allow_shared_subsystem)
    if reasons:
        raise ControllerBusyError(bdf, reasons)
    # Hold every namespace exclusively across the unbind: nothing may mount it meanwhile.
    held: list[int] = []
    try:
        for name, _d in _block_devices(bdf):
            try:
                held.append(os.open(f"/dev/{name}", os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC))
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno == errno.EBUSY:
                    raise ControllerBusyError(bdf, [f"/dev/{name} was claimed while binding"]) from None
                raise
        _write(dev / "driver_override", DRIVER, "bind")
        if before is not None:
            _write(dev / "driver" / "unbind", bdf, "bind")
    finally:
        for fd in held:
            os.close(fd)
    try:
        _write(PCI_DRIVERS / DRIVER / "bind", bdf, "bind")
        _wait_driver(bdf, DRIVER, timeout_s)
    except P2PHubOSError:
        unbind(bdf, driver=before or "")  # give it back rather than leave it driverless
        raise
    log.info("%s: now on %s (was %s)", bdf, DRIVER, before or "unbound")
    return before or ""


def unbind(bdf: str, *, driver: str = "nvme", timeout_s: float = 30.0) -> None:
    """Give the controller back to the kernel (`driver`, normally nvme).

    The owner's controller fd must be closed first: the kernel waits for it.
    """
    bdf = normalize(bdf)
    dev = PCI_DEVICES / bdf
    if not dev.exists():
        raise UsageError(f"no PCI device {bdf}")
    if current_driver(bdf) == DRIVER:
        _write(dev / "driver" / "unbind", bdf, "unbind")
    _write(dev / "driver_override", "\n", "unbind")
    if current_driver(bdf) is None and driver:
        try:
            _write(PCI_DRIVERS / driver / "bind", bdf, "unbind")
        except P2PHubOSError:
            _write(Path("/sys/bus/pci/drivers_probe"), bdf, "unbind")
        _wait_driver(bdf, driver, timeout_s)
        if driver == "nvme":
            _wait_namespaces(bdf, timeout_s)


def _wait_driver(bdf: str, driver: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while current_driver(bdf) != driver:
        if time.monotonic() > deadline:
            raise P2PHubOSError(errno.ETIMEDOUT, "bind", f"{bdf} not bound to {driver} after {timeout_s} s "
                                f"(driver now: {current_driver(bdf)})")
        time.sleep(0.05)


def _wait_namespaces(bdf: str, timeout_s: float) -> None:
    """The kernel nvme driver probes asynchronously: wait for its block devices."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        devs = _block_devices(bdf)
        if devs and all(os.path.exists(f"/dev/{n}") for n, _ in devs):
            return
        time.sleep(0.1)


def block_devices(bdf: str) -> list[str]:
    """/dev paths of the controller's namespaces (when the kernel driver has it)."""
    return [f"/dev/{n}" for n, d in _block_devices(normalize(bdf)) if not (d / "partition").exists()]
