"""The one "controller in use" rule (p2phub.blockuse), as the doctor and `p2phub nvme bind` apply it."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest

from p2phub.blockuse import BlockDev, DevNode, device_nodes, open_reasons, sibling_reasons, usage_reasons

pytestmark = pytest.mark.unit

MOUNTINFO = "24 1 259:2 / /data rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw\n"
MOUNTS = "/dev/nvme0n1p1 /data ext4 rw 0 0\nproc /proc proc rw 0 0\n"
SWAPS = "Filename\tType\tSize\tUsed\tPriority\n/dev/nvme1n1 partition 1024 0 -2\n"


def test_free_devices_have_no_reasons() -> None:
    devs = [BlockDev("nvme2n1", "259:9")]
    assert usage_reasons(devs, mountinfo=MOUNTINFO, swaps=SWAPS) == []
    assert usage_reasons(devs, mounts=MOUNTS, swaps=SWAPS) == []


def test_a_mount_is_found_by_device_number_or_by_name_with_the_same_words() -> None:
    by_devno = usage_reasons([BlockDev("nvme0n1"), BlockDev("nvme0n1p1", "259:2")], mountinfo=MOUNTINFO)
    by_name = usage_reasons([BlockDev("nvme0n1"), BlockDev("nvme0n1p1")], mounts=MOUNTS)
    assert by_devno == by_name == ["/dev/nvme0n1p1 is mounted on /data"]


def test_swap_is_found_through_the_resolver() -> None:
    swaps = "Filename\tType\tSize\tUsed\tPriority\n/dev/disk/by-uuid/abc partition 1024 0 -2\n"
    assert usage_reasons([BlockDev("nvme1n1")], swaps=swaps) == []
    got = usage_reasons([BlockDev("nvme1n1")], swaps=swaps, resolve=lambda p: "/dev/nvme1n1")
    assert got == ["/dev/nvme1n1 is in use as swap"]


def test_holders_name_their_kind() -> None:
    got = usage_reasons([BlockDev("nvme0n1", holders=(("dm-0", "vg-root"), ("md127", None), ("dm-3", None)))])
    assert got == ["/dev/nvme0n1 is held by dm-0: device-mapper 'vg-root' (LVM, dm-crypt, multipath...)",
                   "/dev/nvme0n1 is held by md127: md RAID",
                   "/dev/nvme0n1 is held by dm-3: device-mapper (LVM, dm-crypt, multipath...)"]


# --------------------------------------------------------------------------- who has the device files open


class Tree:
    """A fake /sys and /proc. Device files are plain files under dev/; ``stat`` gives them the
    type and number a real node would have, so matching goes by device number, not by name."""

    def __init__(self, root: Path) -> None:
        self.root, self.sys, self.proc, self.dev = root, root / "sys", root / "proc", root / "dev"
        self.nodes: dict[str, tuple[int, int]] = {}     # dev path -> (S_IFBLK/S_IFCHR, rdev)
        self.proc.mkdir()
        self.dev.mkdir()

    def _file(self, p: Path, text: str) -> None:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")

    def node(self, path: str, block: bool, devno: str) -> str:
        major, minor = map(int, devno.split(":"))
        f = self.dev / path
        f.parent.mkdir(parents=True, exist_ok=True)
        f.touch()
        self.nodes[str(f)] = (stat.S_IFBLK if block else stat.S_IFCHR, os.makedev(major, minor))
        return str(f)

    def ctrl(self, name: str, devno: str) -> None:
        self._file(self.sys / "class/nvme" / name / "dev", devno)
        self.node(name, False, devno)

    def disk(self, ctrl: str, name: str, devno: str, nsid: int, ng: str | None = None) -> None:
        d = self.sys / "class/nvme" / ctrl / name
        self._file(d / "dev", devno)
        self._file(d / "nsid", str(nsid))
        (d / "holders").mkdir()
        blk = self.sys / "class/block"
        blk.mkdir(parents=True, exist_ok=True)
        (blk / name).symlink_to(d)
        self.node(name, True, devno)
        if ng:
            self._file(self.sys / "class/nvme-generic" / ng[0] / "dev", ng[1])
            self.node(ng[0], False, ng[1])

    def part(self, ctrl: str, disk: str, name: str, devno: str) -> None:
        d = self.sys / "class/nvme" / ctrl / disk / name
        self._file(d / "dev", devno)
        self._file(d / "partition", "1")
        (self.sys / "class/block" / name).symlink_to(d)
        self.node(name, True, devno)

    def subsys(self, name: str, ctrls: list[str]) -> None:
        d = self.sys / "class/nvme-subsystem" / name
        d.mkdir(parents=True)
        for c in ctrls:
            (d / c).symlink_to(self.sys / "class/nvme" / c)

    def process(self, pid: int, comm: str, *targets: str) -> None:
        d = self.proc / str(pid)
        self._file(d / "comm", comm)
        (d / "fd").mkdir()
        for fd, t in enumerate(targets):
            (d / "fd" / str(fd)).symlink_to(t)

    def stat(self, path: str) -> os.stat_result:
        real = os.path.realpath(path)
        if real in self.nodes:
            mode, rdev = self.nodes[real]
            return os.stat_result((mode | 0o600, 0, 0, 1, 0, 0, 0, 0, 0, 0), {"st_rdev": rdev})
        return os.stat(path)


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    t = Tree(tmp_path)
    t.ctrl("nvme0", "240:0")
    t.disk("nvme0", "nvme0n1", "259:0", 1, ng=("ng0n1", "241:0"))
    t.part("nvme0", "nvme0n1", "nvme0n1p1", "259:1")
    t.ctrl("nvme1", "240:1")
    t.disk("nvme1", "nvme1n1", "259:5", 1, ng=("ng1n1", "241:1"))
    return t


def _open_reasons(t: Tree, ctrl: str = "nvme0", blocks: tuple[str, ...] = ("nvme0n1", "nvme0n1p1")) -> list[str]:
    return open_reasons(device_nodes(ctrl, list(blocks), sysfs=t.sys), proc=t.proc, stat=t.stat)


def test_device_nodes_come_from_sysfs(tree: Tree) -> None:
    assert device_nodes("nvme0", ["nvme0n1", "nvme0n1p1"], sysfs=tree.sys) == [
        DevNode("nvme0", False, "240:0"), DevNode("nvme0n1", True, "259:0"),
        DevNode("ng0n1", False, "241:0"), DevNode("nvme0n1p1", True, "259:1")]


def test_a_non_exclusive_opener_of_the_namespace_is_named_with_its_pid(tree: Tree) -> None:
    tree.process(1234, "dd", str(tree.dev / "nvme0n1"), "pipe:[77]", "socket:[78]", str(tree.root / "file"))
    (tree.root / "file").touch()
    assert _open_reasons(tree) == ["/dev/nvme0n1 is open by pid 1234 (dd)"]


def test_a_partition_opener_is_reported(tree: Tree) -> None:
    tree.process(40, "postgres", str(tree.dev / "nvme0n1p1"), str(tree.dev / "nvme0n1p1"))
    assert _open_reasons(tree) == ["/dev/nvme0n1p1 is open by pid 40 (postgres)"]


def test_an_io_uring_passthrough_user_of_the_generic_device_is_reported(tree: Tree) -> None:
    tree.process(7, "fio", str(tree.dev / "ng0n1"))
    assert _open_reasons(tree) == ["/dev/ng0n1 is open by pid 7 (fio)"]


def test_an_admin_user_of_the_controller_char_device_is_reported(tree: Tree) -> None:
    tree.process(8, "smartd", str(tree.dev / "nvme0"))
    assert _open_reasons(tree) == ["/dev/nvme0 is open by pid 8 (smartd)"]


def test_matching_is_by_device_number_not_by_name(tree: Tree) -> None:
    # A node made elsewhere (a container's /dev, mknod) for the same device, and one named like ours
    # for another device.
    tree.process(9, "db", tree.node("container/disk", True, "259:0"))
    tree.process(10, "other", tree.node("x/nvme0n1", False, "259:0"))
    assert _open_reasons(tree) == ["/dev/nvme0n1 is open by pid 9 (db)"]


def test_unrelated_devices_are_not_reported(tree: Tree) -> None:
    tree.process(11, "dd", str(tree.dev / "nvme1n1"), str(tree.dev / "ng1n1"), str(tree.dev / "nvme1"))
    assert _open_reasons(tree) == []


def test_processes_that_exit_during_the_scan_are_skipped(tree: Tree) -> None:
    (tree.proc / "50").mkdir()                          # gone before its fd/ was read
    tree.process(51, "dd", str(tree.dev / "nvme0n1"))   # its fd closed, or it exited, before the stat
    tree.process(52, "dd", str(tree.dev / "nvme0n1"))   # exited after the stat, before its comm was read
    (tree.proc / "52" / "comm").unlink()

    def stat(path: str) -> os.stat_result:
        if path.startswith(str(tree.proc / "51")):
            raise ProcessLookupError(errno.ESRCH, "gone")
        return tree.stat(path)
    got = open_reasons(device_nodes("nvme0", ["nvme0n1"], sysfs=tree.sys), proc=tree.proc, stat=stat)
    assert got == ["/dev/nvme0n1 is open by pid 52 (?)"]


def test_a_process_whose_fds_cannot_be_read_is_reported_not_ignored(tree: Tree,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    tree.process(60, "sshd")
    tree.process(61, "dd", str(tree.dev / "nvme0n1"))
    listdir = os.listdir

    def denied(path: "str | os.PathLike[str]") -> list[str]:
        if str(path) == str(tree.proc / "60" / "fd"):
            raise PermissionError(errno.EACCES, "Permission denied")
        return listdir(path)
    monkeypatch.setattr(os, "listdir", denied)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert _open_reasons(tree) == ["/dev/nvme0n1 is open by pid 61 (dd)",
                                   "could not check pid 60 for open namespaces: permission denied (run as root)"]
    monkeypatch.setattr(os, "geteuid", lambda: 0)       # denied to root: an LSM, say
    assert _open_reasons(tree)[-1] == "could not check pid 60 for open namespaces: permission denied"


def test_a_denied_stat_falls_back_to_the_path_the_fd_names(tree: Tree) -> None:
    tree.process(70, "dd", str(tree.dev / "nvme0n1"))

    def stat(path: str) -> os.stat_result:
        if path.startswith(str(tree.proc)):
            raise PermissionError(errno.EACCES, "Permission denied")
        return tree.stat(path)
    got = open_reasons(device_nodes("nvme0", ["nvme0n1"], sysfs=tree.sys), proc=tree.proc, stat=stat)
    assert got == ["/dev/nvme0n1 is open by pid 70 (dd)"]


# --------------------------------------------------------------------------- other controllers of the subsystem


def test_a_controller_alone_in_its_subsystem_has_no_sibling_reasons(tree: Tree) -> None:
    tree.subsys("nvme-subsys0", ["nvme0"])
    tree.subsys("nvme-subsys1", ["nvme1"])
    assert sibling_reasons("nvme0", ["nvme0n1"], mountinfo="", sysfs=tree.sys, proc=tree.proc, stat=tree.stat) == []


def test_a_shared_subsystem_is_a_reason_unless_allowed(tree: Tree) -> None:
    tree.subsys("nvme-subsys0", ["nvme0", "nvme1"])
    kw = dict(mountinfo="", sysfs=tree.sys, proc=tree.proc, stat=tree.stat)
    assert sibling_reasons("nvme0", ["nvme0n1", "nvme0n1p1"], **kw) == [
        "controller nvme0 shares subsystem nvme-subsys0 with nvme1: its namespaces may be the same media"]
    assert sibling_reasons("nvme0", ["nvme0n1"], allow_shared=True, **kw) == []


def test_the_same_namespace_in_use_through_a_sibling_is_refused_even_when_sharing_is_allowed(tree: Tree) -> None:
    tree.subsys("nvme-subsys0", ["nvme0", "nvme1"])
    tree.part("nvme1", "nvme1n1", "nvme1n1p1", "259:6")
    tree.disk("nvme1", "nvme1n2", "259:7", 2)               # nsid 2: not one of nvme0's namespaces
    tree.process(80, "dd", str(tree.dev / "ng1n1"), str(tree.dev / "nvme1n2"))
    mountinfo = "30 1 259:6 / /srv rw - xfs /dev/nvme1n1p1 rw\n31 1 259:7 / /other rw - xfs /dev/nvme1n2 rw\n"
    got = sibling_reasons("nvme0", ["nvme0n1", "nvme0n1p1"], mountinfo=mountinfo, allow_shared=True,
                          sysfs=tree.sys, proc=tree.proc, stat=tree.stat)
    assert got == ["/dev/nvme1n1p1 is mounted on /srv (the same namespace, through nvme1 of nvme-subsys0)",
                   "/dev/ng1n1 is open by pid 80 (dd) (the same namespace, through nvme1 of nvme-subsys0)"]
