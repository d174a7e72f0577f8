"""What ``nixl._bindings`` offers, in Python: descriptor lists, enums, status codes, the
telemetry record, the agent configuration, the error classes, and ``nixlAgent``, the core
object one ``nixl_agent`` drives (it owns the p2phub KV agent and the handle tables).
"""

from __future__ import annotations

import builtins
import enum
import itertools
import os
import time
from typing import Any, Iterable, Optional

from .._resource import Resource
from .errors import (  # noqa: F401 - re-exported under NIXL's module
    nixlBackendError, nixlCancelledError, nixlError, nixlInvalidParamError, nixlMismatchError,
    nixlNoTelemetryError, nixlNotAllowedError, nixlNotFoundError, nixlNotPostedError,
    nixlNotSupportedError, nixlRemoteDisconnectError, nixlRepostActiveError, nixlUnknownError,
)

NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
DEFAULT_COMM_PORT = 8888
HAVE_UCX_GPU_DEVICE_API = False    # no UCX here: prep_mem_view is NIXL_ERR_NOT_SUPPORTED


class nixl_mem_t(enum.IntEnum):  # noqa: N801
    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(enum.IntEnum):  # noqa: N801
    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_status_t(enum.IntEnum):  # noqa: N801
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9
    NIXL_ERR_REMOTE_DISCONNECT = -10
    NIXL_ERR_CANCELED = -11
    NIXL_ERR_NO_TELEMETRY = -12


class nixl_thread_sync_t(enum.IntEnum):  # noqa: N801
    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0


class nixl_cost_t(enum.IntEnum):  # noqa: N801
    NIXL_COST_ANALYTICAL_BACKEND = 0


# pybind11's export_values(): the members at module level, as NIXL's module has them
globals().update({m.name: m for e in (nixl_mem_t, nixl_xfer_op_t, nixl_status_t, nixl_cost_t)
                  for m in e})
NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT

MEM_NAMES = {nixl_mem_t.DRAM_SEG: "DRAM", nixl_mem_t.VRAM_SEG: "VRAM", nixl_mem_t.BLK_SEG: "BLOCK",
             nixl_mem_t.OBJ_SEG: "OBJ", nixl_mem_t.FILE_SEG: "FILE"}


