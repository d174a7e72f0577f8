"""Host memory registered with the batch engine's ring (fixed buffers): O_DIRECT loads that
land in place in a host registration go as READ_FIXED; a registration that closes leaves the
ring; where the ring cannot take memory (Linux AIO, fixed buffers off, a full table) loads go on
as before. Every byte is checked against the file as numpy wrote it."""

from __future__ import annotations

import logging
import mmap

import numpy as np
import pytest

from p2phub import batch
from p2phub.hub import Hub
from p2phub.staged import HostOps

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture()
def data_file(tmp_path):
    p = tmp_path / "data.bin"
    data = np.random.default_rng(11).integers(0, 256, 8 * MiB, dtype=np.uint8)
    data.tofile(p)
    return str(p), data


@pytest.fixture()
def hub():
    h = Hub(mode="staged")
    batch.configure_batch(h, depth=32, slot=256 * KiB, slots=48)
    yield h
    h.close()


def _engine(h: Hub) -> batch._Engine:
    return h.engines.batch_engine(HostOps(), 0)


def _needs_table(h: Hub, f) -> None:
    if f.stats["submit_path"] != "io_uring" or not _engine(h).mem_table()["table"]:
        pytest.skip(f"this host's ring takes no memory ({f.stats['submit_path_reason']})")


