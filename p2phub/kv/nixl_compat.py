"""NIXL's Python agent calls over p2phub's KV agent, so a connector written against
``nixl._api.nixl_agent`` moves with an import change:

    from p2phub.kv.nixl_compat import nixl_agent, nixl_agent_config

What maps one to one: register_memory / deregister_memory / get_reg_descs /
get_xfer_descs (lists of (addr, len, dev[, meta]) tuples or Nx3 arrays; host memory),
get_agent_metadata / add_remote_agent / remove_remote_agent, prep_xfer_dlist ("" or
"NIXL_INIT_AGENT" for the local side), make_prepped_xfer and initialize_xfer ("WRITE" and
"READ"),
transfer / check_xfer_state ("DONE" / "PROC" / "ERR"), release_xfer_handle,
release_dlist_handle, get_new_notifs / update_notifs, check_remote_xfer_done, send_notif,
make_connection, and the listener exchange (send_local_metadata / fetch_remote_metadata /
check_remote_metadata, done by the direct handshake).

Not here: VRAM descriptors (the TCP transport moves host memory), backends other than p2phub's own
(the ``backends`` arguments are accepted and ignored), telemetry and cost estimates.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from ..errors import UsageError
from . import transport as tp
from .agent import Agent, DescList

__all__ = ["nixl_agent", "nixl_agent_config", "DEFAULT_COMM_PORT", "NIXL_INIT_AGENT"]

DEFAULT_COMM_PORT = 8888
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"


class nixl_agent_config:  # noqa: N801 - NIXL's name
    def __init__(self, enable_prog_thread: bool = True, enable_listen_thread: bool = False,
                 listen_port: int = DEFAULT_COMM_PORT, capture_telemetry: bool = False,
                 num_threads: int = 0, backends: list[str] = ["UCX"],  # noqa: B006 - NIXL's default
                 sync_mode: Any = None, stall_timeout: float = 10.0) -> None:
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.backends = list(backends)
        self.stall_timeout = stall_timeout


class _DList:
    """A descriptor list: (addr, len, dev) rows and the memory type."""

    def __init__(self, rows: list[tuple[int, int, int]], mem_type: str) -> None:
        self.rows = rows
        self.mem_type = mem_type

    def descCount(self) -> int:  # noqa: N802 - NIXL's name
        return len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


class nixl_prepped_dlist_handle:  # noqa: N801
    def __init__(self, agent: "nixl_agent", dl: DescList) -> None:
        self._agent = agent
        self.dlist: DescList | None = dl

    def release(self) -> None:
        self.dlist = None


class nixl_xfer_handle:  # noqa: N801
    def __init__(self, agent: "nixl_agent", xfer: tp.Xfer) -> None:
        self._agent = agent
        self.xfer: tp.Xfer | None = xfer
        self.posted = False

    def release(self) -> None:
        self.xfer = None


def _memory_object(d: Any) -> Optional[tuple[int, int, int]]:
    """(addr, len, dev) of a tensor or array object's own memory, or None if `d` is not one.

    Torch tensors, objects with ``__cuda_array_interface__`` (VRAM) and objects with
    ``__array_interface__`` are memory: their bytes are registered or moved, their values
    are never read as descriptors. Only an N x 3 integer numpy array given as ``descs`` is
    a descriptor table (NIXL's meaning)."""
    if hasattr(d, "data_ptr") and hasattr(d, "element_size") and hasattr(d, "numel"):
        if getattr(d, "is_cuda", False):
            raise UsageError("VRAM tensors: the TCP transport moves host memory only")
        if hasattr(d, "is_contiguous") and not d.is_contiguous():
            raise UsageError("a non-contiguous tensor cannot be registered or moved as one range")
        return int(d.data_ptr()), int(d.numel() * d.element_size()), 0
    if hasattr(d, "__cuda_array_interface__"):
        raise UsageError("VRAM arrays: the TCP transport moves host memory only")
    ai = getattr(d, "__array_interface__", None)
    if isinstance(ai, dict):
        import math
        shape = tuple(ai.get("shape", ()))
        itemsize = int(ai["typestr"][2:])
        n = math.prod(shape) * itemsize
        strides = ai.get("strides")
        if strides is not None:
            want, expect = itemsize, []
            for dim in reversed(shape):
                expect.insert(0, want)
                want *= dim
            if tuple(strides) != tuple(expect) and n:
                raise UsageError("a non-contiguous array cannot be registered or moved as one range")
        return int(ai["data"][0]), n, 0
    return None


def _is_desc_array(descs: Any) -> bool:
    """An N x 3 (or N x 4) numpy array of integers: NIXL's descriptor table."""
    ai = getattr(descs, "__array_interface__", None)
    return (type(descs).__module__ == "numpy" and isinstance(ai, dict)
            and len(ai.get("shape", ())) == 2 and ai["typestr"][1] in "iu")


def _rows(descs: Any) -> list[tuple[int, int, int]]:
    if isinstance(descs, _DList):
        return list(descs.rows)
    if _is_desc_array(descs):
        if descs.shape[1] not in (3, 4):
            raise UsageError(f"descriptor array must be Nx3, not {tuple(descs.shape)}")
        return [(int(r[0]), int(r[1]), int(r[2])) for r in descs.tolist()]
    whole = _memory_object(descs)
    if whole is not None:            # one tensor / array: its own memory
        return [whole]
    out = []
    for d in descs:
        mem = _memory_object(d)
        if mem is not None:
            out.append(mem)
        elif isinstance(d, tuple) and len(d) in (3, 4):
            out.append((int(d[0]), int(d[1]), int(d[2])))
        else:
            raise UsageError(f"descriptor {d!r}: want (addr, len, dev[, meta]), a tensor or an Nx3 array")
    return out


def _mem(mem_type: Optional[str]) -> str:
    mt = {"cpu": "DRAM", "cuda": "VRAM"}.get(mem_type or "DRAM", mem_type or "DRAM")
    if mt != "DRAM":
        raise UsageError(f"mem_type {mem_type!r}: p2phub's TCP transport moves DRAM only")
    return mt


class nixl_agent:  # noqa: N801
    """NIXL's nixl_agent, over p2phub.kv.Agent."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None,
                 instantiate_all: bool = False) -> None:
        conf = nixl_conf or nixl_agent_config()
        port = conf.port if conf.enable_listen else 0
        self.name = agent_name
        self.agent = Agent(agent_name, port=port, stall_timeout=conf.stall_timeout)
        self.backends = {"P2PHUB": None}
        self.notifs: dict[str, list[bytes]] = {}
        self._regs: list[tuple[int, int]] = []

    # ------------------------------------------------------------------ memory
    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> _DList:
        return _DList(_rows(descs), _mem(mem_type))

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> _DList:
        return _DList(_rows(descs), _mem(mem_type))

    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None,
                        backends: list[str] = []) -> _DList:  # noqa: B006
        dl = self.get_reg_descs(reg_list, mem_type)
        for addr, n, _dev in dl.rows:
            if (addr, n) not in self._regs:
                self.agent.register_memory(addr, n)
                self._regs.append((addr, n))
        return dl

    def deregister_memory(self, dereg_list: _DList, backends: list[str] = []) -> None:  # noqa: B006
        # Segment ids are positional on the wire: a deregistered range stays known until
        # the agent is closed, but is no longer listed as registered here.
        for addr, n, _dev in dereg_list.rows:
            if (addr, n) in self._regs:
                self._regs.remove((addr, n))

    # ------------------------------------------------------------------ metadata
    def get_agent_metadata(self) -> bytes:
        return self.agent.metadata()

    def add_remote_agent(self, metadata: bytes) -> str:
        return self.agent.add_remote(metadata)

    def remove_remote_agent(self, agent: str) -> None:
        self.agent.remove_remote(agent)

    def make_connection(self, remote_agent: str, backends: list[str] = []) -> None:  # noqa: B006
        self.agent.connect(remote_agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.agent.handshake(ip_addr or "127.0.0.1", port)

    def fetch_remote_metadata(self, remote_name: str, ip_addr: str = "",
                              port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        got = self.agent.handshake(ip_addr or "127.0.0.1", port)
        if got != remote_name:
            raise UsageError(f"the agent at {ip_addr}:{port} is {got!r}, not {remote_name!r}")

    def check_remote_metadata(self, remote_name: str, descs: Any = None) -> bool:
        try:
            self.agent.remote(remote_name)
            return True
        except UsageError:
            return False

    # ------------------------------------------------------------------ transfers
    def prep_xfer_dlist(self, agent_name: str, xfer_list: Any, mem_type: Optional[str] = None,
                        backends: list[str] = []) -> nixl_prepped_dlist_handle:  # noqa: B006
        rows = self.get_xfer_descs(xfer_list, mem_type).rows
        pairs = [(a, n) for a, n, _d in rows]
        if agent_name in ("", NIXL_INIT_AGENT):
            return nixl_prepped_dlist_handle(self, self.agent.prep_local(pairs))
        if agent_name == self.name:
            raise NotImplementedError("loopback transfers within one agent: use a second agent")
        return nixl_prepped_dlist_handle(self, self.agent.prep_remote(agent_name, pairs))

    @staticmethod
    def _op(operation: str) -> str:
        if operation not in ("WRITE", "READ"):
            raise UsageError(f"operation {operation!r} must be 'WRITE' or 'READ'")
        return operation

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle,
                          local_indices: Sequence[int], remote_xfer_side: nixl_prepped_dlist_handle,
                          remote_indices: Sequence[int], notif_msg: bytes = b"",
                          backends: list[str] = [], skip_desc_merge: bool = False  # noqa: B006
                          ) -> nixl_xfer_handle:
        op = self._op(operation)
        ld, rd = local_xfer_side.dlist, remote_xfer_side.dlist
        if ld is None or rd is None:
            raise UsageError("descriptor list handle was released")
        li = [int(i) for i in (local_indices.tolist() if hasattr(local_indices, "tolist") else local_indices)]
        ri = [int(i) for i in (remote_indices.tolist() if hasattr(remote_indices, "tolist") else remote_indices)]
        x = self.agent.make_xfer(rd.peer or "", ld, li, rd, ri, notif=_b(notif_msg), op=op)
        return nixl_xfer_handle(self, x)

    def initialize_xfer(self, operation: str, local_descs: _DList, remote_descs: _DList,
                        remote_agent: str, notif_msg: bytes = b"",
                        backends: list[str] = []) -> nixl_xfer_handle:  # noqa: B006
        op = self._op(operation)
        if len(local_descs.rows) != len(remote_descs.rows):
            raise UsageError(f"{len(local_descs.rows)} local but {len(remote_descs.rows)} remote descriptors")
        ld = self.agent.prep_local([(a, n) for a, n, _ in local_descs.rows])
        rd = self.agent.prep_remote(remote_agent, [(a, n) for a, n, _ in remote_descs.rows])
        idx = list(range(len(local_descs.rows)))
        return nixl_xfer_handle(self, self.agent.make_xfer(remote_agent, ld, idx, rd, idx,
                                                           notif=_b(notif_msg), op=op))

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        x = handle.xfer
        if x is None:
            raise UsageError("transfer handle was released")
        if notif_msg:
            body = _b(notif_msg)
            x.messages = [m for m in x.messages if m.type != tp.NOTIF]
            x.messages.append(tp.Message(tp.NOTIF, 0, 0, body=body))
        if x.posted and not x.fence.done():
            return "ERR"  # one active transfer per handle, as in NIXL
        return self.agent.post(x)

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        if handle.xfer is None:
            raise UsageError("transfer handle was released")
        return handle.xfer.state

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    # ------------------------------------------------------------------ notifications
    def update_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        for peer, msgs in self.agent.get_new_notifs().items():
            self.notifs.setdefault(peer, []).extend(msgs)
        return self.notifs

    def get_new_notifs(self, backends: list[str] = []) -> dict[str, list[bytes]]:  # noqa: B006
        self.update_notifs()
        out, self.notifs = self.notifs, {}
        return out

    def check_remote_xfer_done(self, remote_agent_name: str, lookup_tag: bytes,
                               backends: list[str] = [], tag_is_prefix: bool = True) -> bool:  # noqa: B006
        self.update_notifs()
        msgs = self.notifs.get(remote_agent_name, [])
        tag = _b(lookup_tag)
        for i, m in enumerate(msgs):
            if (m.startswith(tag) if tag_is_prefix else tag in m):
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None) -> None:
        self.agent.send_notif(remote_agent_name, _b(notif_msg))

    def close(self) -> None:
        self.agent.close()

    def __del__(self) -> None:
        try:
            self.agent.close()
        except Exception:
            pass


def _b(msg: bytes | str) -> bytes:
    return msg.encode() if isinstance(msg, str) else bytes(msg)


def wait_state(agent: nixl_agent, handle: nixl_xfer_handle, timeout: float) -> str:
    """Poll check_xfer_state until it leaves "PROC" or `timeout` passes (a helper for tests)."""
    deadline = time.monotonic() + timeout
    while True:
        st = agent.check_xfer_state(handle)
        if st != "PROC" or time.monotonic() >= deadline:
            return st
        time.sleep(0.0005)
