"""kmod.*: p2phub.ko itself: loaded, its device node, ABI, capabilities, and whether it can load."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from .. import probes
from ..model import FAIL, INFO, PASS, SKIP, UNKNOWN, WARN, CheckResult
from .base import Context, R, check

INSTALL_DOC = "docs/install.md"

def _kmod_sig(ctx: Context) -> dict[str, Any]:
    """modinfo's view of the installed p2phub.ko for the kernel the report is about."""
    if "_kmod_sig" not in ctx.__dict__:
        ctx.__dict__["_kmod_sig"] = probes.kmod_signature(ctx.sys, ctx.sys.uname().get("release", ""))
    return ctx.__dict__["_kmod_sig"]


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
    sig = _kmod_sig(ctx)
    if sig.get("filename"):
        return R(WARN, f"p2phub.ko is installed ({sig['filename']}) but not loaded", "sudo modprobe p2phub "
                 f"(loaded at every boot by /etc/modules-load.d/p2phub.conf: {INSTALL_DOC} step 4)",
                 [{"path": "/sys/module/p2phub", "error": "absent"}])
    return R(WARN, "p2phub.ko is not loaded", f"install its DKMS package and load it: {INSTALL_DOC} step 4 "
             "(sudo make -C kmod dkms-install, in a p2phub source tree)",
             [{"path": "/sys/module/p2phub", "error": "absent"}])


