"""p2phub.ko installed through DKMS on a kernel the host's toolchain cannot build for (7.x), by
that kernel's own distribution: `make -C kmod dkms-install P2PHUB_NVIDIA=y` run in the lab's
build root (tests/labkit/build-root: Debian 13 with gcc 14, the kernel's headers and DKMS), as a
user of that kernel runs it on their system; then the running kernel loads what DKMS installed.

The host's side of the packaging (the udev rule giving /dev/p2phub to group p2phub, a member
registering memory) is the same script on every kernel and is checked by test_install.py on
6.12; here the build, DKMS's signature, the installed file, modprobe, the NVIDIA provider and
`dkms remove` are. The build root is reached in the VM through the shared filesystem, under
/var, which is the VM's own overlay: nothing DKMS writes reaches the host. As in
test_install.py, the kernel's /lib/modules/<release> is a tmpfs holding its module indexes and
build link for the test (depmod over 4,000 compressed modules takes minutes under TCG).
Each command and its time go to install-trace.log in the lab's run directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

pytestmark = pytest.mark.lab

TOP = Path(__file__).resolve().parents[2]
KMOD = TOP / "kmod"
VERSION = re.search(r'^PACKAGE_VERSION="([^"]+)"', (KMOD / "dkms.conf").read_text(), re.M).group(1)
PKG = f"p2phub/{VERSION}"
NVSRC = Path("/usr/src/nvidia-open-kernel-src")

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


class BuildRoot:
    """Commands in the build root, with the VM's /proc, /sys, /dev and the checkout mounted in."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def run(self, *cmd: str, check: bool = True, timeout: int = 900) -> subprocess.CompletedProcess[str]:
        return sh("chroot", str(self.root), "env", "-i", "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                  "HOME=/root", "LC_ALL=C.UTF-8", *cmd, check=check, timeout=timeout)

    def path(self, p: str | Path) -> Path:
        return self.root / str(p).lstrip("/")


@pytest.fixture
def build_root(lab: dict[str, str]) -> Iterator[BuildRoot]:
    """The build root set up for DKMS in the VM; the lab's p2phub.ko unloaded for the test and
    loaded back after, whatever the test left."""
    if not lab.get("build_root"):
        pytest.skip(f"kernel {lab['kernel_release']} is built by the host's toolchain: "
                    "test_install.py installs through DKMS on it")
    global TRACE
    TRACE = Path(lab["run_dir"]) / "install-trace.log"
    root = BuildRoot(Path(lab["build_root"]))
    rel = os.uname().release
    if not root.path("usr/sbin/dkms").exists():
        pytest.fail(f"no dkms in the build root {root.root}: run tools/setup", pytrace=False)
    fs = sh("findmnt", "-n", "-o", "FSTYPE", "--target", str(root.root)).stdout.strip()
    assert fs == "overlay", f"DKMS would write to the host through {root.root} ({fs})"

    tree = root.path(f"usr/lib/modules/{rel}")
    indexes = {p.name: p.read_bytes() for p in tree.iterdir() if p.name.startswith("modules.") and p.is_file()}
    links = {p.name: os.readlink(p) for p in tree.iterdir() if p.is_symlink()}
    assert "modules.builtin" in indexes and "build" in links, sorted(indexes) + sorted(links)
    mounts: list[str] = []

    def mount(*args: str) -> None:
        sh("mount", *args)
        mounts.append(args[-1])

    try:
        mount("-t", "proc", "proc", str(root.path("proc")))
        mount("--bind", "/sys", str(root.path("sys")))
        mount("--bind", "/dev", str(root.path("dev")))
        root.path(TOP).mkdir(parents=True, exist_ok=True)
        mount("--bind", str(TOP), str(root.path(TOP)))
        if NVSRC.is_dir():
            root.path(NVSRC).mkdir(parents=True, exist_ok=True)
            mount("--bind", "-o", "ro", str(NVSRC), str(root.path(NVSRC)))
        mount("-t", "tmpfs", "-o", "mode=0755", "p2phub-lab-modules", str(tree))
        for name, data in indexes.items():
            (tree / name).write_bytes(data)
        for name, target in links.items():
            (tree / name).symlink_to(target)
        sh("rmmod", "p2phub")
        yield root
    finally:
        if Path("/sys/module/p2phub").exists():
            sh("rmmod", "p2phub", check=False)
        if mounts and root.run("dkms", "status", PKG, check=False).stdout.strip():
            root.run("dkms", "remove", PKG, "--all", check=False)
        shutil.rmtree(root.path(f"usr/src/p2phub-{VERSION}"), ignore_errors=True)
        for m in reversed(mounts):
            if sh("umount", m, check=False).returncode != 0:
                sh("umount", "--lazy", m, check=False)
        params = [] if lab.get("iommu_groups") == "1" else ["allow_unsafe_noiommu=1"]
        sh("insmod", f"{lab['modules_dir']}/p2phub.ko", *params)
        sh("udevadm", "settle", check=False)


def test_dkms_install_in_the_kernels_own_distribution_then_modprobe_and_remove(build_root: BuildRoot) -> None:
    rel = os.uname().release
    tree = build_root.path(f"usr/lib/modules/{rel}")
    # -- the toolchain is the kernel's own: the compiler it was built with is in the build root
    built_by = Path("/proc/version").read_text()
    cc = re.search(r"\((\S*gcc-\d+) ", built_by)
    assert cc and build_root.path(f"usr/bin/{cc.group(1)}").exists(), built_by

    # -- install, as docs/install.md says (loads it too: KVER is the running kernel)
    res = build_root.run("make", "-C", str(KMOD), "dkms-install", "P2PHUB_NVIDIA=y", timeout=1800)
    out = res.stdout + res.stderr
    assert "NVIDIA P2P provider: nv-p2p.h from /usr/src/nvidia-open-kernel-src/" in out, out[-3000:]
    assert f"{PKG}, {rel}, x86_64: installed" in build_root.run("dkms", "status", "p2phub").stdout
    files = sorted(tree.rglob("p2phub.ko*"))
    assert len(files) == 1 and re.fullmatch(r"p2phub\.ko(\.xz|\.zst|\.gz)?", files[0].name) and \
        files[0].parent == tree / "updates" / "dkms", files
    assert not (KMOD / "p2phub.ko").exists() and not list(KMOD.glob("*.o")), "the checkout was built in"
    # the probes ran in DKMS's build (its log; DKMS removes the build tree after the install)
    log = build_root.path(f"var/lib/dkms/p2phub/{VERSION}/{rel}/x86_64/log/make.log")
    assert re.search(r"UPD\s+\S*conftest\.h", log.read_text()), log.read_text()[-3000:]
    assert Path("/sys/module/p2phub").exists(), out[-2000:]

    # -- the running kernel loads what DKMS installed (the VM's modprobe, the same tree)
    sh("modprobe", "-r", "p2phub")
    sh("modprobe", "p2phub")
    sh("udevadm", "settle", check=False)
    assert Path(sh("modinfo", "-n", "p2phub").stdout.strip()).resolve() == files[0].resolve()
    assert sh("modinfo", "-F", "signer", "p2phub").stdout.strip() == "DKMS module signing key"
    info = json.loads(sh(sys.executable, "-m", "p2phub", "info", "--json").stdout)
    assert "NVIDIA_P2P_BUILT" in info["cap_names"], info
    assert {"DMABUF_IMPORT", "DMABUF_EXPORT", "NVME"} <= set(info["cap_names"]), info
    # the packaging files, in that system's /etc (DKMS ran the post-install)
    assert build_root.path("etc/udev/rules.d/60-p2phub.rules").read_text() == (KMOD / "60-p2phub.rules").read_text()
    assert build_root.path("etc/modules-load.d/p2phub.conf").read_text().split("\n")[-2:] == ["p2phub", ""]

    # -- dkms remove: unloaded, nothing installed
    build_root.run("dkms", "remove", PKG, "--all")
    assert not Path("/sys/module/p2phub").exists()
    assert sorted(tree.rglob("p2phub.ko*")) == []
    assert build_root.run("dkms", "status", "p2phub").stdout.strip() == ""
    assert not build_root.path("etc/udev/rules.d/60-p2phub.rules").exists()
    build_root.run("make", "-C", str(KMOD), "dkms-remove")
    assert not build_root.path(f"usr/src/p2phub-{VERSION}").exists()
