"""The batch API on a staged hub, end to end on the host: scattered reads and writes between
real files (O_DIRECT, and buffered with direct=False) and host memory through the
io_uring engine, every byte checked against the file; bad entries refused before anything
is submitted, naming the entry."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest

from p2phub import batch
from p2phub.errors import P2PHubOSError, UsageError
from p2phub.hub import Hub
from p2phub.memory import Memory, MemoryShare
from p2phub.ordering import FenceError

KiB, MiB = 1 << 10, 1 << 20
SHM = "/dev/shm"


@pytest.fixture()
def hub():
    h = Hub(mode="staged")
    # small slots and a shallow queue: entries split into pieces, slots run out and are reused
    batch.configure_batch(h, depth=16, slot=64 * KiB, slots=24)
    yield h
    h.close()


def _file(path, size: int, seed: int) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    data.tofile(path)
    return data


@pytest.fixture()
def disk_file(tmp_path):
    p = tmp_path / "data.bin"
    return str(p), _file(p, 8 * MiB + 512, 1)


@pytest.fixture()
def shm_file(tmp_path):
    if not os.path.isdir(SHM):
        pytest.skip("no /dev/shm")
    p = os.path.join(SHM, f"p2phub-batch-{os.getpid()}.bin")
    data = _file(p, 2 * MiB + 100, 2)
    yield p, data
    os.unlink(p)


def _scatter(rng, n, length_choices, file_size, mem_size, aligned):
    lens = rng.choice(length_choices, n)
    offs = np.array([rng.integers(0, file_size - ln) for ln in lens], np.int64)
    if aligned:
        offs -= offs % 4096
    # disjoint destinations: slots of the largest length, in random order
    slot = int(max(length_choices))
    dst = rng.permutation(mem_size // slot)[:n].astype(np.int64) * slot
    return offs, lens.astype(np.int64), dst


@pytest.mark.parametrize("aligned,fixed", [(True, True), (False, True), (True, False)])
def test_scattered_reads_direct(hub, disk_file, aligned, fixed) -> None:
    path, data = disk_file
    if not fixed:
        batch.configure_batch(hub, depth=16, slot=64 * KiB, slots=24, fixed_buffers=False)
    mem = bytearray(32 * MiB)
    reg = hub.register(mem)
    rng = np.random.default_rng(3)
    offs, lens, dst = _scatter(rng, 150, [4 * KiB, 12 * KiB, 64 * KiB, 200 * KiB], data.size,
                               len(mem), aligned)
    f = hub.load_batch(storage=path, offsets=offs, lengths=lens, memory=reg, mem_offsets=dst)
    f.wait(60)
    assert f.stats["io"] == {path: "O_DIRECT"}
    assert f.stats["pieces"] >= 150 and f.stats["max_inflight"] <= 16
    # registered staging where the kernel lets this user pin it (root: always)
    if not fixed or os.geteuid() == 0:
        assert f.stats["fixed_buffers"] is fixed
    m = np.frombuffer(mem, np.uint8)
    for o, ln, d in zip(offs, lens, dst):
        assert np.array_equal(m[d:d + ln], data[o:o + ln])
    assert list(f.results) == list(lens)
    reg.close()


def test_aligned_reads_into_host_memory_land_in_place(hub, disk_file) -> None:
    """O_DIRECT reads whose offset, length and memory address are 4 KiB-aligned go straight
    into host memory; the others through a staging slot; the bytes are the same."""
    import mmap
    path, data = disk_file
    mem = mmap.mmap(-1, 8 * MiB)     # page-aligned
    reg = hub.register(mem)
    rng = np.random.default_rng(8)
    n = 120
    offs = rng.integers(0, (data.size - 64 * KiB) // 4096, n) * 4096
    lens = rng.choice([4 * KiB, 16 * KiB, 60 * KiB], n)
    dst = rng.permutation(8 * MiB // (64 * KiB))[:n] * (64 * KiB)
    dst[::3] += 512                   # every third lands off a page boundary: staged
    f = hub.load_batch(storage=path, offsets=offs, lengths=lens, memory=reg, mem_offsets=dst)
    f.wait(60)
    assert f.stats["in_place"] == n - len(dst[::3])
    m = np.frombuffer(mem, np.uint8)
    for o, ln, d in zip(offs, lens, dst):
        assert np.array_equal(m[d:d + ln], data[o:o + ln])
    del m
    reg.close()


def test_batches_waited_on_by_many_threads_and_by_none_all_run_in_order(hub, disk_file) -> None:
    """A thread waiting for its batch runs it itself when the worker has not begun it; many
    such threads at once, batches nobody waits for, and writes after reads of the same
    memory all finish, with every byte where it belongs."""
    path, data = disk_file
    import mmap
    mem = mmap.mmap(-1, 8 * MiB)
    reg = hub.register(mem)
    view = np.frombuffer(mem, np.uint8)
    hub.load_batch([(path, 0, 4096, reg, 0)]).wait(60)     # the engine exists: waiters may run
    n, per = 8, 24
    errors: list[BaseException] = []
    loose: list[object] = []

    def reader(k: int) -> None:
        rng = np.random.default_rng(100 + k)
        base = k * (MiB - 64 * KiB)
        try:
            for r in range(per):
                offs = rng.integers(0, (data.size - 64 * KiB) // 4096, 16) * 4096
                dst = base + np.arange(16) * 4096
                f = hub.load_batch(storage=path, offsets=offs, lengths=4096, memory=reg,
                                   mem_offsets=dst)
                if r % 4 == 3:
                    loose.append(f)           # the worker runs this one
                    continue
                f.wait()
                for o, d in zip(offs, dst):
                    assert np.array_equal(view[d:d + 4096], data[o:o + 4096])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a batch never finished"
    assert not errors, errors[0]
    for f in loose:
        f.wait(60)
    del view
    reg.close()


def test_read_to_the_last_byte_of_an_unaligned_file(hub, disk_file) -> None:
    path, data = disk_file
    mem = bytearray(MiB)
    with hub.register(mem) as reg:
        f = hub.load_batch([(path, data.size - 5000, 5000, reg, 0),
                            (path, data.size - 1, 1, reg, 8192)])
        f.wait(30)
    assert bytes(mem[:5000]) == data[-5000:].tobytes()
    assert mem[8192] == data[-1]


def test_batches_reading_a_path_open_it_once_and_follow_a_rename(hub, disk_file, tmp_path) -> None:
    """Batches that read a path share one open file with per-request loads (no fd per batch,
    none left after hub.close()); once another file is renamed over the path, the next batch
    reads the new file's bytes."""
    path, data = disk_file
    fds = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    mem = bytearray(2 * MiB)
    with hub.register(mem) as reg:
        hub.load_batch([(path, 0, 4096, reg, 0)]).wait(30)
        before = fds()
        for i in range(20):
            hub.load_batch([(path, i * 8192, 8192, reg, 0)]).wait(30)
            hub.load(path, reg, i * 4096, 4096, 8192).wait(30)
            assert bytes(mem[:8192]) == data[i * 8192:(i + 1) * 8192].tobytes()
        assert fds() == before
        new = tmp_path / "new.bin"
        fresh = _file(new, 1 * MiB, 77)
        os.rename(new, path)
        hub.load_batch([(path, 4096, 64 * KiB, reg, 0)]).wait(30)
        assert bytes(mem[:64 * KiB]) == fresh[4096:4096 + 64 * KiB].tobytes()
        with pytest.raises(UsageError, match="past the end"):
            hub.load_batch([(path, 1 * MiB - 4096, 8192, reg, 0)]).wait(30)
    open_before_close = fds()
    hub.close()
    assert fds() < open_before_close


