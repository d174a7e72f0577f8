"""NIXL's Python agent (``nixl._api``, NIXL 1.x) over p2phub's KV agent.

A connector written against NIXL moves with its import changed::

    from p2phub.nixl._api import nixl_agent, nixl_agent_config   # was: from nixl._api ...

Every public ``nixl_agent`` method is here with NIXL's arguments, return types and errors
(see docs/kv.md, "Use it from vLLM" and "Use it from LMCache / SGLang / Dynamo", for what
differs). Peers are reached through p2phub's KV agent (TCP, or RDMA over the NICs it is told:
``nixl_agent_config(transport=, rdma_devices=)`` or P2PHUB_NIXL_TRANSPORT /
P2PHUB_NIXL_RDMA_DEVICES), under the plugin names ``P2PHUB`` and ``UCX`` (the name ``UCX`` in a
``backends`` list selects P2PHUB, so configurations written for NIXL's default work unchanged).
FILE memory (``(offset, length, fd, meta)`` registrations, path mode, transfers to the agent's
own name) is moved by p2phub's batch engine, under the storage plugin names ``POSIX``, ``GDS``,
``GDS_MT`` and ``P2PHUB`` (see ``_storage``).
"""

from __future__ import annotations

import ctypes
import logging
import math
import pickle
import sys
import threading
import time
from enum import Enum
from typing import Any, Optional, Sequence, Union

from ..errors import P2PHubError, UsageError
from ..kv import transport as tp
from ..kv.agent import DescList
from ..kv.errors import KVError, KVPeerError, KVRejected
from . import _bindings as nixlBind
from ..kv.transport import RangeLookup
from .._resource import Resource
from ..ordering.errors import FenceTimeout
from ._kvagent import exchange
from ._storage import NETWORK, PLUGINS, FileXfer, check_params
from .logging import get_logger  # noqa: F401 - nixl._api has it

# How long one check_xfer_state of a FILE transfer still running waits for it (the plugin's
# checkXfer waits as long).
_FILE_POLL_WAIT_S = 200e-6
from .errors import (
    nixlBackendError, nixlError, nixlInvalidParamError, nixlNoTelemetryError,
    nixlNotFoundError, nixlNotPostedError, nixlNotSupportedError, nixlRemoteDisconnectError,
    nixlRepostActiveError,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle",
    "nixl_prepped_dlist_handle", "nixl_thread_sync_t", "nixl_xfer_handle",
]

DEFAULT_COMM_PORT = nixlBind.DEFAULT_COMM_PORT
PLUGIN = "P2PHUB"
ALIASES = ("UCX",)          # names that select P2PHUB in nixl_agent_config's backends list


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


class _NotContiguous(Exception):
    pass


def _memory_row(obj: Any) -> Optional[tuple[str, tuple[int, int, int]]]:
    """("DRAM" | "VRAM", (addr, len, dev)) of a tensor or array object's own memory, or None
    when `obj` is not one. Torch tensors, ``__cuda_array_interface__`` objects (VRAM) and
    ``__array_interface__`` objects (numpy: DRAM) are memory; their values are never read.
    Raises _NotContiguous for one that is not one contiguous range."""
    if _is_torch_tensor(obj) or (hasattr(obj, "data_ptr") and hasattr(obj, "element_size")
                                 and hasattr(obj, "is_contiguous")):
        if not obj.is_contiguous():
            raise _NotContiguous
        dev = int(obj.get_device()) if hasattr(obj, "get_device") else -1
        n = int(obj.numel() * obj.element_size())
        return ("DRAM", (int(obj.data_ptr()), n, 0)) if dev < 0 else ("VRAM", (int(obj.data_ptr()), n, dev))
    for attr, mem in (("__cuda_array_interface__", "VRAM"), ("__array_interface__", "DRAM")):
        ai = getattr(obj, attr, None)
        if isinstance(ai, dict) and "data" in ai and "shape" in ai:
            shape = tuple(int(d) for d in ai["shape"])
            item = int(ai["typestr"][2:])
            strides = ai.get("strides")
            if strides is not None:
                want = item
                for dim, st in zip(reversed(shape), reversed(tuple(strides))):
                    if dim > 1 and st != want:
                        raise _NotContiguous
                    want *= dim
            dev = 0
            if mem == "VRAM":
                d = getattr(obj, "device", None)
                dev = int(getattr(d, "id", getattr(d, "index", 0)) or 0)
            return mem, (int(ai["data"][0]), math.prod(shape) * item, dev)
    return None


def _copy(dst: int, ddev: int, src: int, sdev: int, n: int) -> None:
    """Copy n bytes within this process: host memory (device -1) by memmove, CUDA memory
    through the driver (device -> host -> device for two CUDA ranges), synchronized."""
    if ddev < 0 and sdev < 0:
        ctypes.memmove(dst, src, n)
        return
    from ..kv import cuda
    drv = cuda.driver()
    ep = drv.entry_points()
    ctx_set = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(ep["ctx_set_current"])
    sync = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(ep["stream_sync"])
    dtoh = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t,
                            ctypes.c_void_p)(ep["dtoh_async"])
    htod = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p)(ep["htod_async"])

    def check(rc: int, what: str) -> None:
        if rc:
            raise nixlBackendError(f"local copy: {what} failed: {drv.error_name(rc)} ({rc})")

    bounce = ctypes.create_string_buffer(n) if ddev >= 0 and sdev >= 0 else None
    host = ctypes.addressof(bounce) if bounce is not None else (dst if ddev < 0 else src)
    if sdev >= 0:
        check(ctx_set(drv.primary_context(sdev)), f"selecting cuda:{sdev}")
        check(dtoh(host, src, n, None), f"cuda:{sdev} -> host copy")
        check(sync(None), "synchronizing")
    if ddev >= 0:
        check(ctx_set(drv.primary_context(ddev)), f"selecting cuda:{ddev}")
        check(htod(dst, host, n, None), f"host -> cuda:{ddev} copy")
        check(sync(None), "synchronizing")


def _is_desc_table(x: Any) -> bool:
    """NIXL's descriptor table: a 2-D numpy array of integers (N x 3)."""
    return nixlBind.type_is_ndarray(x) and x.ndim == 2 and x.dtype.kind in "iu"


def _name(x: Union[str, bytes]) -> str:
    return x.decode() if isinstance(x, (bytes, bytearray)) else str(x)


def _b(msg: Union[bytes, str]) -> bytes:
    return msg.encode() if isinstance(msg, str) else bytes(msg)


def _indices(v: Any, what: str) -> list[int]:
    if nixlBind.type_is_ndarray(v):
        if v.ndim != 1:
            raise nixlInvalidParamError(f"{what}: indices numpy array must be 1D")
        if v.dtype.kind not in "iu":
            raise nixlInvalidParamError(f"{what}: indices numpy array must be of integers")
        return v.tolist()
    try:
        return [int(i) for i in v]
    except (TypeError, ValueError):
        raise TypeError(f"{what}: want a list or 1-D numpy array of ints, not {type(v).__name__}") from None