@check("kmod.devnode", "/dev/p2phub")
def _kmod_dev(ctx: Context) -> CheckResult:
    """The character device the library talks to; the user needs read/write access."""
    st, why = ctx.sys.stat("/dev/p2phub")
    ev = ctx.ev("/dev/p2phub")
    if st is None:
        if ctx.status("kmod.loaded") == PASS:
            return R(FAIL, f"/dev/p2phub missing ({why}) although the module is loaded",
                     "check that devtmpfs is mounted on /dev and udev runs (udevadm settle)", ev)
        return R(SKIP, "module not loaded", evidence=ev)
    if not st.is_chr:
        return R(FAIL, "/dev/p2phub is not a character device", "remove it and reload p2phub.ko", ev)
    access = ctx.sys.live and os.access("/dev/p2phub", os.R_OK | os.W_OK)
    if ctx.sys.live and not access:
        return R(WARN, f"/dev/p2phub mode {st.perms} not accessible to this user",
                 f"join group p2phub (sudo usermod -aG p2phub $USER, then log in again); the DKMS package "
                 f"installs the udev rule that gives the group the node: {INSTALL_DOC} steps 4-5",
                 ev, mode=st.perms)
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
        return R(FAIL, f"module ABI {got}, library expects {want}", "install p2phub.ko from the source of the "
                 f"release pip installed, then reload it: {INSTALL_DOC} step 4",
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
    nv = [g.id for g in ctx.top.gpus if g.info.get("flavour") == "nvidia"]
    if nv and "NVIDIA_P2P_BUILT" not in caps:
        return R(WARN, "caps: " + (", ".join(caps) or "none") + f"; built without the NVIDIA P2P provider "
                 f"although {', '.join(nv)} {'is an NVIDIA GPU' if len(nv) == 1 else 'are NVIDIA GPUs'} "
                 "(only dma-buf pins CUDA memory)", f"install the driver's kernel source ({INSTALL_DOC} step 2), "
                 f"then reinstall p2phub.ko with P2PHUB_NVIDIA=y ({INSTALL_DOC} step 4)", applies_to=nv, caps=caps)
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
    facts = signature_facts(ctx)
    build = sr.exists(f"/lib/modules/{rel}/build") if rel else None
    ev = ctx.ev("/sys/kernel/security/lockdown", "/sys/module/module/parameters/sig_enforce",
                "/proc/sys/kernel/modules_disabled", ctx.kconfig_source or "")
    lock_mode = lockdown_mode(ctx)
    blockers = []
    if ctx.kc("MODULES") == "n":
        blockers.append("kernel built without module support (CONFIG_MODULES off)")
    if dis == "1":
        blockers.append("kernel.modules_disabled=1")
    if facts.trusted:
        pass    # signed with a key the kernel trusts: enforcement does not stop it (kmod.signature)
    else:
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
        return R(FAIL, f"{who}: " + "; ".join(blockers), "sign p2phub.ko with a key the kernel trusts, enrolled "
                 f"with mokutil ({INSTALL_DOC} step 3; kmod.signature says what is missing), or boot a kernel "
                 "that accepts unsigned modules", ev, **d)
    if loaded:
        return R(PASS, f"already loaded into {who}" + (f" ({'; '.join(blockers)})" if blockers else ""),
                 evidence=ev, **d)
    if build is None:
        return R(UNKNOWN, f"{'p2phub.ko' if facts.trusted else 'unsigned modules'} can load into {who}; whether its headers are installed is unknown "
                 "(no kernel release)", evidence=ev, **d)
    what = (f"p2phub.ko (signed by '{facts.signer}', a key it trusts)" if facts.trusted
            else "unsigned modules")
    if not build:
        return R(WARN, f"{what} can load into {who}, but there are no headers at /lib/modules/{rel}/build "
                 "to build p2phub.ko", f"install the headers for {rel} (linux-headers-{rel} on Debian/Ubuntu, "
                 f"kernel-devel-{rel} on RHEL; {INSTALL_DOC} step 1)", ev, **d)
    return R(PASS, f"{what} can load into {who}; its headers are present", evidence=ev, **d)


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


# ------------------------------------------------------------------------------------------------
# Secure Boot and module signatures
EFIVARS = "/sys/firmware/efi/efivars"
EFI_GLOBAL = "8be4df61-93ca-11d2-aa0d-00e098032b8c"   # SecureBoot
SHIM_GUID = "605dab50-e046-4300-abb6-3dd810dd8b23"    # MokNew, MokSBStateRT
SECURE_BOOT_VAR = f"{EFIVARS}/SecureBoot-{EFI_GLOBAL}"
MOK_NEW_VAR = f"{EFIVARS}/MokNew-{SHIM_GUID}"           # a mokutil --import waiting for the next boot
MOK_SB_STATE_VAR = f"{EFIVARS}/MokSBStateRT-{SHIM_GUID}"  # shim's validation turned off (mokutil)
# The DKMS signing certificate, for the enrol command (Debian/RHEL dkms; Ubuntu uses its own MOK).
DKMS_CERTS = ("/var/lib/dkms/mok.pub", "/var/lib/shim-signed/mok/MOK.der")


@dataclass
class SignatureFacts:
    """What decides whether this kernel accepts the installed p2phub.ko's signature."""

    secure_boot: bool | None       # None: unknown (EFI without a readable SecureBoot variable)
    secure_boot_why: str
    enforcing: list[str]           # why the kernel refuses modules it cannot verify
    module: dict[str, Any]         # modinfo of the installed p2phub.ko, or {"error": ...}
    signer: str | None             # None: unsigned (or not installed)
    trusted: bool | None           # signer among the kernel's keys; None: keys not readable
    keys_seen: list[str] = field(default_factory=list)
    mok_pending: bool = False
    loaded_taint: str | None = None


def _efi_flag(ctx: Context, path: str) -> bool | None:
    """An EFI variable's one-byte value (after the 4 attribute bytes): True/False, None if unreadable."""
    data, _ = ctx.sys.read_bytes(path, 64)
    if data is None or len(data) < 5:
        return None
    return data[4] == 1


def _keys(ctx: Context) -> list[str]:
    """Descriptions of the asymmetric keys /proc/keys shows (the system keyrings show to root only)."""
    lines = ctx.sys.grep("/proc/keys", ["asymmetri"], limit=200) or []
    out = []
    for line in lines:
        m = re.search(r"\basymmetri\s+(.*)$", line)
        if m:
            out.append(m.group(1))
    return out


def signature_facts(ctx: Context) -> SignatureFacts:
    if "_sigfacts" in ctx.__dict__:
        return ctx.__dict__["_sigfacts"]
    sr = ctx.sys
    if not sr.exists("/sys/firmware/efi"):
        sb, why = False, "no EFI firmware (legacy boot): no Secure Boot"
    else:
        sb = _efi_flag(ctx, SECURE_BOOT_VAR)
        why = {True: "Secure Boot on", False: "Secure Boot off",
               None: "EFI boot; the SecureBoot variable is unreadable"}[sb]
        if sb and _efi_flag(ctx, MOK_SB_STATE_VAR):
            why += " (shim's validation disabled with mokutil)"
    enforcing = []
    if sr.read("/sys/module/module/parameters/sig_enforce") == "Y":
        enforcing.append("module.sig_enforce=Y")
    if ctx.kc("MODULE_SIG_FORCE") == "y":
        enforcing.append("CONFIG_MODULE_SIG_FORCE=y")
    lock = lockdown_mode(ctx)
    if lock and lock.split()[0] in ("integrity", "confidentiality"):
        enforcing.append(f"lockdown={lock.split()[0]}")
    mod = _kmod_sig(ctx)
    signer = (mod.get("signer") or None) if not mod.get("error") else None
    keys = _keys(ctx)
    trusted = None
    if signer and keys:
        trusted = any(k.startswith(signer + ":") for k in keys)
    facts = SignatureFacts(sb, why, enforcing, mod, signer, trusted, keys,
                           mok_pending=sr.exists(MOK_NEW_VAR),
                           loaded_taint=sr.read("/sys/module/p2phub/taint") if sr.exists("/sys/module/p2phub")
                           else None)
    ctx.__dict__["_sigfacts"] = facts
    return facts


def _enrol_fix(ctx: Context) -> str:
    cert = next((c for c in DKMS_CERTS if ctx.sys.exists(c)), DKMS_CERTS[0])
    return (f"enrol the signing key: sudo mokutil --import {cert}, reboot, confirm it in MokManager "
            f"({INSTALL_DOC} step 3)")


@check("kmod.signature", "Module signature and Secure Boot")
def _kmod_signature(ctx: Context) -> CheckResult:
    """With Secure Boot on (lockdown=integrity) or signature enforcement, the kernel loads p2phub.ko
    only if it is signed with a key the kernel trusts: for an out-of-tree module, a Machine Owner
    Key enrolled with `mokutil --import` and confirmed in MokManager at the next boot, which DKMS
    signs with. Reads the SecureBoot EFI variable, the enforcement (module.sig_enforce, lockdown,
    CONFIG_MODULE_SIG_FORCE), the installed module's signer (modinfo), the kernel's keys
    (/proc/keys, root only) and a pending enrollment (the MokNew EFI variable)."""
    f = signature_facts(ctx)
    ev = ctx.ev(SECURE_BOOT_VAR, MOK_NEW_VAR, "/proc/keys", "/sys/module/module/parameters/sig_enforce",
                "/sys/kernel/security/lockdown", "/sys/module/p2phub/taint")
    d = dict(secure_boot=f.secure_boot, enforcing=f.enforcing, module=f.module, signer=f.signer,
             trusted=f.trusted, mok_pending=f.mok_pending)
    if f.module.get("error"):
        what = f"p2phub.ko: {f.module['error']}"
    elif f.signer:
        what = (f"p2phub.ko ({f.module.get('filename')}) is signed by '{f.signer}'"
                + {True: ", a key the kernel trusts", False: ", a key the kernel does not trust",
                   None: ""}[f.trusted])
    else:
        what = f"p2phub.ko ({f.module.get('filename')}) is unsigned"
    enforced = f"{f.secure_boot_why}; " + (f"only verified modules load ({', '.join(f.enforcing)})"
                                            if f.enforcing else "unverified modules load (tainting the kernel)")
    if ctx.kc("MODULES") == "n":
        return R(SKIP, "kernel built without module support (kmod.loadable)", evidence=ev, **d)
    if ctx.sys.exists("/sys/module/p2phub"):
        how = "loaded unverified (taint E)" if "E" in (f.loaded_taint or "") else "loaded"
        return R(PASS, f"{how}; {what}; {enforced}", evidence=ev, **d)
    if not f.enforcing:
        if f.module.get("error") and "not recorded" in f.module["error"]:
            return R(SKIP, f"{enforced}; the installed module was not recorded", evidence=ev, **d)
        return R(PASS, f"{what}; {enforced}", evidence=ev, **d)
    if f.module.get("error"):
        return R(WARN, f"{what}; {enforced}", f"install p2phub.ko signed with an enrolled key: {INSTALL_DOC} "
                 "steps 3-4 (DKMS signs it)", ev, **d)
    if not f.signer:
        return R(FAIL, f"{what}: {enforced}, so it is refused", "sign it with an enrolled Machine Owner Key: "
                 f"configure DKMS's signing key and reinstall ({INSTALL_DOC} step 3)", ev, **d)
    if f.trusted:
        return R(PASS, f"{what}; {enforced}", evidence=ev, **d)
    if f.trusted is None:
        return R(UNKNOWN, f"{what}; whether the kernel trusts that key needs root (/proc/keys); {enforced}",
                 "run the doctor as root (sudo p2phub doctor)", ev, **d)
    if f.mok_pending:
        return R(FAIL, f"{what}: {enforced}; a key enrollment is pending (mokutil --import ran)",
                 f"reboot and confirm the enrollment in MokManager ({INSTALL_DOC} step 3)", ev, **d)
    return R(FAIL, f"{what}: {enforced}, so it is refused", _enrol_fix(ctx), ev, **d)
