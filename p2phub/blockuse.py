"""One rule for "this NVMe controller is in use by the kernel": the doctor and `p2phub nvme bind` both ask it.

A controller must never be taken from the kernel's nvme driver while any of its namespaces or
partitions is mounted, used as swap, or held by a stacked block device (LVM, md, dm-crypt, ...).
The rule is a pure function of what the caller read: ``p2phub.nvme.bind`` reads the live system,
the doctor reads through its SysRoot (live or a captured tree). Messages name the device as
``/dev/NAME`` so both report the same words.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class BlockDev:
    """A namespace or partition of a controller."""

    name: str                                   # nvme0n1, nvme0n1p2
    devno: str | None = None                    # "259:1" (sysfs dev), when known
    holders: tuple[tuple[str, str | None], ...] = ()   # (holder, its device-mapper name or None)


def holder_kind(holder: str, dm_name: str | None) -> str:
    if dm_name:
        return f"device-mapper {dm_name!r} (LVM, dm-crypt, multipath...)"
    if holder.startswith("dm-"):
        return "device-mapper (LVM, dm-crypt, multipath...)"
    if holder.startswith("md"):
        return "md RAID"
    return "a stacked block device"


def _mounts_by_devno(mountinfo: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in mountinfo.splitlines():
        f = line.split()
        if len(f) > 4:
            out.setdefault(f[2], f[4])
    return out


def _mounts_by_name(mounts: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in mounts.splitlines():
        f = line.split()
        if len(f) > 1 and f[0].startswith("/dev/"):
            out.setdefault(os.path.basename(f[0]), f[1])
    return out


def _swap_names(swaps: str, resolve: Callable[[str], str]) -> set[str]:
    return {os.path.basename(resolve(ln.split()[0])) for ln in swaps.splitlines()[1:] if ln.split()}


def usage_reasons(devs: list[BlockDev], *, mountinfo: str | None = None, mounts: str | None = None,
                  swaps: str = "", resolve: Callable[[str], str] = lambda p: p) -> list[str]:
    """Why these block devices cannot be taken from the kernel (empty: free).

    Mounts are matched by device number when ``mountinfo`` (/proc/self/mountinfo) is given, by
    /dev name from ``mounts`` (/proc/mounts) otherwise. ``swaps`` is /proc/swaps; ``resolve`` maps
    a swap path to the real one (the live caller passes os.path.realpath for /dev/disk/by-* links).
    """
    by_devno = _mounts_by_devno(mountinfo) if mountinfo is not None else {}
    by_name = _mounts_by_name(mounts) if mounts is not None and mountinfo is None else {}
    swapped = _swap_names(swaps, resolve)
    reasons: list[str] = []
    for d in devs:
        mp = by_devno.get(d.devno or "") if by_devno else by_name.get(d.name)
        if mp is not None:
            reasons.append(f"/dev/{d.name} is mounted on {mp}")
        if d.name in swapped:
            reasons.append(f"/dev/{d.name} is in use as swap")
        for h, dm in d.holders:
            reasons.append(f"/dev/{d.name} is held by {h}: {holder_kind(h, dm)}")
    return reasons
