"""The p2phub lab: a QEMU VM in which everything below the GPU is real.

    tools/lab run [--kernel 6.1|6.12|7.x|debug|VERSION] [--iommu] [--topology flat|rootports|switch|bridge]
                  [--nvme-backing file|null] [--keep] -- COMMAND...
    tools/lab kernels          the lab kernels found on this machine
    tools/lab probe-kvm        whether KVM can boot a guest here (else TCG is used)

`run` boots a Debian kernel (or, with `--kernel debug`, the debug lab kernel
that `tools/setup --debug-kernel` builds: KASAN, lockdep, DEBUG_ATOMIC_SLEEP,
DMABUF_DEBUG, DMA_API_DEBUG, UBSAN) with the host filesystem shared (virtme-ng), with:
two emulated NVMe controllers (serial p2phub-target: handed to p2phub; serial
p2phub-baseline: left on the kernel nvme driver), an ivshmem-plain device whose
BAR2 is a host file (the stand-in GPU memory), two nodes (the ends of a veth
pair, 169.254.77.1 and .2, policy-routed over the wire, an rdma_rxe device on
each), vgem loaded and, with --iommu, an emulated intel-iommu. It builds and loads p2phub.ko, runs
COMMAND in the checkout, unloads p2phub.ko (a module still in use is a leak)
and scans the kernel log.

Exit status: COMMAND's own status; 125 when the lab could not boot or set up;
126 when COMMAND succeeded but the kernel log has a WARN/BUG/Oops/KASAN/leak
report (those lines are printed either way); 124 on timeout.

Inside the VM, $P2PHUB_LAB_ENV names a file of KEY=VALUE lines describing the
lab (PCI addresses, the host file behind the GPU BAR, node addresses and RDMA devices...,
and `monitor_dir`, where tests reach QEMU's monitor for PCIe error injection: monitor.py).
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import klog, monitor  # stdlib only: tools/lab runs without the venv

TOP = Path(__file__).resolve().parents[3]
GUEST = Path(__file__).resolve().parent / "guest.sh"
BUILD = TOP / "build"
VENV_BIN = TOP / ".venv" / "bin"
CACHE = Path("/var/cache/p2phub-lab")
# Where tests/labkit/build-debug-kernel puts the debug lab kernel (one directory per release).
KERNEL_CACHE = Path(os.environ.get("P2PHUB_KERNEL_CACHE", "/var/lib/p2phub/kernels"))
DEBUG_SUFFIX = "-p2phub-debug"
# Kernels newer than the host's toolchain can build for (7.x: gcc 14, kbuild tools linked
# against a newer glibc) live in a Debian build root of their own, with their headers, made by
# tests/labkit/build-root (tools/setup): p2phub.ko is built there, with that kernel's own
# compiler, and the VM boots the image from there (virtme-ng finds its modules beside it).
BUILD_ROOT = Path(os.environ.get("P2PHUB_BUILD_ROOT", "/var/lib/p2phub/buildroot-trixie"))

EXIT_TIMEOUT = 124
EXIT_LAB = 125
EXIT_KLOG = 126

GPU_MEM_BYTES = 64 << 20
BOOT_ATTEMPTS = 3
# A guest that has not started the lab script (guest.log) this long after QEMU started is stuck
# in its boot: the VM is killed and booted again. A TCG boot takes ~30 s here, a debug kernel's
# a few minutes. P2PHUB_LAB_BOOT_HANG_S overrides it (tests of this path).
BOOT_HANG_S = int(os.environ.get("P2PHUB_LAB_BOOT_HANG_S", "600"))


class _BootHang(Exception):
    """The VM was killed: it never started the lab script."""


def log(msg: str) -> None:
    print(f"\033[1m[lab]\033[0m {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- kernels


_DEBIAN_KVER = r"\d+\.\d+\.\d+(-\d+)?(\+deb\d+)?-amd64"


def build_root_kernels() -> list[str]:
    """The kernels of the build root (BUILD_ROOT): image, modules and headers all there."""
    found = []
    for vmlinuz in sorted(glob.glob(str(BUILD_ROOT / "usr/lib/modules/*/vmlinuz"))):
        ver = Path(vmlinuz).parent.name
        if (re.fullmatch(_DEBIAN_KVER, ver) and (BUILD_ROOT / f"usr/lib/modules/{ver}/kernel").is_dir()
                and (BUILD_ROOT / f"usr/src/linux-headers-{ver}/Makefile").exists()):
            found.append(ver)
    return found


def lab_kernels() -> dict[str, str]:
    """Series ("6.1", "6.12", "7.3") -> newest installed generic amd64 kernel version
    (on the host, or in the build root)."""
    found: dict[str, str] = {}
    vers = []
    for vmlinuz in sorted(glob.glob("/boot/vmlinuz-*")):
        ver = vmlinuz.removeprefix("/boot/vmlinuz-")
        if not re.fullmatch(_DEBIAN_KVER, ver):
            continue  # skip -rt, -cloud and self-built kernels
        if not Path(f"/lib/modules/{ver}/kernel").is_dir():
            continue
        vers.append(ver)
    for ver in vers + build_root_kernels():
        series = ".".join(ver.split(".")[:2])
        if series not in found or _verkey(ver) > _verkey(found[series]):
            found[series] = ver
    return found


def _verkey(ver: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", ver)]


def debug_kernel() -> str | None:
    """The newest finished debug lab kernel in KERNEL_CACHE, or None."""
    found = [d.name for d in KERNEL_CACHE.glob(f"*{DEBUG_SUFFIX}")
             if (d / "config.sha256").exists() and (d / "boot" / f"vmlinuz-{d.name}").exists()]
    return max(found, key=_verkey) if found else None


def kernel_image(kver: str) -> Path:
    if kver.endswith(DEBUG_SUFFIX):
        return KERNEL_CACHE / kver / "boot" / f"vmlinuz-{kver}"
    if not Path(f"/boot/vmlinuz-{kver}").exists() and kver in build_root_kernels():
        return BUILD_ROOT / "usr/lib/modules" / kver / "vmlinuz"
    return Path(f"/boot/vmlinuz-{kver}")


def resolve_kernel(want: str | None) -> str:
    if want == "debug" or (want or "").endswith(DEBUG_SUFFIX):
        kver = debug_kernel() if want == "debug" else want
        if kver is None or not kernel_image(kver).exists():
            raise SystemExit("no debug lab kernel built: run tools/setup --debug-kernel")
        return kver
    kernels = lab_kernels()
    if not kernels:
        raise SystemExit("no lab kernel installed: run tools/setup")
    if want is None:   # the newest the host builds for; a build root's only when asked for
        own = set(build_root_kernels())
        host = [k for k, v in kernels.items() if v not in own] or list(kernels)
        return kernels[max(host, key=_verkey)]
    if want in kernels:
        return kernels[want]
    major = re.fullmatch(r"(\d+)\.x", want)
    if major:   # "7.x": the newest kernel of that major version
        series = [k for k in kernels if k.split(".")[0] == major.group(1)]
        if series:
            return kernels[max(series, key=_verkey)]
    if Path(f"/boot/vmlinuz-{want}").exists() or want in build_root_kernels():
        return want
    raise SystemExit(f"lab kernel {want!r} not installed (have: {', '.join(kernels.values())})")


def headers_dir(kver: str) -> Path:
    """The kernel's build tree, as the build sees it (inside the build root for its kernels)."""
    if kver.endswith(DEBUG_SUFFIX):
        d = KERNEL_CACHE / kver / "build"
        if (d / "Makefile").exists():
            return d
        raise SystemExit(f"the debug kernel {kver} has no build tree: run tools/setup --debug-kernel")
    for d in (Path(f"/usr/src/linux-headers-{kver}"), Path(f"/lib/modules/{kver}/build")):
        if (d / "Makefile").exists():
            return d
    if build_root_for(kver) is not None:
        return Path(f"/usr/src/linux-headers-{kver}")
    raise SystemExit(f"no kernel headers for {kver}: run tools/setup")


