"""Stress: no device DMA outlives the call that released its memory (issue 13).

Each test lets a device write into memory, releases the memory while the device is (or would
still be) writing, and then watches the memory from a side p2phub does not control:

- host memory: the memfd behind a udmabuf (6.12), or vgem's own CPU mapping (6.1, which has no
  udmabuf); the test keeps its own mapping, so the pages outlive the registration and any late
  device write would show;
- stand-in GPU memory: the host file behind the ivshmem BAR (GpuFile), written with a marker after
  the revocation returned.

After the releasing call returns, no byte may change. Figures (iterations, bytes in flight at
release, bytes changed after release) go to build/stress.json, keyed by kernel and IOMMU mode,
for docs/security.md.

Bounded for TCG on a loaded 2-core host: P2PHUB_STRESS_SECONDS (default 20) per storm.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import p2phub_fakegpu as fg
import regutil as ru
from p2phub import nvme, uapi
from p2phub.errors import P2PHubOSError, RevokedError
from p2phub.hostmem import Udmabuf, VgemBuffer
from p2phub.hub import Hub
from p2phub.nvme import bind, kernel_io

pytestmark = pytest.mark.lab

KiB, MiB = 1 << 10, 1 << 20
TOP = Path(__file__).resolve().parents[2]
OUT = TOP / "build" / "stress.json"
BUDGET_S = float(os.environ.get("P2PHUB_STRESS_SECONDS", "20"))
NVME_DEBUGFS = Path("/sys/kernel/debug/p2phub/nvme")
WATCH_S = 1.0          # how long released memory is watched
CHUNKS = 16            # 1 MiB reads in flight at release
LBA_BASE = 64 * MiB // 512   # where the known data lives on namespace 1 (512-byte LBAs)
INITIAL = b"\x5a"      # what host buffers hold before the reads


# --------------------------------------------------------------------------- helpers


def _record(lab: dict[str, str], test: str, figures: dict[str, Any]) -> None:
    """Merge `figures` into build/stress.json under this kernel and IOMMU mode."""
    key = f"{platform.release()}{' iommu' if lab.get('iommu') == '1' else ''}"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(OUT.read_text())
    except (OSError, ValueError):
        data = {}
    entry = dict(figures, date=time.strftime("%Y-%m-%d"),
                 command=f"tools/lab run --kernel {lab.get('kernel', '?')}"
                         f"{' --iommu' if lab.get('iommu') == '1' else ''} -- python -m pytest -m lab "
                         "tests/lab/test_stress_dma_lifetime.py")
    data.setdefault(key, {})[test] = entry
    OUT.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"stress {key} {test}: {json.dumps(figures, sort_keys=True)}")


def _nvme_counters() -> dict[str, int]:
    return {n: int((NVME_DEBUGFS / n).read_text()) for n in ("live_handles", "live_dma_buffers")}


class HostMem:
    """Host memory as a dma-buf plus a CPU view the test owns: the memfd behind a udmabuf, or
    vgem's own mapping where the kernel has no udmabuf. The view keeps the pages alive after
    the registration is gone, so a late device write would show in it."""

    def __init__(self, size: int, vgem: bool = False) -> None:
        self.size = size
        if not vgem and Path("/dev/udmabuf").exists():
            self.buf: Udmabuf | VgemBuffer = Udmabuf(size)
            self.kind = "udmabuf memfd"
            self.view = self.buf.mmap()
        else:
            self.buf = VgemBuffer(size)
            self.kind = "vgem mapping"
            self.view = mmap.mmap(self.buf.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.view[:] = INITIAL * size

    @property
    def fd(self) -> int:
        return self.buf.fd

    def snapshot(self) -> bytes:
        return bytes(self.view[:self.size])

    def close(self) -> None:
        self.view.close()
        self.buf.close()


def _changed(a: bytes, b: bytes) -> int:
    """Bytes that differ between two equal-length snapshots (fast when equal)."""
    if a == b:
        return 0
    step = 64 * KiB
    n = 0
    for o in range(0, len(a), step):
        x, y = a[o:o + step], b[o:o + step]
        if x != y:
            n += sum(1 for i, j in zip(x, y) if i != j)
    return n


def _watch(read, seconds: float = WATCH_S, interval: float = 0.1) -> tuple[bytes, int]:
    """Snapshot now, then compare every `interval` for `seconds`: (first snapshot, bytes changed)."""
    first = read()
    worst = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(interval)
        worst = max(worst, _changed(first, read()))
    return first, worst


def _landed(view: bytes, data: bytes, chunk: int = MiB) -> int:
    """How many whole chunks of `view` already hold the SSD's bytes."""
    return sum(1 for o in range(0, len(data), chunk) if view[o:o + chunk] == data[o:o + chunk])


