"""One registration, two consumers: NVMe reads into it, RDMA moves it between the lab's nodes.

The two nodes are rxe-a and rxe-b on the two ends of a veth pair; every RDMA
byte crosses that pair. Bytes are checked on the receiving side's own CPU view.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import random
import signal
import subprocess
import sys

import pytest
import pyverbs.enums as e

from p2phub import uapi
from p2phub.errors import P2PHubError, P2PHubOSError, RevokedError, UsageError
from p2phub.hostmem import VgemBuffer
from p2phub.hub import Hub
from p2phub.nvme import bind, kernel_io
from p2phub.rdma import Access, MrPath, dmabuf_mr_support

import p2phub_fakegpu as fg
import regutil as ru
from rdmautil import CompletionError, connected_pair

MiB = 1 << 20


def _cpu_view(reg):
    """The source's own CPU view (not p2phub's export mapping, which the MR uses)."""
    src = reg.source
    if hasattr(src, "mmap"):
        return src.mmap()
    return mmap.mmap(src.fd, reg.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def test_dmabuf_mr_probe_reports_unsupported_on_rxe(lab: dict[str, str]) -> None:
    ok, evidence = dmabuf_mr_support(lab["node_a_rdma"])
    assert ok is False
    assert "EOPNOTSUPP" in evidence


@contextlib.contextmanager
def _linked(reg_a, reg_b, pds, access_a: Access | None = None, access_b: Access | None = None):
    """MRs of reg_a on node A and reg_b on node B, a connected QP pair and each registration's
    own CPU view: (ea, eb, mr_a, mr_b, va, vb), all closed on the way out."""
    pd_a, pd_b = pds
    mr_a, mr_b = reg_a.mr(pd_a, access_a), reg_b.mr(pd_b, access_b)
    ea, eb = connected_pair(pd_a, pd_b)
    va, vb = _cpu_view(reg_a), _cpu_view(reg_b)
    try:
        yield ea, eb, mr_a, mr_b, va, vb
    finally:
        for o in (va, vb, ea, eb, mr_a, mr_b):
            o.close()


def _write_read_between_nodes(reg_a, reg_b, pds) -> None:
    """RDMA WRITE A->B then READ B<-A, each checked on the other side's own CPU view."""
    with _linked(reg_a, reg_b, pds, Access.REMOTE_READ, Access.REMOTE_WRITE) as (ea, eb, mr_a, mr_b, va, vb):
        assert mr_a.path is MrPath.HOST_VA and "EOPNOTSUPP" in mr_a.reason
        assert mr_b.path is MrPath.HOST_VA
        payload = random.randbytes(256 << 10)
        va[:len(payload)] = payload
        ea.write(mr_a, mr_b, len(payload), roff=64 << 10)
        assert vb[64 << 10:(64 << 10) + len(payload)] == payload
        assert vb[:64 << 10] == bytes(64 << 10)  # nothing outside the target range

        back = random.randbytes(128 << 10)
        va[512 << 10:(512 << 10) + len(back)] = back
        eb.read(mr_b, mr_a, len(back), loff=0, roff=512 << 10)
        assert vb[:len(back)] == back


def test_vgem_memory_write_then_read_between_nodes(hub: Hub, pds) -> None:
    """vgem's own mapping is PFN-mapped (the NIC cannot pin it): the MR goes on p2phub's
    mmap of the registration's export, and the bytes land in vgem's pages."""
    with hub.register(VgemBuffer(MiB)) as reg_a, hub.register(VgemBuffer(MiB)) as reg_b:
        _write_read_between_nodes(reg_a, reg_b, pds)
        assert ru.counters()["export_mmaps"] == 0  # the MRs' mappings went with them
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