def test_buffered_reads(hub, shm_file) -> None:
    path, data = shm_file
    mem = bytearray(40 * MiB)
    reg = hub.register(mem)
    rng = np.random.default_rng(4)
    offs, lens, dst = _scatter(rng, 500, [1, 100, 4 * KiB, 70 * KiB], data.size, len(mem), False)
    f = hub.load_batch(storage=path, offsets=offs, lengths=lens, memory=reg, mem_offsets=dst,
                       direct=False)
    f.wait(60)
    assert f.stats["io"] == {path: "buffered"}
    m = np.frombuffer(mem, np.uint8)
    for o, ln, d in zip(offs, lens, dst):
        assert np.array_equal(m[d:d + ln], data[o:o + ln])
    reg.close()


def test_entries_across_files_and_registrations(hub, disk_file, shm_file, tmp_path) -> None:
    (p1, d1), (p2, d2) = disk_file, shm_file
    a, b = bytearray(MiB), bytearray(MiB)
    ra, rb = hub.register(a), hub.register(b)
    with open(p2, "rb") as fobj:
        fd = os.open(p1, os.O_RDONLY)
        try:
            f = hub.load_batch([(p1, 4096, 8192, ra, 0), (fobj, 7, 93, rb, 5),
                                (fd, 123, 4000, ra, 100000), (p2, 0, 65536, rb, 200000)],
                               per_entry=True)
            f.wait(30)
        finally:
            os.close(fd)
    assert bytes(a[:8192]) == d1[4096:12288].tobytes()
    assert bytes(b[5:98]) == d2[7:100].tobytes()
    assert bytes(a[100000:104000]) == d1[123:4123].tobytes()
    assert bytes(b[200000:265536]) == d2[:65536].tobytes()
    assert len(f.entries) == 4 and all(e.done() and e.exception() is None for e in f.entries)
    assert list(f.results) == [8192, 93, 4000, 65536]


