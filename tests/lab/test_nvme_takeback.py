"""The kernel takes a controller back from its owner: removal that ends, and IOMMU group confinement.

Unbind (or hot removal) of an owned controller asks the owner to close its fd, and after the
module's grace period (`remove_grace_ms`) stops the controller's DMA, unmaps the owner's
registrations, frees its DMA memory and zaps its BAR0 and buffer mappings itself, then completes;
the owner's later ioctls fail with ENODEV and its mapped BAR0 raises SIGBUS. An owner that unbinds
its own controller gets its write back. A kernel driver bound to another device of an owned
controller's IOMMU group (lab topology `bridge`: two more controllers behind one PCI bridge) takes the
controller is refused by the kernel while the controller is owned (p2phub holds the group's DMA
ownership), and VFIO cannot claim the group; the bus notifier that takes the controller back (EXDEV)
stays as a second line. Unbind resets the function before the controller is handed back. A reset
zaps the owner's BAR0 mapping, which faults back in after it.

Each test checks from outside the fd: the driver link in sysfs, the command register's bus master
bit, the p2phub debugfs counters, the page table (/proc/self/pagemap), a forked child's signal.
"""

from __future__ import annotations

import ctypes
import errno
import faulthandler
import fcntl
import mmap
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

import regutil
from p2phub import uapi
from p2phub.device import Device
from p2phub.hostmem import Udmabuf, VgemBuffer
from p2phub.nvme import bind

from regutil import bus_master as _bus_master, errno_of as _errno_of, nvme_open_arg as _open_arg

pytestmark = pytest.mark.lab

PARAMS = Path("/sys/module/p2phub/parameters")
NVME_DEBUGFS = Path("/sys/kernel/debug/p2phub/nvme")
PCI = Path("/sys/bus/pci/devices")
GRACE_MS = 2000
# TCG on a shared host: the unbind's own work after the grace period takes seconds, not ms.
MARGIN_S = 45.0


def _nvme_counter(name: str) -> int:
    return int((NVME_DEBUGFS / name).read_text())


def _driver(bdf: str) -> str | None:
    link = PCI / bdf / "driver"
    return link.resolve().name if link.exists() else None


def _group(bdf: str) -> str:
    return (PCI / bdf / "iommu_group").resolve().name


def _host_buf(size: int) -> Udmabuf | VgemBuffer:
    return Udmabuf(size) if Path("/dev/udmabuf").exists() else VgemBuffer(size)


