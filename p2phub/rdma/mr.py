"""Memory regions of p2phub registrations, on the best path the NIC supports.

Paths, best first:
  DMABUF    ibv_reg_dmabuf_mr on the registration's dma-buf, at the buffer's own address;
  PEERMEM   a VA MR on GPU memory, resolved by nvidia_peermem;
  HOST_VA   a VA MR on a CPU mapping of host-backed memory: the source's own (a udmabuf's
            memfd), else p2phub's mmap of the registration's export (vgem and any other
            dma-buf with struct pages);
and otherwise an error that names why and the doctor check that explains it. The path is
chosen by the Hub's policy (p2phub.policy) when the memory is first bound to the NIC
(``reg.bind(nic_target(name))``), and listed by ``hub.paths()``.

One more path for memory that is not a registration: FOREIGN_VA, a VA MR of host memory
the caller allocated (``ProtectionDomain.reg_va``), pinned by the NIC driver itself.
"""

from __future__ import annotations

import enum
import errno
from pathlib import Path
from typing import Any

from .._resource import Resource
from ..errors import P2PHubOSError, RevokedError, UsageError
from ..memory import Memory, NicTarget, PathKind
from . import verbs
from .probe import dmabuf_mr_support
from .verbs import Access

DOCTOR_CHECK = "nic.dmabuf_mr"


class MrPath(enum.Enum):
    DMABUF = "dma-buf MR"
    PEERMEM = "peer-memory VA MR"
    HOST_VA = "CPU-mapped VA MR"
    FOREIGN_VA = "VA MR of caller-owned host memory"


IB_CLASS = "/sys/class/infiniband"


def _check_rdma_device(name: str) -> None:
    """UsageError naming the RDMA devices there are when `name` is not one of them; the
    package to install when pyverbs is missing."""
    import os

    from ..deps import require

    have = sorted(os.listdir(IB_CLASS)) if os.path.isdir(IB_CLASS) else []
    if name not in have:
        raise UsageError(f"no RDMA device {name!r} on this host "
                         f"({'it has ' + ', '.join(have) if have else f'{IB_CLASS} is empty or absent'})")
    require("pyverbs.device")


class ProtectionDomain(Resource):
    """A pyverbs Context and PD on one RDMA device, known by name (for the probe)."""

    def __init__(self, device: str) -> None:
        _check_rdma_device(device)
        from pyverbs.device import Context
        from pyverbs.pd import PD

        self.device = device
        self.ctx = Context(name=device)
        self.pd = PD(self.ctx)
        self._verbs_pd: verbs.VerbsPd | None = None

    def reg_mr(self, reg: Memory, access: Access | None = None) -> "MemoryRegion":
        """An RDMA memory region of registration `reg`, by the best path the NIC supports.

        `access` grants the NIC rights on the memory: local write only by default, so the
        rkey lets a peer do nothing; ask for ``Access.REMOTE_WRITE`` (a peer's RDMA WRITE
        target) and/or ``Access.REMOTE_READ`` (a peer's RDMA READ source) as the role needs.
        ``mr.path`` says which path was taken (dma-buf MR, peer-memory VA MR, CPU-mapped
        VA MR). The MR keeps `reg` from closing (EBUSY) until it is closed itself, and is
        closed with it by close(force=True) or Hub.close().
        """
        if reg.closed:
            raise UsageError(f"{reg} is closed")
        mr = register_mr(reg, self, access)
        reg.add_dependent(mr)
        return mr

    def reg_va(self, addr: int, length: int, access: Access | None = None) -> "MemoryRegion":
        """A VA MR of host memory p2phub did not allocate (a numpy array, an mmap): the NIC
        driver pins the pages for the MR's lifetime. The caller keeps the memory alive and
        mapped until the MR is closed. ``registration`` is None; `access` as for reg_mr."""
        if addr <= 0 or length <= 0:
            raise UsageError(f"reg_va: address {addr:#x} and length {length} must be > 0")
        from pyverbs.mr import MR
        from pyverbs.pyverbs_error import PyverbsRDMAError

        bits = mr_access(access)
        try:
            mr = MR(self.pd, length, bits, address=addr)
        except PyverbsRDMAError as exc:
            raise P2PHubOSError(exc.error_code or errno.EIO,
                                f"VA MR of {addr:#x}+{length} on {self.device}",
                                "the NIC driver could not pin that host range") from None
        return MemoryRegion(None, self, MrPath.FOREIGN_VA, addr, mr.lkey, mr.rkey,
                            "host memory the caller owns", [mr], mr.close, length=length)

    def verbs_pd(self) -> verbs.VerbsPd:
        """The same kernel PD, imported into libibverbs for the calls pyverbs lacks."""
        if self._verbs_pd is None:
            self._verbs_pd = verbs.VerbsPd.import_from(self.ctx.cmd_fd, self.pd.handle)
        return self._verbs_pd

    def _close(self) -> None:
        if self._verbs_pd is not None:
            self._verbs_pd.close()
            self._verbs_pd = None
        self.pd.close()
        self.ctx.close()


