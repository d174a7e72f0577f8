"""The few libibverbs calls pyverbs cannot make for p2phub, bound with cffi (ABI mode).

pyverbs' DmaBufMR registers at an iova of its own choosing; p2phub registers
dma-buf MRs at the buffer's own address (so peers address GPU memory by its
pointer), which needs ibv_reg_dmabuf_mr itself. The MR is made on an imported
copy of the caller's pyverbs PD (ibv_import_device + ibv_import_pd), so it
belongs to the same kernel PD the caller's QPs use.
"""

from __future__ import annotations

import enum
import errno as _errno
import os
from functools import lru_cache

import cffi

from ..errors import P2PHubOSError, UsageError
from .._resource import Resource

CDEF = """
struct ibv_device;
struct ibv_context;
struct ibv_pd { struct ibv_context *context; uint32_t handle; };
struct ibv_mr {
    struct ibv_context *context;
    struct ibv_pd *pd;
    void *addr;
    size_t length;
    uint32_t handle;
    uint32_t lkey;
    uint32_t rkey;
};
struct ibv_device **ibv_get_device_list(int *num_devices);
void ibv_free_device_list(struct ibv_device **list);
const char *ibv_get_device_name(struct ibv_device *device);
struct ibv_context *ibv_open_device(struct ibv_device *device);
int ibv_close_device(struct ibv_context *context);
struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);
int ibv_dealloc_pd(struct ibv_pd *pd);
struct ibv_context *ibv_import_device(int cmd_fd);
struct ibv_pd *ibv_import_pd(struct ibv_context *context, uint32_t pd_handle);
void ibv_unimport_pd(struct ibv_pd *pd);
struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length,
                                 uint64_t iova, int fd, int access);
int ibv_dereg_mr(struct ibv_mr *mr);
"""


