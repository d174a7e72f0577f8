"""Probes that need a library or a device rather than a file: CUDA dma-buf support, RDMA dma-buf MR
support, and p2phub.ko's GET_INFO. Live they run through ctypes; for a captured tree they come from
the capture's metadata (``probes`` in p2phub-capture.json), or report why they are unavailable."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
from typing import Any

from .. import uapi as _uapi
from .sysroot import SysRoot

CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 116
# Capability bit -> name, from the UAPI mirror (one source of truth).
CAP_NAMES = {int(c).bit_length() - 1: str(c.name) for c in _uapi.Cap}


def _from_capture(sr: SysRoot, name: str) -> dict[str, Any] | None:
    if sr.live:
        return None
    probes = sr.meta.get("probes") or {}
    if name in probes:
        return dict(probes[name])
    return {"error": "not recorded in this capture"}


def cuda_dmabuf(sr: SysRoot) -> dict[str, Any]:
    cap = _from_capture(sr, "cuda_dmabuf")
    if cap is not None:
        return cap
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return {"error": f"libcuda.so.1 not loadable ({exc})"}
    try:
        rc = lib.cuInit(0)
        if rc != 0:
            return {"error": f"cuInit failed ({rc})"}
        ver = ctypes.c_int(0)
        lib.cuDriverGetVersion(ctypes.byref(ver))
        n = ctypes.c_int(0)
        lib.cuDeviceGetCount(ctypes.byref(n))
        devs = []
        for i in range(n.value):
            dev = ctypes.c_int(0)
            if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
                continue
            a, b = ctypes.c_int(0), ctypes.c_int(0)
            r1 = lib.cuDeviceGetAttribute(ctypes.byref(a), CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev)
            r2 = lib.cuDeviceGetAttribute(ctypes.byref(b), CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED, dev)
            devs.append({"index": i, "dmabuf": bool(a.value) if r1 == 0 else None,
                         "gpudirect_rdma": bool(b.value) if r2 == 0 else None})
        return {"driver_version": ver.value, "devices": devs}
    except (AttributeError, OSError) as exc:
        return {"error": f"CUDA driver API call failed ({exc})"}


class _IbvDevice(ctypes.Structure):
    pass


def ibv_dmabuf(sr: SysRoot) -> dict[str, Any]:
    """NCCL's technique: ibv_reg_dmabuf_mr(pd, 0, 0, 0, fd=-1, 0) and look at errno."""
    cap = _from_capture(sr, "ibv_dmabuf")
    if cap is not None:
        return cap
    path = ctypes.util.find_library("ibverbs") or "libibverbs.so.1"
    try:
        lib = ctypes.CDLL(path, use_errno=True)
    except OSError as exc:
        return {"error": f"libibverbs not loadable ({exc})"}
    if not hasattr(lib, "ibv_reg_dmabuf_mr"):
        return {"error": "libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34)"}
    lib.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
    lib.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    lib.ibv_get_device_name.restype = ctypes.c_char_p
    lib.ibv_get_device_name.argtypes = [ctypes.c_void_p]
    lib.ibv_open_device.restype = ctypes.c_void_p
    lib.ibv_open_device.argtypes = [ctypes.c_void_p]
    lib.ibv_alloc_pd.restype = ctypes.c_void_p
    lib.ibv_alloc_pd.argtypes = [ctypes.c_void_p]
    lib.ibv_reg_dmabuf_mr.restype = ctypes.c_void_p
    lib.ibv_reg_dmabuf_mr.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_uint64,
                                      ctypes.c_int, ctypes.c_int]
    lib.ibv_dereg_mr.argtypes = [ctypes.c_void_p]
    lib.ibv_dealloc_pd.argtypes = [ctypes.c_void_p]
    lib.ibv_close_device.argtypes = [ctypes.c_void_p]
    lib.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    n = ctypes.c_int(0)
    lst = lib.ibv_get_device_list(ctypes.byref(n))
    if not lst:
        return {"error": "ibv_get_device_list failed (no uverbs access?)"}
    out: dict[str, bool | None] = {}
    try:
        for i in range(n.value):
            name = (lib.ibv_get_device_name(lst[i]) or b"?").decode()
            ctx = lib.ibv_open_device(lst[i])
            if not ctx:
                out[name] = None
                continue
            pd = lib.ibv_alloc_pd(ctx)
            if pd:
                ctypes.set_errno(0)
                mr = lib.ibv_reg_dmabuf_mr(pd, 0, 0, 0, -1, 0)
                err = ctypes.get_errno()
                if mr:
                    lib.ibv_dereg_mr(mr)
                out[name] = err not in (errno.EOPNOTSUPP, errno.EPROTONOSUPPORT)
                lib.ibv_dealloc_pd(pd)
            else:
                out[name] = None
            lib.ibv_close_device(ctx)
    finally:
        lib.ibv_free_device_list(lst)
    return {"devices": out}


def kmod_info(sr: SysRoot) -> dict[str, Any]:
    """p2phub.ko's GET_INFO through p2phub.device (imported lazily)."""
    if not sr.live:
        cap = (sr.meta.get("probes") or {}).get("kmod_info")
        if cap:
            return dict(cap)
        return {"skip": "not recorded in this capture"}
    if not sr.exists("/dev/p2phub"):
        return {"skip": "/dev/p2phub absent (module not loaded)"}
    try:
        from .. import device, uapi
    except ImportError as exc:
        return {"error": f"p2phub.device unavailable ({exc})"}
    try:
        info = device.get_info()
    except Exception as exc:  # noqa: BLE001 - any failure here is a finding, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}
    caps = int(getattr(info, "caps", 0) or 0)
    return {"abi_version": getattr(info, "abi_version", None), "version": getattr(info, "version", None),
            "caps": caps, "caps_names": [v for b, v in CAP_NAMES.items() if caps & (1 << b)],
            "expected_abi": getattr(uapi, "P2PHUB_ABI_VERSION", getattr(uapi, "ABI_VERSION", None))}