class MemoryRegion(Resource):
    """An MR over a whole registration. ``addr`` is the address peers use in RDMA requests."""

    def __init__(self, reg: "Memory | None", pd: ProtectionDomain, path: MrPath, addr: int,
                 lkey: int, rkey: int, reason: str, keep: list[Any], release,
                 length: int | None = None) -> None:
        self.registration = reg
        self.pd = pd
        self.path = path
        self.addr = addr
        self.length = reg.length if reg is not None else int(length or 0)
        self.lkey = lkey
        self.rkey = rkey
        self.reason = reason      # why this path was chosen
        self._keep = keep         # the pyverbs MR / mapping the MR depends on
        self._unregister = release

    def check(self) -> None:
        """Raise RevokedError when the registration's memory was revoked (the MR is dead)."""
        if self._closed:
            raise UsageError(f"{self} is closed")
        if self.registration is None:
            return
        if self.registration.closed:
            raise UsageError(f"{self}: its registration is closed")
        if self.registration.info().revoked:
            self.close()
            raise RevokedError(f"{self}: the registration's memory was revoked; the MR is closed")

    def _close(self) -> None:
        self._closed = True  # even if the release below fails: never release twice
        self._unregister()
        self._keep.clear()

    def __repr__(self) -> str:
        return (f"<MemoryRegion {self.path.value} on {self.pd.device} addr={self.addr:#x} "
                f"len={self.length} lkey={self.lkey:#x} rkey={self.rkey:#x}>")


def _peermem_loaded() -> bool:
    return Path("/sys/module/nvidia_peermem").exists()


def mr_access(access: Access | int | None) -> int:
    """The IBV_ACCESS_* bits of an MR: local write unless more is asked for. Verbs refuses
    remote write without local write, so asking for the first brings the second."""
    if access is None:
        return int(Access.LOCAL_WRITE)
    if access < 0 or access & ~verbs._KNOWN_ACCESS:
        raise UsageError(f"MR access {access!r}: not a set of IBV_ACCESS_* bits "
                         "(use p2phub.rdma.Access)")
    if access & Access.REMOTE_WRITE:
        access |= Access.LOCAL_WRITE
    return int(access)


def nic_target(device: str) -> NicTarget:
    """The facts an MR path on RDMA device `device` depends on (probed once per device)."""
    ok, evidence = dmabuf_mr_support(device)
    return NicTarget(device, ok, evidence, _peermem_loaded())


def register_mr(reg: Memory, pd: ProtectionDomain,
                access: Access | int | None = None) -> MemoryRegion:
    if not isinstance(pd, ProtectionDomain):
        raise UsageError(f"pd must be a p2phub.rdma.ProtectionDomain, not {type(pd).__name__}")
    if not isinstance(reg, Memory):
        raise UsageError(f"an MR needs memory registered with a Hub, not {type(reg).__name__}")
    access = mr_access(access)
    if reg.info().revoked:
        raise RevokedError(f"{reg}: revoked; cannot make an MR of it")

    path = reg.bind(nic_target(pd.device)).path   # the Hub's policy: raises naming why
    reason = path.reason

    if path.kind is PathKind.DMABUF_MR:
        vpd = pd.verbs_pd()
        fd = reg.dmabuf_fd
        gpu = reg.gpu
        iova = gpu.ptr if gpu is not None else 0
        cmr = vpd.reg_dmabuf_mr(0, reg.length, iova, fd, access)
        return MemoryRegion(reg, pd, MrPath.DMABUF, iova, cmr.lkey, cmr.rkey, reason, [],
                            lambda: verbs.VerbsPd.dereg_mr(cmr))

    from pyverbs.mr import MR

    if path.kind is PathKind.PEERMEM_MR:
        gpu = reg.gpu
        assert gpu is not None
        mr = MR(pd.pd, reg.length, access, address=gpu.ptr)
        return MemoryRegion(reg, pd, MrPath.PEERMEM, gpu.ptr, mr.lkey, mr.rkey, reason, [mr],
                            mr.close)

    # Host-backed memory: map it for the CPU and register that mapping (reg.mmap(): a
    # udmabuf's own memfd, p2phub's export of other dma-bufs, staged host memory's memfd);
    # pin_user_pages() accepts those pages (a vgem dma-buf's own mapping is PFN-mapped).
    try:
        m = reg.mmap()
    except P2PHubOSError as exc:
        raise P2PHubOSError(exc.errno or errno.EIO, f"mmap {reg}",
                            f"{reason}; and this memory has no CPU mapping p2phub can give "
                            "(no struct pages behind it), so no VA MR either "
                            f"(see `p2phub doctor --explain {DOCTOR_CHECK}`)") from None
    import ctypes

    from pyverbs.pyverbs_error import PyverbsRDMAError

    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    try:
        mr = MR(pd.pd, reg.length, access, address=addr)
    except PyverbsRDMAError as exc:
        m.close()
        err = exc.error_code or errno.EIO
        raise P2PHubOSError(err, f"VA MR on the CPU mapping of {reg}",
                            f"{reason}; and the NIC cannot pin this CPU mapping "
                            f"(see `p2phub doctor --explain {DOCTOR_CHECK}`)") from None

    def release() -> None:
        mr.close()
        m.close()

    return MemoryRegion(reg, pd, MrPath.HOST_VA, addr, mr.lkey, mr.rkey, reason, [mr, m], release)
