"""Helpers for the registration lab tests: p2phub.ko's leak counters, physical addresses."""

from __future__ import annotations

import os
import subprocess
import struct
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DEBUGFS = Path("/sys/kernel/debug/p2phub")

# Counters that must return to zero once everything is released.
LEAK_COUNTERS = ("regs", "dev_maps", "dmabuf_attachments", "dmabuf_pins", "exports",
                 "export_attachments", "export_mmaps", "nv_page_tables", "nv_dma_mappings")


def counters() -> dict[str, int]:
    """p2phub.ko's registration counters from debugfs."""
    out = {}
    for name in (*LEAK_COUNTERS, "revocations"):
        out[name] = int((DEBUGFS / name).read_text())
    return out


def wait_no_leaks(timeout: float = 5.0) -> dict[str, int]:
    """Wait until every leak counter is zero; return the last reading (assert on it)."""
    deadline = time.monotonic() + timeout
    while True:
        c = counters()
        if all(c[k] == 0 for k in LEAK_COUNTERS) or time.monotonic() > deadline:
            return {k: c[k] for k in LEAK_COUNTERS}
        time.sleep(0.05)


def phys_addrs(addr: int, length: int, page: int = 4096) -> list[int]:
    """Physical addresses of the (touched, resident) pages of our mapping [addr, addr + length)."""
    out = []
    with open("/proc/self/pagemap", "rb") as f:
        for va in range(addr, addr + length, page):
            f.seek((va // page) * 8)
            (entry,) = struct.unpack("<Q", f.read(8))
            if not entry >> 63 & 1:
                raise AssertionError(f"page {va:#x} not present")
            out.append((entry & ((1 << 55) - 1)) * page)
    return out


def bdf_exists(bdf: str) -> bool:
    return Path("/sys/bus/pci/devices", bdf).exists()


def wait_until(pred, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# p2phub_fakegpu_consumer.ko: a minimal in-kernel importer / NVIDIA P2P consumer, driven
# through debugfs (see its source for the commands).
CONSUMER = "p2phub_fakegpu_consumer"
CONSUMER_DIR = Path(f"/sys/kernel/debug/{CONSUMER}")


class Consumer:
    def command(self, cmd: str) -> None:
        fd = os.open(CONSUMER_DIR / "cmd", os.O_WRONLY)
        try:
            os.write(fd, cmd.encode())
        finally:
            os.close(fd)

    def state(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in (CONSUMER_DIR / "state").read_text().splitlines():
            key, value = line.split()
            out[key] = int(value, 0)
        return out


@contextmanager
def consumer_loaded(modules_dir: str) -> Iterator[Consumer]:
    """Load the consumer module (the stand-in GPU's must be loaded); release and unload after."""
    subprocess.run(["insmod", f"{modules_dir}/{CONSUMER}.ko"], check=True)
    c = Consumer()
    try:
        yield c
    finally:
        c.command("release")
        subprocess.run(["rmmod", CONSUMER], check=True)


# ---------------------------------------------------------------- NVMe ownership tests

def errno_of(fd: int, request: int, arg) -> int:
    """The errno of one ioctl on fd (0 when it succeeded)."""
    import fcntl
    try:
        fcntl.ioctl(fd, request, arg, True)
    except OSError as exc:
        return exc.errno or 0
    return 0


def nvme_open_arg(bdf: str, **kw: int):
    """P2PHUB_NVME_OPEN's argument for the controller at bdf."""
    from p2phub import uapi
    from p2phub.nvme import bind
    dom, bus, devfn = bind.split_bdf(bdf)
    return uapi.NvmeOpen.new(domain=dom, bus=bus, devfn=devfn, **kw)


def bus_master(bdf: str) -> bool:
    """Whether bus mastering is on in the function's PCI command register."""
    cmd = int.from_bytes(Path(f"/sys/bus/pci/devices/{bdf}/config").read_bytes()[4:6], "little")
    return bool(cmd & 0x4)
