"""The one probe of dma-buf MR support, used by p2phub.rdma (before choosing an MR path) and by the
doctor's ``nic.dmabuf_mr`` check, so the two always agree.

The technique is NCCL's: register a dma-buf MR with fd -1 on a fresh PD. A provider without dma-buf
MR support fails with EOPNOTSUPP, ENOSYS or EPROTONOSUPPORT before it looks at the fd; one with it
gets as far as the fd and fails with EBADF (see ``verbs.VerbsPd.probe_dmabuf``).
"""

from __future__ import annotations

from typing import Any

from ..errors import P2PHubOSError
from . import verbs

_cache: dict[str, tuple[bool, str]] = {}


def dmabuf_mr_support(device: str) -> tuple[bool, str]:
    """(supported, evidence) for dma-buf MRs on RDMA device `device`; probed once per device."""
    if device not in _cache:
        pd = verbs.VerbsPd.open(device)
        try:
            _cache[device] = pd.probe_dmabuf()
        finally:
            pd.close()
    return _cache[device]


def probe_all() -> dict[str, Any]:
    """Every RDMA device's answer: {"devices": {name: True|False|None}, "evidence": {name: text}},
    or {"error": why} when libibverbs cannot be used at all. None: the device could not be opened."""
    try:
        names = verbs.device_names()
    except P2PHubOSError as exc:
        return {"error": str(exc)}
    except AttributeError as exc:  # cffi: a symbol missing from an old libibverbs
        return {"error": f"libibverbs lacks a symbol ({exc}); rdma-core >= 34 has ibv_reg_dmabuf_mr"}
    devices: dict[str, bool | None] = {}
    evidence: dict[str, str] = {}
    for name in names:
        try:
            devices[name], evidence[name] = dmabuf_mr_support(name)
        except P2PHubOSError as exc:
            devices[name], evidence[name] = None, str(exc)
        except AttributeError as exc:
            return {"error": f"libibverbs lacks a symbol ({exc}); rdma-core >= 34 has ibv_reg_dmabuf_mr"}
    return {"devices": devices, "evidence": evidence}
