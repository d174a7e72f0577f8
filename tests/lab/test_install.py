"""p2phub.ko installed as a user installs it (docs/install.md): through DKMS, from the source tree,
against the lab kernel's headers, with the NVIDIA source tools/setup installs.

The lab loads its own build of p2phub.ko; this test unloads it, installs the DKMS package
(`make -C kmod dkms-install P2PHUB_NVIDIA=y`), checks what a user would (`modprobe p2phub`, the
NVIDIA provider built in, /dev/p2phub given to group p2phub by the udev rule, a non-root member
registering memory, a non-member refused, the module signed by DKMS's key, `p2phub doctor`'s
reading of it), removes it with `dkms remove` and checks that nothing is left loaded or
installed, then loads the lab's build again. Everything DKMS writes (/usr/src, /var/lib/dkms,
/lib/modules, /etc) lands in the VM's own overlays, never on the host sharing its filesystem.

One thing differs from a server: for the test, /lib/modules/<release> is a tmpfs holding the lab
kernel's module indexes (modules.builtin, modules.order, ...) and its build link, without the
4,000 in-tree modules. DKMS runs depmod at each install and removal, and depmod over those
(xz-compressed, read through the shared filesystem) takes minutes each time under TCG. p2phub.ko
depends on no other module, so modprobe finds it all the same. Each command and its time go to
install-trace.log in the lab's run directory.
"""

from __future__ import annotations

import grp
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Iterator

import pytest

from p2phub import hostmem

pytestmark = pytest.mark.lab

TOP = Path(__file__).resolve().parents[2]
KMOD = TOP / "kmod"
VERSION = re.search(r'^PACKAGE_VERSION="([^"]+)"', (KMOD / "dkms.conf").read_text(), re.M).group(1)
PKG = f"p2phub/{VERSION}"
MEMBER_UID = 4242   # no account needed: setpriv sets the ids
RULES = Path("/etc/udev/rules.d/60-p2phub.rules")
MODLOAD = Path("/etc/modules-load.d/p2phub.conf")
# Where DKMS and the package write; each must be the VM's overlay, not the host's directory.
WRITTEN = ("/usr/src", "/var/lib/dkms", f"/lib/modules/{os.uname().release}", "/etc")


TRACE: Path | None = None


def sh(*cmd: str, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if TRACE is not None:
        with TRACE.open("a") as f:
            f.write(f"{time.monotonic() - t0:7.1f} s  rc {res.returncode}  {' '.join(cmd)}\n")
    if check and res.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}",
                    pytrace=False)
    return res


def fstype(path: str) -> str:
    return sh("findmnt", "-n", "-o", "FSTYPE", "--target", path).stdout.strip()


def installed_files() -> list[str]:
    return sorted(str(p) for p in Path(f"/lib/modules/{os.uname().release}").rglob("p2phub.ko*"))


def dkms_status() -> str:
    return sh("dkms", "status", "p2phub").stdout.strip()


@pytest.fixture
def lab_module_out(lab: dict[str, str]) -> Iterator[None]:
    """The lab's p2phub.ko unloaded for the test, loaded back after, whatever the test left."""
    if shutil.which("dkms") is None:
        pytest.fail("dkms is not installed on the host: run tools/setup", pytrace=False)
    global TRACE
    TRACE = Path(lab["run_dir"]) / "install-trace.log"
    not_overlay = [f"{d} ({fstype(d)})" for d in WRITTEN if fstype(d) != "overlay"]
    assert not not_overlay, f"DKMS would write to the host through: {', '.join(not_overlay)}"
    tree = Path(f"/lib/modules/{os.uname().release}")
    indexes = {p.name: p.read_bytes() for p in tree.iterdir() if p.name.startswith("modules.") and p.is_file()}
    links = {p.name: os.readlink(p) for p in tree.iterdir() if p.is_symlink()}
    assert "modules.builtin" in indexes and "build" in links, sorted(indexes) + sorted(links)
    sh("mount", "-t", "tmpfs", "-o", "mode=0755", "p2phub-lab-modules", str(tree))
    for name, data in indexes.items():
        (tree / name).write_bytes(data)
    for name, target in links.items():
        (tree / name).symlink_to(target)
    sh("rmmod", "p2phub")
    try:
        yield
    finally:
        if Path("/sys/module/p2phub").exists():
            sh("rmmod", "p2phub", check=False)
        if sh("dkms", "status", PKG, check=False).stdout.strip():
            sh("dkms", "remove", PKG, "--all", check=False)
        shutil.rmtree(f"/usr/src/p2phub-{VERSION}", ignore_errors=True)
        # udevd keeps the module indexes it read mapped: detach the tmpfs lazily if it is busy
        if sh("umount", str(tree), check=False).returncode != 0:
            sh("umount", "--lazy", str(tree))
        params = [] if lab.get("iommu_groups") == "1" else ["allow_unsafe_noiommu=1"]
        sh("insmod", f"{lab['modules_dir']}/p2phub.ko", *params)
        sh("udevadm", "settle", check=False)


# A child that registers a dma-buf it inherited (fd 3) through the Hub, and reports the result.
REGISTER = textwrap.dedent("""
    import json, os, sys
    from p2phub import Hub
    try:
        with Hub(mode="p2p") as hub:
            reg = hub.register_dmabuf(3)
            print(json.dumps({"ok": True, "length": reg.length, "uid": os.getuid(),
                              "groups": os.getgroups()}))
            reg.close()
    except Exception as exc:
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}", "uid": os.getuid()}))
""")