def _faults_of_load(m: mmap.mmap) -> int:
    """Page faults this thread took for one 32-bit load from `m` (/proc/self/pagemap cannot
    see PFN mappings; the fault counter can)."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    _load32(m)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def _load32(m: mmap.mmap, off: int = 0) -> int:
    """One 32-bit load (MMIO wants whole registers, not memcpy's bytes)."""
    return ctypes.c_uint32.from_address(_addr(m) + off).value


def _addr(m: mmap.mmap) -> int:
    buf = ctypes.c_char.from_buffer(m)
    try:
        return ctypes.addressof(buf)
    finally:
        del buf


def _child_signal(addr: int) -> int:
    """Load 32 bits at `addr` in a forked child: the signal that killed it, or 0."""
    pid = os.fork()
    if pid == 0:
        try:
            faulthandler.disable()      # the signal is the expected outcome, not a crash report
            ctypes.c_uint32.from_address(addr).value
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0


@contextmanager
def _params(lab: dict[str, str]) -> Iterator[None]:
    """A short grace period (where the module has one), and ownership without an IOMMU in the lab."""
    saved: dict[Path, str] = {}
    want = {PARAMS / "remove_grace_ms": str(GRACE_MS)}
    if lab.get("iommu_groups") != "1":
        want[PARAMS / "allow_unsafe_noiommu"] = "Y"
    for p, v in want.items():
        if p.exists():
            saved[p] = p.read_text().strip()
            p.write_text(v)
    try:
        yield
    finally:
        for p, v in saved.items():
            p.write_text(v)


class _Owner:
    """An owner that holds everything a controller fd can hold and ignores every request."""

    def __init__(self, bdf: str) -> None:
        self.dev = Device()
        arg = _open_arg(bdf)
        self.fd = fcntl.ioctl(self.dev.fd, uapi.NVME_OPEN, arg, True)
        self.status = mmap.mmap(self.fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ,
                                offset=uapi.NVME_MMAP_STATUS)
        self.bar0 = mmap.mmap(self.fd, arg.out_bar0_mmap_size, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
        self.efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        fcntl.ioctl(self.fd, uapi.NVME_REQ_SET, uapi.NvmeReqSet.new(eventfd=self.efd), True)
        # A registration mapped for the controller, and a DMA buffer mapped into us.
        self.mem = _host_buf(1 << 20)
        reg = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF, fd=self.mem.fd, length=1 << 20)
        self.dev.ioctl(uapi.REGISTER, reg, "REGISTER")
        self.handle = reg.out_handle
        fcntl.ioctl(self.fd, uapi.NVME_MAP_REG, uapi.NvmeMapReg.new(handle=self.handle), True)
        alloc = uapi.NvmeDmaAlloc.new(size=2 * mmap.PAGESIZE)
        fcntl.ioctl(self.fd, uapi.NVME_DMA_ALLOC, alloc, True)
        self.buf = mmap.mmap(self.fd, 2 * mmap.PAGESIZE, mmap.MAP_SHARED, offset=alloc.out_mmap_offset)
        self.buf[:4] = b"p2ph"
        self.cap = _load32(self.bar0)     # CAP (low half): BAR0 faulted in

    @property
    def state(self) -> int:
        return uapi.NvmeStatus.from_buffer_copy(self.status[:ctypes.sizeof(uapi.NvmeStatus)]).state

    def close(self) -> None:
        for m in (self.buf, self.bar0, self.status):
            m.close()
        os.close(self.fd)
        os.close(self.efd)
        self.dev.close()
        self.mem.close()


def _assert_taken_back(o: _Owner, bdf: str, err: int) -> None:
    assert o.state & uapi.NVME_ST_REVOKED and o.state & uapi.NVME_ST_REMOVING, hex(o.state)
    assert os.eventfd_read(o.efd) >= 1
    assert not _bus_master(bdf)
    # The fd's ioctls say so; its mappings are gone, and cannot be made again.
    assert _errno_of(o.fd, uapi.NVME_MAP_REG, uapi.NvmeMapReg.new(handle=o.handle)) == err
    assert _errno_of(o.fd, uapi.NVME_RESUME, uapi.NvmeResume.new()) == err
    assert _errno_of(o.fd, uapi.NVME_DMA_ALLOC, uapi.NvmeDmaAlloc.new(size=mmap.PAGESIZE)) == err
    assert _errno_of(o.fd, uapi.NVME_IRQ_SET, uapi.NvmeIrqSet.new(vector=0, eventfd=o.efd)) in (err, errno.EINVAL)
    with pytest.raises(OSError) as exc:
        mmap.mmap(o.fd, mmap.PAGESIZE, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
    assert exc.value.errno in (err, errno.ENODEV)
    assert _child_signal(_addr(o.bar0)) == signal.SIGBUS
    assert _child_signal(_addr(o.buf)) == signal.SIGBUS
    # Nothing of the owner's is mapped for the device or left allocated for it.
    assert regutil.counters()["dev_maps"] == 0
    assert _nvme_counter("live_dma_buffers") == 0


def _unbind_thread(bdf: str) -> tuple[threading.Thread, dict[str, float]]:
    out: dict[str, float] = {}

    def run() -> None:
        t0 = time.monotonic()
        (PCI / bdf / "driver" / "unbind").write_text(bdf)
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


# ------------------------------------------------------------------------ removal that ends (M4)

def test_unbind_takes_the_controller_back_after_the_grace_period(lab: dict[str, str]) -> None:
    """An owner that ignores the request (fd open, BAR0 and a DMA buffer mapped, a registration
    mapped): the unbind completes after the grace period, the owner's next access fails cleanly."""
    b = lab["nvme_target"]
    bind.bind(b)
    taken = _nvme_counter("taken_back") if (NVME_DEBUGFS / "taken_back").exists() else 0
    with _params(lab):
        o = _Owner(b)
        try:
            assert o.cap != 0xFFFFFFFF and o.state == 0
            t, out = _unbind_thread(b)
            t.join(timeout=GRACE_MS / 1000 + MARGIN_S)
            assert not t.is_alive(), f"unbind still waiting {GRACE_MS / 1000 + MARGIN_S:.0f} s later"
            assert out["s"] >= GRACE_MS / 1000 * 0.9, f"unbind did not wait for the owner ({out['s']:.2f} s)"
            assert _driver(b) is None
            _assert_taken_back(o, b, errno.ENODEV)
            assert _nvme_counter("taken_back") == taken + 1
            assert _nvme_counter("live_handles") == 1   # the fd itself stays until closed
        finally:
            o.close()
            t = locals().get("t")
            if t is not None:
                t.join(timeout=60)
    assert _nvme_counter("live_handles") == 0
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}
    bind.unbind(b)      # back to the kernel's nvme driver, which finds a working controller
    assert _driver(b) == "nvme"


def test_reset_zaps_the_owners_bar0_mapping(lab: dict[str, str]) -> None:
    """A function reset zaps the owner's BAR0 mapping (no access during the reset); it faults back."""
    b = lab["nvme_target"]
    if not (PCI / b / "reset").exists():
        pytest.skip("the controller offers no reset method")
    bind.bind(b)
    with _params(lab):
        o = _Owner(b)
        try:
            # Mapped: a load takes no fault (allow a stray fault of the interpreter's own).
            assert min(_faults_of_load(o.bar0) for _ in range(5)) == 0
            (PCI / b / "reset").write_text("1")
            assert o.state & uapi.NVME_ST_ERROR
            assert _faults_of_load(o.bar0) >= 1, "BAR0 stayed mapped across the reset"
            assert _load32(o.bar0) == o.cap        # faulted back in once the reset was done
            assert o.buf[:4] == b"p2ph"            # DMA buffers are not the device's: kept
        finally:
            o.close()
    bind.unbind(b)


# -------------------------------------------------------------- one IOMMU group, two controllers (N2)

@pytest.fixture
def pair(lab: dict[str, str]) -> Iterator[tuple[str, str]]:
    """Two controllers of one IOMMU group: the one to own, and its sibling (on nvme)."""
    a, sib = lab.get("nvme_pair_a"), lab.get("nvme_pair_b")
    if not a or not sib:
        pytest.skip("needs the lab topology `bridge` (two controllers in one IOMMU group)")
    if lab.get("iommu_groups") != "1":
        pytest.skip("needs the emulated IOMMU (--iommu)")
    assert _group(a) == _group(sib), "the bridge topology's two controllers share a group"
    try:
        yield a, sib
    finally:
        # Leave both as the lab made them: on the kernel's nvme driver.
        bind.unbind(a)
        if _driver(sib) is None:
            bind.unbind(sib)


def test_open_is_refused_while_a_group_sibling_has_a_driver(pair: tuple[str, str]) -> None:
    b, sibling = pair
    bind.bind(b)
    assert _driver(sibling) == "nvme"
    with Device() as dev:
        assert _errno_of(dev.fd, uapi.NVME_OPEN, _open_arg(b)) == errno.EXDEV
        # Driverless, the sibling no longer shares the domain with a kernel driver.
        (PCI / sibling / "driver" / "unbind").write_text(sibling)
        os.close(fcntl.ioctl(dev.fd, uapi.NVME_OPEN, _open_arg(b), True))


def test_the_noiommu_override_leaves_a_group_sibling_with_a_driver_refused(pair: tuple[str, str]) -> None:
    """allow_unsafe_noiommu=1 covers a controller whose DMA no IOMMU translates, nothing more: a
    translated controller whose IOMMU group holds a device on a DMA API driver stays refused
    (EXDEV, p2phub could claim nothing for it), and the kernel is not tainted for it."""
    b, sibling = pair
    bind.bind(b)
    assert _driver(sibling) == "nvme"
    param = PARAMS / "allow_unsafe_noiommu"
    old = param.read_text().strip()
    tainted = int(Path("/proc/sys/kernel/tainted").read_text()) & (1 << 6)
    try:
        param.write_text("Y")
        with Device() as dev:
            assert _errno_of(dev.fd, uapi.NVME_OPEN, _open_arg(b)) == errno.EXDEV
    finally:
        param.write_text(old)
    assert int(Path("/proc/sys/kernel/tainted").read_text()) & (1 << 6) == tainted


VFIO_GROUP_GET_STATUS = 0x3B67        # _IO(';', 100 + 3)
VFIO_GROUP_SET_CONTAINER = 0x3B68     # _IO(';', 100 + 4)
VFIO_GROUP_FLAGS_VIABLE = 1


def _vfio_claim_errno(bdf: str) -> tuple[bool, int] | None:
    """Bind `bdf` to vfio-pci and try to claim its IOMMU group as a VFIO user does (the group's
    status, then SET_CONTAINER): (viable, errno of the claim, 0 when it succeeded), or None
    without vfio-pci and the legacy container in this kernel."""
    if subprocess.run(["modprobe", "vfio-pci"], capture_output=True).returncode != 0 \
            or not Path("/dev/vfio/vfio").exists():
        return None
    (PCI / bdf / "driver_override").write_text("vfio-pci")
    try:
        Path("/sys/bus/pci/drivers_probe").write_text(bdf)
        assert _driver(bdf) == "vfio-pci", f"vfio-pci did not bind {bdf}"
        container = os.open("/dev/vfio/vfio", os.O_RDWR)
        group = os.open(f"/dev/vfio/{_group(bdf)}", os.O_RDWR)
        try:
            status = bytearray(8)
            status[0] = 8
            fcntl.ioctl(group, VFIO_GROUP_GET_STATUS, status, True)
            viable = bool(int.from_bytes(status[4:8], "little") & VFIO_GROUP_FLAGS_VIABLE)
            try:
                fcntl.ioctl(group, VFIO_GROUP_SET_CONTAINER, ctypes.c_int32(container), True)
                return viable, 0
            except OSError as exc:
                return viable, exc.errno or 0
        finally:
            os.close(group)
            os.close(container)
    finally:
        (PCI / bdf / "driver_override").write_text("\n")
        if _driver(bdf) == "vfio-pci":
            (PCI / bdf / "driver" / "unbind").write_text(bdf)


def test_the_kernel_refuses_a_dma_api_driver_in_an_owned_group(lab: dict[str, str],
                                                                 pair: tuple[str, str]) -> None:
    """While the controller is owned, p2phub holds its IOMMU group's DMA ownership: binding nvme
    (a DMA API driver) to the sibling is refused by the kernel itself (EBUSY), and the owner keeps
    its controller, its mappings and its registration; VFIO cannot claim the group either. Once
    the owner closes its fd, nvme binds the sibling and brings its namespace up."""
    b, sibling = pair
    bind.bind(b)
    if _driver(sibling) is not None:
        (PCI / sibling / "driver" / "unbind").write_text(sibling)
    taken = _nvme_counter("taken_back")
    with _params(lab):
        o = _Owner(b)
        try:
            assert regutil.counters()["dev_maps"] == 1 and _bus_master(b)
            with pytest.raises(OSError) as exc:
                Path("/sys/bus/pci/drivers/nvme/bind").write_text(sibling)
            assert exc.value.errno == errno.EBUSY, f"nvme's bind of the sibling: {exc.value}"
            assert _driver(sibling) is None
            # Nothing was taken back: the owner still has everything.
            assert o.state == 0, hex(o.state)
            assert _nvme_counter("taken_back") == taken
            assert _bus_master(b) and regutil.counters()["dev_maps"] == 1
            assert _errno_of(o.fd, uapi.NVME_MAP_REG, uapi.NvmeMapReg.new(handle=o.handle)) == 0
            assert _load32(o.bar0) == o.cap and o.buf[:4] == b"p2ph"
            claim = _vfio_claim_errno(sibling)
            if claim is None:
                print("vfio-pci or /dev/vfio/vfio not in this kernel: the VFIO claim was not tried")
            else:
                viable, err = claim
                assert not viable and err in (errno.EPERM, errno.EBUSY), \
                    f"VFIO's claim of the owned group: viable={viable}, errno {err}"
                assert o.state == 0 and _nvme_counter("taken_back") == taken
        finally:
            o.close()
    # The group's DMA ownership went with the fd: the kernel lets nvme in again.
    Path("/sys/bus/pci/drivers/nvme/bind").write_text(sibling)
    assert _driver(sibling) == "nvme"
    bind._wait_namespaces(sibling, 30)
    assert bind.block_devices(sibling), "nvme did not bring up the sibling's namespace"
    with Device() as dev:
        assert _errno_of(dev.fd, uapi.NVME_OPEN, _open_arg(b)) == errno.EXDEV
    assert _nvme_counter("live_handles") == 0
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


# ------------------------------------------------------------- the function reset at hand-back (S3)

@pytest.mark.parametrize("how", ["grace_period", "closed_during_unbind"])
def test_the_controller_is_reset_before_it_is_handed_back(lab: dict[str, str], how: str) -> None:
    """Unbind of an owned controller resets the function before the PCI core gets it back, both
    when the kernel takes it back after the grace period and when the owner closes its fd while
    the unbind waits (its release cannot take the device lock, which the unbind holds)."""
    b = lab["nvme_target"]
    if not (PCI / b / "reset_method").exists() or not (PCI / b / "reset_method").read_text().split():
        pytest.skip("the controller offers no reset method")
    bind.bind(b)
    with _params(lab):
        o = _Owner(b)
        closed = False
        try:
            before = _nvme_counter("function_resets")      # after OPEN's own reset
            t, out = _unbind_thread(b)
            if how == "closed_during_unbind":
                deadline = time.monotonic() + MARGIN_S
                while not o.state & uapi.NVME_ST_REMOVING and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert o.state & uapi.NVME_ST_REMOVING, "the unbind did not ask the owner"
                o.close()
                closed = True
            t.join(timeout=GRACE_MS / 1000 + MARGIN_S)
            assert not t.is_alive(), "unbind did not return"
            assert _driver(b) is None
            resets = _nvme_counter("function_resets") - before
            assert resets == 1, f"{resets} function resets between the owner and the hand-back ({how})"
        finally:
            if not closed:
                o.close()
            t = locals().get("t")
            if t is not None:
                t.join(timeout=60)
    assert _nvme_counter("live_handles") == 0
    bind.unbind(b)
    assert _driver(b) == "nvme"


# Last: on a module that waits for ever, the owner stays in D state and keeps the controller.
OWN_UNBIND = r"""
import fcntl, mmap, os, sys, time
from p2phub import uapi
from p2phub.device import Device
from p2phub.nvme import bind
bdf = sys.argv[1]
dom, bus, devfn = bind.split_bdf(bdf)
dev = Device()
arg = uapi.NvmeOpen.new(domain=dom, bus=bus, devfn=devfn)
fd = fcntl.ioctl(dev.fd, uapi.NVME_OPEN, arg, True)
bar0 = mmap.mmap(fd, arg.out_bar0_mmap_size, mmap.MAP_SHARED, offset=uapi.NVME_MMAP_BAR0)
print("unbinding", flush=True)
t0 = time.monotonic()
with open(f"/sys/bus/pci/devices/{bdf}/driver/unbind", "w") as f:
    f.write(bdf)
print(f"unbind returned after {time.monotonic() - t0:.2f} s", flush=True)
try:
    fcntl.ioctl(fd, uapi.NVME_RESUME, uapi.NvmeResume.new(), True)
    print("RESUME 0")
except OSError as exc:
    print(f"RESUME errno {exc.errno}")
"""


def test_zz_an_owner_unbinding_its_own_controller_returns(lab: dict[str, str]) -> None:
    b = lab["nvme_target"]
    bind.bind(b)
    with _params(lab):
        p = subprocess.Popen([sys.executable, "-c", OWN_UNBIND, b], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        # Timed from the unbind, not from the interpreter's start (minutes under KASAN and TCG).
        assert p.stdout is not None
        first = p.stdout.readline()
        assert first.strip() == "unbinding", first + p.stdout.read()
        try:
            out, _ = p.communicate(timeout=GRACE_MS / 1000 + MARGIN_S)
        except subprocess.TimeoutExpired:
            state = Path(f"/proc/{p.pid}/stat").read_text().split()[2]
            pytest.fail(f"the owner's unbind did not return (process state {state})")
    assert p.returncode == 0, out
    assert "unbind returned" in out and f"RESUME errno {errno.ENODEV}" in out, out
    assert _driver(b) is None
    assert _nvme_counter("live_handles") == 0
    bind.unbind(b)
    assert _driver(b) == "nvme"