@pytest.fixture(scope="module")
def ssd_data(bdf: str) -> bytes:
    """CHUNKS MiB of random bytes at LBA_BASE of namespace 1, written by the kernel nvme driver."""
    if bind.current_driver(bdf) != "nvme":
        bind.unbind(bdf)
    data = os.urandom(CHUNKS * MiB)
    assert INITIAL * MiB not in (data[o:o + MiB] for o in range(0, len(data), MiB))
    kernel_io.write(kernel_io.require_namespace_device(bdf, 1), LBA_BASE * 512, data)
    return data


def _reads(reg: Any, n: int = CHUNKS) -> list[nvme.Op]:
    return [nvme.ReadOp(reg, lba=LBA_BASE + 2048 * i, nbytes=MiB, offset=MiB * i) for i in range(n)]


# --------------------------------------------------------------------------- 1. close during I/O


@pytest.mark.parametrize("how", ["reg.close", "hub.close", "unregister", "close-timeout-0"])
def test_release_during_inflight_reads(how: str, bdf: str, ssd_data: bytes, lab: dict[str, str]) -> None:
    """16 x 1 MiB reads in flight into host memory, then the release is called at once.

    reg.close() and hub.close() wait for the reads; a raw UNREGISTER is refused with EBUSY while
    the controller holds the registration; close(timeout=0) refuses (EBUSY) and releases
    nothing. After the call that released the memory returned, the memory holds exactly the
    SSD's bytes and not one byte changes for a second."""
    size = CHUNKS * MiB
    mem = HostMem(size)
    hub = Hub()
    try:
        ctrl = hub.nvme(bdf, io_queues=1)
        ns = ctrl.namespace(1)
        reg = hub.register_dmabuf(mem.fd, 0, size, device=bdf)
        futs = ns.submit(_reads(reg))
        inflight = ctrl.inflight(reg)
        landed_at_release = _landed(mem.snapshot(), ssd_data)
        refused = None
        if how == "reg.close":
            reg.close()
        elif how == "hub.close":
            hub.close()
        elif how == "unregister":
            with pytest.raises(OSError) as exc:
                hub.device.ioctl(uapi.UNREGISTER, uapi.Unregister.new(handle=reg.handle), "UNREGISTER")
            refused = exc.value.errno
            assert refused == errno.EBUSY, exc.value
            assert not reg.closed and ctrl.holds(reg)
            reg.close()                       # the release that counts: it waits
        else:
            before = ru.counters()["regs"]
            try:
                reg.close(timeout=0.0)
                refused = 0
            except P2PHubOSError as exc:
                refused = exc.errno
                assert exc.errno == errno.EBUSY and "nothing was released" in str(exc), exc
                # Nothing released: the registration and its pin are still there, the reads land.
                assert not reg.closed and ru.counters()["regs"] == before
                for f in futs:
                    f.result(timeout=60)
                assert mem.snapshot() == ssd_data
                reg.close()
        released_at = time.monotonic()
        for f in futs:
            assert f.done(), "a read was still outstanding after the release returned"
            assert f.exception(timeout=0) is None
        after, changed = _watch(mem.snapshot)
        assert after == ssd_data, f"{_landed(after, ssd_data)}/{CHUNKS} chunks hold the SSD's bytes"
        assert changed == 0, f"{changed} bytes of the released {mem.kind} changed after {how} returned"
    finally:
        hub.close()
        mem.close()
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}
    assert _nvme_counters() == {"live_handles": 0, "live_dma_buffers": 0}
    _record(lab, f"release_during_io[{how}]", {
        "memory": mem.kind, "reads": CHUNKS, "read_bytes": MiB,
        "commands_in_flight_at_release": inflight, "bytes_in_flight_at_release": inflight * MiB,
        "chunks_landed_when_release_called": landed_at_release,
        "refused_errno": refused, "watched_s": round(time.monotonic() - released_at, 2),
        "bytes_changed_after_release": changed})


# --------------------------------------------------------------------------- 2. kill -9 mid-I/O

_CHILD = r"""
import sys, time
from p2phub import nvme
from p2phub.hub import Hub
fd, bdf, n, base = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
hub = Hub()
ctrl = hub.nvme(bdf, io_queues=1)
reg = hub.register_dmabuf(fd, 0, n << 20, device=bdf)
ns = ctrl.namespace(1)
futs = ns.submit([nvme.ReadOp(reg, lba=base + 2048 * i, nbytes=1 << 20, offset=i << 20) for i in range(n)])
print("inflight", ctrl.inflight(reg), flush=True)
time.sleep(600)
"""


