"""PCI function addresses: the one parser and formatter p2phub uses.

``PciAddress.parse("4:0.0")`` and ``PciAddress.parse("0000:04:00.0")`` are the
same function; ``str()`` is the kernel's spelling (``0000:04:00.0``), which is
also the name of the function's directory in /sys/bus/pci/devices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UsageError

# [domain:]bus:device.function; domains above 0xffff exist (VMD) and are spelled in full
_BDF = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


@dataclass(frozen=True)
class PciAddress:
    """A PCI function, domain:bus:device.function (``0000:00:04.0``)."""

    domain: int
    bus: int
    devfn: int

    @classmethod
    def parse(cls, value: "str | PciAddress") -> "PciAddress":
        if isinstance(value, PciAddress):
            return value
        if not isinstance(value, str):
            raise UsageError(f"not a PCI address: {value!r} (want DDDD:BB:DD.F)")
        m = _BDF.match(value.strip())
        if not m:
            raise UsageError(f"not a PCI address: {value!r} (want DDDD:BB:DD.F)")
        dom, bus, dev, fn = m.groups()
        if int(dev, 16) > 31:
            raise UsageError(f"not a PCI address: {value!r} (device above 0x1f)")
        return cls(int(dom or "0", 16), int(bus, 16), (int(dev, 16) << 3) | int(fn))

    @classmethod
    def is_canonical(cls, text: str) -> bool:
        """True for the kernel's own spelling (a sysfs directory name), nothing looser."""
        m = _BDF.match(text)
        return bool(m and m.group(1) and len(m.group(1)) >= 4 and text == text.lower()
                    and len(m.group(2)) == 2 and len(m.group(3)) == 2 and int(m.group(3), 16) <= 31)

    @property
    def device(self) -> int:
        return self.devfn >> 3

    @property
    def function(self) -> int:
        return self.devfn & 7

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.devfn >> 3:02x}.{self.devfn & 7}"


def normalize(value: "str | PciAddress") -> str:
    """The kernel's spelling of a PCI address; UsageError for anything that is not one."""
    return str(PciAddress.parse(value))