def build_root_for(kver: str) -> Path | None:
    """The build root that builds modules for kver, or None when the host does."""
    if kver.endswith(DEBUG_SUFFIX) or any(
            (d / "Makefile").exists()
            for d in (Path(f"/usr/src/linux-headers-{kver}"), Path(f"/lib/modules/{kver}/build"))):
        return None
    return BUILD_ROOT if (BUILD_ROOT / f"usr/src/linux-headers-{kver}/Makefile").exists() else None


# Run as `sh -c SCRIPT sh ROOT TOP CMD...` in a mount namespace of its own (the mounts go
# with it): the checkout and NVIDIA's kernel source (nv-p2p.h) at their own paths in the
# build root, /proc for objtool, and CMD in the chroot with a clean environment.
_IN_BUILD_ROOT = """set -e
root=$1 top=$2
shift 2
mount -t proc proc "$root/proc"
mkdir -p "$root$top"
mount --bind "$top" "$root$top"
nv=/usr/src/nvidia-open-kernel-src
if [ -d "$nv" ]; then
	mkdir -p "$root$nv"
	mount --bind -o ro "$nv" "$root$nv"
fi
exec chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 "$@"
"""


def in_build_root(root: Path, cmd: list[str]) -> list[str]:
    """cmd, to run with the build root's toolchain and headers (root needed: chroot)."""
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _IN_BUILD_ROOT,
            "sh", str(root), str(TOP), *cmd]


