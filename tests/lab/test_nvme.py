"""The user-space NVMe engine against QEMU's NVMe controller, inside the lab.

Data is always checked from a side the engine does not control: the kernel
nvme driver reading the block device after the controller is given back, or
the host file behind the stand-in GPU's BAR.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from p2phub import nvme, uapi
from p2phub.errors import RevokedError, UsageError
from p2phub.hostmem import VgemBuffer
from p2phub.hub import Hub
from p2phub.nvme import bind, kernel_io, spec
from p2phub.nvme.errors import ControllerBusyError, NvmeStatusError, NvmeTimeoutError

import p2phub_fakegpu as fg

pytestmark = pytest.mark.lab

KiB, MiB = 1 << 10, 1 << 20
DEBUGFS = Path("/sys/kernel/debug/p2phub/nvme")


# --------------------------------------------------------------------------- helpers


def _counter(name: str) -> int:
    return int((DEBUGFS / name).read_text())


def _give_back(bdf: str) -> None:
    bind.unbind(bdf)
    assert bind.current_driver(bdf) == "nvme"


@pytest.fixture
def ctrl(bdf: str, hub: Hub) -> Iterator[nvme.Controller]:
    with nvme.open(bdf, hub=hub, io_queues=4) as c:
        yield c
    assert _counter("live_handles") == 0 and _counter("live_dma_buffers") == 0


class Vgem:
    """A vgem dumb buffer registered with p2phub for the controller, plus a CPU view."""

    def __init__(self, hub: Hub, bdf: str, size: int) -> None:
        self.buf = VgemBuffer(size)
        self.map = mmap.mmap(self.buf.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.reg = hub.register_dmabuf(self.buf.fd, 0, size, device=bdf)

    def close(self) -> None:
        assert nvme.quiesce_registration(self.reg, timeout=30)  # the controller lets go of it
        self.reg.close()
        self.map.close()
        self.buf.close()


# --------------------------------------------------------------------------- bind


def test_bind_refuses_busy_namespaces_and_says_why(lab: dict[str, str], tmp_path: Path) -> None:
    b = lab["nvme_target"]
    if bind.current_driver(b) != "nvme":
        bind.unbind(b)
    ns2 = kernel_io.require_namespace_device(b, 2)
    ns1 = kernel_io.require_namespace_device(b, 1)
    subprocess.run(["mkfs.ext4", "-q", "-F", ns2], check=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", ns2, str(mnt)], check=True)
    try:
        with pytest.raises(ControllerBusyError) as e:
            bind.bind(b)
        assert any(f"{ns2} is mounted on {mnt}" in r for r in e.value.reasons), e.value.reasons
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
    # A device-mapper target (what LVM builds) holding ns1.
    sectors = int(Path(f"/sys/class/block/{os.path.basename(ns1)}/size").read_text())
    subprocess.run(["dmsetup", "create", "p2phub-test", "--table", f"0 {sectors} linear {ns1} 0"], check=True)
    try:
        with pytest.raises(ControllerBusyError) as e:
            bind.bind(b)
        assert any("held by dm-" in r and "p2phub-test" in r for r in e.value.reasons), e.value.reasons
    finally:
        subprocess.run(["dmsetup", "remove", "p2phub-test"], check=True)
    # Swap.
    subprocess.run(["mkswap", "-f", ns2], check=True, capture_output=True)
    subprocess.run(["swapon", ns2], check=True)
    try:
        with pytest.raises(ControllerBusyError) as e:
            bind.bind(b)
        assert any("swap" in r for r in e.value.reasons), e.value.reasons
    finally:
        subprocess.run(["swapoff", ns2], check=True)
    # Someone holding it open exclusively.
    fd = os.open(ns1, os.O_RDONLY | os.O_EXCL)
    try:
        with pytest.raises(ControllerBusyError) as e:
            bind.bind(b)
        assert any("exclusively" in r for r in e.value.reasons), e.value.reasons
    finally:
        os.close(fd)
    assert bind.current_driver(b) == "nvme"
    # Free now: it binds, and unbind gives it back to the kernel with its namespaces.
    assert bind.bind(b) == "nvme"
    assert bind.current_driver(b) == "p2phub-nvme"
    _give_back(b)
    assert sorted(int(Path(f"/sys/class/block/{os.path.basename(d)}/nsid").read_text())
                  for d in bind.block_devices(b)) == [1, 2]


def test_bind_refuses_plain_openers_and_names_their_pids(lab: dict[str, str]) -> None:
    """Processes holding the namespace's block device (read-only, no O_EXCL, as an O_DIRECT database
    does) and its generic char device open: bind names them, and binds once they are gone."""
    b = lab["nvme_target"]
    if bind.current_driver(b) != "nvme":
        bind.unbind(b)
    ns1 = kernel_io.require_namespace_device(b, 1)
    ng1 = "/dev/ng" + os.path.basename(ns1)[len("nvme"):]
    hold = "import os, sys, time\nfd = os.open(sys.argv[1], os.O_RDONLY)\nprint('open', flush=True)\ntime.sleep(60)"
    readers = [subprocess.Popen([sys.executable, "-c", hold, dev], stdout=subprocess.PIPE, text=True)
               for dev in (ns1, ng1)]
    try:
        for r in readers:
            assert r.stdout is not None and r.stdout.readline().strip() == "open"
        with pytest.raises(ControllerBusyError) as e:
            bind.bind(b)
        want = [f"{dev} is open by pid {r.pid} ({Path(f'/proc/{r.pid}/comm').read_text().strip()})"
                for dev, r in zip((ns1, ng1), readers)]
        assert sorted(e.value.reasons) == sorted(want), e.value.reasons
        assert bind.current_driver(b) == "nvme"
    finally:
        for r in readers:
            r.kill()
            r.wait()
    assert bind.bind(b) == "nvme"
    assert bind.current_driver(b) == "p2phub-nvme"
    _give_back(b)


# --------------------------------------------------------------------------- identify


def test_identify_controller_and_namespaces(ctrl: nvme.Controller) -> None:
    info = ctrl.info()
    assert info["controller"]["serial"] == "p2phub-target"
    assert info["cap"]["mqes"] >= 64 and info["cap"]["mpsmin"] == 4096
    assert ctrl.max_transfer == 4096 << ctrl.ident.mdts
    assert sorted(ctrl.namespaces) == [1, 2]
    assert ctrl.namespace(1).lba_size == 512 and ctrl.namespace(1).blocks == (256 * MiB) // 512
    assert ctrl.namespace(2).lba_size == 4096 and ctrl.namespace(2).blocks == (64 * MiB) // 4096
    assert 1 <= len(ctrl.io_qps) <= 4
    with pytest.raises(UsageError, match="no active namespace 3"):
        ctrl.namespace(3)


# --------------------------------------------------------------------------- data integrity


def test_write_from_vgem_then_kernel_reads_it(bdf: str, hub: Hub) -> None:
    size = 3 * MiB + 64 * KiB  # > MDTS: several commands
    data = os.urandom(size)
    v = Vgem(hub, bdf, size)
    try:
        v.map[:] = data
        with nvme.open(bdf, hub=hub) as c:
            for nsid, lba in ((1, 2048 + 7), (2, 100)):
                ns = c.namespace(nsid)
                ns.write(v.reg, lba=lba, nbytes=size)
                ns.flush()
    finally:
        v.close()
    _give_back(bdf)
    assert kernel_io.read(kernel_io.require_namespace_device(bdf, 1), (2048 + 7) * 512, size) == data
    assert kernel_io.read(kernel_io.require_namespace_device(bdf, 2), 100 * 4096, size) == data


def test_kernel_writes_then_engine_reads_into_vgem(bdf: str, hub: Hub) -> None:
    if bind.current_driver(bdf) != "nvme":
        bind.unbind(bdf)
    size = 1 * MiB + 8 * KiB
    d1, d2 = os.urandom(size), os.urandom(size)
    kernel_io.write(kernel_io.require_namespace_device(bdf, 1), 77 * 512 * 8, d1)
    kernel_io.write(kernel_io.require_namespace_device(bdf, 2), 3000 * 4096, d2)
    with nvme.open(bdf, hub=hub) as c:
        v = Vgem(hub, bdf, 2 * MiB + 32 * KiB)
        try:
            c.namespace(1).read(v.reg, lba=77 * 8, nbytes=size, offset=4)
            c.namespace(2).read(v.reg, lba=3000, nbytes=size, offset=size + 4)
            assert v.map[4:4 + size] == d1
            assert v.map[size + 4:2 * size + 4] == d2
        finally:
            v.close()


def test_p2p_read_into_stand_in_gpu_lands_in_host_file(bdf: str, hub: Hub, lab: dict[str, str]) -> None:
    """SSD -> ivshmem BAR: a device-to-device DMA, checked in the file behind the BAR."""
    gpu_file = fg.GpuFile(lab["gpu_file"])
    off, size = 5 * MiB, 2 * MiB + 12 * KiB
    with fg.loaded_module(lab["modules_dir"]), fg.FakeGpu() as gpu, nvme.open(bdf, hub=hub) as c:
        ns = c.namespace(1)
        src = c.alloc_dma(4 * MiB, "src")
        data = os.urandom(size)
        src.view[:size] = data
        ns.write(src, lba=4096, nbytes=size)
        gpu_file.write(off, b"\xee" * size)
        fd = gpu.export_dmabuf(off, 4 * MiB)
        try:
            with hub.register_dmabuf(fd, 0, 4 * MiB, device=bdf) as reg:
                ns.read(reg, lba=4096, nbytes=size)
                assert gpu_file.read(off, size) == data
                # And back: GPU memory -> SSD, checked through the engine into host memory.
                back = os.urandom(64 * KiB)
                gpu_file.write(off + 3 * MiB, back)
                ns.write(reg, lba=8192, nbytes=64 * KiB, offset=3 * MiB)
                dst = c.alloc_dma(64 * KiB, "dst")
                ns.read(dst, lba=8192, nbytes=64 * KiB)
                assert bytes(dst.view) == back
                assert c.quiesce_registration(reg, timeout=30)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- queues


def _stamp(lba: int) -> bytes:
    return lba.to_bytes(8, "little") * 512


def test_queue_depth_at_controller_limit_wraps_many_times(bdf: str) -> None:
    with nvme.open(bdf, io_queues=1, queue_depth=1 << 16) as c:
        qp = c.io_qps[0]
        assert qp.depth == c.cap.mqes  # capped by CAP.MQES
        ns = c.namespace(2)
        nblk = 1024
        buf = c.alloc_dma(4 * MiB, "stamps")
        for base in range(0, nblk, 1024):
            for i in range(1024):
                buf.view[i * 4096:(i + 1) * 4096] = _stamp(base + i)
            ns.write(buf, lba=base, nbytes=4 * MiB)
        rd = c.alloc_dma(4 * MiB, "reads")
        order = [random.randrange(nblk) for _ in range(3 * qp.depth + 17)]
        futs = []
        slots = {}
        for k, lba in enumerate(order):
            slot = k % 1024
            futs.append(ns.submit([nvme.ReadOp(rd, lba=lba, nbytes=4096, offset=slot * 4096)])[0])
            slots[k] = slot
            if slot == 1023 or k == len(order) - 1:  # reuse of a slot: drain first
                for f in futs:
                    f.result(timeout=60)
                for j in range(k - len(futs) + 1, k + 1):
                    s = slots[j]
                    assert bytes(rd.view[s * 4096:s * 4096 + 8]) == order[j].to_bytes(8, "little")
                futs = []
        # One batch as deep as the queue: one doorbell for it.
        before = qp.stats()["doorbells"]
        ops = [nvme.ReadOp(rd, lba=i % nblk, nbytes=4096, offset=(i % 1024) * 4096)
               for i in range(qp.ntrk)]
        for f in ns.submit(ops):
            f.result(timeout=60)
        assert qp.stats()["doorbells"] == before + 1
        st = qp.stats()
        assert st["completed"] > 3 * qp.depth and st["stale_cqes"] == 0


def test_queue_pairs_from_threads(bdf: str) -> None:
    with nvme.open(bdf, io_queues=4, queue_depth=64) as c:
        ns = c.namespace(1)
        n = len(c.io_qps)
        errors: list[BaseException] = []
        used = set()

        def worker(k: int) -> None:
            try:
                qp = c.io_qpair()
                used.add(qp.qid)
                src = c.alloc_dma(256 * KiB, f"w{k}")
                dst = c.alloc_dma(256 * KiB, f"r{k}")
                for it in range(6):
                    data = os.urandom(256 * KiB)
                    src.view[:] = data
                    lba = (k * 64 + it * 8) * 512
                    futs = ns.submit([nvme.WriteOp(src, lba=lba + j * 64, nbytes=32 * KiB, offset=j * 32 * KiB)
                                      for j in range(8)])
                    for f in futs:
                        f.result(timeout=30)
                    ns.read(dst, lba=lba, nbytes=256 * KiB, timeout=30)
                    assert bytes(dst.view) == data
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(used) == n  # every queue pair carried I/O
        assert all(q.stats()["completed"] >= 6 * 9 for q in c.io_qps)


def test_write_zeroes_and_asyncio(ctrl: nvme.Controller) -> None:
    ns = ctrl.namespace(2)
    buf = ctrl.alloc_dma(64 * KiB, "aio")
    buf.view[:] = b"\x5a" * (64 * KiB)
    ns.write(buf, lba=500, nbytes=64 * KiB)
    ns.write_zeroes(lba=502, nblocks=3)

    async def main() -> None:
        await asyncio.gather(*(ns.read_async(buf, lba=500 + i, nbytes=4096, offset=i * 4096)
                               for i in range(16)))

    asyncio.run(main())
    got = bytes(buf.view)
    assert got[:8192] == b"\x5a" * 8192
    assert got[8192:5 * 4096] == bytes(3 * 4096)
    assert got[5 * 4096:] == b"\x5a" * (11 * 4096)


def test_interrupt_mode(bdf: str) -> None:
    with nvme.open(bdf, io_queues=2, interrupts=True) as c:
        assert c.nr_irqs >= 2
        ns = c.namespace(1)
        buf = c.alloc_dma(128 * KiB, "irq")
        data = os.urandom(128 * KiB)
        buf.view[:] = data
        ns.write(buf, lba=1 << 16, nbytes=128 * KiB)
        buf.view[:] = bytes(128 * KiB)
        ns.read(buf, lba=1 << 16, nbytes=128 * KiB)
        assert bytes(buf.view) == data
        irqs = Path("/proc/interrupts").read_text()
        assert "p2phub-nvme" in irqs
        counts = [sum(int(x) for x in line.split()[1:3] if x.isdigit())
                  for line in irqs.splitlines() if f"@{bdf}" in line]
        assert sum(counts) > 0, "no MSI-X interrupt reached the eventfd relay"


# --------------------------------------------------------------------------- batches of requests


def _scattered(n: int, seed: int, reg_size: int) -> list[tuple[str, int, int, int, int]]:
    """n requests (kind, registration 0/1, LBA, bytes, offset) of 4 KiB..128 KiB, alternately
    reads and writes, each on LBAs and a registration range of its own, with gaps; shuffled."""
    rnd = random.Random(seed)
    plan = []
    lba, used = 0, [0, 0]
    for k in range(n):
        size = rnd.choices((4, 8, 16, 32, 64, 128), weights=(90, 3, 3, 2, 1, 1))[0] * KiB
        r = k % 2
        assert used[r] + size <= reg_size
        plan.append(("read" if k % 4 < 2 else "write", r, lba, size, used[r]))
        lba += size // 512 + rnd.choice((0, 0, 1, 8))
        used[r] += size + rnd.choice((0, 0, 4096))
    rnd.shuffle(plan)
    return plan


def test_batch_of_thousands_of_scattered_reads_and_writes_checked_by_the_kernel(bdf: str, hub: Hub) -> None:
    """4096 requests of 4..128 KiB into two registrations in one submit call (far more than the
    queue holds); the kernel nvme driver, given the controller back, reads the same LBAs."""
    if bind.current_driver(bdf) != "nvme":
        bind.unbind(bdf)
    reg_size = 20 * MiB
    plan = _scattered(4096, 21, reg_size)
    span = max(lba * 512 + size for _k, _r, lba, size, _o in plan)
    base = 8 * MiB // 512  # LBA of the span on namespace 1
    before = random.Random(5).randbytes(span)
    kernel_io.write(kernel_io.require_namespace_device(bdf, 1), base * 512, before)
    vs = [Vgem(hub, bdf, reg_size), Vgem(hub, bdf, reg_size)]
    try:
        src = [random.Random(9 + r).randbytes(reg_size) for r in range(2)]
        for v, data in zip(vs, src):
            v.map[:] = data
        with nvme.open(bdf, hub=hub, io_queues=1, queue_depth=64) as c:
            qp = c.io_qps[0]
            ops = [nvme.Op(kind, vs[r].reg, base + lba, size, off) for kind, r, lba, size, off in plan]
            st0 = qp.stats()
            futs = c.namespace(1).submit(ops)
            assert len(futs) == 4096 and all(f.result(timeout=120) == 0 for f in futs)
            st1 = qp.stats()
            assert c.inflight(vs[0].reg) == c.inflight(vs[1].reg) == 0
        commands = sum(-(-size // c.max_transfer) for *_x, size, _o in plan)
        assert st1["submitted"] - st0["submitted"] == commands
        # the first round fills the queue with one doorbell; later ones ring as slots free
        assert commands / qp.ntrk <= st1["doorbells"] - st0["doorbells"] <= commands - qp.ntrk + 1
        got_mem = [bytes(v.map[:]) for v in vs]
    finally:
        for v in vs:
            v.close()
    _give_back(bdf)
    after = kernel_io.read(kernel_io.require_namespace_device(bdf, 1), base * 512, span)
    want = bytearray(before)
    for kind, r, lba, size, off in plan:
        if kind == "write":
            want[lba * 512:lba * 512 + size] = src[r][off:off + size]
    assert after == bytes(want)   # every write landed, and nothing else changed
    for kind, r, lba, size, off in plan:
        if kind == "read":
            assert got_mem[r][off:off + size] == before[lba * 512:lba * 512 + size], (lba, size, off)


def test_batch_with_one_bad_request_submits_nothing(bdf: str, hub: Hub) -> None:
    if bind.current_driver(bdf) != "nvme":
        bind.unbind(bdf)
    base, n = 200 * MiB // 512, 4096
    pattern = random.Random(3).randbytes(n * 4096)
    kernel_io.write(kernel_io.require_namespace_device(bdf, 1), base * 512, pattern)
    v = Vgem(hub, bdf, n * 4096)
    try:
        v.map[:] = bytes(n * 4096)
        with nvme.open(bdf, hub=hub, io_queues=1) as c:
            ns = c.namespace(1)
            ops = [nvme.WriteOp(v.reg, base + 8 * k, 4096, 4096 * k) for k in range(n)]
            ops[3000] = nvme.WriteOp(v.reg, ns.blocks - 4, 4096, 0)   # runs past the end
            sub = c.io_qps[0].stats()["submitted"]
            with pytest.raises(UsageError, match="write request 3000 of 4096: LBA range") as e:
                ns.submit(ops)
            assert e.value.index == 3000
            assert c.io_qps[0].stats()["submitted"] == sub and c.inflight(v.reg) == 0
    finally:
        v.close()
    _give_back(bdf)
    assert kernel_io.read(kernel_io.require_namespace_device(bdf, 1), base * 512, n * 4096) == pattern


# --------------------------------------------------------------------------- bad input


def test_bad_requests_are_refused_before_the_device(ctrl: nvme.Controller, hub: Hub, bdf: str) -> None:
    ns1, ns2 = ctrl.namespace(1), ctrl.namespace(2)
    buf = ctrl.alloc_dma(64 * KiB, "bad")
    sub = ctrl.io_qps[0].stats()["submitted"]
    with pytest.raises(UsageError, match="outside namespace 1"):
        ns1.read(buf, lba=ns1.blocks - 1, nbytes=1024)
    with pytest.raises(UsageError, match="outside namespace 2"):
        ns2.write(buf, lba=-1, nbytes=4096)
    with pytest.raises(UsageError, match="multiple of the LBA size 4096"):
        ns2.read(buf, lba=0, nbytes=512)
    with pytest.raises(UsageError, match="multiple of the LBA size 512"):
        ns1.read(buf, lba=0, nbytes=1000)
    with pytest.raises(UsageError, match="outside DMA buffer"):
        ns1.read(buf, lba=0, nbytes=8192, offset=60 * KiB)
    v = Vgem(hub, bdf, 64 * KiB)
    ns1.write(v.reg, lba=0, nbytes=4096)
    v.close()
    with pytest.raises(UsageError, match="closed"):
        ns1.write(v.reg, lba=0, nbytes=4096)
    # A batch with one bad op submits nothing.
    with pytest.raises(UsageError):
        ns1.submit([nvme.ReadOp(buf, 0, 4096), nvme.ReadOp(buf, ns1.blocks, 512)])
    assert ctrl.io_qps[0].stats()["submitted"] == sub + 1


def test_revoked_registration(ctrl: nvme.Controller, hub: Hub, lab: dict[str, str], bdf: str) -> None:
    with fg.loaded_module(lab["modules_dir"]), fg.FakeGpu() as gpu:
        fd = gpu.export_dmabuf(0, 64 * KiB)
        try:
            reg = hub.register_dmabuf(fd, 0, 64 * KiB, device=bdf)
            ctrl.namespace(1).read(reg, lba=0, nbytes=4096)
            gpu.revoke(fd)
            with pytest.raises(RevokedError):
                ctrl.namespace(1).read(reg, lba=0, nbytes=4096)
            assert ctrl.quiesce_registration(reg, timeout=30)
            reg.close()
        finally:
            os.close(fd)


def test_controller_error_status_is_decoded(ctrl: nvme.Controller) -> None:
    qp = ctrl.io_qps[0]
    # An opcode the controller does not implement, on an I/O queue.
    fut = nvme.CommandFuture(qp, 0x7F, 1, what="bogus opcode")
    assert qp.submit_raw([spec.command(0x7F, nsid=1)], [fut]) == 1
    with pytest.raises(NvmeStatusError, match="Invalid Command Opcode") as e:
        fut.result(timeout=10)
    assert (e.value.sct, e.value.sc) == (0, 0x01) and e.value.qid == qp.qid
    # A read past the end, built by hand (the API would refuse it): the device says so.
    buf = ctrl.alloc_dma(4096, "oob")
    ns = ctrl.namespace(2)
    fut = nvme.CommandFuture(qp, spec.OPC_READ, 1, what="read past end")
    qp.submit_raw([spec.command(spec.OPC_READ, nsid=2, prp1=buf.dma_addr, cdw10=ns.blocks)], [fut])
    with pytest.raises(NvmeStatusError, match="LBA Out of Range"):
        fut.result(timeout=10)
    # Admin: Identify of a namespace that does not exist.
    with pytest.raises(NvmeStatusError, match="Identify"):
        ctrl.admin_cmd(spec.command(spec.ADM_IDENTIFY, nsid=0xFFFF0000, prp1=buf.dma_addr,
                                    cdw10=spec.CNS_NAMESPACE))
    # Still usable.
    ns.read(buf, lba=0, nbytes=4096)


def test_command_that_never_completes_on_admin_queue_is_recovered(ctrl: nvme.Controller) -> None:
    """An Asynchronous Event Request completes only on an event: it never does here.
    Timeout -> Abort -> (QEMU 7.2 never aborts) reset; the engine works after."""
    old = ctrl.admin.timeout_s
    ctrl.admin.timeout_s = 1.0
    try:
        fut = ctrl.admin_submit(spec.command(spec.ADM_ASYNC_EVENT), what="AER")
        t0 = time.monotonic()
        with pytest.raises(NvmeTimeoutError) as e:
            fut.result(timeout=60)
        assert 1.0 <= time.monotonic() - t0 < 30
        assert e.value.recovery in ("abort", "reset")
        print(f"AER timeout recovered by {e.value.recovery}: {e.value}")
    finally:
        ctrl.admin.timeout_s = old
    buf = ctrl.alloc_dma(4096, "after-aer")
    ctrl.namespace(1).read(buf, lba=0, nbytes=4096)


def test_lost_io_command_is_recovered_by_reset_without_stray_writes(bdf: str) -> None:
    """The doorbell of a write is never rung (fault injected in the hot path): the
    controller never sees it. Timeout -> Abort (nothing to abort) -> reset."""
    with nvme.open(bdf, io_queues=1) as c:
        ns = c.namespace(1)
        qp = c.io_qps[0]
        around = c.alloc_dma(64 * KiB, "around")
        before = os.urandom(64 * KiB)
        around.view[:] = before
        ns.write(around, lba=10_000, nbytes=64 * KiB)
        victim = c.alloc_dma(8 * KiB, "victim")
        victim.view[:] = b"\xab" * (8 * KiB)
        qp.timeout_s = 1.0
        qp.c.hold_doorbell = 1
        fut = ns.submit([nvme.WriteOp(victim, lba=10_000 + 32, nbytes=8 * KiB)])[0]
        qp.c.hold_doorbell = 0
        with pytest.raises(NvmeTimeoutError) as e:
            fut.result(timeout=60)
        assert e.value.recovery == "reset" and c.resets == 1
        # Usable again, and nothing was written outside [lba 10032, +16).
        check = c.alloc_dma(64 * KiB, "check")
        ns.read(check, lba=10_000, nbytes=64 * KiB)
        got = bytes(check.view)
        assert got[:32 * 512] == before[:32 * 512]
        assert got[48 * 512:] == before[48 * 512:]
        assert got[32 * 512:48 * 512] in (before[32 * 512:48 * 512], b"\xab" * (8 * KiB))
        ns.write(victim, lba=10_000 + 32, nbytes=8 * KiB)
        ns.read(check, lba=10_000, nbytes=64 * KiB)
        assert bytes(check.view)[32 * 512:48 * 512] == b"\xab" * (8 * KiB)


# --------------------------------------------------------------------------- lifetime


def test_one_owner_and_process_death_releases_everything(bdf: str) -> None:
    code = (
        "import os, p2phub.nvme as n\n"
        f"c = n.open({bdf!r}, bind=False)\n"
        "c.alloc_dma(1 << 20); print('up', flush=True); os._exit(0)\n"
    )
    with nvme.open(bdf) as c:
        assert _counter("live_handles") == 1 and _counter("live_dma_buffers") > 0
        # A second owner is refused while this one holds the controller.
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert res.returncode != 0 and "EBUSY" in res.stderr, res.stderr
    assert _counter("live_handles") == 0 and _counter("live_dma_buffers") == 0
    # A process that dies holding it (no close): the kernel releases everything.
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0 and "up" in res.stdout, res.stderr
    assert _counter("live_handles") == 0 and _counter("live_dma_buffers") == 0
    with nvme.open(bdf, bind=False) as c:  # usable again at once
        assert c.namespace(1).blocks
        c.close()  # idempotent


# --------------------------------------------------------------------------- C1: DMA lifetime


def test_registration_held_by_controller_cannot_be_unregistered_until_quiesced(bdf: str) -> None:
    """Sixteen 1 MiB reads in flight into a registration: UNREGISTER is refused (EBUSY) while the
    controller holds it; quiesce waits for them and lets go; then it unregisters."""
    with Hub() as h, h.nvme(bdf, io_queues=1) as c:
        ns = c.namespace(1)
        v = Vgem(h, bdf, 16 * MiB)
        futs = ns.submit([nvme.ReadOp(v.reg, lba=2048 * i, nbytes=MiB, offset=MiB * i) for i in range(16)])
        # some may have completed already (reaped while the rest were submitted)
        assert 0 < c.inflight(v.reg) <= 16 and c.holds(v.reg)
        with pytest.raises(OSError) as e:
            v.reg.hub.device.ioctl(uapi.UNREGISTER,
                                    uapi.Unregister.new(handle=v.reg.handle), "UNREGISTER")
        assert e.value.errno == 16  # EBUSY: the kernel refuses while the controller holds it
        assert c.quiesce_registration(v.reg, timeout=60)
        assert all(f.done() for f in futs) and c.inflight(v.reg) == 0 and not c.holds(v.reg)
        v.close()


def test_batch_api_reads_into_a_registration(bdf: str, hub: Hub) -> None:
    if bind.current_driver(bdf) != "nvme":
        bind.unbind(bdf)
    data = os.urandom(256 * KiB)
    kernel_io.write(kernel_io.require_namespace_device(bdf, 1), 5000 * 512, data)
    with nvme.open(bdf, hub=hub, io_queues=1) as c:
        ns = c.namespace(1)
        v = Vgem(hub, bdf, 512 * KiB)
        try:
            order = list(range(64))
            random.shuffle(order)
            lbas = [5000 + 8 * i for i in order]
            offs = [4096 * k for k in range(64)]
            fut = ns.read_batch(v.reg, lbas, offs, 4096, qd=8)
            assert fut.result(timeout=60) == 64 and fut.statuses() == [0] * 64
            for k, i in enumerate(order):
                assert v.map[4096 * k:4096 * (k + 1)] == data[4096 * i:4096 * (i + 1)]
            assert c.io_qps[0].c.refused == 0
        finally:
            v.close()


def test_revocation_during_io_fences_fails_at_once_and_resumes(bdf: str, hub: Hub, lab: dict[str, str]) -> None:
    """The stand-in GPU takes its memory back while reads into it are in flight: the kernel
    fences the controller; the futures fail with RegistrationRevokedError at once; the engine
    resumes for other memory; no byte of the GPU file changes after revoke returned."""
    gpu_file = fg.GpuFile(lab["gpu_file"])
    with fg.loaded_module(lab["modules_dir"]), fg.FakeGpu() as gpu, nvme.open(bdf, hub=hub, io_queues=1) as c:
        ns = c.namespace(1)
        c.io_qps[0].timeout_s = 30.0
        fd = gpu.export_dmabuf(0, 16 * MiB)
        try:
            reg = hub.register_dmabuf(fd, 0, 16 * MiB, device=bdf)
            futs = [ns.read_batch(reg, [2048 * i for i in range(16)], [MiB * i for i in range(16)], 512 * KiB)
                    for _ in range(4)]
            gpu.revoke(fd)
            snap = gpu_file.read(0, 16 * MiB)
            t0 = time.monotonic()
            for f in futs:
                exc = f.exception(timeout=30)
                assert exc is None or isinstance(exc, (RevokedError, nvme.ControllerResetError)), exc
            assert time.monotonic() - t0 < 20
            time.sleep(0.5)
            assert gpu_file.read(0, 16 * MiB) == snap
            assert c.quiesce_registration(reg, timeout=30)
            reg.close()
            buf = c.alloc_dma(64 * KiB, "after")
            ns.read(buf, lba=0, nbytes=64 * KiB)  # the engine works after the fence
            print(f"fences={c.recovery.fences} resets={c.resets} state={c.state}")
        finally:
            os.close(fd)
