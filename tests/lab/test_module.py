"""p2phub.ko as loaded by the lab: /dev/p2phub, GET_INFO, and argument validation."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import stat
import subprocess
import sys

import pytest

from p2phub import uapi
from p2phub.device import Device, get_info
from p2phub.errors import P2PHubOSError


def test_device_node_is_a_char_device() -> None:
    st = os.stat(uapi.DEVICE_PATH)
    assert stat.S_ISCHR(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660


def test_get_info_reports_abi_and_version() -> None:
    info = get_info()
    assert info.abi_version == uapi.ABI_VERSION
    assert info.version == open("/sys/module/p2phub/version").read().strip()
    assert info.max_regs_per_file > 0
    # Every bit the module reports is one user space knows about.
    assert int(info.caps) & ~sum(int(c) for c in uapi.Cap) == 0


def _raw_get_info(arg: uapi.Info) -> int:
    with Device() as dev:
        try:
            fcntl.ioctl(dev.fd, uapi.GET_INFO, arg, True)
        except OSError as exc:
            return exc.errno or 0
    return 0


def test_get_info_rejects_short_argsz() -> None:
    arg = uapi.Info.new()
    arg.argsz = 8
    assert _raw_get_info(arg) == errno.EINVAL


def test_get_info_rejects_unknown_flags() -> None:
    arg = uapi.Info.new(flags=1)
    assert _raw_get_info(arg) == errno.EINVAL


def test_get_info_rejects_nonzero_reserved() -> None:
    arg = uapi.Info.new()
    arg.reserved[3] = 1
    assert _raw_get_info(arg) == errno.EINVAL


@pytest.mark.parametrize("field", ["abi_version", "max_regs_per_file", "caps"])
def test_get_info_refuses_an_output_that_comes_in_nonzero(field: str) -> None:
    arg = uapi.Info.new()
    setattr(arg, field, 1)
    assert _raw_get_info(arg) == errno.EINVAL


def test_reg_info_refuses_every_output_that_comes_in_nonzero() -> None:
    """The UAPI's one rule for outputs: 0 on input, on every ioctl."""
    from p2phub.hostmem import VgemBuffer
    from p2phub.hub import Hub

    outputs = [f for f, *_ in uapi.RegInfo._fields_ if f.startswith("out_")]
    assert len(outputs) == 10
    with Hub() as hub, VgemBuffer(64 * 1024) as buf, hub.register_dmabuf(buf.fd) as reg:
        for field in outputs:
            a = uapi.RegInfo.new(handle=reg.handle)
            setattr(a, field, 1)
            with pytest.raises(OSError) as e:
                fcntl.ioctl(hub.device.fd, uapi.REG_INFO, a, True)
            assert e.value.errno == errno.EINVAL, field
        a = uapi.RegInfo.new(handle=reg.handle)
        fcntl.ioctl(hub.device.fd, uapi.REG_INFO, a, True)
        assert a.out_length == 64 * 1024
        # A cache hit checks the live handle with REG_INFO: twice, so the second call's
        # argument must not carry the first call's outputs.
        for _ in range(2):
            with hub.register_dmabuf(buf.fd) as again:
                assert again.handle == reg.handle


def test_get_info_accepts_a_longer_zeroed_struct_and_refuses_a_dirty_tail() -> None:
    class Longer(ctypes.Structure):
        _fields_ = [("info", uapi.Info), ("tail", ctypes.c_uint64 * 2)]

    arg = Longer()
    arg.info.argsz = ctypes.sizeof(Longer)
    assert _raw_get_info(arg) == 0
    assert arg.info.abi_version == uapi.ABI_VERSION
    assert arg.info.argsz == ctypes.sizeof(uapi.Info)  # the size the kernel filled in
    arg.info.argsz = ctypes.sizeof(Longer)
    arg.tail[1] = 7
    assert _raw_get_info(arg) == errno.E2BIG


def test_get_info_bad_pointer_is_efault() -> None:
    with Device() as dev:
        with pytest.raises(OSError) as exc:
            fcntl.ioctl(dev.fd, uapi.GET_INFO, 16)  # an address nobody mapped
        assert exc.value.errno == errno.EFAULT


def test_unknown_ioctl_is_enotty() -> None:
    with Device() as dev:
        arg = uapi.Info.new()
        with pytest.raises(P2PHubOSError) as exc:
            dev.ioctl(uapi._io(0xFF), arg, "bogus ioctl")
        assert exc.value.errno == errno.ENOTTY
        assert "ENOTTY" in str(exc.value)


def test_cli_info_json() -> None:
    res = subprocess.run([sys.executable, "-m", "p2phub", "info", "--json"],
                         capture_output=True, text=True, check=True)
    doc = json.loads(res.stdout)
    assert doc["loaded"] is True
    assert doc["abi_version"] == uapi.ABI_VERSION


def test_many_opens_and_closes_leave_nothing_behind() -> None:
    refs = int(open("/sys/module/p2phub/refcnt").read())
    for _ in range(200):
        with Device() as dev:
            dev.info()
    assert int(open("/sys/module/p2phub/refcnt").read()) == refs
