"""One registration, two consumers: NVMe reads into it, RDMA moves it between the lab's nodes.

The two nodes are rxe-a and rxe-b on the two ends of a veth pair; every RDMA
byte crosses that pair. Bytes are checked on the receiving side's own CPU view.
"""

from __future__ import annotations

import errno
import os
import random
from typing import Iterator

import pytest

from p2phub.errors import P2PHubError, P2PHubOSError, RevokedError, UsageError
from p2phub.hostmem import VgemBuffer
from p2phub.hub import Hub
from p2phub.nvme import bind
from p2phub.rdma import MrPath, ProtectionDomain, dmabuf_mr_support

import fakegpu as fg
from rdmautil import connected_pair

MiB = 1 << 20


@pytest.fixture(scope="module")
def pds(lab: dict[str, str]) -> Iterator[tuple[ProtectionDomain, ProtectionDomain]]:
    a, b = ProtectionDomain(lab["node_a_rdma"]), ProtectionDomain(lab["node_b_rdma"])
    yield a, b
    a.close()
    b.close()


@pytest.fixture
def hub() -> Iterator[Hub]:
    with Hub() as h:
        yield h


def _cpu_view(reg):
    src = reg.source
    if hasattr(src, "mmap"):
        return src.mmap()
    import mmap
    return mmap.mmap(src.fd, reg.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def test_dmabuf_mr_probe_reports_unsupported_on_rxe(lab: dict[str, str]) -> None:
    ok, evidence = dmabuf_mr_support(lab["node_a_rdma"])
    assert ok is False
    assert "EOPNOTSUPP" in evidence


HAVE_UDMABUF = os.path.exists("/dev/udmabuf")


def test_vgem_memory_cannot_be_va_registered_and_says_why(hub: Hub, pds) -> None:
    with hub.register(VgemBuffer(64 << 10)) as reg:
        with pytest.raises(P2PHubOSError) as exc:
            reg.mr(pds[0])
        assert exc.value.errno == errno.EFAULT
        assert "EOPNOTSUPP" in str(exc.value) and "nic.dmabuf_mr" in str(exc.value)
        assert reg.live_mrs == 0


@pytest.mark.skipif(not HAVE_UDMABUF, reason="host memory for VA MRs needs udmabuf (Linux 6.12 lab)")
def test_host_memory_write_then_read_between_nodes(hub: Hub, pds) -> None:
    pd_a, pd_b = pds
    with hub.alloc_host(MiB) as reg_a, hub.alloc_host(MiB) as reg_b:
        mr_a, mr_b = reg_a.mr(pd_a), reg_b.mr(pd_b)
        assert mr_a.path is MrPath.HOST_VA and "EOPNOTSUPP" in mr_a.reason
        ea, eb = connected_pair(pd_a, pd_b)
        try:
            va, vb = _cpu_view(reg_a), _cpu_view(reg_b)
            payload = random.randbytes(256 << 10)
            va[:len(payload)] = payload
            ea.write(mr_a, mr_b, len(payload), roff=64 << 10)
            assert vb[64 << 10:(64 << 10) + len(payload)] == payload
            assert vb[:64 << 10] == bytes(64 << 10)  # nothing outside the target range

            back = random.randbytes(128 << 10)
            va[512 << 10:(512 << 10) + len(back)] = back
            eb.read(mr_b, mr_a, len(back), loff=0, roff=512 << 10)
            assert vb[:len(back)] == back
            va.close()
            vb.close()
        finally:
            ea.close()
            eb.close()
            mr_a.close()
            mr_b.close()


@pytest.mark.skipif(not HAVE_UDMABUF, reason="host memory for VA MRs needs udmabuf (Linux 6.12 lab)")
def test_ssd_to_host_memory_then_rdma_write_to_the_other_node(hub: Hub, pds,
                                                               lab: dict[str, str]) -> None:
    """Node A reads a region from the SSD into its registration, then RDMA-writes it to B."""
    pd_a, pd_b = pds
    bdf = lab["nvme_target"]
    pattern = random.randbytes(512 << 10)
    dev = bind.block_devices(bdf)
    ns1 = next(d for d in dev if d.endswith("n1"))
    fd = os.open(ns1, os.O_WRONLY)
    try:
        os.pwrite(fd, pattern, 8 * MiB)
        os.fsync(fd)
    finally:
        os.close(fd)

    with hub.alloc_host(MiB) as reg_a, hub.alloc_host(MiB) as reg_b:
        ctrl = hub.nvme(bdf)
        try:
            ctrl.namespace(1).read(reg_a, lba=(8 * MiB) // 512, nbytes=len(pattern))
        finally:
            ctrl.close()
            bind.unbind(bdf)
        mr_a, mr_b = reg_a.mr(pd_a), reg_b.mr(pd_b)
        ea, eb = connected_pair(pd_a, pd_b)
        try:
            ea.write(mr_a, mr_b, len(pattern))
            vb = _cpu_view(reg_b)
            assert vb[:len(pattern)] == pattern
            vb.close()
        finally:
            ea.close()
            eb.close()
            mr_a.close()
            mr_b.close()


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
    try:
        mr = reg.mr(pds[0])
    except P2PHubOSError:  # vgem memory cannot be VA-registered (6.1): nothing to close
        mr = None
    hub.close()
    assert reg.closed and src.closed
    assert mr is None or mr.closed