def register_as(user: list[str], fd: int) -> dict:
    os.dup2(fd, 3, inheritable=True)
    try:
        res = subprocess.run([*user, sys.executable, "-c", REGISTER], capture_output=True, text=True,
                             pass_fds=(3,), timeout=120, cwd="/")
    finally:
        os.close(3)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_dkms_install_modprobe_group_access_and_remove(lab_module_out: None) -> None:
    kver = os.uname().release
    # -- install, as docs/install.md says: the NVIDIA provider asked for, so a missing header fails
    res = sh("make", "-C", str(KMOD), "dkms-install", "P2PHUB_NVIDIA=y", timeout=1800)
    out = res.stdout + res.stderr
    assert "NVIDIA P2P provider: nv-p2p.h from /usr/src/nvidia-open-kernel-src/" in out, out[-3000:]
    assert f"{PKG}, {kver}, x86_64: installed" in dkms_status()
    files = installed_files()   # DKMS compresses it as the kernel's own modules are
    assert len(files) == 1 and re.fullmatch(rf"/lib/modules/{re.escape(kver)}/updates/dkms/p2phub\.ko(\.xz|\.zst|\.gz)?",
                                            files[0]), files
    assert not (KMOD / "p2phub.ko").exists() and not list(KMOD.glob("*.o")), "the checkout was built in"

    # -- modprobe finds it (depmod ran); the packaging files are in place
    sh("modprobe", "-r", "p2phub")
    sh("modprobe", "p2phub")
    sh("udevadm", "settle")
    assert sh("modinfo", "-n", "p2phub").stdout.strip() == installed_files()[0]
    assert RULES.read_text() == (KMOD / "60-p2phub.rules").read_text()
    assert MODLOAD.read_text().split("\n")[-2:] == ["p2phub", ""]

    # -- the NVIDIA P2P provider is built in (caps), the rest as the lab's build
    info = json.loads(sh(sys.executable, "-m", "p2phub", "info", "--json").stdout)
    assert "NVIDIA_P2P_BUILT" in info["cap_names"], info
    assert {"DMABUF_IMPORT", "DMABUF_EXPORT", "NVME"} <= set(info["cap_names"]), info

    # -- DKMS signed it with its own key (an unenrolled one: the doctor says so, Secure Boot is off)
    assert sh("modinfo", "-F", "signer", "p2phub").stdout.strip() == "DKMS module signing key"
    doc = json.loads(sh(sys.executable, "-m", "p2phub", "doctor", "--json", check=False).stdout)
    sig = next(c for c in doc["checks"] if c["id"] == "kmod.signature")
    assert sig["status"] == "PASS" and "DKMS module signing key" in sig["summary"], sig

    # -- the udev rule: group p2phub, mode 0660
    st = os.stat("/dev/p2phub")
    assert stat.S_ISCHR(st.st_mode)
    assert (grp.getgrgid(st.st_gid).gr_name, oct(st.st_mode & 0o777)) == ("p2phub", "0o660")

    # -- a non-root member of p2phub registers memory; a non-member is refused
    # (an unnamed uid with the p2phub group as a supplementary group: what a member's login
    # gets, without writing /etc/shadow, which useradd cannot do on the lab's overlay /etc)
    gid = grp.getgrnam("p2phub").gr_gid
    member = ["setpriv", f"--reuid={MEMBER_UID}", "--regid=65534", f"--groups={gid}"]
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    buf = hostmem.Udmabuf(1 << 20) if Path("/dev/udmabuf").exists() else hostmem.VgemBuffer(1 << 20)
    try:
        got = register_as(member, buf.fd)
        assert got["ok"] and got["length"] == 1 << 20, got
        assert got["uid"] == MEMBER_UID and gid in got["groups"], got
        refused = register_as(nobody, buf.fd)
        assert not refused["ok"] and ("EACCES" in refused["error"] or "ermission" in refused["error"]), refused
    finally:
        buf.close()

    # -- dkms remove: nothing loaded, nothing installed, the rule and boot-time load gone
    sh("dkms", "remove", PKG, "--all")
    sh("udevadm", "settle")
    assert not Path("/sys/module/p2phub").exists()
    assert "p2phub" not in sh("lsmod").stdout.split()
    assert installed_files() == []
    assert sh("modinfo", "p2phub", check=False).returncode != 0
    assert dkms_status() == ""
    assert not RULES.exists() and not MODLOAD.exists()
    assert not Path("/dev/p2phub").exists()
    # ...and the package's source goes with make -C kmod dkms-remove
    sh("make", "-C", str(KMOD), "dkms-remove")
    assert not Path(f"/usr/src/p2phub-{VERSION}").exists()


def test_asking_for_the_nvidia_provider_without_its_source_fails_loudly(lab_module_out: None) -> None:
    # NVIDIA_SRC names a tree without nv-p2p.h: refused before anything is registered
    res = sh("make", "-C", str(KMOD), "dkms-install", "P2PHUB_NVIDIA=y", "NVIDIA_SRC=/usr/share/doc",
             check=False)
    assert res.returncode != 0
    assert "NVIDIA_SRC=/usr/share/doc holds no nv-p2p.h" in res.stderr, res.stderr
    assert "nv-p2p.h not found" in res.stderr
    assert dkms_status() == "" and not Path(f"/usr/src/p2phub-{VERSION}").exists()
    assert installed_files() == []