# --------------------------------------------------------------------------- build


def build_modules(kver: str, dest: Path | None = None) -> list[Path]:
    """Build kmod/ (and tests/kmod/, tests/labkit/kmod/ when present) for kver into build/kmod/<kver>/.

    With `dest`, the modules are copied there before the build lock is released,
    so a concurrent run rebuilding the same kernel cannot pull them away."""
    out = BUILD / "kmod" / kver
    out.mkdir(parents=True, exist_ok=True)
    built: list[Path] = []
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for src, name in ((TOP / "kmod", "p2phub"), (TOP / "tests" / "kmod", "tests"),
                          (Path(__file__).resolve().parents[1] / "kmod", "labkit"),
                          (TOP / "tests" / "labkit" / "fakegpu" / "kmod", "fakegpu")):
            if not (src / "Kbuild").exists():
                continue
            dst = out / name
            # Mirror the sources so two kernels never share object files.
            if dst.exists():
                shutil.rmtree(dst)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.o", "*.ko", ".*.cmd", "*.mod*"))
            if name == "tests":
                # Test modules include the UAPI header and may link against p2phub's symbols.
                (dst / "p2phub-uapi").symlink_to(TOP / "kmod" / "uapi")
            cmd = ["make", "-C", str(dst), f"KDIR={headers_dir(kver)}", "W=1"]
            if name == "tests":
                cmd.append(f"KBUILD_EXTRA_SYMBOLS={out / 'p2phub' / 'Module.symvers'}")
            if name == "fakegpu":
                cmd.append(f"P2PHUB_KMOD={out / 'p2phub'}")   # the mirrored kmod/ headers
            root = build_root_for(kver)
            if root is not None:
                cmd = in_build_root(root, cmd)
            res = subprocess.run(cmd, capture_output=True, text=True)
            warnings = [l for l in res.stderr.splitlines() if "warning:" in l]
            if res.returncode != 0 or warnings:
                sys.stderr.write(res.stdout[-4000:] + res.stderr[-8000:])
                raise SystemExit(f"building {name} modules for {kver} failed")
            built += sorted(dst.glob("*.ko"))
        if dest is not None:
            dest.mkdir(parents=True, exist_ok=True)
            built = [Path(shutil.copy2(m, dest / m.name)) for m in built]
    return built


