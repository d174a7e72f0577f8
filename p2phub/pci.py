"""PCI function addresses: the one parser and formatter p2phub uses.

``PciAddress.parse("4:0.0")``, ``PciAddress.parse("00:04.0".upper())`` and
``PciAddress.parse("0000:04:00.0")`` are each one function; ``str()`` is the
kernel's spelling (``0000:04:00.0``), which is also the name of the function's
directory in /sys/bus/pci/devices. Every field is checked against the width the
UAPI gives it (domain u32, bus u8, devfn u8 = device 5 bits, function 3 bits), so
no value is silently truncated on its way into an ioctl argument.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UsageError

# [domain:]bus:device.function, any number of hex digits: the ranges are checked after the match
# so that an out-of-range field gets an error that names it. Domains above 0xffff exist (Intel
# VMD puts its child devices at 10000 and up) and sysfs spells them in full.
_BDF = re.compile(r"(?:([0-9a-f]+):)?([0-9a-f]+):([0-9a-f]+)\.([0-9a-f]+)", re.IGNORECASE)
# a PCI root bus directory in sysfs: /sys/devices/pci0000:00
_ROOT_BUS = re.compile(r"pci([0-9a-f]{4,8}):([0-9a-f]{2})")

DOMAIN_MAX = 0xFFFFFFFF   # struct p2phub_*: __u32 domain
BUS_MAX = 0xFF
DEVICE_MAX = 0x1F
FUNCTION_MAX = 7
WANT = "want [DDDD:]BB:DD.F, hex"


@dataclass(frozen=True)
class PciAddress:
    """A PCI function, domain:bus:device.function (``0000:00:04.0``)."""

    domain: int
    bus: int
    devfn: int

    @classmethod
    def parse(cls, value: "str | PciAddress") -> "PciAddress":
        """A PciAddress from its text, short (``0a:00.0``) or full, either case; UsageError,
        naming the text and the field, for anything else."""
        if isinstance(value, PciAddress):
            return value
        if not isinstance(value, str):
            raise UsageError(f"not a PCI address: {value!r} ({WANT})")
        m = _BDF.fullmatch(value.strip())
        if not m:
            raise UsageError(f"not a PCI address: {value!r} ({WANT})")
        dom, bus, dev, fn = (int(g or "0", 16) for g in m.groups())
        for field_name, v, top in (("domain", dom, DOMAIN_MAX), ("bus", bus, BUS_MAX),
                                   ("device number", dev, DEVICE_MAX), ("function", fn, FUNCTION_MAX)):
            if v > top:
                raise UsageError(f"not a PCI address: {value!r} ({field_name} {v:#x} is above {top:#x})")
        return cls(dom, bus, (dev << 3) | fn)

    @classmethod
    def is_canonical(cls, text: str) -> bool:
        """True for the kernel's own spelling (a sysfs directory name), nothing looser."""
        try:
            return str(cls.parse(text)) == text
        except UsageError:
            return False

    @property
    def device(self) -> int:
        return self.devfn >> 3

    @property
    def function(self) -> int:
        return self.devfn & 7

    def fields(self) -> dict[str, int]:
        """The address as the UAPI structs carry it: domain, bus, devfn."""
        return {"domain": self.domain, "bus": self.bus, "devfn": self.devfn}

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.devfn >> 3:02x}.{self.devfn & 7}"


def normalize(value: "str | PciAddress") -> str:
    """The kernel's spelling of a PCI address; UsageError for anything that is not one."""
    return str(PciAddress.parse(value))


def root_bus(name: str) -> PciAddress | None:
    """Device 00.0 on the root bus a sysfs directory names (``pci0000:00``), or None when
    `name` is not a root bus directory."""
    m = _ROOT_BUS.fullmatch(name)
    return PciAddress(int(m.group(1), 16), int(m.group(2), 16), 0) if m else None
