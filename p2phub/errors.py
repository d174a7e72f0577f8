"""Exceptions raised by p2phub. Each carries what a user needs to act on it."""

from __future__ import annotations

import errno as _errno
import os


class P2PHubError(Exception):
    """Base class of every p2phub error."""


class UsageError(P2PHubError, ValueError):
    """The caller asked for something that cannot be valid (bad range, wrong type)."""


class P2PHubOSError(P2PHubError, OSError):
    """A system call failed; ``errno`` is set and the message names the operation."""

    def __init__(self, err: int, what: str, detail: str = "") -> None:
        name = _errno.errorcode.get(err, str(err))
        msg = f"{what}: {name} ({os.strerror(err)})"
        if detail:
            msg += f": {detail}"
        OSError.__init__(self, err, msg)
        self.what = what
        self.detail = detail

    def __str__(self) -> str:  # OSError's str() would prefix "[Errno N]" twice
        return self.args[1]


class ModuleNotLoadedError(P2PHubError):
    """/dev/p2phub is missing: p2phub.ko is not loaded (see `p2phub doctor`, check kmod.loaded)."""


class RevokedError(P2PHubError):
    """The memory behind a registration was freed or moved by its owner."""


class StagedModeError(P2PHubError):
    """Asked for something only peer-to-peer mode has (DMA pages, a dma-buf export, an MR of
    GPU memory, an NVMe transfer straight into memory); the message says why it is staged."""

class MissingDependencyError(P2PHubError, ImportError):
    """An optional package (or the hardware) a call needs is not here; the message names it
    and how to get it: ``needs torch: pip install torch``."""

    def __init__(self, what: str, install: str) -> None:
        super().__init__(f"needs {what}: {install}")
        self.what = what
        self.install = install