class nixlXferTelemetry:  # noqa: N801
    """One transfer's telemetry: times in microseconds (startTime on the monotonic clock,
    postDuration from the post call to its return, xferDuration from the post call to
    completion), totalBytes moved and descCount, the descriptors the request named."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime: int = 0, postDuration: int = 0, xferDuration: int = 0,  # noqa: N803
                 totalBytes: int = 0, descCount: int = 0) -> None:  # noqa: N803
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
                f"descCount={self.descCount})")


def _u64(v: Any, what: str) -> int:
    try:
        i = int(v)
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be an integer, not {type(v).__name__}") from None
    if i < 0 or i >= 1 << 64:
        raise ValueError(f"{what} {i} is outside [0, 2^64)")
    return i


class _DList:
    """Rows of a descriptor list and its memory type (NIXL's nixlDescList)."""

    _width = 3

    def __init__(self, type: nixl_mem_t, descs: Any = 0) -> None:  # noqa: A002 - NIXL's name
        self._type = nixl_mem_t(type)
        self._rows: list[tuple] = []
        if isinstance(descs, int):       # (type, init_size): init_size empty rows, as NIXL
            self._rows = [self._empty()] * descs
        elif type_is_ndarray(descs):
            self._rows = self._from_array(descs)
        else:
            if not isinstance(descs, (list, tuple)):
                raise TypeError(f"descriptors must be a list of tuples or an Nx3 numpy array, "
                                f"not {builtins.type(descs).__name__}")
            self._rows = [self._row(d) for d in descs]

    # -- construction
    def _empty(self) -> tuple:
        return (0, 0, 0)

    def _row(self, d: Any) -> tuple:
        if not isinstance(d, tuple):
            raise TypeError("Each descriptor must be a tuple when provided as a list")
        if len(d) != self._width:
            raise ValueError(f"Each descriptor tuple must have exactly {self._width} elements")
        return (_u64(d[0], "address"), _u64(d[1], "length"), _u64(d[2], "device id")) + self._extra(d)

    def _extra(self, d: tuple) -> tuple:
        return ()

    def _from_array(self, a: Any) -> list[tuple]:
        if a.ndim != 2 or a.shape[1] != 3:
            raise ValueError("descs must be a Nx3 numpy array")
        if a.dtype.kind not in "iu" or a.dtype.itemsize != 8:
            raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
        if not a.flags["C_CONTIGUOUS"]:
            raise ValueError("descs must be a C-contiguous numpy array")
        return [(int(x), int(n), int(dv)) + self._extra(()) for x, n, dv in a.tolist()]

    # -- NIXL's methods
    def getType(self) -> nixl_mem_t:  # noqa: N802
        return self._type

    def descCount(self) -> int:  # noqa: N802
        return len(self._rows)

    def isEmpty(self) -> bool:  # noqa: N802
        return not self._rows

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._type == self._type and other._rows == self._rows

    __hash__ = None  # type: ignore[assignment]

    def __getitem__(self, i: int) -> tuple:
        return self._rows[self._index(i)]

    def __setitem__(self, i: int, d: tuple) -> None:
        self._rows[self._index(i)] = self._row(tuple(d))

    def _index(self, i: int) -> int:
        if not isinstance(i, int) or not 0 <= i < len(self._rows):
            raise IndexError(f"descriptor index {i!r} is outside 0..{len(self._rows) - 1}")
        return i

    def addDesc(self, d: tuple) -> None:  # noqa: N802
        self._rows.append(self._row(tuple(d)))

    append = addDesc

    def index(self, d: tuple) -> int:
        try:
            return self._rows.index(self._row(tuple(d)))
        except ValueError:
            raise nixlNotFoundError(f"descriptor {d!r} is not in the list") from None

    def remDesc(self, i: int) -> None:  # noqa: N802
        del self._rows[self._index(i)]

    def clear(self) -> None:
        self._rows = []

    def print(self) -> None:
        print(repr(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({MEM_NAMES[self._type]}, {len(self._rows)} descriptors)"

    # -- pickling (get_serialized_descs / deserialize_descs)
    def __getstate__(self) -> dict:
        return {"type": int(self._type), "rows": self._rows}

    def __setstate__(self, st: dict) -> None:
        self._type = nixl_mem_t(st["type"])
        self._rows = [tuple(r) for r in st["rows"]]

    # -- for the agent
    def ranges(self) -> list[tuple[int, int, int]]:
        """(address, length, device) of every row."""
        return [(r[0], r[1], r[2]) for r in self._rows]


def type_is_ndarray(x: Any) -> bool:
    return type(x).__module__ == "numpy" and type(x).__name__ == "ndarray"


class nixlXferDList(_DList):  # noqa: N801
    """Transfer descriptors: (address, length, device id)."""


class nixlRegDList(_DList):  # noqa: N801
    """Registration descriptors: (address, length, device id, meta info)."""

    _width = 4

    def _empty(self) -> tuple:
        return (0, 0, 0, b"")

    def _extra(self, d: tuple) -> tuple:
        if len(d) < 4:
            return (b"",)
        m = d[3]
        return (m.encode() if isinstance(m, str) else bytes(m),)

    def trim(self) -> nixlXferDList:
        """The same descriptors without their meta info, as a transfer list."""
        out = nixlXferDList(self._type)
        out._rows = [r[:3] for r in self._rows]
        return out


class nixlRemoteDList(_DList):  # noqa: N801
    """Remote descriptors: (address, length, device id, agent name)."""

    _width = 4

    def _empty(self) -> tuple:
        return (0, 0, 0, "")

    def _extra(self, d: tuple) -> tuple:
        if len(d) < 4:
            return ("",)
        return (d[3].decode() if isinstance(d[3], bytes) else str(d[3]),)

    def _from_array(self, a: Any) -> list[tuple]:
        raise TypeError("a remote descriptor list is built from (addr, len, dev, agent) tuples")


class nixlAgentConfig:  # noqa: N801
    """The agent configuration NIXL's core takes (field names as NIXL's)."""

    def __init__(self, useProgThread: bool = False, useListenThread: bool = False,  # noqa: N803
                 listenPort: int = 0, syncMode: int = 0, captureTelemetry: bool = False,  # noqa: N803
                 pthrDelay: int = 0, lthrDelay: int = 100000, etcdWatchTimeout: int = 0) -> None:  # noqa: N803
        self.useProgThread = useProgThread
        self.useListenThread = useListenThread
        self.listenPort = listenPort
        self.syncMode = syncMode
        self.captureTelemetry = captureTelemetry
        self.pthrDelay = pthrDelay
        self.lthrDelay = lthrDelay
        self.etcdWatchTimeout = etcdWatchTimeout
        self.stallTimeout = 10.0          # p2phub: seconds without progress before a peer fails
        self.transport: Optional[str] = None          # p2phub: "auto" | "tcp" | "rdma"
        self.rdmaDevices: Optional[list[str]] = None  # p2phub: the RDMA NICs to move payload on


def transport_choice(transport: Optional[str], devices: Optional[Iterable[str]]) -> tuple[str, list[str]]:
    """The KV agent's transport and RDMA devices: the configuration's, else the environment's
    (P2PHUB_NIXL_TRANSPORT, P2PHUB_NIXL_RDMA_DEVICES: comma-separated names, or "all" for
    every device libibverbs sees), else "auto" with no devices (TCP)."""
    t = transport or os.environ.get("P2PHUB_NIXL_TRANSPORT", "").strip() or "auto"
    if t not in ("auto", "tcp", "rdma"):
        raise nixlInvalidParamError(f"transport {t!r}: want 'auto', 'tcp' or 'rdma'")
    if devices is None:
        env = os.environ.get("P2PHUB_NIXL_RDMA_DEVICES", "")
        devices = [d.strip() for d in env.split(",") if d.strip()]
    devs = [str(d) for d in devices]
    if devs == ["all"]:
        from ..rdma import verbs
        try:
            devs = verbs.device_names()
        except Exception as exc:  # noqa: BLE001 - no libibverbs: no devices
            raise nixlInvalidParamError(f"RDMA devices 'all': {exc}") from None
    if t == "rdma" and not devs:
        raise nixlInvalidParamError("transport 'rdma' needs RDMA devices (rdma_devices in "
                                    "nixl_agent_config, or P2PHUB_NIXL_RDMA_DEVICES)")
    return t, ([] if t == "tcp" else devs)


def _env_bool(name: str) -> Optional[bool]:
    v = os.environ.get(name)
    if v is None:
        return None
    v = v.strip().lower()
    if v in ("y", "yes", "1", "true", "on", "enable", "enabled"):
        return True
    if v in ("n", "no", "0", "false", "off", "disable", "disabled"):
        return False
    return None


class nixlAgent(Resource):  # noqa: N801
    """The core one ``nixl_agent`` drives: the p2phub KV agent, the registered ranges, and the
    tables behind NIXL's integer handles. Built as ``nixlAgent(name, nixlAgentConfig)``."""

    def __init__(self, name: str, config: nixlAgentConfig) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("Agent needs a non-empty name")
        from ._kvagent import NixlKVAgent
        self.name = name
        self.config = config
        env = _env_bool("NIXL_TELEMETRY_ENABLE")
        self.telemetry = env if env is not None else bool(config.captureTelemetry)
        port = int(config.listenPort) if config.useListenThread else 0
        host = os.environ.get("P2PHUB_NIXL_HOST", "127.0.0.1")
        transport, devices = transport_choice(getattr(config, "transport", None),
                                              getattr(config, "rdmaDevices", None))
        from ..errors import UsageError
        from ..kv.auth import KVAuthError
        try:
            self.kv = NixlKVAgent(name, host=host, port=port,
                                  stall_timeout=float(config.stallTimeout),
                                  transport=transport, rdma_devices=devices or None)
        except (UsageError, KVAuthError) as exc:
            raise nixlInvalidParamError(f"agent {name!r}: {exc}") from None
        from ._storage import Storage
        self.storage = Storage()          # FILE registrations and the batch engine's hub
        self._ids = itertools.count(1)
        self.xfers: dict[int, Any] = {}
        self.dlists: dict[int, Any] = {}
        self.backends: dict[int, str] = {}

    def new_id(self) -> int:
        return next(self._ids)

    def getAvailPlugins(self) -> list[str]:  # noqa: N802
        from ._storage import PLUGINS
        return list(PLUGINS)

    def releaseXferReq(self, handle: int) -> int:  # noqa: N802
        x = self.xfers.pop(handle, None)
        if x is not None:
            x.release()
        return nixl_status_t.NIXL_SUCCESS

    def releasedDlistH(self, handle: int) -> int:  # noqa: N802
        self.dlists.pop(handle, None)
        return nixl_status_t.NIXL_SUCCESS

    def _close(self) -> None:
        try:
            self.storage.close()
        finally:
            self.kv.close()


def now_us() -> int:
    return time.monotonic_ns() // 1000


def rows_of(lists: Iterable[_DList]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for dl in lists:
        out.extend(dl.ranges())
    return out
