"""The /dev/p2phub character device: open it, issue ioctls, read the module's info."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import resource
import stat
from dataclasses import dataclass, field

from . import uapi
from ._resource import Resource
from .errors import ModuleNotLoadedError, P2PHubOSError, UsageError

# The ioctls that map memory for a device, and what their EOPNOTSUPP means.
_MAPS = (uapi.REGISTER, uapi.DMA_PAGES, uapi.NVME_MAP_REG)
_MAP_REFUSED = ("the device cannot use this memory directly: its DMA would need bounce buffers or "
                "cache maintenance (swiotlb, a non-coherent or untrusted device), or the exporter "
                "cannot map it peer-to-peer; the kernel log names the reason")


PARAMS = "/sys/module/p2phub/parameters"
CAP_IPC_LOCK = 14


def _status_field(name: str) -> str:
    """A field of /proc/self/status ("" when absent)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == name:
                    return value.strip()
    except OSError:
        pass
    return ""


def memlock_detail(length: int) -> str:
    """Why REGISTER's ENOMEM is RLIMIT_MEMLOCK, with the figures; "" when the limit was not it.

    p2phub.ko charges every registration's bytes to the registering process's pinned memory
    (VmPin) against RLIMIT_MEMLOCK, as RDMA memory registrations are; CAP_IPC_LOCK lifts the limit.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    caps = _status_field("CapEff")
    if soft == resource.RLIM_INFINITY or (caps and int(caps, 16) >> CAP_IPC_LOCK & 1):
        return ""
    pinned_kib = int((_status_field("VmPin") or "0 kB").split()[0])
    page = os.sysconf("SC_PAGE_SIZE")
    want = pinned_kib * 1024 + -(-length // page) * page
    if want <= soft:
        return ""
    return (f"over RLIMIT_MEMLOCK: registering {length} bytes would pin {want >> 10} KiB for this "
            f"process (VmPin {pinned_kib} KiB now), its limit is {soft >> 10} KiB. Raise it with "
            f"`ulimit -l` (the hard limit as root, or memlock for group p2phub in "
            f"/etc/security/limits.d, docs/install.md), or run with CAP_IPC_LOCK")


def _module_param(name: str) -> int | None:
    try:
        with open(f"{PARAMS}/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def pinned_per_user_detail() -> str:
    """Why REGISTER failed with EDQUOT: p2phub.ko's per-user cap on pinned memory."""
    gib = _module_param("max_pinned_gib_per_user")
    limit = (f"the p2phub module parameter max_pinned_gib_per_user ({gib} GiB)" if gib
             else "this process's RLIMIT_MEMLOCK (`ulimit -l`; the module parameter "
                  "max_pinned_gib_per_user is 0)")
    return (f"over the per-user limit on pinned memory: this user's registrations, in all its "
            f"processes together, would pin more than {limit}. Close registrations, raise the limit "
            f"({PARAMS}/max_pinned_gib_per_user, docs/settings.md), or run with CAP_IPC_LOCK")


def files_limit_detail() -> str:
    """Why open(/dev/p2phub)'s EMFILE may be p2phub.ko's per-user limit ("" when not)."""
    limit = _module_param("max_files_per_user")
    if limit is None:
        return ""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and len(os.listdir("/proc/self/fd")) >= soft:
        return ""  # this process's own descriptor limit
    return (f"this user has max_files_per_user ({limit}) opens of /dev/p2phub already: close some, "
            f"or raise the p2phub module parameter max_files_per_user "
            f"({PARAMS}/max_files_per_user, docs/settings.md)")


def ioctl_error(exc: OSError, request: int, what: str, length: int = 0) -> P2PHubOSError:
    """The error for a failed /dev/p2phub ioctl, with what its errno means where that is not
    obvious. `length`: the bytes a REGISTER asked for."""
    err = exc.errno or errno.EIO
    detail = ""
    if err == errno.EOPNOTSUPP and request in _MAPS:
        detail = _MAP_REFUSED
    elif err == errno.ENODEV and request in (uapi.REGISTER, uapi.DMA_PAGES):
        detail = ("the PCI device is gone, or no driver is bound to it (nothing could use the "
                  "addresses; bind its driver first)")
    elif err == errno.ENOMEM and request == uapi.REGISTER and length:
        detail = memlock_detail(length)
    elif err == errno.EDQUOT and request == uapi.REGISTER:
        detail = pinned_per_user_detail()
    return P2PHubOSError(err, what, detail)


@dataclass(frozen=True)
class ModuleInfo:
    """What P2PHUB_GET_INFO reports."""

    version: str
    abi_version: int
    caps: uapi.Cap
    max_regs_per_file: int
    cap_names: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "version": self.version,
            "abi_version": self.abi_version,
            "caps": int(self.caps),
            "cap_names": self.cap_names,
            "max_regs_per_file": self.max_regs_per_file,
        }


MISC_DEV = "/sys/class/misc/p2phub/dev"  # "MAJOR:MINOR" of the node p2phub.ko registered


def _check_is_p2phub(fd: int, path: str) -> None:
    """UsageError unless `fd` is p2phub.ko's character device (not /dev/null, not a file)."""
    st = os.fstat(fd)
    if not stat.S_ISCHR(st.st_mode):
        raise UsageError(f"{path} is not the p2phub device: not a character device")
    try:
        with open(MISC_DEV) as f:
            want = f.read().strip()
    except OSError:
        raise UsageError(f"{path} is not the p2phub device: p2phub.ko is not loaded "
                         f"({MISC_DEV} is absent)") from None
    have = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    if have != want:
        raise UsageError(f"{path} is not the p2phub device: it is {have}, p2phub.ko's is {want}")


class Device(Resource):
    """An open file on /dev/p2phub. Everything registered through it dies with it."""

    def __init__(self, path: str = uapi.DEVICE_PATH) -> None:
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            if path != uapi.DEVICE_PATH:
                raise UsageError(f"{path} does not exist (the p2phub device is "
                                 f"{uapi.DEVICE_PATH})") from None
            raise ModuleNotLoadedError(
                f"{path} does not exist: p2phub.ko is not loaded (run `p2phub doctor`)"
            ) from None
        except OSError as exc:
            err = exc.errno or errno.EIO
            detail = files_limit_detail() if err == errno.EMFILE else ""
            raise P2PHubOSError(err, f"open {path}", detail) from None
        try:
            _check_is_p2phub(self.fd, path)
        except BaseException:
            os.close(self.fd)
            self.fd = -1
            raise
        self.path = path

    def ioctl(self, request: int, arg: ctypes.Structure, what: str) -> None:
        try:
            fcntl.ioctl(self.fd, request, arg, True)
        except OSError as exc:
            raise ioctl_error(exc, request, what) from None

    def info(self) -> ModuleInfo:
        arg = uapi.Info.new()
        self.ioctl(uapi.GET_INFO, arg, "P2PHUB_GET_INFO")
        caps = uapi.Cap(arg.caps)
        return ModuleInfo(
            version=arg.version.decode(errors="replace"),
            abi_version=arg.abi_version,
            caps=caps,
            max_regs_per_file=arg.max_regs_per_file,
            cap_names=[c.name for c in uapi.Cap if c in caps and c.name],
        )

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def closed(self) -> bool:
        return self._closed or self.fd < 0

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            self.close()


def get_info(path: str = uapi.DEVICE_PATH) -> ModuleInfo:
    with Device(path) as dev:
        return dev.info()