@pytest.mark.parametrize("where", ["disk", "shm"])
def test_scattered_writes(hub, tmp_path, where) -> None:
    direct = where == "disk"
    if where == "shm":
        if not os.path.isdir(SHM):
            pytest.skip("no /dev/shm")
        path = os.path.join(SHM, f"p2phub-batch-out-{os.getpid()}.bin")
    else:
        path = str(tmp_path / "out.bin")
    size = 4 * MiB
    np.zeros(size, np.uint8).tofile(path)
    try:
        src = np.random.default_rng(5).integers(0, 256, 2 * MiB, dtype=np.uint8)
        mem = bytearray(src.tobytes())
        reg = hub.register(mem)
        n = 200
        rng = np.random.default_rng(6)
        lens = rng.choice([4 * KiB, 16 * KiB, 128 * KiB], n).astype(np.int64)
        # disjoint file places (slots of 128 KiB), so the expected file is well defined
        offs = rng.permutation(size // (128 * KiB))[:n % 32 or 32].astype(np.int64) * 128 * KiB
        n = offs.size
        lens = lens[:n]
        moff = rng.integers(0, (len(mem) - 128 * KiB) // 4096, n).astype(np.int64) * 4096
        f = hub.save_batch(storage=path, offsets=offs, lengths=lens, memory=reg, mem_offsets=moff,
                           direct=direct)
        f.wait(60)
        assert f.stats["io"] == {path: "O_DIRECT" if direct else "buffered"}
        out = np.fromfile(path, np.uint8)
        expect = np.zeros(size, np.uint8)
        for o, ln, m in zip(offs, lens, moff):
            expect[o:o + ln] = src[m:m + ln]
        assert np.array_equal(out, expect)
        reg.close()
    finally:
        if where == "shm":
            os.unlink(path)


def test_auto_reads_every_entry_o_direct_by_default(hub, disk_file) -> None:
    path, data = disk_file
    mem = bytearray(8 * MiB)
    with hub.register(mem) as reg:
        entries = [(path, 4096, 4 * MiB, reg, 0), (path, 123, 5000, reg, 4 * MiB + 8192)]
        f = hub.load_batch(entries)
        f.wait(60)
        assert f.stats["io"] == {path: "O_DIRECT"}
        for _st, o, ln, _r, d in entries:
            assert bytes(mem[d:d + ln]) == data[o:o + ln].tobytes()
    with pytest.raises(UsageError, match="buffered_from=-1"):
        batch.configure_batch(hub, buffered_from=-1)


def test_auto_reads_large_entries_through_the_page_cache(hub, disk_file) -> None:
    path, data = disk_file
    batch.configure_batch(hub, depth=8, slot=256 * KiB, slots=16, buffered_from=MiB)
    mem = bytearray(8 * MiB)
    with hub.register(mem) as reg:
        entries = [(path, 4096, MiB, reg, 0), (path, 123, 5000, reg, 2 * MiB),
                   (path, 3 * MiB + 7, 2 * MiB + 1, reg, 4 * MiB)]
        f = hub.load_batch(entries)
        f.wait(60)
        assert f.stats["io"] == {path: f"O_DIRECT below {MiB} bytes, buffered from {MiB}"}
        for st, o, ln, _r, d in entries:
            assert bytes(mem[d:d + ln]) == data[o:o + ln].tobytes()
        f = hub.load_batch(entries, direct=True)
        f.wait(60)
        assert f.stats["io"] == {path: "O_DIRECT"}
        with pytest.raises(UsageError, match="direct='yes'"):
            hub.load_batch(entries, direct="yes")


def test_unaligned_writes_to_a_path_go_through_the_page_cache(hub, tmp_path) -> None:
    path = str(tmp_path / "out.bin")
    mem = bytearray(os.urandom(MiB))
    with hub.register(mem) as reg:
        f = hub.save_batch([(path, 10, 5000, reg, 3), (path, 70000, 1, reg, 900)])
        f.wait(30)
    assert f.stats["io"] == {path: "buffered"}
    out = open(path, "rb").read()
    assert out[10:5010] == bytes(mem[3:5003]) and out[70000] == mem[900]


# ------------------------------------------------------------------ refusals


def _untouched(mem: bytearray) -> bool:
    return not any(mem)


def test_bad_entries_are_refused_by_index_and_nothing_is_submitted(hub, disk_file, tmp_path) -> None:
    path, data = disk_file
    mem = bytearray(MiB)
    reg = hub.register(mem)
    good = [(path, i * 4096, 4096, reg, i * 4096) for i in range(10)]

    def refused(bad_index, bad, match, exc=UsageError):
        entries = list(good)
        entries.insert(bad_index, bad)
        with pytest.raises(exc, match=match):
            hub.load_batch(entries)
        assert _untouched(mem), "a refused batch moved bytes"

    refused(3, (path, data.size - 100, 4096, reg, 0), r"entry 3: range .* past the end")
    refused(7, (path, 0, 4096, reg, MiB - 100), r"entry 7: memory range .* outside")
    refused(0, (path, -4096, 4096, reg, 0), r"entry 0: offset -4096 is negative")
    refused(5, (path, 0, 0, reg, 0), r"entry 5: length 0 is not positive")
    refused(2, (path, 0, 4096, reg, -1), r"entry 2: memory offset -1 is negative")
    refused(4, (path, 0, "4096", reg, 0), r"entry 4: length '4096' is not an integer")
    refused(6, (path, 0, 4096, bytearray(10), 0), r"entry 6: bytearray is not a registration")
    refused(9, (path, 0, 4096), r"entry 9: want \(storage, offset")
    refused(8, (3.5, 0, 4096, reg, 0), r"entry 8: float is not a path")
    refused(1, (str(tmp_path / "missing"), 0, 4096, reg, 0), r"entry 1: open .*missing",
            P2PHubOSError)
    # an fd that is not open
    with pytest.raises(P2PHubOSError, match=r"entry 10: fd 999999: .*not an open file") as ei:
        hub.load_batch(good + [(999999, 0, 4096, reg, 0)])
    assert ei.value.errno == errno.EBADF
    # a closed registration
    other = hub.register(bytearray(MiB))
    other.close()
    with pytest.raises(UsageError, match=r"entry 4: .* is closed"):
        hub.load_batch(good[:4] + [(path, 0, 4096, other, 0)] + good[4:])
    assert _untouched(mem)
    reg.close()


def test_column_form_from_strided_arrays_and_a_shared_length(hub, disk_file) -> None:
    """Columns that are views of other arrays (every other element, reversed, read-only) and
    a scalar length that batches of the same size share: the bytes land where each entry
    says, batch after batch of different sizes, and the shared length column stays as it is."""
    path, data = disk_file
    mem = bytearray(4 * MiB)
    view = np.frombuffer(mem, np.uint8)
    with hub.register(mem) as reg:
        rng = np.random.default_rng(21)
        for n in (64, 7, 64, 1):
            offs = (rng.permutation(data.size // 8192 - 1)[:2 * n] * 8192)[::2]
            dst = (np.arange(2 * n, dtype=np.int64)[::-1] * 16384)[1::2]
            dst.flags.writeable = False
            f = hub.load_batch(storage=path, offsets=offs, lengths=8192, memory=reg,
                               mem_offsets=dst)
            f.wait(30)
            assert list(f.results) == [8192] * n and f.nbytes == 8192 * n
            for o, d in zip(offs, dst):
                assert np.array_equal(view[d:d + 8192], data[o:o + 8192]), (n, o, d)
    del view


def test_entries_that_fail_while_running_are_named_and_the_rest_land(hub, tmp_path) -> None:
    """A file cut short after the batch was planned: the entries past its new end fail (EIO,
    the first named in the error, the count of the others given), their results say so, and
    every other entry's bytes arrive."""
    path = tmp_path / "shrinks.bin"
    data = _file(path, 1 * MiB, 8)
    mem = bytearray(256 * KiB)
    with hub.register(mem) as reg:
        offs = [0, 256 * KiB, 768 * KiB, 512 * KiB, 896 * KiB]
        with hub.engines.paused():      # planned (the file checked whole), not yet run
            f = hub.load_batch(storage=str(path), offsets=offs, lengths=16 * KiB, memory=reg,
                               mem_offsets=np.arange(5) * 16 * KiB)
            os.truncate(path, 640 * KiB)
        with pytest.raises(FenceError, match=r"entry 2: read .*shrinks.bin\[786432:\+16384\] "
                                             r"\(and 1 more entries\): EIO") as got:
            f.wait(30)
        assert isinstance(got.value.__cause__, P2PHubOSError)
        assert got.value.__cause__.errno == errno.EIO
        assert list(f.results) == [16 * KiB, 16 * KiB, -errno.EIO, 16 * KiB, -errno.EIO]
        for k in (0, 1, 3):
            assert bytes(mem[k * 16 * KiB:(k + 1) * 16 * KiB]) == \
                data[offs[k]:offs[k] + 16 * KiB].tobytes()


def test_column_form_refusals(hub, disk_file) -> None:
    path, data = disk_file
    mem = bytearray(MiB)
    reg = hub.register(mem)
    offs = np.arange(100, dtype=np.int64) * 4096
    offs[57] = data.size
    with pytest.raises(UsageError, match=r"entry 57: range .* past the end"):
        hub.load_batch(storage=path, offsets=offs, lengths=4096, memory=reg,
                       mem_offsets=np.arange(100) * 4096)
    with pytest.raises(UsageError, match=r"lengths: 3 values for 100 entries"):
        hub.load_batch(storage=path, offsets=offs, lengths=[1, 2, 3], memory=reg)
    with pytest.raises(UsageError, match=r"entry 1: memory_index 5 is not one of the 1"):
        hub.load_batch(storage=path, offsets=[0, 0], lengths=8, memory=reg, memory_index=[0, 5])
    # sums past 2**63 wrap negative in int64: still refused, naming the entry
    big = np.full(4, 4096, np.int64)
    big[2] = (1 << 63) - 4096
    with pytest.raises(UsageError, match=r"entry 2: range .* past the end"):
        hub.load_batch(storage=path, offsets=big, lengths=8192, memory=reg,
                       mem_offsets=np.arange(4) * 8192)
    with pytest.raises(UsageError, match=r"entry 2: memory range .* is outside"):
        hub.load_batch(storage=path, offsets=np.zeros(4, np.int64), lengths=8192, memory=reg,
                       mem_offsets=big)
    # two memories, the second's range past its end: named, with the first's entries fine
    reg2 = hub.register(bytearray(64 * KiB))
    with pytest.raises(UsageError, match=r"entry 3: memory range 61440\+8192 is outside"):
        hub.load_batch(storage=path, offsets=np.zeros(4, np.int64), lengths=8192,
                       memory=[reg, reg2], memory_index=[0, 1, 0, 1],
                       mem_offsets=[0, 0, 8192, 60 * KiB])
    reg2.close()
    with pytest.raises(UsageError, match="an empty batch"):
        hub.load_batch([])
    with pytest.raises(UsageError, match="not both"):
        hub.load_batch([(path, 0, 1, reg, 0)], storage=path)
    assert _untouched(mem)
    reg.close()


def test_unaligned_write_to_an_odirect_fd_is_refused(hub, tmp_path) -> None:
    path = str(tmp_path / "out.bin")
    np.zeros(MiB, np.uint8).tofile(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError:
        pytest.skip("no O_DIRECT on this file system")
    mem = bytearray(b"\x55" * MiB)
    try:
        with hub.register(mem) as reg:
            with pytest.raises(UsageError, match=r"entry 1: .*O_DIRECT .*10\+4096 is not aligned"):
                hub.save_batch([(fd, 0, 4096, reg, 0), (fd, 10, 4096, reg, 0)])
            ro = os.open(path, os.O_RDONLY)
            try:
                with pytest.raises(P2PHubOSError, match=r"entry 0: .* open for reading only"):
                    hub.save_batch([(ro, 0, 4096, reg, 0)])
            finally:
                os.close(ro)
    finally:
        os.close(fd)
    assert not np.fromfile(path, np.uint8).any(), "a refused batch wrote bytes"


def test_registration_is_busy_during_a_batch_and_hub_close_closes_the_engine(disk_file) -> None:
    path, data = disk_file
    h = Hub(mode="staged")
    mem = bytearray(8 * MiB)
    reg = h.register(mem)
    f = h.load_batch(storage=path, offsets=np.arange(1000) * 4096, lengths=4096, memory=reg,
                     mem_offsets=np.arange(1000) * 4096)
    f.wait(60)
    assert bytes(mem[:4096000]) == data[:4096000].tobytes()
    assert reg.holds == 0
    h.close()
    with pytest.raises(Exception, match="closed"):
        h.load_batch([(path, 0, 4096, reg, 0)])


def test_configure_batch_refusals(hub) -> None:
    with pytest.raises(UsageError, match="depth"):
        batch.configure_batch(hub, depth=0)
    with pytest.raises(UsageError, match="multiple of 4096"):
        batch.configure_batch(hub, slot=1000)


class _MappedDmabuf(Memory):
    """Stands for a dma-buf registration of a P2P hub (vgem, udmabuf): no GPU engine, a CPU
    mapping (a memfd here)."""

    mode = "p2p"

    def __init__(self, n: int, mappable: bool = True) -> None:
        self.length, self.what, self.mappable = n, "a mapped dma-buf", mappable
        self._share = MemoryShare()
        self.fd = os.memfd_create("p2phub-test")
        os.ftruncate(self.fd, n)

    @property
    def gpu(self):
        return None

    @property
    def source(self):
        return None

    def mmap(self):
        import mmap
        if not self.mappable:
            raise P2PHubOSError(errno.ENODEV, "mmap the dma-buf export", "no struct pages")
        return mmap.mmap(self.fd, self.length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def test_file_entries_reach_a_dmabuf_registration_through_its_cpu_mapping(hub, disk_file,
                                                                          tmp_path) -> None:
    path, data = disk_file
    reg = _MappedDmabuf(4 * MiB)
    offs = np.arange(64) * 8192
    dst = np.arange(64)[::-1] * 65536 + 512          # unaligned places: through staging
    f = hub.load_batch(storage=path, offsets=offs, lengths=4096, memory=reg, mem_offsets=dst)
    f.wait(60)
    view = np.frombuffer(reg.mmap(), np.uint8)
    for o, d in zip(offs, dst):
        assert np.array_equal(view[d:d + 4096], data[o:o + 4096])
    out = tmp_path / "out.bin"
    out.write_bytes(bytes(MiB))
    hub.save_batch(storage=str(out), offsets=np.arange(16) * 4096, lengths=4096, memory=reg,
                   mem_offsets=dst[:16]).wait(60)
    got = np.fromfile(out, np.uint8)
    for i, d in enumerate(dst[:16]):
        assert np.array_equal(got[i * 4096:(i + 1) * 4096], view[d:d + 4096])
    with pytest.raises(UsageError, match="entry 0: .* has no CPU mapping"):
        hub.load_batch(storage=path, offsets=offs, lengths=4096,
                       memory=_MappedDmabuf(4 * MiB, mappable=False), mem_offsets=dst)
