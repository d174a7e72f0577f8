"""Probes that need a library or a device rather than a file: CUDA dma-buf support, RDMA dma-buf MR
support, and p2phub.ko's GET_INFO. Live they run through ctypes; for a captured tree they come from
the capture's metadata (``probes`` in p2phub-capture.json), or report why they are unavailable."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
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


def ibv_dmabuf(sr: SysRoot) -> dict[str, Any]:
    """dma-buf MR support per RDMA device: p2phub.rdma's own probe (one probe, one errno policy)."""
    cap = _from_capture(sr, "ibv_dmabuf")
    if cap is not None:
        return cap
    try:
        from ..rdma import probe
    except ImportError as exc:
        return {"error": f"p2phub.rdma unavailable ({exc})"}
    return probe.probe_all()


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
        from .. import device
    except ImportError as exc:
        return {"error": f"p2phub.device unavailable ({exc})"}
    try:
        info = device.get_info()
    except Exception as exc:  # noqa: BLE001 - any failure here is a finding, not a crash
        return {"error": f"{type(exc).__name__}: {exc}"}
    caps = int(getattr(info, "caps", 0) or 0)
    return {"abi_version": getattr(info, "abi_version", None), "version": getattr(info, "version", None),
            "caps": caps, "caps_names": [v for b, v in CAP_NAMES.items() if caps & (1 << b)],
            "expected_abi": _uapi.ABI_VERSION}


MODINFO_FIELDS = ("filename", "version", "signer", "sig_key", "sig_id", "sig_hashalgo")


def kmod_signature(sr: SysRoot, release: str) -> dict[str, Any]:
    """The installed p2phub.ko for ``release`` and its signature, as ``modinfo`` reports them:
    ``{"filename", "version", "signer", "sig_key", "sig_id", "sig_hashalgo"}`` (the sig_* keys
    absent for an unsigned module), or ``{"error": why}`` (not installed, no modinfo)."""
    if not sr.live:
        cap = (sr.meta.get("probes") or {}).get("kmod_signature")
        return dict(cap) if cap else {"error": "not recorded in this capture"}
    modinfo = shutil.which("modinfo") or next((p for p in ("/usr/sbin/modinfo", "/sbin/modinfo")
                                               if os.path.exists(p)), None)
    if modinfo is None:
        return {"error": "modinfo not found (the kmod package)"}
    try:
        res = subprocess.run([modinfo, "-k", release, "p2phub"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"modinfo failed ({exc})"}
    if res.returncode != 0:
        return {"error": f"p2phub.ko is not installed for {release}" if "not found" in res.stderr
                else (res.stderr.strip() or f"modinfo exited {res.returncode}")}
    out: dict[str, Any] = {}
    for line in res.stdout.splitlines():
        key, sep, value = line.partition(":")
        if sep and key in MODINFO_FIELDS and key not in out:
            out[key] = value.strip()
    return out
