"""Python mirror of kmod/uapi/p2phub.h, the ioctl ABI of /dev/p2phub.

Every struct here names its C twin in ``_c_name_``; tests/unit/test_uapi.py
compiles a probe against the header and compares every size and offset, and
every constant, so this file and the header cannot drift apart.
"""

from __future__ import annotations

import ctypes
import enum

from .errors import UsageError

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


_INT_RANGES: dict[type, tuple[int, int]] = {
    ctypes.c_uint8: (0, (1 << 8) - 1), ctypes.c_uint16: (0, (1 << 16) - 1),
    ctypes.c_uint32: (0, (1 << 32) - 1), ctypes.c_uint64: (0, (1 << 64) - 1),
    ctypes.c_int8: (-(1 << 7), (1 << 7) - 1), ctypes.c_int16: (-(1 << 15), (1 << 15) - 1),
    ctypes.c_int32: (-(1 << 31), (1 << 31) - 1), ctypes.c_int64: (-(1 << 63), (1 << 63) - 1),
}


def _check_value(struct_name: str, name: str, ctype: type, value: object) -> None:
    """Raise UsageError where ctypes would silently truncate or wrap `value`."""
    if isinstance(ctype, type) and issubclass(ctype, ctypes.Array):
        elem = ctype._type_  # type: ignore[attr-defined]
        if elem is ctypes.c_char:
            if isinstance(value, (bytes, bytearray)) and len(value) > ctype._length_:  # type: ignore[attr-defined]
                raise UsageError(f"{struct_name}.{name}: {len(value)} bytes do not fit in {ctype._length_}")  # type: ignore[attr-defined]
            return
        if isinstance(value, ctypes.Array):
            return
        items = list(value)  # type: ignore[call-overload]
        if len(items) > ctype._length_:  # type: ignore[attr-defined]
            raise UsageError(f"{struct_name}.{name}: {len(items)} values do not fit in {ctype._length_}")  # type: ignore[attr-defined]
        for i, v in enumerate(items):
            _check_value(struct_name, f"{name}[{i}]", elem, v)
        return
    bounds = _INT_RANGES.get(ctype)
    if bounds is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{struct_name}.{name}: {value!r} is not an integer")
    lo, hi = bounds
    if not lo <= value <= hi:
        raise UsageError(f"{struct_name}.{name}: {value} is outside {lo}..{hi} ({ctype.__name__})")


class _Struct(ctypes.Structure):
    """A UAPI struct whose fields refuse values that do not fit (never truncated silently)."""

    _c_name_ = ""

    def __init__(self, **fields: object) -> None:
        super().__init__()
        for name, value in fields.items():
            setattr(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        types = type(self)._field_types()
        if name in types:
            _check_value(self._c_name_, name, types[name], value)
        elif not name.startswith("_"):
            raise UsageError(f"struct {self._c_name_} has no field {name!r}")
        super().__setattr__(name, value)

    @classmethod
    def _field_types(cls) -> dict[str, type]:
        cached = cls.__dict__.get("_types_cache_")
        if cached is None:
            cached = {f[0]: f[1] for f in cls._fields_}  # type: ignore[attr-defined]
            cls._types_cache_ = cached  # type: ignore[attr-defined]
        return cached

    @classmethod
    def new(cls, **fields: object) -> "_Struct":
        """The struct with argsz set and `fields` assigned, each checked against its C type."""
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
        ("out_bar0_mmap_size", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 1),
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


# Registrations held by a controller, and the status page (revocation without a system call).
NVME_MAX_MAPS = 256
NVME_MMAP_STATUS = 1 << 31
NVME_STATUS_ABI = 1
NVME_ST_FENCED = 1 << 0
NVME_ST_REMOVING = 1 << 1
NVME_ST_ERROR = 1 << 2
NVME_ST_REVOKED = 1 << 3


class NvmeStatus(ctypes.Structure):
    """The read-only status page (mmap NVME_MMAP_STATUS); read in place, never passed to an ioctl."""

    _c_name_ = "p2phub_nvme_status"
    _fields_ = [
        ("abi", ctypes.c_uint32),
        ("state", ctypes.c_uint32),
        ("events", ctypes.c_uint64),
        ("reg_gen", ctypes.c_uint64 * NVME_MAX_MAPS),
    ]


class NvmeMapReg(_Struct):
    _c_name_ = "p2phub_nvme_map_reg"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("handle", ctypes.c_uint64),
        ("addrs", ctypes.c_uint64),
        ("first", ctypes.c_uint64),
        ("count", ctypes.c_uint32),
        ("page_size", ctypes.c_uint32),
        ("out_total", ctypes.c_uint64),
        ("out_generation", ctypes.c_uint64),
        ("out_slot", ctypes.c_uint32),
        ("__reserved", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 2),
    ]