# --------------------------------------------------------------------------- KVM


def probe_kvm(kver: str) -> bool:
    """True when KVM boots this kernel to its first panic (no root fs) in time.

    Nested KVM on some hosts hangs early in boot; TCG always works, only slower.
    The answer is cached per host kernel, QEMU and guest kernel.
    """
    if os.environ.get("P2PHUB_LAB_KVM") in ("0", "1"):
        return os.environ["P2PHUB_LAB_KVM"] == "1"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    qemu = shutil.which("qemu-system-x86_64") or "qemu-system-x86_64"
    qver = subprocess.run([qemu, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(f"{os.uname().release}|{qver}|{kver}".encode()).hexdigest()[:16]
    cached = CACHE / f"kvm-{key}"
    if cached.exists():
        return cached.read_text().strip() == "yes"
    with tempfile.TemporaryDirectory() as tmp:
        serial = Path(tmp) / "serial.log"
        cmd = [
            qemu, "-enable-kvm", "-cpu", "host", "-m", "256", "-nographic", "-no-reboot",
            "-serial", f"file:{serial}", "-monitor", "none",
            "-kernel", str(kernel_image(kver)), "-append", "console=ttyS0 panic=-1",
        ]
        try:
            subprocess.run(cmd, capture_output=True, timeout=30)
        except subprocess.TimeoutExpired:
            pass
        text = serial.read_text(errors="replace") if serial.exists() else ""
    ok = "Kernel panic" in text or "Unable to mount root" in text
    CACHE.mkdir(parents=True, exist_ok=True)
    cached.write_text("yes\n" if ok else "no\n")
    return ok


# --------------------------------------------------------------------------- QEMU devices


def qemu_devices(run: Path, topology: str, backing: str, iommu: bool) -> list[str]:
    opts: list[str] = []
    if iommu:
        opts += ["-machine", "kernel-irqchip=split",
                 "-device", "intel-iommu,intremap=on,caching-mode=on"]

    # Where each device plugs in, per topology.
    if topology == "flat":
        buses = {"target": "pcie.0", "gpu": "pcie.0", "baseline": "pcie.0"}
    elif topology == "rootports":
        for i, name in enumerate(("target", "gpu", "baseline")):
            opts += ["-device", f"pcie-root-port,id=rp-{name},chassis={i + 1},slot={i + 1}"]
        buses = {n: f"rp-{n}" for n in ("target", "gpu", "baseline")}
    elif topology == "switch":
        # target and GPU under one switch; the baseline on a root port of its own.
        opts += ["-device", "pcie-root-port,id=rp-sw,chassis=1,slot=1",
                 "-device", "x3130-upstream,id=sw-up,bus=rp-sw"]
        for i, name in enumerate(("target", "gpu")):
            opts += ["-device", f"xio3130-downstream,id=sw-{name},bus=sw-up,chassis={10 + i},slot={i}"]
        opts += ["-device", "pcie-root-port,id=rp-baseline,chassis=2,slot=2"]
        buses = {"target": "sw-target", "gpu": "sw-gpu", "baseline": "rp-baseline"}
    elif topology == "bridge":
        # flat, plus two more NVMe controllers behind one conventional PCI bridge (below).
        opts += ["-device", "pci-bridge,id=br-shared,bus=pcie.0,chassis_nr=7,shpc=off"]
        buses = {"target": "pcie.0", "gpu": "pcie.0", "baseline": "pcie.0"}
    else:
        raise SystemExit(f"unknown topology {topology!r}")

    def drive(ident: str, size: str) -> list[str]:
        if backing == "null":
            return ["-drive", f"if=none,id={ident},driver=null-co,size={size},read-zeroes=on"]
        img = run / f"{ident}.img"
        with open(img, "wb") as f:
            f.truncate(_size_bytes(size))
        return ["-drive", f"if=none,id={ident},file={img},format=raw,cache=writeback"]

    # The controller p2phub drives: ns1 with 512 B LBAs, ns2 with 4 KiB LBAs.
    opts += drive("tgt-ns1", "256M") + drive("tgt-ns2", "64M")
    opts += ["-device", f"nvme,id=nvme-target,serial=p2phub-target,bus={buses['target']}",
             "-device", "nvme-ns,drive=tgt-ns1,bus=nvme-target,nsid=1",
             "-device", "nvme-ns,drive=tgt-ns2,bus=nvme-target,nsid=2,"
                        "logical_block_size=4096,physical_block_size=4096"]
    # The twin left on the kernel nvme driver: the baseline and the independent reader.
    opts += drive("base-ns1", "256M")
    opts += ["-device", f"nvme,id=nvme-baseline,serial=p2phub-baseline,bus={buses['baseline']}",
             "-device", "nvme-ns,drive=base-ns1,bus=nvme-baseline,nsid=1"]

    if topology == "bridge":
        # Two controllers behind the bridge (no SHPC, so no hotplug driver binds it) share one
        # requester ID alias, hence one IOMMU group; both start on the kernel nvme driver.
        for pair in ("a", "b"):
            opts += ["-drive", f"if=none,id=pair-{pair}-ns1,driver=null-co,size=64M,read-zeroes=on",
                     "-device", f"nvme,id=nvme-pair-{pair},serial=p2phub-pair-{pair},bus=br-shared",
                     "-device", f"nvme-ns,drive=pair-{pair}-ns1,bus=nvme-pair-{pair},nsid=1"]

    gpu_file = run / "gpu.mem"
    with open(gpu_file, "wb") as f:
        f.truncate(GPU_MEM_BYTES)
    opts += ["-object", f"memory-backend-file,id=gpumem,share=on,mem-path={gpu_file},size={GPU_MEM_BYTES}",
             "-device", f"ivshmem-plain,memdev=gpumem,bus={buses['gpu']}"]
    # A spare function for hot-removal tests (remove, then rescan); the stand-in GPU module
    # brings a do-nothing driver for it (p2phub maps only for devices a driver drives).
    opts += ["-device", "pci-testdev,bus=pcie.0"]
    return opts


def _size_bytes(size: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)


# --------------------------------------------------------------------------- run


def scan_klog(path: Path) -> list[str]:
    """The kernel log's report lines, each prefixed with its kind ("lockdep: ...")."""
    if not path.exists():
        return ["lab: kernel log missing: the guest did not finish"]
    return [f"{r.kind}: {r.line}" for r in klog.reports(path.read_text(errors="replace").splitlines())]


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("tools/lab run: no COMMAND given (tools/lab run -- COMMAND...)")
    kver = resolve_kernel(args.kernel)
    t0 = time.monotonic()
    runs = BUILD / "lab" / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=runs))
    run.chmod(0o755)  # unprivileged commands in the guest read lab.env too
    (run / "command").write_text(shlex.join(command) + "\n")
    # The guest loads copies: another run may rebuild build/kmod meanwhile.
    try:
        build_modules(kver, dest=run / "ko")
    except BaseException:
        shutil.rmtree(run, ignore_errors=True)
        raise
    kvm = probe_kvm(kver) if not args.tcg else False

    vng = [
        str(VENV_BIN / "vng"), "--run", str(kernel_image(kver)), "--disable-microvm",
        "--cpus", str(args.cpus), "--memory", args.memory,
        "--rwdir", str(TOP), "--cwd", os.getcwd() if _inside(Path.cwd(), TOP) else str(TOP),
        "--append", " ".join(filter(None, ("nvme.poll_queues=1",
                                         "intel_iommu=on iommu=nopt" if args.iommu else "",
                                         args.cmdline))),
        "--qemu-opts=" + shlex.join(qemu_devices(run, args.topology, args.nvme_backing, args.iommu)
                                    + monitor.qemu_opts(run)),
        "--exec", f"bash {shlex.quote(str(GUEST))} {shlex.quote(str(run))}",
    ]
    if not kvm:
        vng.insert(3, "--disable-kvm")
    (run / "lab.args").write_text(
        f"kernel={kver}\ndebug_kernel={int(kver.endswith(DEBUG_SUFFIX))}\niommu={int(args.iommu)}\ntopology={args.topology}\n"
        f"accel={'kvm' if kvm else 'tcg'}\nnvme_backing={args.nvme_backing}\ncmdline={args.cmdline}\n"
        f"build_root={build_root_for(kver) or ''}\n"
    )
    log(f"booting {kver} ({'kvm' if kvm else 'tcg'}, topology {args.topology}"
        f"{', iommu' if args.iommu else ''}): {shlex.join(command)}")
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    status_file = run / "status"
    relay = monitor.Relay(run)      # the guest's PCIe error injections reach QEMU through it
    relay.start()
    try:
        for attempt in range(1, BOOT_ATTEMPTS + 1):
            try:
                vm = _run_relayed(vng, env, args.timeout, run / "guest.log")
            except subprocess.TimeoutExpired:
                log(f"timed out after {args.timeout} s (run dir {run})")
                return EXIT_TIMEOUT
            except _BootHang:
                if attempt == BOOT_ATTEMPTS:
                    log(f"the VM did not start the lab in {BOOT_HANG_S} s, {attempt} times "
                        f"(run dir {run})")
                    return EXIT_TIMEOUT
                log(f"the VM did not start the lab in {BOOT_HANG_S} s; booting again "
                    f"(attempt {attempt + 1} of {BOOT_ATTEMPTS})")
                continue
            # A VM that died before the guest script wrote a line never ran COMMAND:
            # boot again rather than fail the command for it. Anything later is reported.
            if status_file.exists() or (run / "guest.log").exists() or attempt == BOOT_ATTEMPTS:
                break
            log(f"the VM exited ({vm.returncode}) before the lab started; booting again "
                f"(attempt {attempt + 1} of {BOOT_ATTEMPTS})")
    finally:
        relay.stop()

    if not status_file.exists():
        log(f"the guest did not report a status (vng exit {vm.returncode}); run dir {run}")
        _dump_tail(run / "guest.log")
        return EXIT_LAB
    status = int(status_file.read_text().split()[0])
    bad = scan_klog(run / "dmesg.txt")
    elapsed = time.monotonic() - t0
    for line in bad:
        print(f"[lab] kernel log: {line}", file=sys.stderr)
    if status == EXIT_LAB:
        _dump_tail(run / "guest.log")
    log(f"exit {status}, {len(bad)} bad kernel log line(s), {elapsed:.0f} s")
    if not args.keep and status == 0 and not bad:
        shutil.rmtree(run, ignore_errors=True)
    else:
        log(f"kept {run}")
    if bad and status == 0:
        return EXIT_KLOG
    return status