def test_kill_9_mid_io(bdf: str, ssd_data: bytes, lab: dict[str, str]) -> None:
    """A child owns the controller and a registration of memory the parent also maps, submits
    16 x 1 MiB reads and is SIGKILLed at once. Once it is reaped, no byte of the memory changes
    and p2phub.ko's counters are back to zero."""
    size = CHUNKS * MiB
    rounds = []
    for delay in (0.0, 0.02):
        if bind.current_driver(bdf) == "nvme":
            bind.bind(bdf)  # bound here: the child's start-up is then only imports and bring-up
        mem = HostMem(size)
        try:
            child = subprocess.Popen(
                [sys.executable, "-c", _CHILD, str(mem.fd), bdf, str(CHUNKS), str(LBA_BASE)],
                pass_fds=(mem.fd,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                line = child.stdout.readline()
                assert line.startswith("inflight"), (line, child.stderr.read() if child.poll() is not None else "")
                time.sleep(delay)
                landed_at_kill = _landed(mem.snapshot(), ssd_data)
                os.kill(child.pid, signal.SIGKILL)
            finally:
                if child.poll() is None:
                    child.kill()
                rc = child.wait(timeout=120)
                child.stdout.close()
                child.stderr.close()
            assert rc == -signal.SIGKILL
            reaped, changed = _watch(mem.snapshot)
            landed = _landed(reaped, ssd_data)
            # Whatever landed is the SSD's bytes or the initial pattern, chunk-wise or partially:
            # never anything else.
            for o in range(0, size, MiB):
                got = reaped[o:o + MiB]
                if got != ssd_data[o:o + MiB] and got != INITIAL * MiB:
                    assert all(g in (d, INITIAL[0]) for g, d in zip(got, ssd_data[o:o + MiB])), o
            assert changed == 0, f"{changed} bytes of the {mem.kind} changed after the child was reaped"
            assert ru.wait_no_leaks(timeout=30) == {k: 0 for k in ru.LEAK_COUNTERS}
            assert ru.wait_until(lambda: _nvme_counters() == {"live_handles": 0, "live_dma_buffers": 0}, 30)
            rounds.append({"kill_delay_s": delay, "commands_in_flight_at_kill": int(line.split()[1]),
                           "chunks_landed_at_kill": landed_at_kill, "chunks_landed_at_reap": landed,
                           "bytes_changed_after_reap": changed})
        finally:
            mem.close()
    # The controller is usable again at once.
    with Hub() as hub, hub.nvme(bdf, io_queues=1) as ctrl:
        buf = ctrl.alloc_dma(MiB, "after")
        ctrl.namespace(1).read(buf, lba=LBA_BASE, nbytes=MiB)
        assert bytes(buf.view[:MiB]) == ssd_data[:MiB]
    _record(lab, "kill_9_mid_io", {
        "memory": mem.kind, "rounds": len(rounds), "reads_per_round": CHUNKS, "read_bytes": MiB,
        "bytes_in_flight_at_kill": sum(r["commands_in_flight_at_kill"] for r in rounds) * MiB,
        "per_round": rounds,
        "bytes_changed_after_reap": sum(r["bytes_changed_after_reap"] for r in rounds)})


# --------------------------------------------------------------------------- 3. revocation storm

STORM_REG = 8 * MiB   # one stand-in GPU range per iteration, distinct ranges in turn


def test_revocation_storm_during_nvme_reads(bdf: str, ssd_data: bytes, gpu: fg.FakeGpu,
                                            lab: dict[str, str]) -> None:
    """Reads into stand-in GPU memory in a loop; another thread revokes the registration under
    them, then it is exported and registered again. Every revocation fences the controller:
    the affected futures fail with a revocation (or reset) error, the engine resumes, and the
    next fresh registration reads the SSD's bytes. A marker written into the revoked range
    (the host file behind the BAR) after the revocation returned stays as written."""
    gpu_file = fg.GpuFile(lab["gpu_file"])
    c0 = gpu.query()   # the stand-in's counters are per module load: earlier tests' misuse is theirs
    slots = c0.bar_size // STORM_REG
    data = ssd_data[:STORM_REG]
    stats = {"iterations": 0, "revocations": 0, "futures_ok": 0, "futures_revoked": 0,
             "futures_reset": 0, "bytes_in_flight_at_revoke": 0, "bytes_changed_after_revoke": 0,
             "fresh_registration_reads_ok": 0}
    rng = random.Random(13)
    revoke_go, revoke_done = threading.Event(), threading.Event()
    current: dict[str, Any] = {}
    errors: list[BaseException] = []

    def revoker() -> None:
        """The other thread: revoke what it is told to, as soon as it is told, then mark it."""
        while True:
            revoke_go.wait()
            revoke_go.clear()
            if current.get("stop"):
                return
            try:
                time.sleep(current["delay"])
                gpu.revoke(current["fd"])
                # After revoke returned: a marker in the revoked range, to be watched.
                marker = f"revoked {current['it']} ".encode()
                current["marker"] = gpu_file.fill(current["off"], STORM_REG, marker)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
            revoke_done.set()

    t = threading.Thread(target=revoker, name="revoker")
    t.start()
    deadline = time.monotonic() + BUDGET_S
    try:
        with Hub() as hub, hub.nvme(bdf, io_queues=1) as ctrl:
            ns = ctrl.namespace(1)
            ctrl.io_qps[0].timeout_s = 30.0
            fences0 = ctrl.recovery.fences
            it = 0
            while time.monotonic() < deadline or it < 3:
                off = (it % slots) * STORM_REG
                gpu_file.fill(off, STORM_REG, b"\xa5")
                fd = gpu.export_dmabuf(off, STORM_REG)
                try:
                    reg = hub.register_dmabuf(fd, 0, STORM_REG, device=bdf)
                    # A fresh registration works, whatever was revoked before it.
                    ns.read(reg, lba=LBA_BASE, nbytes=MiB)
                    assert gpu_file.read(off, MiB) == data[:MiB], f"iteration {it}: fresh read"
                    stats["fresh_registration_reads_ok"] += 1
                    # 8 x 1 MiB reads in flight over the whole range.
                    futs = ns.submit(_reads(reg, STORM_REG // MiB))
                    stats["bytes_in_flight_at_revoke"] += ctrl.inflight(reg) * MiB
                    current.update(fd=fd, off=off, it=it, delay=rng.choice((0.0, 0.0, 0.005, 0.02)))
                    revoke_done.clear()
                    revoke_go.set()
                    for f in futs:   # waiting drives the queue: the engine sees the fence here
                        exc = f.exception(timeout=60)
                        if exc is None:
                            stats["futures_ok"] += 1
                        elif isinstance(exc, RevokedError):
                            stats["futures_revoked"] += 1
                        elif isinstance(exc, nvme.ControllerResetError):
                            stats["futures_reset"] += 1
                        else:
                            raise exc
                    assert revoke_done.wait(60), "revoke did not return"
                    if errors:
                        raise errors[0]
                    stats["revocations"] += 1
                    assert ctrl.quiesce_registration(reg, timeout=30)
                    reg.close()
                    # The revoked range keeps the marker written after revoke returned.
                    _, changed = _watch(lambda: gpu_file.read(off, STORM_REG), seconds=0.3)
                    got = gpu_file.read(off, STORM_REG)
                    changed = max(changed, _changed(got, current["marker"]))
                    stats["bytes_changed_after_revoke"] += changed
                    assert changed == 0, f"iteration {it}: {changed} bytes of the revoked range changed"
                finally:
                    os.close(fd)
                it += 1
                stats["iterations"] = it
            # Every revocation fenced the controller (the engine counted it), and the engine
            # still works on memory nobody revoked.
            stats["fences"] = ctrl.recovery.fences - fences0
            assert stats["fences"] >= 1
            buf = ctrl.alloc_dma(MiB, "after")
            ns.read(buf, lba=LBA_BASE, nbytes=MiB)
            assert bytes(buf.view[:MiB]) == data[:MiB]
    finally:
        current["stop"] = True
        revoke_go.set()
        t.join(timeout=60)
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}
    assert _nvme_counters() == {"live_handles": 0, "live_dma_buffers": 0}
    c = gpu.query()
    assert c.attachments == 0 and c.mappings == 0 and c.pins == 0 and c.misuse == c0.misuse, c
    _record(lab, "revocation_storm_nvme", stats)


# --------------------------------------------------------------------------- 4. RDMA MRs


def test_release_during_rdma_writes_into_an_mr(pds, lab: dict[str, str]) -> None:
    """Node B RDMA-writes into an MR over node A's registration in a loop; node A releases the
    registration (close(force=True) closes the MR first). After it returned: no byte of the
    memory changes (the test's own mapping of the pages), B's writes fail with an error
    completion (remote access) rather than landing, and p2phub.ko's counters are zero.

    rxe cannot take an MR on stand-in GPU memory (no dma-buf MRs, and a BAR export has no
    struct pages to mmap), so revocation itself is shown for MRs by the refusal of an MR on a
    revoked registration (test_rdma.py) and by this release of host memory under live MRs."""
    from p2phub.rdma import Access
    from rdmautil import connected_pair
    pd_a, pd_b = pds
    size = 4 * MiB
    rounds = []
    t_end = time.monotonic() + BUDGET_S / 2
    while time.monotonic() < t_end or len(rounds) < 2:
        # vgem: a udmabuf's pages are its memfd's page cache, which p2phub's export does not map
        # itself, and udmabuf's own mapping is PFN-mapped: no VA MR could pin either
        mem = HostMem(size, vgem=True)
        hub = Hub()
        try:
            reg_a = hub.register_dmabuf(mem.fd, 0, size)
            reg_b = hub.alloc_host(size)
            src = reg_b.source.mmap() if hasattr(reg_b.source, "mmap") else mmap.mmap(
                reg_b.source.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            payload = bytes(random.Random(len(rounds)).randbytes(64 * KiB))
            src[:len(payload)] = payload
            mr_a, mr_b = reg_a.mr(pd_a, Access.REMOTE_WRITE), reg_b.mr(pd_b)
            ea, eb = connected_pair(pd_a, pd_b)
            writes, failure = [0], []
            stop = threading.Event()

            def writer() -> None:
                off = 0
                while not stop.is_set():
                    try:
                        eb.write(mr_b, mr_a, len(payload), roff=off, timeout=10)
                    except (RuntimeError, TimeoutError) as exc:
                        failure.append(exc)
                        return
                    writes[0] += 1
                    off = (off + len(payload)) % size

            w = threading.Thread(target=writer, name="rdma-writer")
            w.start()
            assert ru.wait_until(lambda: writes[0] >= 4 or bool(failure), 30), "no RDMA write completed"
            assert not failure, failure
            n_before = writes[0]
            reg_a.close(force=True)                  # the MR goes first, then the pin
            assert mr_a.closed and reg_a.closed
            released = mem.snapshot()
            _, changed = _watch(mem.snapshot)
            changed = max(changed, _changed(released, mem.snapshot()))
            stop.set()
            w.join(timeout=30)
            assert not w.is_alive()
            assert changed == 0, f"{changed} bytes of the released {mem.kind} changed after close returned"
            assert payload in released, "no RDMA write landed before the release"
            rounds.append({"writes_before_release": n_before, "writes_total": writes[0],
                           "writer_error_after_release": repr(failure[0]) if failure else None,
                           "bytes_changed_after_release": changed})
            ea.close()
            eb.close()
            mr_b.close()
            src.close()
        finally:
            hub.close()
            mem.close()
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}
    _record(lab, "release_during_rdma_writes", {
        "memory": rounds and mem.kind, "rounds": len(rounds), "write_bytes": 64 * KiB,
        "rdma_writes_before_release": sum(r["writes_before_release"] for r in rounds),
        "writers_failed_cleanly": sum(1 for r in rounds if r["writer_error_after_release"]),
        "per_round": rounds,
        "bytes_changed_after_release": sum(r["bytes_changed_after_release"] for r in rounds)})


def test_revoked_source_takes_no_mr_and_no_late_write(pds, gpu: fg.FakeGpu, lab: dict[str, str]) -> None:
    """Stand-in GPU memory registered and exported; revoke the source while the export is
    held: every later MR is refused (RevokedError or the missing dma-buf MR path), and a marker
    written into the revoked range after the revocation returned stays as written."""
    gpu_file = fg.GpuFile(lab["gpu_file"])
    off = 0
    rounds = 0
    with Hub() as hub:
        for it in range(4):
            fd = gpu.export_dmabuf(off, MiB)
            try:
                reg = hub.register_dmabuf(fd, 0, MiB, device=lab["nvme_target"])
                exp = reg.dmabuf_fd               # p2phub's export, held across the revocation
                assert exp >= 0
                gpu.revoke(fd)
                marker = gpu_file.fill(off, MiB, f"revoked {it} ".encode())
                with pytest.raises((RevokedError, P2PHubOSError)):
                    reg.mr(pds[0])
                _, changed = _watch(lambda: gpu_file.read(off, MiB), seconds=0.3)
                assert changed == 0 and gpu_file.read(off, MiB) == marker
                reg.close(force=True)
                rounds += 1
            finally:
                os.close(fd)
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}
    _record(lab, "revoked_export_refuses_mr", {"rounds": rounds, "bytes_changed_after_revoke": 0})
