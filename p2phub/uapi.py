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

STRUCTS: list[type[_Struct]] = [Info, NvmeOpen, NvmeDmaAlloc, NvmeDmaFree, NvmeIrqSet]
