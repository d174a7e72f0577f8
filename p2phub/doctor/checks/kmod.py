"""kmod.*: p2phub.ko itself: loaded, its device node, ABI, capabilities, and whether it can load."""

from __future__ import annotations

import os
import re
from typing import Any

from .. import probes
from ..model import FAIL, INFO, PASS, SKIP, UNKNOWN, WARN, CheckResult
from .base import Context, R, check

def _kmod_info(ctx: Context) -> dict[str, Any]:
    if "_kmod" not in ctx.__dict__:
        ctx.__dict__["_kmod"] = probes.kmod_info(ctx.sys)
    return ctx.__dict__["_kmod"]


@check("kmod.loaded", "p2phub.ko loaded")
def _kmod_loaded(ctx: Context) -> CheckResult:
    """p2phub.ko pins GPU memory, maps it for each device and owns NVMe controllers; nothing P2P
    happens through p2phub without it."""
    sr = ctx.sys
    if sr.exists("/sys/module/p2phub"):
        st = sr.read("/sys/module/p2phub/initstate")
        ver = sr.read("/sys/module/p2phub/version")
        return R(PASS, f"loaded ({st or 'live'}; version {ver or '?'})", evidence=ctx.ev("/sys/module/p2phub/initstate",
                 "/sys/module/p2phub/version"))
    return R(WARN, "p2phub.ko is not loaded", "build and load it: make -C kmod && sudo insmod kmod/p2phub.ko "
             "(or dkms install)", [{"path": "/sys/module/p2phub", "error": "absent"}])


@check("kmod.devnode", "/dev/p2phub")
def _kmod_dev(ctx: Context) -> CheckResult:
    """The character device the library talks to; the user needs read/write access."""
    st, why = ctx.sys.stat("/dev/p2phub")
    ev = ctx.ev("/dev/p2phub")
    if st is None:
        if ctx.status("kmod.loaded") == PASS:
            return R(FAIL, f"/dev/p2phub missing ({why}) although the module is loaded",
                     "check udev rules / devtmpfs", ev)
        return R(SKIP, "module not loaded", evidence=ev)
    if not st.is_chr:
        return R(FAIL, "/dev/p2phub is not a character device", "remove it and reload p2phub.ko", ev)
    access = ctx.sys.live and os.access("/dev/p2phub", os.R_OK | os.W_OK)
    if ctx.sys.live and not access:
        return R(WARN, f"/dev/p2phub mode {st.perms} not accessible to this user",
                 "add a udev rule: KERNEL==\"p2phub\", GROUP=\"p2phub\", MODE=\"0660\"", ev, mode=st.perms)
    return R(PASS, f"character device, mode {st.perms}", evidence=ev, mode=st.perms)


@check("kmod.abi", "p2phub.ko ABI version")
def _kmod_abi(ctx: Context) -> CheckResult:
    """P2PHUB_GET_INFO's abi_version must match the library's uapi mirror."""
    info = _kmod_info(ctx)
    if info.get("skip"):
        return R(SKIP, info["skip"])
    if info.get("error"):
        return R(UNKNOWN, f"GET_INFO unavailable: {info['error']}")
    want = info.get("expected_abi")
    got = info.get("abi_version")
    if want is not None and got != want:
        return R(FAIL, f"module ABI {got}, library expects {want}", "rebuild and reload p2phub.ko from this release",
                 details_info=info)
    return R(PASS, f"ABI {got} (module {info.get('version')})")


@check("kmod.caps", "p2phub.ko capabilities")
def _kmod_caps(ctx: Context) -> CheckResult:
    """The capabilities p2phub.ko reports: dma-buf import/export, NVIDIA P2P API, NVMe ownership."""
    info = _kmod_info(ctx)
    if info.get("skip"):
        return R(SKIP, info["skip"])
    if info.get("error"):
        return R(UNKNOWN, f"GET_INFO unavailable: {info['error']}")
    caps = info.get("caps_names", [])
    return R(INFO, "caps: " + (", ".join(caps) or "none"), caps=caps)


