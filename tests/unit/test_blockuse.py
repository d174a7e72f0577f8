"""The one "controller in use" rule (p2phub.blockuse), as the doctor and `p2phub nvme bind` apply it."""

from __future__ import annotations

from p2phub.blockuse import BlockDev, usage_reasons

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
