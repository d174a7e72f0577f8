"""Argument types for the `p2phub` command line: each one checks its value while argparse
parses, so a bad argument is refused (exit 4, one line on stderr) before any work starts."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn

Bad = argparse.ArgumentTypeError

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class ToolParser(argparse.ArgumentParser):
    """argparse for the scripts under tools/: a bad argument is one line on stderr and exit 4,
    the code `p2phub` itself gives a usage error (p2phub.exitcodes.Exit.USAGE)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        sys.exit(4)


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer >= low."""
    def parse(text: str) -> int:
        try:
            v = int(text, 0)
        except ValueError:
            raise Bad(f"{text!r} is not an integer") from None
        if v < low:
            raise Bad(f"must be at least {low}, got {v}")
        return v
    parse.__name__ = f"integer >= {low}"
    return parse


positive = int_at_least(1)
non_negative = int_at_least(0)


def float_above(low: float, inclusive: bool = False) -> Callable[[str], float]:
    """A finite number > low (>= low with inclusive)."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise Bad(f"{text!r} is not a number") from None
        if v != v or v in (float("inf"), float("-inf")) or v < low or (v == low and not inclusive):
            raise Bad(f"must be {'at least' if inclusive else 'above'} {low:g}, got {text}")
        return v
    parse.__name__ = "number"
    return parse


seconds = float_above(0.0)
non_negative_seconds = float_above(0.0, inclusive=True)


def size_bytes(text: str) -> int:
    """A byte count: 4096, 64K, 1M, 2G (powers of 1024, an optional B or iB suffix)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = 1
    if t and t[-1] in _UNITS:
        t, mult = t[:-1], _UNITS[t[-1]]
    try:
        v = int(float(t) * mult)
    except ValueError:
        raise Bad(f"{text!r} is not a size (want e.g. 4096, 64K, 1M, 2G)") from None
    if v <= 0:
        raise Bad(f"{text!r}: a size must be above 0")
    return v


def comma_list(item: Callable[[str], object]) -> Callable[[str], str]:
    """A comma-separated list whose every item parses with `item`; the text is kept as given
    (commands split it themselves)."""
    def parse(text: str) -> str:
        parts = [p for p in text.split(",") if p.strip()]
        if not parts:
            raise Bad("an empty list")
        for p in parts:
            try:
                item(p)
            except Bad as exc:
                raise Bad(f"{p.strip()!r}: {exc}") from None
        return text
    parse.__name__ = "list"
    return parse


def hostport(allow_zero: bool) -> Callable[[str], str]:
    """HOST:PORT with a port in 1..65535 (0 too with allow_zero: any free port)."""
    low = 0 if allow_zero else 1

    def parse(text: str) -> str:
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit():
            raise Bad(f"{text!r}: want HOST:PORT")
        if not low <= int(port) <= 65535:
            raise Bad(f"{text!r}: port {int(port)} is not in {low}..65535")
        return text
    parse.__name__ = "HOST:PORT"
    return parse


def pci_address(text: str) -> str:
    """A PCI address in the kernel's spelling, from any spelling p2phub.pci accepts."""
    from ..errors import UsageError
    from ..pci import normalize
    try:
        return normalize(text)
    except UsageError as exc:
        raise Bad(str(exc)) from None


def nvme_controller(text: str) -> str:
    """An NVMe controller: its PCI address (0000:05:00.0, 05:00.0) or its device node
    (/dev/nvme0, /dev/nvme0n1, nvme0), given as the PCI address of a function this host has."""
    name = text.strip()
    if name.startswith("/dev/") or name.startswith("nvme"):
        ctrl = os.path.basename(name).split("n", 2)
        # nvme0 -> ["", "vme0"]; nvme0n1 -> ["", "vme0", "1"]
        if len(ctrl) < 2 or not ctrl[1].startswith("vme") or not ctrl[1][3:].isdigit():
            raise Bad(f"{text!r}: want a PCI address or /dev/nvmeN[nM]")
        kname = "nvme" + ctrl[1][3:]
        dev = Path("/sys/class/nvme") / kname / "device"
        try:
            bdf = os.path.basename(os.path.realpath(dev, strict=True))
        except OSError:
            raise Bad(f"{text!r}: no NVMe controller {kname} on this host "
                      f"(/sys/class/nvme/{kname} is absent)") from None
        return pci_address(bdf)
    bdf = pci_address(name)
    if not os.path.isdir(f"/sys/bus/pci/devices/{bdf}"):
        raise Bad(f"no PCI device {bdf} on this host")
    return bdf


def choice_list(choices: tuple[str, ...]) -> Callable[[str], str]:
    """A comma-separated subset of `choices`."""
    def parse(text: str) -> str:
        for m in (p.strip() for p in text.split(",")):
            if m and m not in choices:
                raise Bad(f"unknown {m!r} (choose from {', '.join(choices)})")
        return text
    parse.__name__ = "list"
    return parse


def size_text(text: str) -> str:
    """A byte count checked like size_bytes, kept as the text given."""
    size_bytes(text)
    return text


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_present() -> str | None:
    """The device node that shows a GPU driver is loaded (NVIDIA or AMD), None without one."""
    for node in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd"):
        if os.path.exists(node):
            return node
    return None


def new_file(text: str) -> str:
    """A file to write: its directory must exist and be writable."""
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise Bad(f"{text!r}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise Bad(f"{text!r}: directory {parent} is not writable")
    if os.path.isdir(text):
        raise Bad(f"{text!r} is a directory")
    return text