def _run_relayed(cmd: list[str], env: dict[str, str], timeout: int,
                 started: Path) -> subprocess.CompletedProcess:
    """Run vng with its output relayed through pipes; _BootHang when the guest has not
    created `started` BOOT_HANG_S seconds in (the VM is killed).

    QEMU reopens the guest's stdout by path (/proc/self/fd/1) with truncation;
    handed a regular file it would overwrite what was already written there.
    """
    # A session of its own: on timeout QEMU (vng's child) goes with it.
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    relays = [threading.Thread(target=_relay, args=(src, dst), daemon=True)
              for src, dst in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
    for t in relays:
        t.start()
    t0 = time.monotonic()
    while True:
        try:
            rc = proc.wait(timeout=min(5, timeout))
            break
        except subprocess.TimeoutExpired:
            now = time.monotonic() - t0
            hung = now >= BOOT_HANG_S and not started.exists()
            if now < timeout and not hung:
                continue
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if hung:
                raise _BootHang() from None
            raise
    for t in relays:
        t.join(timeout=5)
    return subprocess.CompletedProcess(cmd, rc)


def _relay(src, dst) -> None:
    out = dst.buffer
    for chunk in iter(lambda: src.read1(65536), b""):
        out.write(chunk)
        out.flush()


def cmd_bench_boot(args: argparse.Namespace) -> int:
    kver = resolve_kernel(args.kernel)
    build_modules(kver)  # not part of the boot time
    cmd = [sys.argv[0], "run", "--kernel", kver] + (["--iommu"] if args.iommu else []) + ["--", "true"]
    times = []
    for i in range(args.runs):
        t0 = time.monotonic()
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
        times.append(time.monotonic() - t0)
        if rc != 0:
            log(f"run {i + 1} exited {rc}")
            return rc
    times.sort()
    accel = "kvm" if probe_kvm(kver) else "tcg"
    print(f"lab boot {kver} {accel}{' iommu' if args.iommu else ''}: median {times[len(times) // 2]:.1f} s "
          f"over {args.runs} runs (min {times[0]:.1f}, max {times[-1]:.1f})")
    return 0


def _inside(p: Path, top: Path) -> bool:
    try:
        p.resolve().relative_to(top)
        return True
    except ValueError:
        return False


def _dump_tail(path: Path, n: int = 40) -> None:
    if path.exists():
        for line in path.read_text(errors="replace").splitlines()[-n:]:
            print(f"[lab] guest: {line}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(prog="tools/lab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="boot the lab, run COMMAND in it")
    r.add_argument("--kernel", help="6.1, 6.12, 7.x (the newest 7 series), debug or a full version "
                                    "(default: newest Debian kernel)")
    r.add_argument("--iommu", action="store_true", help="add an emulated intel-iommu")
    r.add_argument("--topology", default="flat", choices=("flat", "rootports", "switch", "bridge"),
                   help="bridge: flat plus two NVMe controllers behind one PCI bridge (one IOMMU group)")
    r.add_argument("--nvme-backing", default="file", choices=("file", "null"))
    r.add_argument("--cpus", type=int, default=2)
    r.add_argument("--memory", default="2G")
    r.add_argument("--timeout", type=int, default=1800, help="seconds (default 1800)")
    r.add_argument("--tcg", action="store_true", help="never use KVM")
    r.add_argument("--cmdline", default="", metavar="ARGS",
                   help="extra guest kernel command line (e.g. swiotlb=force)")
    r.add_argument("--keep", action="store_true", help="keep the run directory")
    r.add_argument("command", nargs=argparse.REMAINDER)
    b = sub.add_parser("bench-boot", help="median wall time of `run -- true` (boot, setup, teardown)")
    b.add_argument("--kernel")
    b.add_argument("--iommu", action="store_true")
    b.add_argument("--runs", type=int, default=3)
    sub.add_parser("kernels", help="list the lab kernels")
    k = sub.add_parser("probe-kvm", help="can KVM boot a guest here?")
    k.add_argument("--kernel")
    args = ap.parse_args()
    if args.cmd == "kernels":
        for series, ver in sorted(lab_kernels().items(), key=lambda kv: _verkey(kv[0])):
            print(f"{series}\t{ver}")
        dbg = debug_kernel()
        if dbg:
            print(f"debug\t{dbg}")
        return 0
    if args.cmd == "bench-boot":
        return cmd_bench_boot(args)
    if args.cmd == "probe-kvm":
        ok = probe_kvm(resolve_kernel(args.kernel))
        print("kvm" if ok else "tcg")
        return 0
    return cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