def _kv_error(exc: BaseException, what: str) -> nixlError:
    """The NIXL error for a p2phub KV failure."""
    if isinstance(exc, nixlError):
        return exc
    if isinstance(exc, KVPeerError):
        return nixlRemoteDisconnectError(f"{what}: {exc}")
    if isinstance(exc, KVRejected):
        return nixlBackendError(f"{what}: {exc}")
    if isinstance(exc, UsageError):
        return nixlInvalidParamError(f"{what}: {exc}")
    return nixlBackendError(f"{what}: {exc}")


class _MemNames(dict):
    def __missing__(self, key: object) -> Any:
        raise KeyError(f"memory type {key!r} is not one of {sorted(self)}")


class _Ops(dict):
    def __missing__(self, key: object) -> Any:
        raise KeyError(f"operation {key!r} must be 'READ' or 'WRITE'")


# ---------------------------------------------------------------------------- handles
class nixl_prepped_dlist_handle:  # noqa: N801 - NIXL's name
    """Handle of a prepared descriptor list (prep_xfer_dlist)."""

    __slots__ = ("_handle", "_agent", "_released")

    def __init__(self, agent: nixlBind.nixlAgent, value: int) -> None:
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            self._agent.releasedDlistH(self._handle)
            self._released = True


class nixl_xfer_handle:  # noqa: N801
    """Handle of a transfer request (make_prepped_xfer / initialize_xfer)."""

    __slots__ = ("_handle", "_agent", "_released", "_last")

    def __init__(self, agent: nixlBind.nixlAgent, value: int) -> None:
        self._handle = int(value)
        self._agent = agent
        self._released = False
        self._last = "PROC"

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        """Free the request. One still in flight is not cancelled on the wire (TCP has no
        cancel): it completes or fails on its own, and nothing reports it any more."""
        if not self._released:
            req = self._agent.xfers.get(self._handle)
            if req is not None:
                self._last = req.last_state
            self._agent.releaseXferReq(self._handle)
            self._released = True

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            pass


nixl_backend_handle = int


class nixl_thread_sync_t(Enum):  # noqa: N801
    NIXL_THREAD_SYNC_NONE = nixlBind.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = nixlBind.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = nixlBind.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = nixlBind.NIXL_THREAD_SYNC_DEFAULT


class nixl_agent_config:  # noqa: N801
    """NIXL's agent configuration. ``listen_port`` is where the agent takes metadata and
    transfers when ``enable_listen_thread`` is set (an ephemeral port otherwise; p2phub's
    agent always listens). ``num_threads`` and ``enable_prog_thread`` are accepted and have
    no effect (the transport's threads are per connection). ``stall_timeout`` (p2phub):
    seconds without progress after which a peer's transfers fail. ``transport`` ("auto",
    "tcp", "rdma") and ``rdma_devices`` (p2phub: NIC names, or ["all"]) choose how payload
    moves; left out, P2PHUB_NIXL_TRANSPORT and P2PHUB_NIXL_RDMA_DEVICES (comma-separated)
    decide, and without either it is TCP. With devices, "auto" moves payload over RDMA to
    every peer that has some too, and TCP to the others."""

    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = DEFAULT_COMM_PORT, capture_telemetry: bool = False,
                 num_threads: int = 0, backends: list[str] = ["UCX"],  # noqa: B006 - NIXL's default
                 sync_mode: Optional[nixl_thread_sync_t] = None, stall_timeout: float = 10.0,
                 transport: Optional[str] = None, rdma_devices: Optional[list[str]] = None) -> None:
        self.backends = backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        self.sync_mode = sync_mode
        if not stall_timeout > 0:
            raise ValueError(f"stall_timeout={stall_timeout!r} must be > 0 seconds")
        self.stall_timeout = float(stall_timeout)
        if transport is not None and transport not in ("auto", "tcp", "rdma"):
            raise ValueError(f"transport={transport!r}: want 'auto', 'tcp' or 'rdma'")
        self.transport = transport
        self.rdma_devices = list(rdma_devices) if rdma_devices is not None else None


# ---------------------------------------------------------------------------- internals
class _Prepped:
    """A prepared list: local ("init"), a peer's, or this agent's own ("loop")."""

    __slots__ = ("kind", "peer", "rows", "kvlist", "mem", "cols")

    def __init__(self, kind: str, peer: str, rows: list[tuple[int, int, int]],
                 kvlist: Optional[DescList], mem: str) -> None:
        self.kind = kind
        self.peer = peer
        self.rows = rows
        self.kvlist = kvlist
        self.mem = mem
        self.cols: Any = None     # for FILE transfers: (registrations, index, offset) per row


class _Req:
    """One transfer request: a KV transfer to a peer, a copy within this process, or a batch
    between memory and FILE."""

    __slots__ = ("op", "peer", "pairs", "count", "nbytes", "notif", "x", "t0", "post_us",
                 "done_ns", "posted", "loop_state", "released", "lock", "counted", "file")

    def __init__(self, op: str, peer: str, pairs: list[tuple[int, int, int, int, int]], count: int,
                 nbytes: int, notif: bytes, x: Optional[tp.Xfer]) -> None:
        self.op = op
        self.peer = peer
        self.pairs = pairs            # loopback: (local addr, own addr, len, their devices)
        self.count = count
        self.nbytes = nbytes
        self.notif = notif
        self.x = x
        self.t0 = 0
        self.post_us = 0
        self.done_ns = 0
        self.posted = False
        self.loop_state = ""
        self.released = False
        self.lock = threading.Lock()
        self.counted = False
        self.file: Optional[FileXfer] = None    # a transfer between memory and FILE

    def mark_done(self, _x: Any = None) -> None:
        if not self.done_ns:
            self.done_ns = time.monotonic_ns()

    @property
    def last_state(self) -> str:
        if not self.posted:
            return "PROC"
        if self.file is not None:
            f = self.file
            if f.error is not None:
                return "ERR"
            if f.fence is None or not f.fence.done():
                return "PROC"
            return "ERR" if f.fence.exception() is not None else "DONE"
        if self.x is None:
            return self.loop_state
        return self.x.state

    def release(self) -> None:
        self.released = True