@check("kmod.loadable", "Module loadability")
def _kmod_loadable(ctx: Context) -> CheckResult:
    """Lockdown, enforced module signatures (module.sig_enforce or CONFIG_MODULE_SIG_FORCE) and
    kernel.modules_disabled stop an unsigned out-of-tree p2phub.ko from loading; building it needs
    the kernel's headers. The verdict names the kernel it is about: on a captured tree, the captured
    kernel (from the capture's uname or its /proc/sys/kernel/osrelease), never the host reading it."""
    sr = ctx.sys
    rel = sr.uname().get("release", "")
    who = (f"the captured kernel {rel}" if not sr.live else f"kernel {rel}") if rel else \
        ("the captured kernel (release not recorded)" if not sr.live else "this kernel (release unknown)")
    sig = sr.read("/sys/module/module/parameters/sig_enforce")
    dis = sr.read("/proc/sys/kernel/modules_disabled")
    build = sr.exists(f"/lib/modules/{rel}/build") if rel else None
    ev = ctx.ev("/sys/kernel/security/lockdown", "/sys/module/module/parameters/sig_enforce",
                "/proc/sys/kernel/modules_disabled", ctx.kconfig_source or "")
    lock_mode = lockdown_mode(ctx)
    blockers = []
    if ctx.kc("MODULES") == "n":
        blockers.append("kernel built without module support (CONFIG_MODULES off)")
    if dis == "1":
        blockers.append("kernel.modules_disabled=1")
    if sig == "Y" or ctx.kc("MODULE_SIG_FORCE") == "y":
        src = "module.sig_enforce=Y" if sig == "Y" else "CONFIG_MODULE_SIG_FORCE=y"
        blockers.append(f"signed modules only ({src}): an unsigned p2phub.ko is refused")
    if lock_mode and lock_mode.split()[0] in ("integrity", "confidentiality"):
        blockers.append(f"kernel lockdown={lock_mode}: unsigned modules are refused")
    d = dict(kernel=rel or None, lockdown=lock_mode, sig_enforce=sig, modules_disabled=dis, headers=build)
    loaded = ctx.status("kmod.loaded") == PASS
    if blockers and not loaded and ctx.kc("MODULES") == "n":
        return R(FAIL, f"{who}: " + "; ".join(blockers), "boot a kernel built with CONFIG_MODULES=y", ev, **d)
    if blockers and not loaded:
        return R(FAIL, f"{who}: " + "; ".join(blockers), "sign p2phub.ko with a key the kernel trusts (enroll it "
                 "with mokutil) or boot a kernel that accepts unsigned modules", ev, **d)
    if loaded:
        return R(PASS, f"already loaded into {who}" + (f" ({'; '.join(blockers)})" if blockers else ""),
                 evidence=ev, **d)
    if build is None:
        return R(UNKNOWN, f"unsigned modules can load into {who}; whether its headers are installed is unknown "
                 "(no kernel release)", evidence=ev, **d)
    if not build:
        return R(WARN, f"unsigned modules can load into {who}, but there are no headers at /lib/modules/{rel}/build "
                 "to build p2phub.ko", f"install the headers for {rel} (linux-headers-{rel} on Debian)", ev, **d)
    return R(PASS, f"unsigned modules can load into {who}; its headers are present", evidence=ev, **d)


def lockdown_mode(ctx: Context) -> str | None:
    """The kernel lockdown mode ("none", "integrity", "confidentiality"), from securityfs or, when
    that is not mounted, from a config that forces it; None when unknown."""
    lock = ctx.sys.read("/sys/kernel/security/lockdown")
    if lock:
        m = re.search(r"\[(\w+)\]", lock)
        return m.group(1) if m else lock
    mode = None
    if ctx.kc("LOCK_DOWN_KERNEL_FORCE_CONFIDENTIALITY") == "y":
        mode = "confidentiality"
    elif ctx.kc("LOCK_DOWN_KERNEL_FORCE_INTEGRITY") == "y":
        mode = "integrity"
    return mode + " (forced by the kernel config; securityfs not mounted)" if mode else None
