"""PCI config-space parsing (capabilities, ACS, ATS, port type) and link speeds; the P2P path
classification over them is in ``route.py``."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

from ..capabilities import ECAP_ACS, acs_redirects

# --- config-space constants (PCI Express Base spec; names as in pci_regs.h) -------------------
CAP_ID_PCIE = 0x10
ECAP_AER = 0x0001
ECAP_ATS = 0x000F
ECAP_REBAR = 0x0015
ECAP_DPC = 0x001D

ACS_BITS = [("SV", "SrcValid"), ("TB", "TransBlk"), ("RR", "ReqRedir"), ("CR", "CmpltRedir"),
            ("UF", "UpstreamFwd"), ("EC", "EgressCtrl"), ("DT", "DirectTrans")]
ACS_TB = 1 << 1
ACS_DT = 1 << 6

PORT_TYPES = {0: "endpoint", 1: "legacy-endpoint", 4: "root-port", 5: "upstream-port",
              6: "downstream-port", 7: "pcie-to-pci-bridge", 8: "pci-to-pcie-bridge",
              9: "rc-integrated-endpoint", 10: "rc-event-collector"}

UNPRIVILEGED_CFG = 64  # sysfs returns only the header to readers without CAP_SYS_ADMIN


def acs_bits_str(value: int, lspci: bool = True) -> str:
    """ACS bits in lspci's ``SrcValid+ TransBlk- ...`` form (or short names)."""
    return " ".join(f"{(lng if lspci else sh)}{'+' if value & (1 << i) else '-'}"
                    for i, (sh, lng) in enumerate(ACS_BITS))


@dataclass
class ConfigSpace:
    """What the doctor learns from one device's config space."""

    size: int = 0
    reason: str | None = None      # why the extended space is unknown (None: it was read)
    pcie: bool = False
    port_type: str | None = None
    ext_read: bool = False         # extended capabilities could be walked (>= 4096 bytes read)
    ext_caps: list[int] = field(default_factory=list)
    acs_cap: int | None = None     # None: no ACS capability (or unknown, see ``reason``)
    acs_ctrl: int | None = None
    ats_cap: bool = False
    ats_enabled: bool | None = None
    ats_stu: int | None = None
    rebar: list[tuple[int, int]] = field(default_factory=list)  # (bar index, current size bytes)
    link_speed_code: int | None = None
    link_width: int | None = None

    @property
    def acs_known(self) -> bool:
        """ACS is known (present with a value, or known to be absent)."""
        return self.reason is None

    @property
    def acs_redirect(self) -> bool | None:
        if not self.acs_known:
            return None
        return acs_redirects(self.acs_ctrl)

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"size": self.size, "port_type": self.port_type}
        if self.reason:
            d["unknown_reason"] = self.reason
        d["acs"] = None if self.acs_ctrl is None else {
            "cap": f"0x{self.acs_cap or 0:04x}", "ctrl": f"0x{self.acs_ctrl:04x}",
            "ctrl_bits": acs_bits_str(self.acs_ctrl), "redirect": self.acs_redirect}
        d["ats"] = {"cap": self.ats_cap, "enabled": self.ats_enabled} if self.ats_cap else None
        return d


def _u16(b: bytes, off: int) -> int:
    return struct.unpack_from("<H", b, off)[0]


def _u32(b: bytes, off: int) -> int:
    return struct.unpack_from("<I", b, off)[0]


def parse_config(data: bytes | None, reason: str | None = None) -> ConfigSpace:
    """Parse a config-space dump as read from ``/sys/bus/pci/devices/<bdf>/config``."""
    cs = ConfigSpace()
    if data is None:
        cs.reason = reason or "config space unreadable"
        return cs
    cs.size = len(data)
    if len(data) <= UNPRIVILEGED_CFG:
        cs.reason = (f"only {len(data)} bytes of config space readable: capabilities need "
                     "CAP_SYS_ADMIN (run as root)")
        return cs
    # standard capability list
    status = _u16(data, 0x06)
    pcie_off = None
    if status & 0x10 and len(data) > 0x34:
        ptr = data[0x34] & 0xFC
        seen = 0
        while ptr and ptr + 2 <= len(data) and seen < 48:
            cap_id = data[ptr]
            if cap_id == CAP_ID_PCIE:
                pcie_off = ptr
            ptr = data[ptr + 1] & 0xFC
            seen += 1
    if pcie_off is not None and pcie_off + 0x14 <= len(data):
        cs.pcie = True
        flags = _u16(data, pcie_off + 0x02)
        cs.port_type = PORT_TYPES.get((flags >> 4) & 0xF, f"type-{(flags >> 4) & 0xF}")
        lnksta = _u16(data, pcie_off + 0x12)
        cs.link_speed_code = lnksta & 0xF
        cs.link_width = (lnksta >> 4) & 0x3F
    if len(data) < 4096:
        # conventional PCI or a function without extended space: no ACS/ATS exist
        cs.ext_read = False
        if cs.pcie and len(data) == 256:
            cs.ext_read = True  # PCIe function whose config is 256 bytes: no extended caps at all
        return cs
    cs.ext_read = True
    off = 0x100
    seen = 0
    while 0x100 <= off <= 4096 - 4 and seen < 128:
        hdr = _u32(data, off)
        if hdr in (0, 0xFFFFFFFF):
            break
        cap_id = hdr & 0xFFFF
        cs.ext_caps.append(cap_id)
        if cap_id == ECAP_ACS and off + 8 <= 4096:
            cs.acs_cap = _u16(data, off + 4)
            cs.acs_ctrl = _u16(data, off + 6)
        elif cap_id == ECAP_ATS and off + 8 <= 4096:
            cs.ats_cap = True
            ctrl = _u16(data, off + 6)
            cs.ats_enabled = bool(ctrl & 0x8000)
            cs.ats_stu = ctrl & 0x1F
        elif cap_id == ECAP_REBAR and off + 8 <= 4096:
            nbars = (_u32(data, off + 8) >> 5) & 0x7 or 1
            for i in range(min(nbars, 6)):
                ctl = _u32(data, off + 8 + 8 * i)
                cs.rebar.append((ctl & 0x7, 1 << (((ctl >> 8) & 0x3F) + 20)))
        nxt = (hdr >> 20) & 0xFFC
        if nxt <= off:  # lists only go forward; stop on loops
            break
        off = nxt
        seen += 1
    return cs


LINK_GTS = {"2.5": 2.5, "5.0": 5.0, "5": 5.0, "8.0": 8.0, "16.0": 16.0, "32.0": 32.0, "64.0": 64.0}


def link_gbps(speed: str | None, width: int | None) -> float | None:
    """Usable GB/s of a link from sysfs ``current_link_speed`` text and width."""
    if not speed or not width:
        return None
    try:
        gts = float(speed.split()[0])
    except (ValueError, IndexError):
        return None
    eff = 0.8 if gts <= 5.0 else (128 / 130 if gts < 64 else 242 / 256)
    return round(gts * eff * width / 8, 1)
