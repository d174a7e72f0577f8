"""mmap of p2phub's exports maps exactly the source's pages, the way the source exporter does.

Each page of the export mapping is written with its own index and read back through an
independent view of the same memory (the memfd behind a udmabuf, vgem's own mapping). Large
folios (a THP-backed or hugetlb-backed memfd) are mapped by the exporter itself; the writes and
reads run in a child process, so that a SIGBUS is a failure, not a crash of the test run.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

from p2phub.hostmem import UDMABUF_CREATE, UDMABUF_FLAGS_CLOEXEC, VgemBuffer, _UdmabufCreate
from p2phub.hub import Hub

import regutil as ru
from p2phub_lab import klog

pytestmark = pytest.mark.lab

MiB = 1 << 20
THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
F_ADD_SEALS = 1033
F_SEAL_SHRINK = 0x0002
MFD_HUGETLB = 0x0004

# Child: map the export (fd 3) and the independent view (fd 4), write index i into page i of
# the export, read every page back through the other view. Prints the pages that differ.
_CHILD = textwrap.dedent("""
    import mmap, struct, sys
    size = int(sys.argv[1])
    exp = mmap.mmap(3, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    view = mmap.mmap(4, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    n = size // mmap.PAGESIZE
    for i in range(n):
        exp[i * mmap.PAGESIZE:i * mmap.PAGESIZE + 8] = struct.pack("<Q", i + 1)
    bad = [i for i in range(n)
           if struct.unpack_from("<Q", view, i * mmap.PAGESIZE)[0] != i + 1]
    view[8:16] = b"fromview"             # and the other way
    back = exp[8:16]
    print(f"bad={len(bad)} first={bad[:8]} back={back!r}")
    sys.exit(1 if bad or back != b"fromview" else 0)
""")


def _check_pages(export_fd: int, view_fd: int, size: int) -> None:
    p = subprocess.run([sys.executable, "-c", _CHILD, str(size)], pass_fds=(3, 4),
                       preexec_fn=lambda: (os.dup2(export_fd, 3), os.dup2(view_fd, 4)),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (
        f"export mapping does not show page i at page i (rc {p.returncode}, "
        f"{'SIGBUS' if p.returncode == -7 else ''}): {p.stdout.strip()} {p.stderr.strip()[-300:]}")


@pytest.fixture
def udmabuf_kernel(lab: dict[str, str]) -> None:
    if lab["kernel_release"].startswith("6.1."):
        assert not Path("/dev/udmabuf").exists()
        pytest.skip("Debian 6.1 has no udmabuf (CONFIG_UDMABUF off)")


@contextlib.contextmanager
def _udmabuf(memfd: int, size: int) -> Iterator[int]:
    fcntl.fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK)
    dev = os.open("/dev/udmabuf", os.O_RDWR | os.O_CLOEXEC)
    try:
        fd = fcntl.ioctl(dev, UDMABUF_CREATE, _UdmabufCreate(memfd, UDMABUF_FLAGS_CLOEXEC, 0, size),
                         True)
    finally:
        os.close(dev)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def _sysctl(path: Path, value: str) -> Iterator[str]:
    if not path.exists():
        # a kernel without the feature (the debug lab kernel has no THP and no hugetlb)
        if value == "never":
            yield ""            # shmem's folios are order-0 there anyway
            return
        pytest.skip(f"{path} does not exist: this kernel lacks the feature")
    old = path.read_text().strip()
    path.write_text(value)
    try:
        yield old
    finally:
        # shmem_enabled reads "always within_size [never] ...": write back the bracketed word
        path.write_text(old[old.index("[") + 1:old.index("]")] if "[" in old else old)


def _shmem_huge_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("ShmemHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no ShmemHugePages in /proc/meminfo")


def _export_pages_match(src_fd: int, view_fd: int, size: int) -> None:
    with Hub() as hub, hub.register_dmabuf(src_fd) as reg:
        _check_pages(reg.dmabuf_fd, view_fd, size)
    assert ru.wait_no_leaks()["export_mmaps"] == 0


def test_thp_udmabuf_export_mmap_maps_each_page(udmabuf_kernel) -> None:
    """A THP-backed memfd: each 2 MiB folio's pages are distinct in the export mapping."""
    size = 4 * MiB
    with _sysctl(THP, "always"):
        memfd = os.memfd_create("p2phub-thp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            before = _shmem_huge_kib()
            os.ftruncate(memfd, size)
            # Written, not fallocated: shmem zeroes a fallocated folio at its first fault.
            os.pwrite(memfd, bytes(size), 0)
            assert _shmem_huge_kib() - before >= 2048, "the memfd got no huge folio"
            with _udmabuf(memfd, size) as fd:
                _export_pages_match(fd, memfd, size)
        finally:
            os.close(memfd)


def test_hugetlb_udmabuf_export_mmap_maps_each_page(udmabuf_kernel) -> None:
    """A hugetlb-backed memfd (2 MiB pages): no SIGBUS, no aliasing."""
    size = 4 * MiB
    if not NR_HUGEPAGES.exists():
        pytest.skip("this kernel has no hugetlb pages (no /proc/sys/vm/nr_hugepages)")
    old = int(NR_HUGEPAGES.read_text())
    NR_HUGEPAGES.write_text(str(old + 2))
    try:
        memfd = os.memfd_create("p2phub-hugetlb",
                                os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | MFD_HUGETLB)
        try:
            os.ftruncate(memfd, size)
            try:
                os.posix_fallocate(memfd, 0, size)
            except OSError as exc:
                raise AssertionError(f"no 2 MiB pages for the test: {exc}") from None
            with _udmabuf(memfd, size) as fd:
                _export_pages_match(fd, memfd, size)
        finally:
            os.close(memfd)
    finally:
        NR_HUGEPAGES.write_text(str(old))


def test_vgem_export_mmap_is_p2phubs_own_and_coherent_with_vgem() -> None:
    """vgem's pages (order 0, write-combined) are mapped by p2phub itself, with vgem's caching:
    a VMA of the export (counted, so the NIC path can pin it), every page its own."""
    size = 1 * MiB
    with VgemBuffer(size) as src, Hub() as hub, hub.register(src) as reg:
        m = mmap.mmap(reg.dmabuf_fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            assert ru.counters()["export_mmaps"] == 1
        finally:
            m.close()
        _check_pages(reg.dmabuf_fd, src.fd, size)
    assert ru.wait_no_leaks()["export_mmaps"] == 0


FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
TAINTED = Path("/proc/sys/kernel/tainted")


def _punch_hole(fd: int, size: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE): {os.strerror(err)}")


@pytest.mark.parametrize("owner_lets_go", ["punch_hole", "close_memfd"])
def test_memfd_truncated_under_an_export_mapping_leaves_no_bad_page(udmabuf_kernel,
                                                                     owner_lets_go: str) -> None:
    """Order-0 pages of a udmabuf's memfd are that memfd's page cache, which its owner may
    truncate (a hole punched, or the memfd closed and evicted) while the export is mapped. The
    export mapping must not hold those pages with a file rmap of its own (truncation cannot find
    it: "Bad page" reports, a tainted kernel, leaked pages): what the CPU reads through it is
    still the memfd's bytes, and tearing everything down leaves the kernel as it was."""
    size = 1 * MiB
    taint = int(TAINTED.read_text())
    before = len(klog.read())
    pattern = bytes(range(256)) * (size // 256)
    with _sysctl(THP, "never"):
        memfd = os.memfd_create("p2phub-s1", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(memfd, size)
            os.pwrite(memfd, pattern, 0)
            with _udmabuf(memfd, size) as fd, Hub() as hub, hub.register_dmabuf(fd) as reg:
                m = mmap.mmap(reg.dmabuf_fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
                try:
                    seen = b"".join(m[i:i + mmap.PAGESIZE] for i in range(0, size, mmap.PAGESIZE))
                    assert seen == pattern, "the export mapping does not show the memfd's bytes"
                    if owner_lets_go == "punch_hole":
                        _punch_hole(memfd, size)
                    else:
                        os.close(memfd)
                        memfd = -1
                finally:
                    m.close()
        finally:
            if memfd >= 0:
                os.close(memfd)
    assert ru.wait_no_leaks()["export_mmaps"] == 0
    bad = [r.line for r in klog.reports(klog.read()[before:]) if "Bad page" in r.line
           or r.kind in ("bug", "corruption")]
    assert not bad, "kernel reports after the memfd was truncated:\n" + "\n".join(bad[:5])
    assert int(TAINTED.read_text()) == taint, (
        f"the kernel got tainted: {taint} -> {TAINTED.read_text().strip()}")
