"""One rule for "this NVMe controller is in use by the kernel": the doctor and `p2phub nvme bind` both ask it.

A controller must never be taken from the kernel's nvme driver while any of its namespaces or
partitions is mounted, used as swap, or held by a stacked block device (LVM, md, dm-crypt, ...).
The rule is a pure function of what the caller read: ``p2phub.nvme.bind`` reads the live system,
the doctor reads through its SysRoot (live or a captured tree). Messages name the device as
``/dev/NAME`` so both report the same words.

``p2phub nvme bind`` also asks who has the controller's device files open (``open_reasons``:
O_DIRECT users of a namespace or partition, io_uring passthrough on ``/dev/ngXnY``, admin tools
on ``/dev/nvmeX``) and whether another controller of the same NVMe subsystem reaches the same
namespaces (``sibling_reasons``). These read ``/proc`` and ``/sys`` below roots a test can point
at a fake tree. Nothing here can see other hosts sharing a namespace, or NVMe reservations.
"""

from __future__ import annotations

import errno
import os
import re
import stat as st
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

SYS = Path("/sys")
PROC = Path("/proc")
StatFn = Callable[[str], os.stat_result]


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


# --------------------------------------------------------------------------- open device files


@dataclass(frozen=True)
class DevNode:
    """A device file that reaches the controller or its media."""

    name: str       # nvme0n1, nvme0n1p2 (block); ng0n1, nvme0 (char)
    block: bool
    devno: str      # "259:1", as sysfs dev reads


def read_attr(p: Path) -> str:
    """A sysfs/procfs attribute, stripped; "" when it cannot be read (gone, or never there)."""
    try:
        return p.read_text().strip()
    except OSError:
        return ""


def read_blockdev(name: str, *, sysfs: Path = SYS) -> BlockDev:
    """A block device's number and holders (with their device-mapper names) from sysfs."""
    d = sysfs / "class" / "block" / name
    try:
        holders = sorted(os.listdir(d / "holders"))
    except OSError:
        holders = []
    return BlockDev(name, read_attr(d / "dev") or None,
                    tuple((h, read_attr(sysfs / "class" / "block" / h / "dm" / "name") or None) for h in holders))


def device_nodes(ctrl: str | None, blocks: list[str], *, sysfs: Path = SYS) -> list[DevNode]:
    """The controller's char device, the block devices ``blocks`` (namespaces and partitions) and
    their generic char devices: ngXnY goes with nvmeXnY, for a multipath head as for a plain disk."""
    out: list[DevNode] = []

    def add(name: str, block: bool, d: Path) -> None:
        devno = read_attr(d / "dev")
        if devno:
            out.append(DevNode(name, block, devno))

    if ctrl:
        add(ctrl, False, sysfs / "class" / "nvme" / ctrl)
    for b in blocks:
        add(b, True, sysfs / "class" / "block" / b)
        m = re.fullmatch(r"nvme(\d+n\d+)", b)
        if m:
            add(f"ng{m[1]}", False, sysfs / "class" / "nvme-generic" / f"ng{m[1]}")
    return out


def _rdev(devno: str) -> int:
    major, minor = devno.split(":")
    return os.makedev(int(major), int(minor))


def _opened(link: str, by_rdev: dict[tuple[bool, int], str], by_path: dict[str, str],
            stat: StatFn) -> str | None:
    """Which of our nodes the fd ``link`` (/proc/PID/fd/N) has open, if any."""
    try:
        target = os.readlink(link)
    except OSError:
        return None                     # closed meanwhile, or the process is gone
    if not target.startswith("/"):
        return None                     # socket:[...], pipe:[...], anon_inode:...: never a device file
    target = target.removesuffix(" (deleted)")
    try:
        s = stat(link)                  # the open file itself: a node made elsewhere by mknod counts
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        try:
            s = stat(target)            # the path it was opened by, as this process sees it
        except OSError:
            return by_path.get(target)
    if not (st.S_ISBLK(s.st_mode) or st.S_ISCHR(s.st_mode)):
        return None
    return by_rdev.get((st.S_ISBLK(s.st_mode), s.st_rdev))