class _Estimator:
    """Transfer times seen on this agent, for estimate_xfer_cost: microseconds per byte and
    per transfer, from the last completed transfers."""

    def __init__(self) -> None:
        self.samples: list[tuple[int, int]] = []

    def add(self, nbytes: int, us: int) -> None:
        self.samples.append((nbytes, max(1, us)))
        del self.samples[:-64]

    def estimate(self, nbytes: int) -> tuple[int, int]:
        if not self.samples:
            raise nixlNotSupportedError("no completed transfer on this agent yet to estimate "
                                        "from (estimates come from measured transfers)")
        preds = sorted(int(us * nbytes / max(1, b)) if b else us for b, us in self.samples)
        mid = preds[len(preds) // 2]
        return mid, (preds[-1] - preds[0]) // 2


# ---------------------------------------------------------------------------- the agent
class nixl_agent(Resource):  # noqa: N801
    """NIXL's nixl_agent over p2phub's KV agent (TCP, or RDMA where told its NICs)."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False) -> None:
        if nixl_conf and instantiate_all:
            instantiate_all = False
            logger.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        if not nixl_conf:
            nixl_conf = nixl_agent_config()
        default_sync = (nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if nixl_conf.enable_listen
                        else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
        cfg = nixlBind.nixlAgentConfig()
        cfg.useProgThread = nixl_conf.enable_pthread
        cfg.useListenThread = nixl_conf.enable_listen
        cfg.listenPort = nixl_conf.port
        cfg.syncMode = (nixl_conf.sync_mode or default_sync).value
        cfg.captureTelemetry = nixl_conf.capture_telemetry
        cfg.stallTimeout = getattr(nixl_conf, "stall_timeout", 10.0)
        cfg.transport = getattr(nixl_conf, "transport", None)
        cfg.rdmaDevices = getattr(nixl_conf, "rdma_devices", None)
        self.agent = nixlBind.nixlAgent(agent_name, cfg)   # looked up now: a spy may replace it

        self.name = agent_name
        self._leaked_xfer_handles: list[int] = []
        self.notifs: dict[str, list[bytes]] = {}
        self._own_notifs: dict[str, list[bytes]] = {}
        self.backends: dict[str, nixl_backend_handle] = {}
        self.backend_mems: dict[str, list[str]] = {}
        self.backend_options: dict[str, dict[str, str]] = {}
        self.plugin_list = self.agent.getAvailPlugins()
        self.plugin_b_options: dict[str, dict[str, str]] = {}
        self.plugin_mem_types: dict[str, list[str]] = {}
        # registered DRAM and VRAM ranges -> whether the KV agent has them too (a network
        # backend existed when they were registered: NIXL registers memory with the backends
        # created by then)
        self._regs: dict[tuple[int, int], bool] = {}
        self._est = _Estimator()
        self.nixl_mems = _MemNames({
            "DRAM": nixlBind.DRAM_SEG, "VRAM": nixlBind.VRAM_SEG, "FILE": nixlBind.FILE_SEG,
            "BLOCK": nixlBind.BLK_SEG, "OBJ": nixlBind.OBJ_SEG,
            "cpu": nixlBind.DRAM_SEG, "cuda": nixlBind.VRAM_SEG})
        self.nixl_ops = _Ops({"WRITE": nixlBind.NIXL_WRITE, "READ": nixlBind.NIXL_READ})

        wanted = self.plugin_list if instantiate_all else list(nixl_conf.backends)
        for b in wanted:
            if b in ALIASES:
                b = PLUGIN
            if b not in self.plugin_list:
                logger.warning("Skipping backend registration %s due to the missing plugin.", b)
            elif b not in self.backends:
                self.create_backend(b)
        logger.info("Initialized NIXL agent: %s", agent_name)

    @property
    def kv(self) -> Any:
        """The p2phub.kv.Agent underneath."""
        return self.agent.kv

    def __del__(self) -> None:
        try:
            self.agent.close()
        except Exception:  # noqa: BLE001 - a finalizer must not raise
            pass

    def _close(self) -> None:
        """Close the agent's listener and connections (p2phub; NIXL does it at destruction)."""
        self.agent.close()

    # ------------------------------------------------------------------ plugins, backends
    def _params(self) -> dict[str, str]:
        kv = self.kv
        return {"stall_timeout": str(kv.stall_timeout), "transport": kv.transport,
                "rdma_devices": ",".join(kv.rails.devices) if kv.rails is not None else ""}

    def _plugin_params(self, plugin: str) -> None:
        spec = PLUGINS.get(plugin)
        if spec is not None and plugin in self.plugin_list:
            self.plugin_b_options[plugin] = self._params() if plugin == PLUGIN else dict(spec.params)
            self.plugin_mem_types[plugin] = list(spec.mems)

    def transport_to(self, remote_agent: Union[str, bytes]) -> str:
        """p2phub: "rdma" or "tcp", how this agent's payload moves to and from that peer
        (RDMA where both have devices, unless told "tcp"; each connection logs it too)."""
        try:
            return self.kv.transport_to(_name(remote_agent))
        except UsageError as exc:
            raise nixlNotFoundError(f"transport_to: {exc}") from None

    def get_plugin_list(self) -> list[str]:
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> list[str]:
        if backend not in self.plugin_mem_types:
            self._plugin_params(backend)
        if backend not in self.plugin_mem_types:
            logger.warning("Plugin %s is not available to get its supported mem types.", backend)
            return []
        return self.plugin_mem_types[backend]

    def get_plugin_params(self, backend: str) -> dict[str, str]:
        if backend not in self.plugin_b_options:
            self._plugin_params(backend)
        if backend not in self.plugin_b_options:
            logger.warning("Plugin %s is not available to get its parameters.", backend)
            return {}
        return self.plugin_b_options[backend]

    def get_backend_mem_types(self, backend: str) -> list[str]:
        if backend in self.backend_mems:
            return self.backend_mems[backend]
        logger.warning("Backend %s not instantiated to get its supported mem types.", backend)
        return []

    def get_backend_params(self, backend: str) -> dict[str, str]:
        if backend in self.backend_options:
            return self.backend_options[backend]
        logger.warning("Backend %s not instantiated to get its parameters.", backend)
        return {}

    def create_backend(self, backend: str, initParams: dict[str, str] = {}) -> None:  # noqa: B006, N803
        """Instantiate a plugin, with its parameters (an unknown one is refused by name).
        P2PHUB: the KV agent for peers and the batch engine for FILE (``stall_timeout``,
        seconds); UCX: the KV agent; POSIX (DRAM, FILE), GDS and GDS_MT (DRAM, VRAM, FILE):
        the batch engine (hub.load_batch / hub.save_batch), NIXL's parameters accepted."""
        if backend not in self.plugin_list:
            raise nixlNotFoundError(f"no plugin {backend!r}: the plugins here are {self.plugin_list}")
        if backend in self.backends:
            raise nixlInvalidParamError(f"backend {backend!r} was already created")
        params = check_params(backend, dict(initParams))
        if "stall_timeout" in initParams:
            self.kv.stall_timeout = float(params["stall_timeout"])
        h = self.agent.new_id()
        self.agent.backends[h] = backend
        self.backends[backend] = h
        self.backend_mems[backend] = list(PLUGINS[backend].mems)
        self.backend_options[backend] = self._params() if backend == PLUGIN else params
        logger.info("Backend %s was instantiated", backend)

    def _backend_key(self, b: str) -> Optional[str]:
        if b in self.backends:
            return b
        if b in ALIASES and PLUGIN in self.backends:
            return PLUGIN
        return None

    def _backends(self, names: Sequence[str]) -> list[str]:
        """The created backends `names` stand for (UCX stands for P2PHUB where only that
        was created); a name not created raises KeyError."""
        out = []
        for b in names:
            key = self._backend_key(b)
            if key is None:
                raise KeyError(f"backend {b!r} was not created on agent {self.name!r} "
                               f"(created: {sorted(self.backends)})")
            out.append(key)
        return out

    def _serving(self, mems: Sequence[str], names: Sequence[str] = ()) -> list[str]:
        """The created backends (of `names`, if given) that move every one of `mems`."""
        pool = self._backends(names) if names else list(self.backends)
        return [b for b in pool if all(m in PLUGINS[b].mems for m in mems)]

    def _need_backend(self, what: str, mems: Sequence[str] = (), names: Sequence[str] = (),
                      network: bool = False) -> str:
        """The backend that serves `mems` (and peers, with `network`); nixlNotFoundError
        naming what to create when none does."""
        got = self._serving(mems, names)
        if network:
            got = [b for b in got if b in NETWORK]
        if not got:
            kind = "a peer" if network else " <-> ".join(mems) or "this"
            raise nixlNotFoundError(
                f"{what}: agent {self.name!r} has no backend for {kind} (created: "
                f"{sorted(self.backends) or 'none'}; create_backend({PLUGIN!r}) serves DRAM, "
                "VRAM and FILE, or list 'UCX' or 'P2PHUB' in nixl_agent_config's backends)")
        return got[0]

    # ------------------------------------------------------------------ descriptors
    def _mem_objects(self, descs: Any, width: int) -> Any:
        """Descriptor rows of a tensor / array object or a list of them; None where NIXL
        answers None (non-contiguous, mixed devices). Returns NotImplemented when `descs`
        is not memory objects."""
        try:
            one = _memory_row(descs)
            if one is not None:
                mems, rows = [one[0]], [one[1]]
            elif isinstance(descs, (list, tuple)) and descs and not isinstance(descs[0], tuple):
                got = [_memory_row(d) for d in descs]
                if any(g is None for g in got):
                    return NotImplemented
                mems, rows = [g[0] for g in got], [g[1] for g in got]  # type: ignore[index]
            else:
                return NotImplemented
        except _NotContiguous:
            logger.error("Please use a list of contiguous Tensors")
            return None
        if len(set(mems)) != 1 or (mems[0] == "VRAM" and len({r[2] for r in rows}) != 1):
            logger.error("Tensors of one descriptor list must be on one device")
            return None
        if width == 4:
            rows = [r + ("",) for r in rows]
        cls = nixlBind.nixlRegDList if width == 4 else nixlBind.nixlXferDList
        return cls(self.nixl_mems[mems[0]], rows)

    def _descs(self, descs: Any, mem_type: Optional[str], cls: type, width: int) -> Any:
        if isinstance(descs, cls):
            return descs
        if isinstance(descs, nixlBind._DList):
            logger.error("%s given where a %s is wanted", type(descs).__name__, cls.__name__)
            return None
        if _is_desc_table(descs):
            if mem_type is not None and descs.shape[1] == 3:
                return cls(self.nixl_mems[mem_type], descs)
            if mem_type is None:
                logger.error("Please specify a mem type if not using Tensors")
            else:
                logger.error("Nx3 shape required for descriptor list from numpy array")
            return None
        mem = self._mem_objects(descs, width)
        if mem is not NotImplemented:
            return mem
        if isinstance(descs, (list, tuple)):
            if not descs:
                return cls(self.nixl_mems[mem_type], []) if mem_type is not None else None
            if isinstance(descs[0], tuple):
                if mem_type is not None and len(descs[0]) == width:
                    return cls(self.nixl_mems[mem_type], list(descs))
                if mem_type is None:
                    logger.error("Please specify a mem type if not using Tensors")
                else:
                    logger.error("%d-tuple list needed", width)
                return None
        return None

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> nixlBind.nixlXferDList:
        """A nixlXferDList from (addr, len, dev) tuples + mem_type, an Nx3 integer numpy array
        + mem_type, a tensor / array object, or a list of them (their own memory)."""
        return self._descs(descs, mem_type, nixlBind.nixlXferDList, 3)

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> nixlBind.nixlRegDList:
        """A nixlRegDList from (addr, len, dev, meta) tuples + mem_type, an Nx3 integer numpy
        array + mem_type, a tensor / array object, or a list of them (their own memory)."""
        return self._descs(descs, mem_type, nixlBind.nixlRegDList, 4)

    def get_remote_descs(self, descs: Any, mem_type: Optional[str] = None) -> nixlBind.nixlRemoteDList:
        if isinstance(descs, nixlBind.nixlRemoteDList):
            return descs
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is not None and len(descs[0]) == 4:
                return nixlBind.nixlRemoteDList(self.nixl_mems[mem_type], list(descs))
            logger.error("Please specify a mem type" if mem_type is None else
                         "4-tuple list (addr, len, dev_id, agent_name) needed for remote descriptors")
        return None

    def get_serialized_descs(self, descs: Any) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        return pickle.loads(serialized_descs)

    # ------------------------------------------------------------------ memory
    def _mem_kind(self, dl: Any, what: str) -> str:
        """"DRAM", "VRAM" or "FILE"; BLOCK and OBJ are refused (no plugin here moves them)."""
        name = nixlBind.MEM_NAMES[dl.getType()]
        if name in ("DRAM", "VRAM", "FILE"):
            return name
        raise nixlNotSupportedError(f"{what}: {name} needs a storage plugin that moves it; "
                                    f"the plugins here ({', '.join(self.plugin_list)}) move "
                                    "DRAM, VRAM and FILE")

    @property
    def _storage(self) -> Any:
        return self.agent.storage

    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None,
                        backends: list[str] = []) -> nixlBind.nixlRegDList:  # noqa: B006
        """Register DRAM / VRAM ranges (tuples, a table, tensors) or FILE rows: ``(offset,
        length, fd, meta)``, or path mode with meta ``"ro|rw[,direct|sync|noatime|create]:/path"``
        (the file is opened here and closed at deregistration; a missing path without
        ``create`` raises nixlBackendError, as NIXL's file plugins do)."""
        reg = self.get_reg_descs(reg_list, mem_type)
        if reg is None:
            raise TypeError("register_memory: want a nixlRegDList, (addr, len, dev, meta) tuples "
                            "with mem_type, an Nx3 integer array with mem_type, or contiguous "
                            "tensors / arrays")
        mem = self._mem_kind(reg, "register_memory")
        self._need_backend("register_memory", [mem], backends)
        if mem == "FILE":
            self._storage.register([(r[0], r[1], r[2], r[3]) for r in reg._rows])
            return reg
        vram = mem == "VRAM"
        peers = any(b in NETWORK for b in self.backends)
        added: dict[int, list[tuple[int, int]]] = {}
        try:
            for addr, n, dev in reg.ranges():
                if (addr, n) in self._regs:
                    continue
                if peers:
                    try:
                        self.kv.register_memory(addr, n, device=dev if vram else None)
                    except UsageError as exc:
                        raise nixlInvalidParamError(f"register_memory: {exc}") from None
                self._regs[(addr, n)] = peers
                added.setdefault(dev, []).append((addr, n))
        finally:    # what was registered is known to the storage side too, in one merge
            for dev, ranges in added.items():
                self._storage.add_mems(ranges, vram, dev)
        return reg

    def deregister_memory(self, dereg_list: nixlBind.nixlRegDList,
                          backends: list[str] = []) -> None:  # noqa: B006
        """Deregister: the ranges can no longer be prepared here, and transfers into them
        from peers are refused (their segment ids stay taken; peers see empty slots). FILE
        rows registered by path close their file."""
        if not isinstance(dereg_list, nixlBind.nixlRegDList):
            raise TypeError(f"deregister_memory: want the nixlRegDList register_memory returned, "
                            f"not {type(dereg_list).__name__}")
        self._backends(backends)
        if dereg_list.getType() == nixlBind.FILE_SEG:
            self._storage.deregister([(r[0], r[1], r[2], r[3]) for r in dereg_list._rows])
            return
        ranges = [(addr, n) for addr, n, _dev in dereg_list.ranges()]
        for addr, n in ranges:
            if (addr, n) not in self._regs:
                raise nixlNotFoundError(f"deregister_memory: {addr:#x}+{n} is not registered")
        self._storage.drop_mems(ranges)
        for key in ranges:
            if self._regs.pop(key, False):
                self.kv.deregister_range(*key)

    def query_memory(self, reg_list: Any, backend: str,
                     mem_type: Optional[str] = None) -> list[Optional[dict[str, str]]]:
        """Per descriptor: None where it is not there. FILE: the meta names a file; its
        {"size", "mode", "mtime"} when it exists (as NIXL's file plugins). DRAM / VRAM:
        {"mem_type", "registered": "true", "region"} when inside memory registered here."""
        reg = self.get_reg_descs(reg_list, mem_type)
        if self._backend_key(backend) is None:
            raise ValueError(f"Backend '{backend}' not found. Available backends: {list(self.backends.keys())}")
        if reg is None:
            raise TypeError("query_memory: want descriptors get_reg_descs takes")
        if reg.getType() == nixlBind.FILE_SEG:
            return self._storage.query([r[3] for r in reg._rows])
        out: list[Optional[dict[str, str]]] = []
        for a, n, _d in reg.ranges():
            hit = next((i for i, (ra, rn) in enumerate(self._regs) if ra <= a and a + n <= ra + rn), None)
            out.append(None if hit is None else {"mem_type": nixlBind.MEM_NAMES[reg.getType()],
                                                 "registered": "true", "region": str(hit)})
        return out

    def _registered(self, rows: list[tuple[int, int, int]], what: str) -> None:
        look = RangeLookup(self._regs)
        for i, (a, n, _d) in enumerate(rows):
            if look.find(a, n) is None:
                raise nixlNotFoundError(f"{what}: descriptor {i} ({a:#x}+{n}) is not inside "
                                        f"memory registered with agent {self.name!r}")

    # ------------------------------------------------------------------ metadata
    def get_agent_metadata(self) -> bytes:
        return self.kv.metadata()

    def get_partial_agent_metadata(self, descs: nixlBind.nixlRegDList, inc_conn_info: bool = False,
                                   backends: list[str] = []) -> bytes:  # noqa: B006
        """Metadata naming only the registrations holding `descs` (an empty list: the
        connection information alone). A peer's add_remote_agent adds them to what it knows."""
        import json
        self._backends(backends)
        rows = descs.ranges() if descs is not None else []
        self._registered(rows, "get_partial_agent_metadata")
        return json.dumps(self.kv.metadata_dict([(a, n) for a, n, _ in rows],
                                                {"partial": True})).encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's (full or partial) metadata; returns its name as bytes, as NIXL."""
        try:
            return self.kv.add_remote(_b(metadata)).encode()
        except UsageError as exc:
            raise nixlInvalidParamError(f"add_remote_agent: {exc}") from None

    def remove_remote_agent(self, agent: Union[str, bytes]) -> None:
        self.kv.remove_remote(_name(agent))

    def _peer_addr(self, ip_addr: str, what: str) -> str:
        if not ip_addr:
            raise nixlNotSupportedError(f"{what}: there is no central metadata server here "
                                        "(no etcd); give ip_addr and port of the peer's agent")
        return ip_addr

    def _exchange(self, what: str, host: str, port: int, md: dict, timeout: float) -> Optional[dict]:
        """NIXL sends and fetches metadata from its listener thread and reports no failure to
        the caller (the peer's check_remote_metadata stays False); so here: logged."""
        try:
            return exchange(self.kv, host, port, md, timeout)
        except nixlError as exc:
            logger.error("%s: %s", what, exc)
            return None

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        host = self._peer_addr(ip_addr, "send_local_metadata")
        self._exchange("send_local_metadata", host, port, self.kv.metadata_dict(), self.kv.stall_timeout)

    def send_partial_agent_metadata(self, descs: nixlBind.nixlRegDList, inc_conn_info: bool = False,
                                    backends: list[str] = [], ip_addr: str = "",  # noqa: B006
                                    port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        import json
        host = self._peer_addr(ip_addr, "send_partial_agent_metadata")
        md = json.loads(self.get_partial_agent_metadata(descs, inc_conn_info, backends))
        self._exchange("send_partial_agent_metadata", host, port, md, self.kv.stall_timeout)

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "",
                              port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        """Get the metadata of the agent at ip_addr:port (this agent's own goes to it too:
        the exchange is one handshake)."""
        host = self._peer_addr(ip_addr, "fetch_remote_metadata")
        md = self._exchange("fetch_remote_metadata", host, port, self.kv.metadata_dict(),
                            self.kv.stall_timeout)
        if md is None:
            return
        got = self.kv.add_remote(md)
        if got != _name(remote_agent):
            logger.error("fetch_remote_metadata: the agent at %s:%s is %r, not %r",
                         host, port, got, _name(remote_agent))

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Make the agent at ip_addr:port forget this one."""
        host = self._peer_addr(ip_addr, "invalidate_local_metadata")
        self._exchange("invalidate_local_metadata", host, port,
                       self.kv.metadata_dict([], {"invalidate": True}), 1.0)

    def check_remote_metadata(self, agent: Union[str, bytes], descs: Any = None) -> bool:
        name = _name(agent)
        try:
            ra = self.kv.remote(name)
        except UsageError:      # not known
            return False
        rows = descs.ranges() if descs is not None else []
        try:
            for a, n, _d in rows:
                ra.find(a, n)
        except UsageError:
            return False
        return True

    def make_connection(self, remote_agent: Union[str, bytes], backends: list[str] = []) -> None:  # noqa: B006
        self._backends(backends)
        name = _name(remote_agent)
        try:
            self.kv.connect(name)
        except UsageError as exc:
            raise nixlNotFoundError(f"make_connection: {exc}") from None
        except KVError as exc:
            raise _kv_error(exc, "make_connection") from None

    # ------------------------------------------------------------------ transfers
    def _prep(self, agent_name: str, descs: nixlBind.nixlXferDList) -> _Prepped:
        mem = self._mem_kind(descs, "prep_xfer_dlist")
        rows = descs.ranges()
        if mem == "FILE":
            if agent_name != self.name:
                raise nixlNotSupportedError("prep_xfer_dlist: FILE descriptors are the remote "
                                            "side of a transfer, prepared with this agent's own "
                                            f"name ({self.name!r}), not {agent_name!r}")
            self._need_backend("prep_xfer_dlist", ["FILE"])
            p = _Prepped("file", self.name, rows, None, mem)
            p.cols = self._storage.file_cols(rows, "prep_xfer_dlist")
            return p
        local = agent_name in ("", nixlBind.NIXL_INIT_AGENT) or agent_name == self.name
        self._need_backend("prep_xfer_dlist", [mem], network=not local)
        if local:
            self._registered(rows, "prep_xfer_dlist")
            if agent_name == self.name:
                return _Prepped("loop", self.name, rows, None, mem)
            # the KV agent's list only for memory it has (a network backend): a list that
            # only FILE transfers use needs none
            kvlist = None
            if any(self._regs.values()):
                try:
                    kvlist = self.kv.prep_local([(a, n) for a, n, _ in rows])
                except UsageError:
                    pass    # memory registered before the network backend: FILE only
            return _Prepped("init", "", rows, kvlist, mem)
        try:
            return _Prepped("remote", agent_name, rows,
                            self.kv.prep_remote(agent_name, [(a, n) for a, n, _ in rows]), mem)
        except UsageError as exc:
            raise nixlNotFoundError(f"prep_xfer_dlist for {agent_name!r}: {exc}") from None

    def prep_xfer_dlist(self, agent_name: Union[str, bytes], xfer_list: Any, mem_type: Optional[str] = None,
                        backends: list[str] = []) -> nixl_prepped_dlist_handle:  # noqa: B006
        """Prepare a list once: agent_name "" / "NIXL_INIT_AGENT" (local side), a peer's name,
        or this agent's own name (the remote side of a transfer within this agent)."""
        if _is_desc_table(xfer_list) and xfer_list.shape[1] == 5:
            # NIXL 1.5's compressed form: (address, len, dev, stride, count) per row, `count`
            # blocks of `len` bytes `stride` apart; the list holds every block, in row order
            if mem_type is None:
                raise ValueError("Please specify a mem type for strided descriptors")
            rows = [(a + k * st, n, dv) for a, n, dv, st, cnt in xfer_list.tolist() for k in range(cnt)]
            xfer_list = nixlBind.nixlXferDList(self.nixl_mems[mem_type], rows)
        descs = self.get_xfer_descs(xfer_list, mem_type)
        if descs is None:
            raise TypeError("prep_xfer_dlist: want descriptors get_xfer_descs takes")
        self._backends(backends)
        p = self._prep(_name(agent_name), descs)
        h = self.agent.new_id()
        self.agent.dlists[h] = p
        return nixl_prepped_dlist_handle(self.agent, h)

    def _held(self, handle: Any, cls: type, table: dict, what: str) -> Any:
        """What a live handle of type `cls` stands for in `table`."""
        if not isinstance(handle, cls):
            raise nixlInvalidParamError(f"{what}: want a {cls.__name__}, not {handle!r}")
        obj = table.get(handle._handle)
        if obj is None:
            raise nixlInvalidParamError(f"{what}: {handle!r} was released")
        return obj

    def _dlist(self, handle: Any, what: str) -> _Prepped:
        return self._held(handle, nixl_prepped_dlist_handle, self.agent.dlists, what)

    def _make_file(self, op: str, lp: _Prepped, li: list[int], rp: _Prepped, ri: list[int],
                   backends: Sequence[str]) -> nixl_xfer_handle:
        """A transfer between registered memory and FILE: its batch columns, by index."""
        import numpy as np
        backend = self._need_backend("make_prepped_xfer", [lp.mem, "FILE"], backends)
        if len(li) != len(ri):
            raise nixlInvalidParamError(f"{len(li)} local indices but {len(ri)} remote indices")
        if not li:
            raise nixlInvalidParamError("a transfer of no descriptors")
        la, ra = np.asarray(li, np.int64), np.asarray(ri, np.int64)
        if la.min() < 0 or la.max() >= len(lp.rows) or ra.min() < 0 or ra.max() >= len(rp.rows):
            k = int(np.flatnonzero((la < 0) | (la >= len(lp.rows)) | (ra < 0) | (ra >= len(rp.rows)))[0])
            raise nixlInvalidParamError(f"index pair {k} ({li[k]}, {ri[k]}) is outside the lists "
                                        f"({len(lp.rows)} local, {len(rp.rows)} remote)")
        if lp.cols is None or lp.cols[0] != self._storage.generation:
            lp.cols = (self._storage.generation,) + self._storage.mem_cols(lp.rows, "make_prepped_xfer")
        llen = np.fromiter((r[1] for r in lp.rows), np.int64, len(lp.rows))[la]
        rlen = np.fromiter((r[1] for r in rp.rows), np.int64, len(rp.rows))[ra]
        if (llen != rlen).any():
            k = int(np.flatnonzero(llen != rlen)[0])
            raise nixlInvalidParamError(f"index pair {k}: local descriptor {li[k]} has {int(llen[k])} "
                                        f"bytes, FILE descriptor {ri[k]} has {int(rlen[k])}")
        _gen, mems, midx, moff = lp.cols
        files, fidx, foff = rp.cols
        req = _Req(op, self.name, [], len(li), int(llen.sum()), b"", None)
        req.file = FileXfer(op == "WRITE", backend, mems, midx[la], moff[la], files, fidx[ra],
                            foff[ra], llen)
        h = self.agent.new_id()
        self.agent.xfers[h] = req
        return nixl_xfer_handle(self.agent, h)

    def _make(self, op: str, lp: _Prepped, li: list[int], rp: _Prepped, ri: list[int],
              notif: bytes, backends: Sequence[str] = ()) -> nixl_xfer_handle:
        if lp.kind != "init":
            raise nixlInvalidParamError("the local side must be prepared with NIXL_INIT_AGENT")
        if rp.kind == "file":
            return self._make_file(op, lp, li, rp, ri, backends)
        if rp.kind == "init":
            raise nixlInvalidParamError("the remote side must be prepared with a peer's (or this "
                                        "agent's own) name, not NIXL_INIT_AGENT")
        if len(li) != len(ri):
            raise nixlInvalidParamError(f"{len(li)} local indices but {len(ri)} remote indices")
        nbytes = 0
        for k, (i, j) in enumerate(zip(li, ri)):
            if not 0 <= i < len(lp.rows) or not 0 <= j < len(rp.rows):
                raise nixlInvalidParamError(f"index pair {k} ({i}, {j}) is outside the lists "
                                            f"({len(lp.rows)} local, {len(rp.rows)} remote)")
            if lp.rows[i][1] != rp.rows[j][1]:
                raise nixlInvalidParamError(f"index pair {k}: local descriptor {i} has "
                                            f"{lp.rows[i][1]} bytes, remote {j} has {rp.rows[j][1]}")
            nbytes += lp.rows[i][1]
        if rp.kind == "loop":
            ldev = (lambda r: r[2]) if lp.mem == "VRAM" else (lambda r: -1)
            rdev = (lambda r: r[2]) if rp.mem == "VRAM" else (lambda r: -1)
            pairs = [(lp.rows[i][0], rp.rows[j][0], lp.rows[i][1], ldev(lp.rows[i]),
                      rdev(rp.rows[j])) for i, j in zip(li, ri)]
            req = _Req(op, self.name, pairs, len(li), nbytes, notif, None)
        else:
            if lp.kvlist is None:
                raise nixlNotFoundError(
                    "make_prepped_xfer: the local memory is not registered with a network "
                    "backend (register it after create_backend('UCX' or 'P2PHUB'))")
            try:
                x = self.kv.make_xfer(rp.peer, lp.kvlist, li, rp.kvlist, ri, notif=notif, op=op)
            except UsageError as exc:
                if "unknown KV peer" in str(exc):
                    raise nixlNotFoundError(str(exc)) from None
                raise nixlInvalidParamError(str(exc)) from None
            req = _Req(op, rp.peer, [], len(li), nbytes, notif, x)
        h = self.agent.new_id()
        self.agent.xfers[h] = req
        return nixl_xfer_handle(self.agent, h)

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle,
                          local_indices: Union[list[int], Any], remote_xfer_side: nixl_prepped_dlist_handle,
                          remote_indices: Union[list[int], Any], notif_msg: bytes = b"",
                          backends: list[str] = [], skip_desc_merge: bool = False  # noqa: B006
                          ) -> nixl_xfer_handle:
        """A transfer by index into two prepared lists: local[li[k]] <-> remote[ri[k]]."""
        op = "WRITE" if self.nixl_ops[operation] == nixlBind.NIXL_WRITE else "READ"
        self._backends(backends)
        lp = self._dlist(local_xfer_side, "make_prepped_xfer")
        rp = self._dlist(remote_xfer_side, "make_prepped_xfer")
        return self._make(op, lp, _indices(local_indices, "local_indices"), rp,
                          _indices(remote_indices, "remote_indices"), _b(notif_msg), backends)

    def initialize_xfer(self, operation: str, local_descs: nixlBind.nixlXferDList,
                        remote_descs: nixlBind.nixlXferDList, remote_agent: Union[str, bytes],
                        notif_msg: bytes = b"", backends: list[str] = []) -> nixl_xfer_handle:  # noqa: B006
        """A transfer of local_descs[k] <-> remote_descs[k] for every k."""
        op = "WRITE" if self.nixl_ops[operation] == nixlBind.NIXL_WRITE else "READ"
        self._backends(backends)
        for d, side in ((local_descs, "local"), (remote_descs, "remote")):
            if not isinstance(d, nixlBind.nixlXferDList):
                raise TypeError(f"initialize_xfer: {side}_descs must be a nixlXferDList "
                                f"(get_xfer_descs), not {type(d).__name__}")
        if local_descs.descCount() != remote_descs.descCount():
            raise nixlInvalidParamError(f"{local_descs.descCount()} local but "
                                        f"{remote_descs.descCount()} remote descriptors")
        peer = _name(remote_agent)
        if peer != self.name and not self.check_remote_metadata(peer):
            raise nixlNotFoundError(f"initialize_xfer: no metadata of agent {peer!r} "
                                    "(add_remote_agent or fetch_remote_metadata first)")
        lp = self._prep("", local_descs)
        rp = self._prep(peer, remote_descs)
        idx = list(range(local_descs.descCount()))
        return self._make(op, lp, idx, rp, idx, _b(notif_msg), backends)

    def _req(self, handle: Any, what: str) -> _Req:
        return self._held(handle, nixl_xfer_handle, self.agent.xfers, what)

    def _loop(self, req: _Req) -> None:
        for a, b, n, adev, bdev in req.pairs:
            if req.op == "WRITE":
                _copy(b, bdev, a, adev, n)
            else:
                _copy(a, adev, b, bdev, n)
        if req.notif:
            self._own_notifs.setdefault(self.name, []).append(req.notif)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Post the transfer (again, once done). "PROC" while it moves, "DONE" when it
        completed within the call; a failure raises (nixlRemoteDisconnectError names the
        peer), as NIXL's post does. A FILE transfer the engine refuses before moving anything
        answers "ERR" (check_xfer_state then raises nixlBackendError saying why)."""
        req = self._req(handle, "transfer")
        with req.lock:
            if req.posted and req.last_state == "PROC":
                raise nixlRepostActiveError(f"transfer {handle!r} is still in progress and "
                                            "cannot be reposted")
            if notif_msg:
                req.notif = _b(notif_msg)
                if req.x is not None:
                    req.x.messages = [m for m in req.x.messages if m.type != tp.NOTIF]
                    req.x.messages.append(tp.Message(tp.NOTIF, 0, 0, body=req.notif))
            req.done_ns = 0
            req.counted = False
            req.t0 = time.monotonic_ns()
            req.posted = True
            if req.file is not None:
                return self._post_file(req)
            if req.x is None:
                self._loop(req)
                req.loop_state = "DONE"
                req.post_us = max(1, (time.monotonic_ns() - req.t0) // 1000)
                req.mark_done()
                self._est.add(req.nbytes, req.post_us)
                return "DONE"
            x = req.x
            try:
                st = self.kv.post(x)
            except UsageError as exc:
                req.posted = False
                if "unknown KV peer" in str(exc):
                    raise nixlNotFoundError(f"transfer: {exc}") from None
                raise nixlInvalidParamError(f"transfer: {exc}") from None
            req.post_us = max(1, (time.monotonic_ns() - req.t0) // 1000)
            clear = x.on_done
            x.on_done = lambda xx, _c=clear: (req.mark_done(), _c and _c(xx))
            if x.fence.done():
                req.mark_done()
            if st == "ERR":
                raise _kv_error(x.error or KVError("failed"), f"transfer to {req.peer!r}")
            return "PROC" if st == "PROC" else "DONE"

    def _post_file(self, req: _Req) -> str:
        """One batch on the storage engine. A batch it refuses before moving anything (a
        range past the end of the file, a write not aligned for an O_DIRECT file, a file
        open the wrong way) answers "ERR" here, and check_xfer_state raises it."""
        f = req.file
        assert f is not None
        f.fence, f.error = None, None
        try:
            f.fence = self._storage.post(f)
        except (P2PHubError, nixlError) as exc:
            f.error = exc
            logger.error("transfer (%s, %d descriptors): %s", f.backend, req.count, exc)
            return "ERR"
        finally:
            req.post_us = max(1, (time.monotonic_ns() - req.t0) // 1000)
        f.fence.add_done_callback(lambda _f: req.mark_done())
        return req.last_state

    def _file_state(self, req: _Req) -> str:
        f = req.file
        assert f is not None
        st = req.last_state
        if st == "ERR":
            exc = f.error if f.error is not None else f.fence.exception()
            raise nixlBackendError(f"{f.backend} {'WRITE' if f.write else 'READ'} of "
                                   f"{req.count} descriptors failed: {exc}")
        if st == "DONE":
            req.mark_done()
            if not req.counted:
                req.counted = True
                self._est.add(req.nbytes, (req.done_ns - req.t0) // 1000)
        return st

    def _state(self, req: _Req) -> str:
        if not req.posted:
            raise nixlNotPostedError("the transfer was not posted (transfer())")
        if req.file is not None:
            return self._file_state(req)
        if req.x is None:
            return req.loop_state
        st = req.x.state
        if st == "DONE":
            req.mark_done()
            if not req.counted:
                req.counted = True
                self._est.add(req.nbytes, (req.done_ns - req.t0) // 1000)
            return "DONE"
        if st == "ERR":
            raise _kv_error(req.x.error or KVError("failed"), f"transfer to {req.peer!r}")
        return "PROC"

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"DONE" / "PROC"; a failed transfer raises (nixlRemoteDisconnectError for a peer
        that died or stalled past the deadline), as NIXL's getXferStatus does. After
        release_xfer_handle: the state the transfer had when it was released."""
        if isinstance(handle, nixl_xfer_handle) and handle._released:
            return handle._last
        req = self._req(handle, "check_xfer_state")
        st = self._state(req)
        if st == "PROC":
            fence = req.file.fence if req.file is not None else None
            if fence is not None:
                # a FILE transfer: wait a little for it without the GIL (as the plugin's
                # checkXfer does) rather than let a caller polling in a loop take the CPU
                # and the GIL from the engine thread that completes it
                try:
                    fence.exception(_FILE_POLL_WAIT_S)
                except FenceTimeout:
                    return "PROC"
                return self._state(req)
            # NIXL's status check runs without the GIL; a caller polling in a loop must let
            # the transport's threads run between polls, as it does there
            time.sleep(0)
        return st

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlBind.nixlXferTelemetry:
        """startTime (µs, monotonic clock), postDuration and xferDuration (µs), totalBytes,
        descCount. Needs telemetry on (capture_telemetry=True, or NIXL_TELEMETRY_ENABLE=y);
        NIXL_TELEMETRY_ENABLE=n turns it off whatever the config says."""
        if not self.agent.telemetry:
            raise nixlNoTelemetryError("telemetry is not enabled on this agent (capture_telemetry="
                                       "True in nixl_agent_config, or NIXL_TELEMETRY_ENABLE=y)")
        req = self._req(handle, "get_xfer_telemetry")
        if self._state(req) != "DONE":
            return nixlBind.nixlXferTelemetry()
        post = req.post_us
        xfer = max(post, (req.done_ns - req.t0) // 1000)
        return nixlBind.nixlXferTelemetry(req.t0 // 1000, post, xfer, req.nbytes, req.count)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        """(duration µs, error margin µs, method): from the transfers this agent completed
        (method "UNKNOWN": measured, not NIXL's analytical model). Before any completed
        transfer: nixlNotSupportedError."""
        req = self._req(req_handle, "estimate_xfer_cost")
        d, m = self._est.estimate(req.nbytes)
        return d, m, "UNKNOWN"

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        req = self._req(handle, "query_xfer_backend")
        return req.file.backend if req.file is not None else PLUGIN

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def prep_mem_view(self, dlist: Any, *, backends: Optional[list[str]] = None) -> int:
        raise nixlNotSupportedError("prep_mem_view needs UCX's GPU device API; not available here")

    def release_mem_view(self, mvh: int) -> None:
        raise nixlNotSupportedError("prep_mem_view needs UCX's GPU device API; not available here")

    # ------------------------------------------------------------------ notifications
    def _drain(self) -> dict[str, list[bytes]]:
        new = self.kv.get_new_notifs()
        if self._own_notifs:
            for k, v in self._own_notifs.items():
                new.setdefault(k, []).extend(v)
            self._own_notifs = {}
        return new

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        self._backends(backends)
        return self._drain()

    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        self._backends(backends)
        for peer, msgs in self._drain().items():
            self.notifs.setdefault(peer, []).extend(msgs)
        return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: Union[str, bytes], lookup_tag: bytes,
                               backends: list[str] = [], tag_is_prefix: bool = True) -> bool:  # noqa: B006
        self.update_notifs(backends)
        msgs = self.notifs.get(_name(remote_agent_name), [])
        tag = _b(lookup_tag)
        for i, m in enumerate(msgs):
            if (m.startswith(tag) if tag_is_prefix else tag in m):
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: Union[str, bytes], notif_msg: bytes,
                   backend: Optional[str] = None) -> None:
        """A notification not bound to a transfer; it reaches the peer after every transfer
        this agent posted to it before."""
        if backend is not None:
            self._backends([backend])
        name = _name(remote_agent_name)
        if name == self.name:
            self._own_notifs.setdefault(name, []).append(_b(notif_msg))
            return
        try:
            self.kv.send_notif(name, _b(notif_msg))
        except UsageError as exc:
            raise nixlNotFoundError(f"send_notif: {exc}") from None
        except (KVError, TimeoutError) as exc:
            raise _kv_error(exc, f"send_notif to {name!r}") from None
