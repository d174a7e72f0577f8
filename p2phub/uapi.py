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

# NVMe controller ownership: P2PHUB_IOCTL_BASE + 16 .. + 31.
NVME_MAX_IRQS = 32
NVME_DMA_MAX_BUF = 4 << 20
NVME_DMA_MAX_TOTAL = 512 << 20
NVME_DMA_MAX_BUFS = 4096
NVME_MMAP_BAR0 = 0
NVME_MMAP_DMA_SHIFT = 32


class NvmeOpen(_Struct):
    _c_name_ = "p2phub_nvme_open"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("domain", ctypes.c_uint32),
        ("bus", ctypes.c_uint8),
        ("devfn", ctypes.c_uint8),
        ("__reserved0", ctypes.c_uint16),
        ("out_nr_irqs", ctypes.c_uint32),
        ("__reserved1", ctypes.c_uint32),
        ("out_bar0_size", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 2),
    ]


class NvmeDmaAlloc(_Struct):
    _c_name_ = "p2phub_nvme_dma_alloc"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("size", ctypes.c_uint64),
        ("out_dma_addr", ctypes.c_uint64),
        ("out_mmap_offset", ctypes.c_uint64),
        ("out_id", ctypes.c_uint32),
        ("__reserved", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 2),
    ]


class NvmeDmaFree(_Struct):
    _c_name_ = "p2phub_nvme_dma_free"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("__reserved", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 1),
    ]


class NvmeIrqSet(_Struct):
    _c_name_ = "p2phub_nvme_irq_set"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("vector", ctypes.c_uint32),
        ("eventfd", ctypes.c_int32),
        ("reserved", ctypes.c_uint64 * 1),
    ]


NVME_OPEN = _io(IOCTL_BASE + 16)
NVME_DMA_ALLOC = _io(IOCTL_BASE + 17)
NVME_DMA_FREE = _io(IOCTL_BASE + 18)
NVME_IRQ_SET = _io(IOCTL_BASE + 19)

CONSTANTS.update({
    "NVME_MAX_IRQS": "P2PHUB_NVME_MAX_IRQS",
    "NVME_DMA_MAX_BUF": "P2PHUB_NVME_DMA_MAX_BUF",
    "NVME_DMA_MAX_TOTAL": "P2PHUB_NVME_DMA_MAX_TOTAL",
    "NVME_DMA_MAX_BUFS": "P2PHUB_NVME_DMA_MAX_BUFS",
    "NVME_MMAP_BAR0": "P2PHUB_NVME_MMAP_BAR0",
    "NVME_MMAP_DMA_SHIFT": "P2PHUB_NVME_MMAP_DMA_SHIFT",
    "NVME_OPEN": "P2PHUB_NVME_OPEN",
    "NVME_DMA_ALLOC": "P2PHUB_NVME_DMA_ALLOC",
    "NVME_DMA_FREE": "P2PHUB_NVME_DMA_FREE",
    "NVME_IRQ_SET": "P2PHUB_NVME_IRQ_SET",
})

# ---------------------------------------------------------------- registrations

PROVIDER_DMABUF = 1
PROVIDER_NVIDIA = 2
REG_STATE_LIVE = 1
REG_STATE_REVOKED = 2
DMA_PAGES_MAX = 1 << 20

REGISTER_F_DMABUF = 1 << 0
REGISTER_F_NVIDIA = 1 << 1
REGISTER_F_DEVICE = 1 << 2
EXPORT_F_CLOEXEC = 1 << 0


class Register(_Struct):
    _c_name_ = "p2phub_register"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("fd", ctypes.c_int32),
        ("domain", ctypes.c_uint32),
        ("bus", ctypes.c_uint8),
        ("devfn", ctypes.c_uint8),
        ("__reserved0", ctypes.c_uint16),
        ("__reserved1", ctypes.c_uint32),
        ("va", ctypes.c_uint64),
        ("offset", ctypes.c_uint64),
        ("length", ctypes.c_uint64),
        ("out_handle", ctypes.c_uint64),
        ("out_page_size", ctypes.c_uint32),
        ("out_provider", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 2),
    ]


class Unregister(_Struct):
    _c_name_ = "p2phub_unregister"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("handle", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 1),
    ]


class RegInfo(_Struct):
    _c_name_ = "p2phub_reg_info"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("handle", ctypes.c_uint64),
        ("out_state", ctypes.c_uint32),
        ("out_provider", ctypes.c_uint32),
        ("out_generation", ctypes.c_uint64),
        ("out_length", ctypes.c_uint64),
        ("out_page_size", ctypes.c_uint32),
        ("out_nr_devices", ctypes.c_uint32),
        ("out_nr_exports", ctypes.c_uint32),
        ("out_nr_attached", ctypes.c_uint32),
        ("out_io_holds", ctypes.c_uint32),
        ("__reserved0", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 2),
    ]


class DmaPages(_Struct):
    _c_name_ = "p2phub_dma_pages"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("handle", ctypes.c_uint64),
        ("domain", ctypes.c_uint32),
        ("bus", ctypes.c_uint8),
        ("devfn", ctypes.c_uint8),
        ("__reserved0", ctypes.c_uint16),
        ("page_size", ctypes.c_uint32),
        ("count", ctypes.c_uint32),
        ("first", ctypes.c_uint64),
        ("addrs", ctypes.c_uint64),
        ("out_total", ctypes.c_uint64),
        ("out_generation", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 2),
    ]


class Export(_Struct):
    _c_name_ = "p2phub_export"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("handle", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 2),
    ]


REGISTER = _io(IOCTL_BASE + 1)
UNREGISTER = _io(IOCTL_BASE + 2)
REG_INFO = _io(IOCTL_BASE + 3)
DMA_PAGES = _io(IOCTL_BASE + 4)
EXPORT = _io(IOCTL_BASE + 5)

REG_STRUCTS: list[type[_Struct]] = [Register, Unregister, RegInfo, DmaPages, Export]

CONSTANTS.update({
    "PROVIDER_DMABUF": "P2PHUB_PROVIDER_DMABUF",
    "PROVIDER_NVIDIA": "P2PHUB_PROVIDER_NVIDIA",
    "REG_STATE_LIVE": "P2PHUB_REG_STATE_LIVE",
    "REG_STATE_REVOKED": "P2PHUB_REG_STATE_REVOKED",
    "DMA_PAGES_MAX": "P2PHUB_DMA_PAGES_MAX",
    "REGISTER_F_DMABUF": "P2PHUB_REGISTER_F_DMABUF",
    "REGISTER_F_NVIDIA": "P2PHUB_REGISTER_F_NVIDIA",
    "REGISTER_F_DEVICE": "P2PHUB_REGISTER_F_DEVICE",
    "EXPORT_F_CLOEXEC": "P2PHUB_EXPORT_F_CLOEXEC",
    "REGISTER": "P2PHUB_REGISTER",
    "UNREGISTER": "P2PHUB_UNREGISTER",
    "REG_INFO": "P2PHUB_REG_INFO",
    "DMA_PAGES": "P2PHUB_DMA_PAGES",
    "EXPORT": "P2PHUB_EXPORT",
})


STRUCTS: list[type[_Struct]] = [Info, NvmeOpen, NvmeDmaAlloc, NvmeDmaFree, NvmeIrqSet, *REG_STRUCTS]