def open_reasons(nodes: list[DevNode], *, proc: Path = PROC, stat: StatFn = os.stat) -> list[str]:
    """Processes that have one of ``nodes`` open, exclusively or not, found through /proc/PID/fd by
    device number. Every process counts, this one too: a caller that binds a controller whose
    namespace it has open would lose it. Processes that exit during the scan are skipped; one whose
    fds cannot be read (another user's, when not root) is reported, since it may be a user."""
    if not nodes:
        return []
    by_rdev = {(n.block, _rdev(n.devno)): n.name for n in nodes}
    by_path = {f"/dev/{n.name}": n.name for n in nodes}
    found: dict[tuple[int, str], None] = {}     # ordered set of (pid, device)
    denied: list[int] = []
    try:
        pids = sorted(int(p) for p in os.listdir(proc) if p.isdigit())
    except OSError as exc:
        return [f"could not list processes in {proc}: {exc.strerror}"]
    for pid in pids:
        fddir = proc / str(pid) / "fd"
        try:
            fds = os.listdir(fddir)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EPERM):
                denied.append(pid)
            continue                    # ENOENT, ESRCH: exited
        for fd in fds:
            name = _opened(str(fddir / fd), by_rdev, by_path, stat)
            if name is not None:
                found.setdefault((pid, name))
    reasons = [f"/dev/{name} is open by pid {pid} ({read_attr(proc / str(pid) / 'comm') or '?'})"
               for pid, name in found]
    if denied:
        shown = ", ".join(map(str, denied[:8])) + (f" and {len(denied) - 8} more" if len(denied) > 8 else "")
        hint = " (run as root)" if os.geteuid() else ""
        reasons.append(f"could not check pid {shown} for open namespaces: permission denied{hint}")
    return reasons


# --------------------------------------------------------------------------- NVMe subsystems


def subsystem_siblings(ctrl: str, *, sysfs: Path = SYS) -> tuple[str, list[str]] | None:
    """(nvme-subsysN, the other controllers in it) for controller ``ctrl``; None if in none."""
    base = sysfs / "class" / "nvme-subsystem"
    try:
        subs = sorted(os.listdir(base))
    except OSError:
        return None
    for sub in subs:
        try:
            ctrls = sorted(c for c in os.listdir(base / sub) if re.fullmatch(r"nvme\d+", c))
        except OSError:
            continue
        if ctrl in ctrls:
            return sub, [c for c in ctrls if c != ctrl]
    return None


def _nsid(name: str, sysfs: Path) -> int | None:
    try:
        return int(read_attr(sysfs / "class" / "block" / name / "nsid"))
    except ValueError:
        return None


def _sibling_blocks(sibling: str, nsids: set[int], sysfs: Path) -> list[str]:
    """The sibling's visible block devices (and partitions) of the namespaces ``nsids``.

    NSIDs are subsystem-wide, so the same nsid in one subsystem is the same namespace. With native
    multipath the sibling's paths are hidden (nvmeXcYnZ) behind the head the caller already has.
    """
    d = sysfs / "class" / "nvme" / sibling
    try:
        names = sorted(os.listdir(d))
    except OSError:
        return []
    out: list[str] = []
    for ns in names:
        if re.fullmatch(r"nvme\d+n\d+", ns) and _nsid(ns, sysfs) in nsids:
            out.append(ns)
            try:
                out += sorted(p for p in os.listdir(d / ns) if (d / ns / p / "partition").exists())
            except OSError:
                pass
    return out


def sibling_reasons(ctrl: str, blocks: list[str], *, mountinfo: str, swaps: str = "",
                    resolve: Callable[[str], str] = lambda p: p, allow_shared: bool = False,
                    sysfs: Path = SYS, proc: Path = PROC, stat: StatFn = os.stat) -> list[str]:
    """Uses of this controller's namespaces through another controller of its NVMe subsystem
    (``nvme_core.multipath=N`` gives each its own nvmeXnY), and, unless ``allow_shared``, the plain
    fact that the subsystem has other controllers: from here nothing says which namespaces they share."""
    sub = subsystem_siblings(ctrl, sysfs=sysfs)
    if sub is None:
        return []
    subsys, siblings = sub
    nsids = {n for n in (_nsid(b, sysfs) for b in blocks) if n is not None}
    reasons: list[str] = []
    for sib in siblings:
        names = _sibling_blocks(sib, nsids, sysfs)
        used = usage_reasons([read_blockdev(n, sysfs=sysfs) for n in names], mountinfo=mountinfo, swaps=swaps,
                             resolve=resolve)
        used += open_reasons(device_nodes(None, names, sysfs=sysfs), proc=proc, stat=stat)
        reasons += [f"{r} (the same namespace, through {sib} of {subsys})" for r in used]
        if not allow_shared:
            reasons.append(f"controller {ctrl} shares subsystem {subsys} with {sib}: its namespaces may be "
                           "the same media")
    return reasons
