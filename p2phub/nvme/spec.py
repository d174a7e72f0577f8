"""NVMe base specification pieces the engine needs (NVMe Base Spec 2.0).

Registers, opcodes, status codes and the Identify fields read, as explicit
offsets, masks and shifts (no bitfields), so the same numbers read the same
from C and Python.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

PAGE = 4096  # the memory page size the engine programs (CC.MPS = 0)

# Controller registers (offsets into BAR0).
REG_CAP = 0x00
REG_VS = 0x08
REG_INTMS = 0x0C
REG_INTMC = 0x10
REG_CC = 0x14
REG_CSTS = 0x1C
REG_AQA = 0x24
REG_ASQ = 0x28
REG_ACQ = 0x30
DOORBELL_BASE = 0x1000

# CAP fields.
CAP_MQES_MASK = 0xFFFF  # bits 15:0, zero-based
CAP_TO_SHIFT, CAP_TO_MASK = 24, 0xFF  # units of 500 ms
CAP_DSTRD_SHIFT, CAP_DSTRD_MASK = 32, 0xF  # stride = 4 << DSTRD
CAP_CSS_NVM = 1 << 37
CAP_MPSMIN_SHIFT, CAP_MPSMIN_MASK = 48, 0xF  # 2 ^ (12 + MPSMIN)
CAP_MPSMAX_SHIFT, CAP_MPSMAX_MASK = 52, 0xF

# CC fields.
CC_EN = 1 << 0
CC_CSS_SHIFT = 4
CC_MPS_SHIFT = 7
CC_SHN_SHIFT = 14
CC_IOSQES_SHIFT = 16
CC_IOCQES_SHIFT = 20
SQE_SIZE_LOG2 = 6  # 64-byte submission entries
CQE_SIZE_LOG2 = 4  # 16-byte completion entries

# CSTS fields.
CSTS_RDY = 1 << 0
CSTS_CFS = 1 << 1

# Admin opcodes.
ADM_DELETE_SQ = 0x00
ADM_CREATE_SQ = 0x01
ADM_DELETE_CQ = 0x04
ADM_CREATE_CQ = 0x05
ADM_IDENTIFY = 0x06
ADM_ABORT = 0x08
ADM_SET_FEATURES = 0x09
ADM_GET_FEATURES = 0x0A
ADM_ASYNC_EVENT = 0x0C

# NVM opcodes.
OPC_FLUSH = 0x00
OPC_WRITE = 0x01
OPC_READ = 0x02
OPC_WRITE_ZEROES = 0x08

OPCODE_NAMES = {
    (0, ADM_DELETE_SQ): "Delete I/O SQ", (0, ADM_CREATE_SQ): "Create I/O SQ",
    (0, ADM_DELETE_CQ): "Delete I/O CQ", (0, ADM_CREATE_CQ): "Create I/O CQ",
    (0, ADM_IDENTIFY): "Identify", (0, ADM_ABORT): "Abort",
    (0, ADM_SET_FEATURES): "Set Features", (0, ADM_GET_FEATURES): "Get Features",
    (0, ADM_ASYNC_EVENT): "Asynchronous Event Request",
    (1, OPC_FLUSH): "Flush", (1, OPC_WRITE): "Write", (1, OPC_READ): "Read",
    (1, OPC_WRITE_ZEROES): "Write Zeroes",
}

# Identify CNS values.
CNS_NAMESPACE = 0x00
CNS_CONTROLLER = 0x01
CNS_ACTIVE_NSIDS = 0x02

FEAT_NUMBER_OF_QUEUES = 0x07

# Identify Namespace: FLBAS bit 4 (metadata inline with the data), DPS bits 2:0 (PI type).
FLBAS_EXTENDED = 1 << 4
DPS_PIT_MASK = 0x7

# Status: the 15 bits above the phase tag in CQE DW3 (as the hot path reports them).
STATUS_SC_MASK = 0xFF
STATUS_SCT_SHIFT, STATUS_SCT_MASK = 8, 0x7
STATUS_MORE = 1 << 13
STATUS_DNR = 1 << 14

SCT_GENERIC = 0
SCT_COMMAND_SPECIFIC = 1
SCT_MEDIA = 2
SCT_PATH = 3
SCT_VENDOR = 7

SCT_NAMES = {0: "generic", 1: "command specific", 2: "media/data integrity", 3: "path", 7: "vendor"}

GENERIC_STATUS = {
    0x00: "Successful Completion",
    0x01: "Invalid Command Opcode",
    0x02: "Invalid Field in Command",
    0x03: "Command ID Conflict",
    0x04: "Data Transfer Error",
    0x05: "Commands Aborted due to Power Loss Notification",
    0x06: "Internal Error",
    0x07: "Command Abort Requested",
    0x08: "Command Aborted due to SQ Deletion",
    0x09: "Command Aborted due to Failed Fused Command",
    0x0A: "Command Aborted due to Missing Fused Command",
    0x0B: "Invalid Namespace or Format",
    0x0C: "Command Sequence Error",
    0x0D: "Invalid SGL Segment Descriptor",
    0x0F: "Invalid SGL Descriptor",
    0x13: "PRP Offset Invalid",
    0x15: "Operation Denied",
    0x1D: "Namespace is Write Protected",
    0x80: "LBA Out of Range",
    0x81: "Capacity Exceeded",
    0x82: "Namespace Not Ready",
    0x83: "Reservation Conflict",
}
COMMAND_SPECIFIC_STATUS = {
    0x00: "Completion Queue Invalid",
    0x01: "Invalid Queue Identifier",
    0x02: "Invalid Queue Size",
    0x03: "Abort Command Limit Exceeded",
    0x05: "Asynchronous Event Request Limit Exceeded",
    0x08: "Invalid Interrupt Vector",
    0x0B: "Invalid Namespace or Format",
    0x0C: "Invalid Queue Deletion",
    0x0D: "Feature Identifier Not Saveable",
    0x0F: "Feature Not Namespace Specific",
    0x80: "Conflicting Attributes",
    0x81: "Invalid Protection Information",
    0x82: "Attempted Write to Read Only Range",
}
MEDIA_STATUS = {
    0x80: "Write Fault",
    0x81: "Unrecovered Read Error",
    0x85: "Compare Failure",
    0x86: "Access Denied",
    0x87: "Deallocated or Unwritten Logical Block",
}

# Synthetic statuses the engine reports for commands that never completed
# on the controller (vendor-specific type, never produced by a device).
SYNTH_TIMEOUT = (SCT_VENDOR << STATUS_SCT_SHIFT) | 0xF0 | STATUS_DNR
SYNTH_RESET = (SCT_VENDOR << STATUS_SCT_SHIFT) | 0xF1 | STATUS_DNR


def status_fields(status: int) -> tuple[int, int, bool, bool]:
    """(sct, sc, dnr, more) of a 15-bit status."""
    return (
        (status >> STATUS_SCT_SHIFT) & STATUS_SCT_MASK,
        status & STATUS_SC_MASK,
        bool(status & STATUS_DNR),
        bool(status & STATUS_MORE),
    )


def status_str(status: int) -> str:
    """Human text for a status, e.g. 'LBA Out of Range (sct 0x0, sc 0x80)'."""
    if status == SYNTH_TIMEOUT:
        return "no completion before the deadline (engine timeout)"
    if status == SYNTH_RESET:
        return "command discarded by a controller reset"
    sct, sc, dnr, more = status_fields(status)
    table = {SCT_GENERIC: GENERIC_STATUS, SCT_COMMAND_SPECIFIC: COMMAND_SPECIFIC_STATUS,
             SCT_MEDIA: MEDIA_STATUS}.get(sct, {})
    name = table.get(sc, f"{SCT_NAMES.get(sct, 'reserved')} status 0x{sc:02x}")
    extra = ", DNR" if dnr else ""
    return f"{name} (sct 0x{sct:x}, sc 0x{sc:02x}{extra})"


def opcode_name(admin: bool, opc: int) -> str:
    return OPCODE_NAMES.get((0 if admin else 1, opc), f"opcode 0x{opc:02x}")


def sq_doorbell(qid: int, dstrd: int) -> int:
    return DOORBELL_BASE + (2 * qid) * (4 << dstrd)


def cq_doorbell(qid: int, dstrd: int) -> int:
    return DOORBELL_BASE + (2 * qid + 1) * (4 << dstrd)


@dataclass(frozen=True)
class Cap:
    """The fields of the CAP register the engine honours."""

    raw: int

    @property
    def mqes(self) -> int:
        """Maximum queue entries supported (1-based)."""
        return (self.raw & CAP_MQES_MASK) + 1

    @property
    def timeout_s(self) -> float:
        """Worst-case time for CSTS.RDY to change after CC.EN (CAP.TO)."""
        return ((self.raw >> CAP_TO_SHIFT) & CAP_TO_MASK) * 0.5

    @property
    def dstrd(self) -> int:
        return (self.raw >> CAP_DSTRD_SHIFT) & CAP_DSTRD_MASK

    @property
    def mpsmin(self) -> int:
        """Smallest memory page size, bytes."""
        return 1 << (12 + ((self.raw >> CAP_MPSMIN_SHIFT) & CAP_MPSMIN_MASK))

    @property
    def mpsmax(self) -> int:
        return 1 << (12 + ((self.raw >> CAP_MPSMAX_SHIFT) & CAP_MPSMAX_MASK))

    @property
    def nvm_css(self) -> bool:
        return bool(self.raw & CAP_CSS_NVM)


def _ascii(b: bytes) -> str:
    return b.decode("ascii", errors="replace").strip(" \x00")


@dataclass(frozen=True)
class IdentifyController:
    vid: int
    serial: str
    model: str
    firmware: str
    mdts: int  # 0 = no limit; else 2^mdts units of CAP.MPSMIN
    cntlid: int
    version: int
    nn: int  # number of namespaces (highest nsid)
    oncs: int  # optional NVM commands
    vwc: int

    @classmethod
    def parse(cls, data: bytes) -> "IdentifyController":
        vid, = struct.unpack_from("<H", data, 0)
        cntlid, = struct.unpack_from("<H", data, 78)
        ver, = struct.unpack_from("<I", data, 80)
        oncs, = struct.unpack_from("<H", data, 520)
        nn, = struct.unpack_from("<I", data, 516)
        return cls(
            vid=vid, serial=_ascii(data[4:24]), model=_ascii(data[24:64]),
            firmware=_ascii(data[64:72]), mdts=data[77], cntlid=cntlid, version=ver,
            nn=nn, oncs=oncs, vwc=data[525],
        )

    @property
    def supports_write_zeroes(self) -> bool:
        return bool(self.oncs & (1 << 3))

    def as_dict(self) -> dict:
        return {
            "vid": f"0x{self.vid:04x}", "serial": self.serial, "model": self.model,
            "firmware": self.firmware, "mdts": self.mdts, "cntlid": self.cntlid,
            "version": f"{self.version >> 16}.{(self.version >> 8) & 0xFF}.{self.version & 0xFF}",
            "namespaces": self.nn, "oncs": f"0x{self.oncs:04x}",
        }


@dataclass(frozen=True)
class IdentifyNamespace:
    nsid: int
    nsze: int  # blocks
    ncap: int
    nuse: int
    lba_size: int
    metadata_size: int
    flbas: int
    dps: int = 0
    lbads: int = 9
    fmt: int = 0

    @classmethod
    def parse(cls, nsid: int, data: bytes) -> "IdentifyNamespace":
        nsze, ncap, nuse = struct.unpack_from("<QQQ", data, 0)
        flbas = data[26]
        fmt = (flbas & 0xF) | (((flbas >> 5) & 0x3) << 4)
        ms, lbads, _rp = struct.unpack_from("<HBB", data, 128 + 4 * fmt)
        return cls(nsid=nsid, nsze=nsze, ncap=ncap, nuse=nuse, lba_size=1 << min(lbads, 63),
                   metadata_size=ms, flbas=flbas, dps=data[29], lbads=lbads, fmt=fmt)

    @property
    def extended_lba(self) -> bool:
        """FLBAS bit 4: metadata travels inline, at the end of each block's data."""
        return bool(self.flbas & FLBAS_EXTENDED)

    def unsupported(self) -> str:
        """Why the engine will not drive this namespace ('' when it will).

        The engine transfers nlb * lba_size bytes per command through PRPs and
        sets no metadata pointer: a format with metadata (inline: the device
        moves more bytes than the PRPs describe; separate: MPTR 0) or
        protection information would make the controller DMA where it must not.
        """
        desc = (f"LBA format {self.fmt}: {1 << min(self.lbads, 63)}-byte blocks + {self.metadata_size} "
                f"bytes of metadata{' (extended LBA)' if self.extended_lba else ''}, "
                f"protection information type {self.dps & DPS_PIT_MASK}")
        if self.lbads < 9 or self.lbads > 16:
            return f"{desc}: LBADS {self.lbads} is outside 9..16 (512 B .. 64 KiB blocks)"
        if self.metadata_size or self.extended_lba or self.dps & DPS_PIT_MASK:
            return (f"{desc}: metadata and protection information are not supported; "
                    "format the namespace without them (nvme format --lbaf=N with ms=0)")
        return ""

    @property
    def size_bytes(self) -> int:
        return self.nsze * self.lba_size

    def as_dict(self) -> dict:
        return {"nsid": self.nsid, "blocks": self.nsze, "lba_size": self.lba_size,
                "bytes": self.size_bytes, "metadata_size": self.metadata_size,
                "extended_lba": self.extended_lba, "protection_type": self.dps & DPS_PIT_MASK,
                "lba_format": self.fmt}


def command(opc: int, *, nsid: int = 0, prp1: int = 0, prp2: int = 0,
            cdw10: int = 0, cdw11: int = 0, cdw12: int = 0, cdw13: int = 0,
            cdw14: int = 0, cdw15: int = 0) -> list[int]:
    """A 64-byte submission entry as 16 dwords; the hot path fills in the CID."""
    return [opc, nsid, 0, 0, 0, 0,
            prp1 & 0xFFFFFFFF, prp1 >> 32, prp2 & 0xFFFFFFFF, prp2 >> 32,
            cdw10 & 0xFFFFFFFF, cdw11 & 0xFFFFFFFF, cdw12 & 0xFFFFFFFF,
            cdw13 & 0xFFFFFFFF, cdw14 & 0xFFFFFFFF, cdw15 & 0xFFFFFFFF]
