"""Tensors and arrays given to the NIXL adapter are memory: their own bytes are registered and
moved; their values are never read as a descriptor table (a 2x3 float array once became the
descriptors (4096, 64, 0), (8192, 64, 0))."""

from __future__ import annotations

import time

import pytest

np = pytest.importorskip("numpy")

from p2phub.nixl import nixl_agent, nixl_agent_config  # noqa: E402


def _torch():
    try:
        import torch
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return None
    return torch


def _pair():
    a = nixl_agent("mem-a", nixl_agent_config(backends=["UCX"]))
    b = nixl_agent("mem-b", nixl_agent_config(backends=["UCX"]))
    a.add_remote_agent(b.get_agent_metadata())
    return a, b


def _wait(agent, h, timeout=10.0) -> str:
    deadline = time.monotonic() + timeout
    st = agent.check_xfer_state(h)
    while st == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
        st = agent.check_xfer_state(h)
    return st


def _rows(dl):
    if hasattr(dl, "rows"):
        return [tuple(r[:3]) for r in dl.rows]
    return [tuple(dl[i][:3]) for i in range(dl.descCount())]


def test_numpy_float_array_is_its_own_memory() -> None:
    a, _b = _pair()
    try:
        arr = np.arange(6, dtype=np.float32).reshape(2, 3) * 4096.0   # values look like addresses
        reg = a.register_memory(arr)
        assert _rows(reg) == [(arr.ctypes.data, arr.nbytes, 0)]
        xd = a.get_xfer_descs([arr[0], arr[1]])
        assert _rows(xd) == [(arr.ctypes.data, 12, 0), (arr.ctypes.data + 12, 12, 0)]
    finally:
        a.close()
        _b.close()


def test_integer_nx3_numpy_array_is_still_a_descriptor_table() -> None:
    a, b = _pair()
    try:
        buf = np.zeros(4096, dtype=np.uint8)
        table = np.array([[buf.ctypes.data, 1024, 0], [buf.ctypes.data + 2048, 512, 0]], dtype=np.uint64)
        dl = a.get_xfer_descs(table, "DRAM")
        assert _rows(dl) == [(buf.ctypes.data, 1024, 0), (buf.ctypes.data + 2048, 512, 0)]
    finally:
        a.close()
        b.close()


def _roundtrip(a, b, src, dst, src_list, dst_list) -> None:
    a.register_memory(src)
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    h = a.initialize_xfer("WRITE", a.get_xfer_descs(src_list), a.get_xfer_descs(dst_list),
                          b.name, b"memobj")
    assert a.transfer(h) in ("PROC", "DONE")
    assert _wait(a, h) == "DONE"
    deadline = time.monotonic() + 10
    while not b.check_remote_xfer_done(a.name, b"memobj"):
        assert time.monotonic() < deadline, "no notification"
        time.sleep(0.001)
    a.release_xfer_handle(h)


def test_numpy_arrays_move_their_bytes() -> None:
    a, b = _pair()
    try:
        src = (np.arange(2 * 1024, dtype=np.float32).reshape(2, 1024) + 0.5)
        dst = np.zeros_like(src)
        _roundtrip(a, b, src, dst, [src[0], src[1]], [dst[1], dst[0]])
        assert (dst[1] == src[0]).all() and (dst[0] == src[1]).all()
    finally:
        a.close()
        b.close()


def test_torch_cpu_tensors_move_their_bytes() -> None:
    torch = _torch()
    if torch is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0 takes the local CPU build)")
    a, b = _pair()
    try:
        src = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 3) * 4096
        dst = torch.zeros(2, 3, dtype=torch.float32)
        reg = a.register_memory(src)
        assert _rows(reg) == [(src.data_ptr(), 24, 0)]          # not (0, 4096, 8192), ...
        _roundtrip(a, b, torch.zeros(1), dst, [src], [dst])
        assert torch.equal(dst, src)
        rows = [src[i, :] for i in range(2)]
        assert _rows(a.get_xfer_descs(rows)) == [(src.data_ptr(), 12, 0), (src.data_ptr() + 12, 12, 0)]
    finally:
        a.close()
        b.close()