def test_stand_in_gpu_export_cannot_be_mmapped(hub: Hub, lab) -> None:
    """A GPU BAR export has no struct pages: mmap of p2phub's export fails with ENODEV."""
    with fg.loaded_module(lab["modules_dir"]), fg.FakeGpu() as gpu:
        fd = gpu.export_dmabuf(0, 1 * MiB)
        try:
            with hub.register(fd) as reg:
                with pytest.raises(OSError) as exc:
                    mmap.mmap(reg.dmabuf_fd, reg.length, mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
                assert exc.value.errno == errno.ENODEV
                assert ru.counters()["export_mmaps"] == 0
        finally:
            os.close(fd)
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


def _unregister_errno(reg) -> int:
    try:
        reg.hub.device.ioctl(uapi.UNREGISTER, uapi.Unregister.new(handle=reg.handle),
                              "P2PHUB_UNREGISTER")
    except P2PHubOSError as exc:
        return exc.errno
    return 0


def test_mapped_export_pins_the_registration(hub: Hub) -> None:
    """Like an attached importer, a mapping of the export makes UNREGISTER fail with EBUSY."""
    src = VgemBuffer(64 << 10)
    reg = hub.register(src)
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    fd = reg.dmabuf_fd
    with pytest.raises(OSError) as exc:  # a private copy of device memory makes no sense
        mmap.mmap(fd, reg.length, mmap.MAP_PRIVATE, rw)
    assert exc.value.errno == errno.EINVAL
    with pytest.raises(OSError) as exc:  # past the registration's end
        mmap.mmap(fd, 4096, mmap.MAP_SHARED, rw, offset=reg.length)
    assert exc.value.errno == errno.EINVAL

    m = mmap.mmap(fd, reg.length, mmap.MAP_SHARED, rw)
    tail = mmap.mmap(fd, 8192, mmap.MAP_SHARED, rw, offset=reg.length - 8192)
    assert ru.counters()["export_mmaps"] == 2
    m[:5] = b"hello"
    tail[-5:] = b"world"
    own = mmap.mmap(src.fd, reg.length, mmap.MAP_SHARED, rw)  # vgem's own view: same pages
    assert own[:5] == b"hello" and own[-5:] == b"world"
    own[100:103] = b"abc"
    assert m[100:103] == b"abc"
    own.close()

    assert _unregister_errno(reg) == errno.EBUSY
    m.close()
    assert _unregister_errno(reg) == errno.EBUSY
    tail.close()
    assert ru.counters()["export_mmaps"] == 0
    reg.close()
    src.close()
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


_ZAP_CHILD = r"""
import mmap, sys, time
from p2phub.hostmem import VgemBuffer
from p2phub.hub import Hub
hub = Hub()
reg = hub.register(VgemBuffer(64 << 10))
m = mmap.mmap(reg.dmabuf_fd, reg.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
m[:4] = b"live"
assert m[:4] == b"live"
hub.close()          # the registration dies with the file: its mappings are zapped
time.sleep(1.0)      # the zap runs from a work item
print("touching", flush=True)
m[0]                 # SIGBUS: no PTE comes back for a registration that is not live
print("still mapped", flush=True)
"""


def test_closing_the_owner_zaps_export_mappings() -> None:
    """vgem memory cannot be revoked, so the zap is shown by the other way a registration
    stops being live while mapped: its /dev/p2phub file closes."""
    r = subprocess.run([sys.executable, "-c", _ZAP_CHILD], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == -signal.SIGBUS, (r.returncode, r.stdout, r.stderr)
    assert "touching" in r.stdout and "still mapped" not in r.stdout
    assert ru.wait_no_leaks() == {k: 0 for k in ru.LEAK_COUNTERS}


def test_host_memory_write_then_read_between_nodes(hub: Hub, pds) -> None:
    """hub.alloc_host(): udmabuf where there is one (6.12), vgem otherwise (6.1)."""
    with hub.alloc_host(MiB) as reg_a, hub.alloc_host(MiB) as reg_b:
        _write_read_between_nodes(reg_a, reg_b, pds)


def test_ssd_to_host_memory_then_rdma_write_to_the_other_node(hub: Hub, pds,
                                                               lab: dict[str, str]) -> None:
    """Node A reads a region from the SSD into its registration, then RDMA-writes it to B."""
    bdf = lab["nvme_target"]
    pattern = random.randbytes(512 << 10)
    kernel_io.write(kernel_io.require_namespace_device(bdf, 1), 8 * MiB, pattern)

    with hub.alloc_host(MiB) as reg_a, hub.alloc_host(MiB) as reg_b:
        ctrl = hub.nvme(bdf)
        try:
            ctrl.namespace(1).read(reg_a, lba=(8 * MiB) // 512, nbytes=len(pattern))
        finally:
            ctrl.close()
            bind.unbind(bdf)
        with _linked(reg_a, reg_b, pds, None, Access.REMOTE_WRITE) as (ea, _eb, mr_a, mr_b, va, vb):
            assert va[:len(pattern)] == pattern, "node A's memory does not hold the SSD's bytes"
            ea.write(mr_a, mr_b, len(pattern))
            assert vb[:len(pattern)] == pattern, "node B's memory does not hold node A's bytes"


def test_remote_write_into_a_default_mr_is_refused(hub: Hub, pds) -> None:
    """An MR grants local write only unless remote access is asked for: the NIC refuses a
    peer's WRITE with a remote access error, and B's memory keeps its bytes."""
    with hub.alloc_host(MiB) as reg_a, hub.alloc_host(MiB) as reg_b, \
         _linked(reg_a, reg_b, pds) as (ea, _eb, mr_a, mr_b, va, vb):
        va[:64 << 10] = random.randbytes(64 << 10)
        with pytest.raises(CompletionError) as exc:
            ea.write(mr_a, mr_b, 64 << 10)
        assert exc.value.status == e.IBV_WC_REM_ACCESS_ERR
        assert vb[:64 << 10] == bytes(64 << 10)


def test_close_with_live_mr_is_refused_then_forced(hub: Hub, pds) -> None:
    reg = hub.alloc_host(64 << 10)
    mr = reg.mr(pds[0])
    with pytest.raises(P2PHubOSError) as exc:
        reg.close()
    assert exc.value.errno == errno.EBUSY and "RDMA memory region" in str(exc.value)
    assert not reg.closed and not mr.closed
    reg.close(force=True)
    assert reg.closed and mr.closed


def test_mr_on_a_closed_registration(hub: Hub, pds) -> None:
    reg = hub.alloc_host(64 << 10)
    reg.close()
    with pytest.raises(UsageError, match="closed"):
        reg.mr(pds[0])


def test_mr_needs_a_p2phub_protection_domain(hub: Hub, pds) -> None:
    with hub.alloc_host(64 << 10) as reg, pytest.raises(UsageError, match="ProtectionDomain"):
        reg.mr(pds[0].pd)


def test_gpu_memory_without_a_path_names_the_doctor_check(hub: Hub, pds, lab) -> None:
    with fg.loaded_module(lab["modules_dir"]), fg.FakeGpu() as gpu:
        fd = gpu.export_dmabuf(0, 1 * MiB)
        try:
            with hub.register(fd) as reg:
                with pytest.raises((P2PHubError, P2PHubOSError), match="nic.dmabuf_mr"):
                    reg.mr(pds[0])
        finally:
            os.close(fd)


def test_revoked_registration_refuses_mrs(hub: Hub, pds, lab) -> None:
    with fg.loaded_module(lab["modules_dir"]), fg.FakeGpu() as gpu:
        fd = gpu.export_dmabuf(0, 1 * MiB)
        try:
            reg = hub.register(fd, device=lab["nvme_target"])
            gpu.revoke(fd)
            with pytest.raises(RevokedError):
                reg.mr(pds[0])
            reg.close()
        finally:
            os.close(fd)


def test_register_rejects_what_it_cannot_pin(hub: Hub, tmp_path) -> None:
    with open(tmp_path / "plain", "wb") as f:
        with pytest.raises(UsageError, match="not a dma-buf"):
            hub.register(f.fileno())
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(UsageError, match="not an open file descriptor"):
        hub.register(r)
    with pytest.raises(UsageError, match="alloc_host"):
        hub.register(bytearray(4096))
    with pytest.raises(UsageError, match="not memory p2phub knows"):
        hub.register(object())
    with pytest.raises(UsageError, match="multiple of 4096"):
        hub.alloc_host(1000)


def test_closing_the_hub_closes_mrs_and_host_buffers(pds) -> None:
    hub = Hub()
    reg = hub.alloc_host(64 << 10)
    src = reg.source
    mr = reg.mr(pds[0])
    hub.close()
    assert reg.closed and src.closed and mr.closed
