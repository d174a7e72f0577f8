"""The kernel nvme driver's side of a controller: its namespaces' block devices, read and
written with O_DIRECT. This is the independent path that checks what the engine did.

Block device names (nvmeXnY) are instance numbers, not namespace ids: with native
multipath and asynchronous scanning, nsid 2 can be nvmeXn1. Find them by nsid.
"""

from __future__ import annotations

import mmap
import os

from . import bind


def namespace_device(bdf: str, nsid: int) -> str | None:
    """/dev path of namespace `nsid` while the kernel nvme driver has the controller."""
    for dev in bind.block_devices(bdf):
        try:
            with open(f"/sys/class/block/{os.path.basename(dev)}/nsid") as f:
                if int(f.read()) == nsid:
                    return dev
        except (OSError, ValueError):
            continue
    return None


def read(dev: str, offset: int, n: int) -> bytes:
    buf = mmap.mmap(-1, n)
    fd = os.open(dev, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        got = os.preadv(fd, [buf], offset)
        if got != n:
            raise OSError(f"short read from {dev}: {got} of {n} bytes")
        return bytes(buf)
    finally:
        os.close(fd)
        buf.close()


def write(dev: str, offset: int, data: bytes) -> None:
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    fd = os.open(dev, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        got = os.pwritev(fd, [buf], offset)
        if got != len(data):
            raise OSError(f"short write to {dev}: {got} of {len(data)} bytes")
        os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()


def require_namespace_device(bdf: str, nsid: int) -> str:
    dev = namespace_device(bdf, nsid)
    if dev is None:
        raise LookupError(f"no block device for nsid {nsid} of {bdf}: {bind.block_devices(bdf)}")
    return dev