def _load(h: Hub, path: str, data: np.ndarray, reg, view: np.ndarray, n: int = 48,
          size: int = 64 * KiB, seed: int = 3, shift: int = 0):
    """n reads of `size` at random aligned offsets into scattered places of `reg` (`shift`
    bytes past a page boundary for every other one when given); checked through `view`."""
    rng = np.random.default_rng(seed)
    offs = rng.integers(0, (data.size - size) // 4096, n) * 4096
    dst = rng.permutation(n) * (size + 4096)
    if shift:
        dst[1::2] += shift
    f = h.load_batch(storage=path, offsets=offs, lengths=size, memory=reg, mem_offsets=dst,
                     direct=True)
    f.wait(60)
    for o, d in zip(offs, dst):
        assert np.array_equal(view[d:d + size], data[o:o + size]), (o, d)
    assert list(f.results) == [size] * n
    return f


def test_loads_into_alloc_host_read_into_registered_memory(hub, data_file) -> None:
    path, data = data_file
    reg = hub.alloc_host(48 * (64 * KiB + 4096))
    mm = reg.mmap()
    view = np.frombuffer(mm, np.uint8)
    f = _load(hub, path, data, reg, view)
    _needs_table(hub, f)
    assert f.stats["in_place"] == 48 and f.stats["fixed_mem"] == 48
    assert "memory registrable" in f.stats["submit_path_reason"]
    assert _engine(hub).mem_table() == {"table": 1, "live": 1, "pending": 0, "refused_errno": 0}
    # a second batch reuses the registration: nothing more is registered
    f = _load(hub, path, data, reg, view, seed=4)
    assert f.stats["fixed_mem"] == 48 and _engine(hub).mem_table()["live"] == 1
    del view
    mm.close()


def test_caller_buffer_and_unaligned_places(hub, data_file) -> None:
    """A caller's buffer registers too; reads off a page boundary in memory still go through
    a staging slot (not in place), the others through the registered memory."""
    path, data = data_file
    mem = mmap.mmap(-1, 48 * (64 * KiB + 4096))
    reg = hub.register(mem)
    view = np.frombuffer(mem, np.uint8)
    f = _load(hub, path, data, reg, view, shift=512)
    _needs_table(hub, f)
    assert f.stats["in_place"] == 24 and f.stats["fixed_mem"] == 24
    del view
    reg.close()


def test_large_reads_into_registered_memory_go_whole(hub, data_file) -> None:
    """An entry larger than a staging slot, read in place into registered memory, is one read
    (the block layer cuts it as it would a pread's), as a plain read rather than through the
    table; an unaligned tail after it goes through a slot; the same entries into memory off a
    page boundary go through the slots in split pieces. Every byte arrives."""
    path, data = data_file
    size, n = 1 * MiB + 8 * KiB, 6          # 4 slots' worth and more per entry
    mem = mmap.mmap(-1, n * (size + 8 * KiB) + 4096)
    reg = hub.register(mem)
    view = np.frombuffer(mem, np.uint8)
    f = _load(hub, path, data, reg, view, n=n, size=size)
    _needs_table(hub, f)
    assert f.stats["pieces"] == n and f.stats["in_place"] == n and f.stats["fixed_mem"] == 0
    # an unaligned length: the aligned part whole and in place, the rest through a slot
    odd = size - 512
    offs = np.arange(n) * (size + 4096)
    dst = np.arange(n)[::-1] * (size + 8 * KiB)
    f = hub.load_batch(storage=path, offsets=offs, lengths=odd, memory=reg, mem_offsets=dst,
                       direct=True)
    f.wait(60)
    for o, d in zip(offs, dst):
        assert np.array_equal(view[d:d + odd], data[o:o + odd]), (o, d)
    assert f.stats["in_place"] == n and f.stats["pieces"] == 2 * n
    # off a page boundary in memory: through the slots, cut into the engine's split pieces
    # (the first one short by the 512 bytes before the aligned start), none in place
    f = _load(hub, path, data, reg, view, n=2, size=size, seed=6, shift=512)
    piece = f.stats["split_bytes"]
    assert piece == 128 * KiB and f.stats["split_entries"] == 1
    assert f.stats["in_place"] == 1 and f.stats["pieces"] == 1 + -(-(size + 512) // piece)
    del view
    reg.close()


def test_a_closed_registration_leaves_the_ring(hub, data_file) -> None:
    """Closing a registration gives its range up at once (no read lands in its pages again)
    and the kernel lets go of it at the engine's next batch; memory mapped afterwards,
    likely at the same address, gets its own bytes."""
    path, data = data_file
    size = 48 * (64 * KiB + 4096)
    reg = hub.alloc_host(size)
    mm = reg.mmap()
    view = np.frombuffer(mm, np.uint8)
    f = _load(hub, path, data, reg, view)
    _needs_table(hub, f)
    del view
    mm.close()
    reg.close()
    eng = _engine(hub)
    t = eng.mem_table()
    # given up: either the kernel let go at once, or it does at the next batch
    assert t["live"] == t["pending"] in (0, 1)
    reg2 = hub.alloc_host(size)
    mm2 = reg2.mmap()
    view2 = np.frombuffer(mm2, np.uint8)
    f = _load(hub, path, data, reg2, view2, seed=8)
    assert f.stats["fixed_mem"] == 48
    assert eng.mem_table() == {"table": 1, "live": 1, "pending": 0, "refused_errno": 0}
    del view2
    mm2.close()
    reg2.close()
    # the same address or not, both ranges are gone once the next batch ran
    other = hub.alloc_host(1 * MiB)
    with other.mmap() as mm3:
        f = hub.load_batch([(path, 4096, 4096, other, 0)], direct=True)
        f.wait(60)
        assert bytes(mm3[:4096]) == data[4096:8192].tobytes()
    assert eng.mem_table()["live"] == 1 and eng.mem_table()["pending"] == 0
    other.close()


def test_a_full_table_reads_the_rest_unregistered(hub, data_file) -> None:
    """More host registrations in one batch than the ring's table holds: the ones past it are
    read into as plain memory, every byte arrives."""
    path, data = data_file
    regs = [hub.alloc_host(64 * KiB) for _ in range(40)]
    maps = [r.mmap() for r in regs]
    offs = np.arange(40) * 64 * KiB + 4096
    f = hub.load_batch(storage=path, offsets=offs, lengths=16 * KiB, memory=regs,
                       memory_index=np.arange(40), mem_offsets=8 * KiB, direct=True)
    f.wait(60)
    for i, mm in enumerate(maps):
        o = int(offs[i])
        assert bytes(mm[8 * KiB:24 * KiB]) == data[o:o + 16 * KiB].tobytes(), i
    _needs_table(hub, f)
    assert f.stats["in_place"] == 40
    assert 0 < f.stats["fixed_mem"] < 40
    for mm, r in zip(maps, regs):
        mm.close()
        r.close()


def test_memory_the_kernel_will_not_pin_is_read_as_before(hub, data_file, tmp_path,
                                                          caplog) -> None:
    """A caller's buffer that maps a file on disk: the kernel refuses to pin it for long
    (shared file pages), the log says so, and the reads land in place as before."""
    path, data = data_file
    backing = tmp_path / "backing.bin"
    size = 48 * (64 * KiB + 4096)
    with open(backing, "wb") as fh:
        fh.truncate(size)
    with open(backing, "r+b") as fh:
        mem = mmap.mmap(fh.fileno(), size, mmap.MAP_SHARED)
    reg = hub.register(mem)
    view = np.frombuffer(mem, np.uint8)
    with caplog.at_level(logging.INFO, logger="p2phub.batch"):
        f = _load(hub, path, data, reg, view)
    t = _engine(hub).mem_table()
    if f.stats["submit_path"] != "io_uring" or not t["table"] or t["live"]:
        pytest.skip(f"this host's ring took the file mapping, or takes no memory ({t})")
    assert f.stats["fixed_mem"] == 0 and f.stats["in_place"] == 48
    assert t["refused_errno"] != 0
    assert any("not registered with the ring" in r.getMessage() for r in caplog.records)
    del view
    reg.close()
    mem.close()


def test_fixed_buffers_off_registers_no_memory(data_file) -> None:
    path, data = data_file
    h = Hub(mode="staged")
    try:
        batch.configure_batch(h, depth=32, slot=256 * KiB, slots=48, fixed_buffers=False)
        reg = h.alloc_host(48 * (64 * KiB + 4096))
        mm = reg.mmap()
        f = _load(h, path, data, reg, np.frombuffer(mm, np.uint8))
        assert f.stats["fixed_mem"] == 0 and f.stats["in_place"] == 48
        assert f.stats["fixed_buffers"] is False
        if f.stats["submit_path"] == "io_uring":
            assert "fixed buffers off" in f.stats["submit_path_reason"]
        assert _engine(h).mem_table()["live"] == 0
        mm.close()
    finally:
        h.close()


def test_linux_aio_reads_in_place_without_a_table(data_file, monkeypatch) -> None:
    """P2PHUB_IO_URING=0 (io_uring blocked): Linux AIO has no registered buffers; loads into
    host registrations still read in place, and closing them is harmless."""
    path, data = data_file
    monkeypatch.setenv("P2PHUB_IO_URING", "0")
    h = Hub(mode="staged")
    try:
        batch.configure_batch(h, depth=32, slot=256 * KiB, slots=48)
        reg = h.alloc_host(48 * (64 * KiB + 4096))
        mm = reg.mmap()
        f = _load(h, path, data, reg, np.frombuffer(mm, np.uint8), shift=512)
        assert f.stats["submit_path"] == "aio"
        assert f.stats["in_place"] == 24 and f.stats["fixed_mem"] == 0
        assert _engine(h).mem_table()["table"] == 0
        mm.close()
        reg.close()
        assert _engine(h).mem_table()["live"] == 0
    finally:
        h.close()


def test_hub_close_with_registered_memory_open(data_file) -> None:
    path, data = data_file
    h = Hub(mode="staged")
    reg = h.alloc_host(48 * (64 * KiB + 4096))
    mm = reg.mmap()
    _load(h, path, data, reg, np.frombuffer(mm, np.uint8))
    mm.close()
    h.close()
    assert reg.closed
