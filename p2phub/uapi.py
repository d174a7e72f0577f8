"""Python mirror of kmod/uapi/p2phub.h, the ioctl ABI of /dev/p2phub.

Every struct here names its C twin in ``_c_name_``; tests/unit/test_uapi.py
compiles a probe against the header and compares every size and offset, and
every constant, so this file and the header cannot drift apart.
"""

from __future__ import annotations

import ctypes
import enum

ABI_VERSION = 1
DEVICE_PATH = "/dev/p2phub"

IOCTL_TYPE = 0xB9
IOCTL_BASE = 0x40


def _io(nr: int) -> int:
    """_IO(type, nr): no size or direction encoded (argsz travels in the struct)."""
    return (IOCTL_TYPE << 8) | nr


class Cap(enum.IntFlag):
    DMABUF_IMPORT = 1 << 0
    NVIDIA_P2P_BUILT = 1 << 1
    NVIDIA_P2P_LIVE = 1 << 2
    DMABUF_EXPORT = 1 << 3
    NVME = 1 << 4


# Constants checked against the header: python name -> C macro.
CONSTANTS: dict[str, str] = {
    "ABI_VERSION": "P2PHUB_ABI_VERSION",
    "IOCTL_TYPE": "P2PHUB_IOCTL_TYPE",
    "IOCTL_BASE": "P2PHUB_IOCTL_BASE",
    "GET_INFO": "P2PHUB_GET_INFO",
    "Cap.DMABUF_IMPORT": "P2PHUB_CAP_DMABUF_IMPORT",
    "Cap.NVIDIA_P2P_BUILT": "P2PHUB_CAP_NVIDIA_P2P_BUILT",
    "Cap.NVIDIA_P2P_LIVE": "P2PHUB_CAP_NVIDIA_P2P_LIVE",
    "Cap.DMABUF_EXPORT": "P2PHUB_CAP_DMABUF_EXPORT",
    "Cap.NVME": "P2PHUB_CAP_NVME",
}


class _Struct(ctypes.Structure):
    _c_name_ = ""

    @classmethod
    def new(cls, **fields: int) -> "_Struct":
        s = cls(**fields)
        s.argsz = ctypes.sizeof(cls)
        return s


class Info(_Struct):
    _c_name_ = "p2phub_info"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("abi_version", ctypes.c_uint32),
        ("max_regs_per_file", ctypes.c_uint32),
        ("caps", ctypes.c_uint64),
        ("version", ctypes.c_char * 32),
        ("reserved", ctypes.c_uint64 * 4),
    ]


GET_INFO = _io(IOCTL_BASE + 0)

STRUCTS: list[type[_Struct]] = [Info]