class NvmeUnmapReg(_Struct):
    _c_name_ = "p2phub_nvme_unmap_reg"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("handle", ctypes.c_uint64),
        ("reserved", ctypes.c_uint64 * 1),
    ]


class NvmeResume(_Struct):
    _c_name_ = "p2phub_nvme_resume"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 1),
    ]


class NvmeReqSet(_Struct):
    _c_name_ = "p2phub_nvme_req_set"
    _fields_ = [
        ("argsz", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("eventfd", ctypes.c_int32),
        ("__reserved", ctypes.c_uint32),
        ("reserved", ctypes.c_uint64 * 1),
    ]


NVME_OPEN = _io(IOCTL_BASE + 16)
NVME_DMA_ALLOC = _io(IOCTL_BASE + 17)
NVME_DMA_FREE = _io(IOCTL_BASE + 18)
NVME_IRQ_SET = _io(IOCTL_BASE + 19)
NVME_MAP_REG = _io(IOCTL_BASE + 20)
NVME_UNMAP_REG = _io(IOCTL_BASE + 21)
NVME_RESUME = _io(IOCTL_BASE + 22)
NVME_REQ_SET = _io(IOCTL_BASE + 23)

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
    "NVME_MAX_MAPS": "P2PHUB_NVME_MAX_MAPS",
    "NVME_MMAP_STATUS": "P2PHUB_NVME_MMAP_STATUS",
    "NVME_STATUS_ABI": "P2PHUB_NVME_STATUS_ABI",
    "NVME_ST_FENCED": "P2PHUB_NVME_ST_FENCED",
    "NVME_ST_REMOVING": "P2PHUB_NVME_ST_REMOVING",
    "NVME_ST_ERROR": "P2PHUB_NVME_ST_ERROR",
    "NVME_ST_REVOKED": "P2PHUB_NVME_ST_REVOKED",
    "NVME_MAP_REG": "P2PHUB_NVME_MAP_REG",
    "NVME_UNMAP_REG": "P2PHUB_NVME_UNMAP_REG",
    "NVME_RESUME": "P2PHUB_NVME_RESUME",
    "NVME_REQ_SET": "P2PHUB_NVME_REQ_SET",
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
REG_INFO_F_READ_ONLY = 1 << 0
REG_INFO_F_REVOCABLE = 1 << 1


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
        ("out_flags", ctypes.c_uint32),
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
    "REG_INFO_F_READ_ONLY": "P2PHUB_REG_INFO_F_READ_ONLY",
    "REG_INFO_F_REVOCABLE": "P2PHUB_REG_INFO_F_REVOCABLE",
    "REGISTER": "P2PHUB_REGISTER",
    "UNREGISTER": "P2PHUB_UNREGISTER",
    "REG_INFO": "P2PHUB_REG_INFO",
    "DMA_PAGES": "P2PHUB_DMA_PAGES",
    "EXPORT": "P2PHUB_EXPORT",
})


NVME_STRUCTS: list[type[ctypes.Structure]] = [NvmeOpen, NvmeDmaAlloc, NvmeDmaFree, NvmeIrqSet, NvmeMapReg,
                                              NvmeUnmapReg, NvmeResume, NvmeReqSet]

# Every mirrored struct; the status page is the one without argsz/flags (it is no ioctl argument).
STRUCTS: list[type[ctypes.Structure]] = [Info, *NVME_STRUCTS, NvmeStatus, *REG_STRUCTS]
IOCTL_STRUCTS: list[type[ctypes.Structure]] = [Info, *NVME_STRUCTS, *REG_STRUCTS]
