"""The doctor's install-facing checks on captured trees: kmod.signature (and kmod.loadable) on the
lab's 6.12 capture made into a server that booted with Secure Boot on, p2phub.ko installed but not
loaded; kmod.caps on an NVIDIA host whose module lacks the NVIDIA provider; the fix lines' steps."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from p2phub.doctor.checks.kmod import MOK_NEW_VAR, SECURE_BOOT_VAR
from p2phub.doctor.core import diagnose
from p2phub.doctor.sysroot import SysRoot

pytestmark = pytest.mark.unit

BASE = Path(__file__).resolve().parent.parent / "fixtures" / "doctor" / "lab-switch-6.12"
KO = "/lib/modules/6.12.117+deb12-amd64/updates/dkms/p2phub.ko"
SIGNED = {"filename": KO, "version": "0.1.0", "signer": "DKMS module signing key",
          "sig_key": "2B:11:9C:4E", "sig_id": "PKCS#7", "sig_hashalgo": "sha256"}
UNSIGNED = {"filename": KO, "version": "0.1.0"}
# /proc/keys as root sees it on a Debian host booted through shim
DEBIAN_KEYS = [
    "1b2c3d4e I------     1 perm 1f0b0000     0     0 keyring   .builtin_trusted_keys: 2",
    "2a3b4c5d I------     1 perm 1f010000     0     0 asymmetri Debian Secure Boot CA: 6ccece7e4c6c0d1f6149f3dd27dfcc5cbb419ea1: X509.rsa 4c6c0d1f []",
    "3a3b4c5d I------     1 perm 1f010000     0     0 asymmetri Debian Secure Boot Signer 2022 - linux: 14011249c2675ea8e5148542202005810584b25f: X509.rsa 0584b25f []",
]
DKMS_KEY = ("4a3b4c5d I------     1 perm 1f010000     0     0 asymmetri DKMS module signing key: "
            "2b119c4e0d1f6149f3dd27dfcc5cbb419ea1aa01: X509.rsa 19ea1aa0 []")


def host(tmp_path: Path, *, secure_boot: bool = True, module: dict[str, Any] | None = None,
         keys: list[str] | None = None, mok_pending: bool = False) -> SysRoot:
    """The lab capture, p2phub.ko not loaded, booted through EFI with Secure Boot on or off."""
    root = tmp_path / "capture"
    shutil.copytree(BASE, root, symlinks=True)
    shutil.rmtree(root / "sys/module/p2phub")
    meta = json.loads((root / "p2phub-capture.json").read_text())
    meta["probes"].pop("kmod_info")
    meta["probes"]["kmod_signature"] = module if module is not None else {"error": "p2phub.ko is not installed"}
    (root / "p2phub-capture.json").write_text(json.dumps(meta))

    def put(path: str, data: bytes) -> None:
        p = root / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)

    # efivarfs: 4 attribute bytes, then the value
    put(SECURE_BOOT_VAR, b"\x06\x00\x00\x00" + (b"\x01" if secure_boot else b"\x00"))
    if mok_pending:
        put(MOK_NEW_VAR, b"\x07\x00\x00\x00" + b"\x30" * 64)
    # what Secure Boot does to a Debian kernel: lockdown=integrity
    put("/sys/kernel/security/lockdown",
        b"none [integrity] confidentiality\n" if secure_boot else b"[none] integrity confidentiality\n")
    put("/sys/module/module/parameters/sig_enforce", b"Y\n" if secure_boot else b"N\n")
    put("/proc/keys", ("\n".join(keys if keys is not None else DEBIAN_KEYS) + "\n").encode())
    put("/var/lib/dkms/mok.pub", b"")
    return SysRoot(str(root))


def checks(sr: SysRoot) -> dict[str, Any]:
    rep = diagnose(sr)
    return {cid: rep.check(cid) for cid in ("kmod.loaded", "kmod.loadable", "kmod.signature")}


def test_secure_boot_on_and_an_unsigned_module_is_refused_with_the_signing_step(tmp_path: Path) -> None:
    c = checks(host(tmp_path, module=UNSIGNED))
    sig = c["kmod.signature"]
    assert sig.status == "FAIL"
    assert f"p2phub.ko ({KO}) is unsigned" in sig.summary
    assert "Secure Boot on" in sig.summary and "lockdown=integrity" in sig.summary
    assert "docs/install.md step 3" in sig.fix
    assert c["kmod.loadable"].status == "FAIL" and "kmod.signature" in c["kmod.loadable"].fix
    # installed, not loaded: the fix is modprobe, not a build
    assert c["kmod.loaded"].status == "WARN" and c["kmod.loaded"].fix.startswith("sudo modprobe p2phub")


def test_signed_with_a_key_not_enrolled_names_the_key_and_the_mokutil_line(tmp_path: Path) -> None:
    sig = checks(host(tmp_path, module=SIGNED))["kmod.signature"]
    assert sig.status == "FAIL"
    assert "signed by 'DKMS module signing key', a key the kernel does not trust" in sig.summary
    assert "sudo mokutil --import /var/lib/dkms/mok.pub" in sig.fix and "MokManager" in sig.fix
    assert sig.details["trusted"] is False and sig.details["mok_pending"] is False


def test_an_enrollment_waiting_for_the_reboot_says_so(tmp_path: Path) -> None:
    sig = checks(host(tmp_path, module=SIGNED, mok_pending=True))["kmod.signature"]
    assert sig.status == "FAIL" and "enrollment is pending" in sig.summary
    assert sig.fix.startswith("reboot and confirm the enrollment in MokManager")


def test_signed_with_an_enrolled_key_passes_and_lets_the_module_load(tmp_path: Path) -> None:
    c = checks(host(tmp_path, module=SIGNED, keys=DEBIAN_KEYS + [DKMS_KEY]))
    assert c["kmod.signature"].status == "PASS"
    assert "a key the kernel trusts" in c["kmod.signature"].summary
    loadable = c["kmod.loadable"]
    assert loadable.status == "PASS", loadable.summary
    assert "signed by 'DKMS module signing key', a key it trusts" in loadable.summary


def test_keys_that_only_root_can_see_make_it_unknown_not_wrong(tmp_path: Path) -> None:
    # an unprivileged reader's /proc/keys lists none of the system keyrings
    sig = checks(host(tmp_path, module=SIGNED, keys=[]))["kmod.signature"]
    assert sig.status == "UNKNOWN" and "needs root" in sig.summary


def test_secure_boot_on_without_the_module_installed_warns_before_it_is_built(tmp_path: Path) -> None:
    sig = checks(host(tmp_path))["kmod.signature"]
    assert sig.status == "WARN" and "not installed" in sig.summary and "steps 3-4" in sig.fix


def test_secure_boot_off_an_unsigned_module_is_fine(tmp_path: Path) -> None:
    c = checks(host(tmp_path, secure_boot=False, module=UNSIGNED))
    assert c["kmod.signature"].status == "PASS"
    assert "Secure Boot off" in c["kmod.signature"].summary
    assert c["kmod.loadable"].status == "PASS"



def test_every_install_step_a_fix_names_exists_and_no_fix_points_at_a_checkout_build() -> None:
    top = Path(__file__).resolve().parents[2]
    text = "".join(p.read_text() for p in (top / "p2phub" / "doctor").rglob("*.py"))
    assert "insmod kmod/" not in text and "make -C kmod &&" not in text
    steps = {int(n) for m in re.finditer(r"(?:INSTALL_DOC\}|docs/install\.md),? steps? (\d+)(?:-(\d+))?", text)
             for n in m.groups() if n}
    doc = (top / "docs" / "install.md").read_text()
    headings = {int(m.group(1)) for m in re.finditer(r"^## (\d+)\. ", doc, re.M)}
    assert steps and steps <= headings, (steps, headings)


def test_an_nvidia_host_whose_module_lacks_the_nvidia_provider_is_told_to_rebuild(tmp_path: Path) -> None:
    root = tmp_path / "capture"
    shutil.copytree(BASE.parent / "h200-firecracker", root, symlinks=True)
    (root / "sys/module/p2phub").mkdir(parents=True)
    (root / "sys/module/p2phub/initstate").write_text("live\n")
    meta = json.loads((root / "p2phub-capture.json").read_text())
    caps = ["DMABUF_IMPORT", "DMABUF_EXPORT", "NVME"]
    meta["probes"]["kmod_info"] = {"abi_version": 1, "version": "0.1.0", "caps": 0x19, "caps_names": caps,
                                   "expected_abi": 1}
    (root / "p2phub-capture.json").write_text(json.dumps(meta))
    rep = diagnose(SysRoot(str(root)))
    c = rep.check("kmod.caps")
    assert c.status == "WARN" and "built without the NVIDIA P2P provider" in c.summary
    assert c.applies_to == [g.id for g in rep.top.gpus] and "P2PHUB_NVIDIA=y" in c.fix
    # the same module with the provider built in is only reported
    meta["probes"]["kmod_info"]["caps_names"] = caps + ["NVIDIA_P2P_BUILT"]
    (root / "p2phub-capture.json").write_text(json.dumps(meta))
    assert diagnose(SysRoot(str(root))).check("kmod.caps").status == "INFO"