class Access(enum.IntFlag):
    """What an MR lets the NIC do with its memory (the IBV_ACCESS_* bits). A peer holding
    the rkey can reach the memory only in the remote ways granted here."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4


_KNOWN_ACCESS = 0x1FFF  # every IBV_ACCESS_* bit libibverbs defines today

ffi = cffi.FFI()
ffi.cdef(CDEF)


@lru_cache(maxsize=1)
def lib():
    try:
        return ffi.dlopen("libibverbs.so.1")
    except OSError as exc:
        raise P2PHubOSError(_errno.ENOENT, "load libibverbs.so.1", str(exc)) from None


def _err(what: str) -> P2PHubOSError:
    return P2PHubOSError(ffi.errno or _errno.EIO, what)


def check_dmabuf_args(offset: int, length: int, iova: int, fd: int, access: int) -> None:
    """Validate ibv_reg_dmabuf_mr arguments before they reach the provider."""
    if offset < 0 or length <= 0 or iova < 0:
        raise UsageError(f"dma-buf MR: offset={offset}, length={length}, iova={iova:#x} "
                         "(offset and iova must be >= 0, length > 0)")
    if offset + length > 1 << 64 or iova + length > 1 << 64:
        raise UsageError(f"dma-buf MR: offset={offset} / iova={iova:#x} + length={length} overflows")
    if (offset ^ iova) & 0xFFF:
        raise UsageError(f"dma-buf MR: offset={offset:#x} and iova={iova:#x} must agree in their "
                         "low 12 bits (same offset within a page)")
    if fd < -1:
        raise UsageError(f"dma-buf MR: fd={fd} is not a file descriptor")
    if access & ~_KNOWN_ACCESS:
        raise UsageError(f"dma-buf MR: unknown access bits {access & ~_KNOWN_ACCESS:#x}")


def device_names() -> list[str]:
    """The names of the RDMA devices libibverbs sees."""
    L = lib()
    n = ffi.new("int *")
    devs = L.ibv_get_device_list(n)
    if devs == ffi.NULL:
        raise _err("ibv_get_device_list")
    try:
        return [ffi.string(L.ibv_get_device_name(devs[i])).decode() for i in range(n[0])]
    finally:
        L.ibv_free_device_list(devs)


class VerbsPd(Resource):
    """A PD in C: opened from a device name, or imported from a pyverbs Context + PD."""

    def __init__(self, ctx, pd, imported: bool) -> None:
        self._ctx = ctx
        self._pd = pd
        self._imported = imported

    @classmethod
    def open(cls, device: str) -> "VerbsPd":
        L = lib()
        n = ffi.new("int *")
        devs = L.ibv_get_device_list(n)
        if devs == ffi.NULL:
            raise _err("ibv_get_device_list")
        try:
            for i in range(n[0]):
                if ffi.string(L.ibv_get_device_name(devs[i])).decode() == device:
                    ctx = L.ibv_open_device(devs[i])
                    if ctx == ffi.NULL:
                        raise _err(f"ibv_open_device({device})")
                    pd = L.ibv_alloc_pd(ctx)
                    if pd == ffi.NULL:
                        e = _err(f"ibv_alloc_pd({device})")
                        L.ibv_close_device(ctx)
                        raise e
                    return cls(ctx, pd, imported=False)
        finally:
            L.ibv_free_device_list(devs)
        raise P2PHubOSError(_errno.ENODEV, f"open RDMA device {device!r}", "no such device")

    @classmethod
    def import_from(cls, cmd_fd: int, pd_handle: int) -> "VerbsPd":
        L = lib()
        fd = os.dup(cmd_fd)
        ctx = L.ibv_import_device(fd)
        if ctx == ffi.NULL:
            e = _err("ibv_import_device")
            os.close(fd)
            raise e
        pd = L.ibv_import_pd(ctx, pd_handle)
        if pd == ffi.NULL:
            e = _err(f"ibv_import_pd(handle {pd_handle})")
            L.ibv_close_device(ctx)
            raise e
        return cls(ctx, pd, imported=True)

    def reg_dmabuf_mr(self, offset: int, length: int, iova: int, fd: int, access: int):
        check_dmabuf_args(offset, length, iova, fd, access)
        mr = lib().ibv_reg_dmabuf_mr(self._pd, offset, length, iova, fd, int(access))
        if mr == ffi.NULL:
            raise _err(f"ibv_reg_dmabuf_mr(fd {fd}, offset {offset}, length {length}, iova {iova:#x})")
        return mr

    @staticmethod
    def dereg_mr(mr) -> None:
        if lib().ibv_dereg_mr(mr):
            raise _err("ibv_dereg_mr")

    def probe_dmabuf(self) -> tuple[bool, str]:
        """NCCL's probe: register fd -1. EBADF means the provider got as far as the fd."""
        mr = lib().ibv_reg_dmabuf_mr(self._pd, 0, 4096, 0, -1, Access.LOCAL_WRITE)
        if mr != ffi.NULL:  # no provider should accept fd -1; do not leak it if one does
            lib().ibv_dereg_mr(mr)
            return True, "accepted fd -1"
        err = ffi.errno
        # Linux's ENOTSUP and EOPNOTSUPP are one number; providers mean the latter.
        name = "EOPNOTSUPP" if err == _errno.EOPNOTSUPP else _errno.errorcode.get(err, str(err))
        if err in (_errno.EOPNOTSUPP, _errno.ENOSYS, _errno.EPROTONOSUPPORT):
            return False, f"ibv_reg_dmabuf_mr: {name} (the provider has no dma-buf MR support)"
        return True, f"ibv_reg_dmabuf_mr(fd -1): {name}"

    def _close(self) -> None:
        L = lib()
        if self._pd is not None:
            if self._imported:
                L.ibv_unimport_pd(self._pd)
            else:
                L.ibv_dealloc_pd(self._pd)
            self._pd = None
        if self._ctx is not None:
            L.ibv_close_device(self._ctx)
            self._ctx = None
