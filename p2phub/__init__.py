"""p2phub: one registration makes GPU memory usable by NVMe SSDs and RDMA NICs.

    from p2phub import Hub
    with Hub() as hub, hub.register(gpu_tensor) as reg:
        ...

The names below are imported on first use, so ``import p2phub`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Hub": "hub", "Registration": "hub", "RegInfo": "hub", "RegState": "hub", "Provider": "hub",
    "RegistrationUser": "hub",
    "PciAddress": "pci",
    "P2PHubError": "errors", "P2PHubOSError": "errors", "UsageError": "errors",
    "RevokedError": "errors", "ModuleNotLoadedError": "errors",
    "Udmabuf": "hostmem", "VgemBuffer": "hostmem",
    "ModuleInfo": "device", "get_info": "device",
    "StagedModeError": "errors", "StagedRegistration": "staged", "OrderingError": "ordering",
    "Memory": "memory", "MemPath": "memory", "PathKind": "memory",
    "StorageFile": "files",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .device import ModuleInfo, get_info
    from .files import StorageFile
    from .errors import (ModuleNotLoadedError, P2PHubError, P2PHubOSError, RevokedError,
                         StagedModeError, UsageError)
    from .hostmem import Udmabuf, VgemBuffer
    from .hub import Hub, Provider, RegInfo, Registration, RegistrationUser, RegState
    from .memory import Memory, MemPath, PathKind
    from .ordering import OrderingError
    from .pci import PciAddress
    from .staged import StagedRegistration


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'p2phub' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _init_logging() -> None:
    """The ``p2phub`` logger prints nothing unless asked (P2PHUB_LOG, or p2phub.log.configure)."""
    import logging
    import os

    logging.getLogger(__name__).addHandler(logging.NullHandler())
    if os.environ.get("P2PHUB_LOG"):
        from .log import configure
        configure()


_init_logging()
