"""The batch engine's submission path (io_uring, or Linux AIO where io_uring is blocked) and
its split of large reads: the bytes that arrive, and what fence.stats and the log say."""

from __future__ import annotations

import logging
import mmap

import numpy as np
import pytest

from p2phub import batch
from p2phub.errors import UsageError
from p2phub.hub import Hub

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture()
def data_file(tmp_path):
    p = tmp_path / "data.bin"
    data = np.random.default_rng(5).integers(0, 256, 16 * MiB + 512, dtype=np.uint8)
    data.tofile(p)
    return str(p), data


def _hub(**opts) -> Hub:
    h = Hub(mode="staged")
    batch.configure_batch(h, depth=32, slot=1 * MiB, slots=40, **opts)
    return h


def _mixed_reads(hub: Hub, path: str, data: np.ndarray) -> tuple[object, mmap.mmap, list]:
    """O_DIRECT reads, scattered: aligned ones (in place), ones off a page boundary in memory
    (through a slot), large ones (split); returns the fence, the memory and the entries."""
    n, slot = 64, 1 * MiB + 4096
    mem = mmap.mmap(-1, n * slot)
    reg = hub.register(mem)
    rng = np.random.default_rng(9)
    lens = rng.choice([4 * KiB, 64 * KiB, 300 * KiB, 1 * MiB], n)
    offs = np.array([rng.integers(0, (data.size - ln) // 4096) * 4096 for ln in lens])
    dst = rng.permutation(n) * slot
    dst[1::4] += 512
    f = hub.load_batch(storage=path, offsets=offs, lengths=lens, memory=reg, mem_offsets=dst,
                       direct=True)
    f.wait(60)
    m = np.frombuffer(mem, np.uint8)
    for o, ln, d in zip(offs, lens, dst):
        assert np.array_equal(m[d:d + ln], data[o:o + ln]), (o, ln, d)
    assert list(f.results) == list(lens)
    del m
    reg.close()
    return f, mem, list(zip(offs, lens, dst))


def test_linux_aio_where_io_uring_is_blocked(data_file, monkeypatch, caplog) -> None:
    """P2PHUB_IO_URING=0 stands for a host that refuses io_uring_setup: the engine submits
    through Linux AIO, says so in the stats and the log, and every byte arrives."""
    path, data = data_file
    monkeypatch.setenv("P2PHUB_IO_URING", "0")
    h = _hub(split=256 * KiB)
    try:
        with caplog.at_level(logging.INFO, logger="p2phub.batch"):
            f, _mem, _ = _mixed_reads(h, path, data)
        assert f.stats["submit_path"] == "aio"
        assert "P2PHUB_IO_URING" in f.stats["submit_path_reason"]
        assert f.stats["fixed_buffers"] is False
        assert f.stats["in_place"] > 0 and f.stats["split_entries"] > 0
        assert any("aio" in r.getMessage() and "P2PHUB_IO_URING" in r.getMessage()
                   for r in caplog.records)
        # writes through AIO too: read back from the file, not through p2phub
        src = mmap.mmap(-1, 1 * MiB)
        np.frombuffer(src, np.uint8)[:] = np.arange(1 * MiB, dtype=np.uint64).astype(np.uint8)
        reg = h.register(src)
        out = path + ".out"
        w = h.save_batch(storage=out, offsets=[0, 512 * KiB], lengths=256 * KiB, memory=reg,
                         mem_offsets=[256 * KiB, 0])
        w.wait(60)
        assert w.stats["submit_path"] == "aio"
        got = np.fromfile(out, np.uint8)
        s = np.frombuffer(src, np.uint8)
        assert np.array_equal(got[:256 * KiB], s[256 * KiB:512 * KiB])
        assert np.array_equal(got[512 * KiB:768 * KiB], s[:256 * KiB])
        del s
        reg.close()
    finally:
        h.close()


def test_io_uring_by_default(data_file) -> None:
    path, data = data_file
    h = _hub()
    try:
        f, _mem, _ = _mixed_reads(h, path, data)
        if f.stats["submit_path"] == "aio":   # a host (container) that blocks io_uring
            assert f.stats["submit_path_reason"].startswith("io_uring_setup: ")
        else:
            assert f.stats["submit_path"] == "io_uring"
    finally:
        h.close()


@pytest.mark.parametrize("split", [0, 64 * KiB, 256 * KiB, None])
def test_large_reads_split_into_pieces(data_file, split) -> None:
    """O_DIRECT reads through the staging slots of twice the split size and up go in pieces
    of it (128 KiB by default; 0: slot-sized pieces); reads in place stay whole; the bytes
    are the same either way."""
    path, data = data_file
    h = _hub(split=split)
    try:
        f, _mem, entries = _mixed_reads(h, path, data)
        piece = 128 * KiB if split is None else split
        assert f.stats["split_bytes"] == piece
        staged = [ln for _o, ln, d in entries if d % 4096]
        big = [ln for ln in staged if piece and ln >= 2 * piece]
        assert f.stats["split_entries"] == len(big)
        if piece:
            assert big
            assert f.stats["pieces"] >= len(entries) - len(staged) + sum(
                -(-ln // piece) for ln in big)
    finally:
        h.close()


@pytest.mark.parametrize("inflight", [256 * KiB, 0, None])
def test_reads_through_the_slots_keep_their_bytes_in_flight_bounded(data_file, inflight) -> None:
    """At most `inflight` bytes of reads through the slots are in flight (one piece may pass
    the bound: a read starts while less is in flight); 0 bounds them by the depth alone; the
    default is 8 MiB. Every byte arrives either way."""
    path, data = data_file
    h = _hub(split=64 * KiB, inflight=inflight)
    try:
        f, _mem, _ = _mixed_reads(h, path, data)
        bound = 8 * MiB if inflight is None else inflight
        assert f.stats["inflight_bytes"] == bound
        assert f.stats["max_inflight_bytes"] > 0
        if bound:
            assert f.stats["max_inflight_bytes"] < bound + 1 * MiB   # + one slot at most
        if inflight == 256 * KiB:
            assert f.stats["max_inflight_bytes"] < 256 * KiB + 64 * KiB + 4096
        if inflight == 0:   # 32 deep, every staged piece at most 64 KiB + the skip
            assert f.stats["max_inflight_bytes"] > 256 * KiB
    finally:
        h.close()


@pytest.mark.parametrize("opts,match", [({"split": 1000}, "split=1000 must be 0 or a positive "
                                                          "multiple of 4096"),
                                        ({"inflight": -1}, "inflight=-1 must be 0")])
def test_bad_split_or_inflight_is_refused(opts, match) -> None:
    h = Hub(mode="staged")
    try:
        with pytest.raises(UsageError, match=match):
            batch.configure_batch(h, **opts)
    finally:
        h.close()


def test_buffered_reads_are_not_split(data_file) -> None:
    """A read through the page cache stays whole (each piece would start its own readahead),
    and its bytes are not counted against the bound on O_DIRECT bytes in flight."""
    path, data = data_file
    h = _hub(split=256 * KiB)
    try:
        mem = mmap.mmap(-1, 4 * MiB)
        reg = h.register(mem)
        f = h.load_batch([(path, 4096, 2 * MiB, reg, 0), (path, 8 * MiB, 1 * MiB, reg, 2 * MiB)],
                         direct=False)
        f.wait(60)
        assert f.stats["split_entries"] == 0 and f.stats["pieces"] == 3   # 1 MiB slots
        assert f.stats["max_inflight_bytes"] == 0
        m = np.frombuffer(mem, np.uint8)
        assert np.array_equal(m[:2 * MiB], data[4096:4096 + 2 * MiB])
        assert np.array_equal(m[2 * MiB:3 * MiB], data[8 * MiB:9 * MiB])
        del m
        reg.close()
    finally:
        h.close()


@pytest.mark.parametrize("how", ["io_uring", "aio", "nofixed"])
def test_large_entries_get_larger_slots_and_small_ones_the_base_slots(data_file, tmp_path,
                                                                      monkeypatch, how) -> None:
    """A run of large entries carves the staging memory into fewer, larger slots (up to 2 MiB,
    at least 32 of them); the next run of small entries gets the base slots back. Reads into
    memory off a page boundary go through the slots, so every byte crosses them; a save of
    large entries from such memory lands whole in the file."""
    path, data = data_file
    if how == "aio":
        monkeypatch.setenv("P2PHUB_IO_URING", "0")
    h = Hub(mode="staged")
    batch.configure_batch(h, depth=32, slot=64 * KiB, slots=256, fixed_buffers=how != "nofixed")
    try:
        mem = mmap.mmap(-1, 24 * MiB)
        reg = h.register(mem)
        m = np.frombuffer(mem, np.uint8)
        rng = np.random.default_rng(11)
        for ln, slot_bytes, slots in ((1 * MiB, 512 * KiB, 32), (4 * KiB, 64 * KiB, 256),
                                      (256 * KiB, 256 * KiB, 64)):
            n = 20
            offs = rng.integers(0, (data.size - ln) // 4096, n) * 4096
            dst = np.arange(n) * (ln + 4096) + 512
            f = h.load_batch(storage=path, offsets=offs, lengths=np.full(n, ln), memory=reg,
                             mem_offsets=dst, direct=True)
            f.wait(60)
            assert (f.stats["slot_bytes"], f.stats["slots"]) == (slot_bytes, slots)
            assert f.stats["in_place"] == 0
            for o, d in zip(offs, dst):
                assert np.array_equal(m[d:d + ln], data[o:o + ln]), (ln, o, d)
        out = str(tmp_path / "out.bin")
        n, ln = 8, 2 * MiB
        f = h.save_batch(storage=out, offsets=np.arange(n) * ln, lengths=np.full(n, ln),
                         memory=reg, mem_offsets=np.arange(n) * ln + 512)
        f.wait(60)
        assert (f.stats["slot_bytes"], f.stats["slots"]) == (512 * KiB, 32)
        written = np.fromfile(out, np.uint8)
        assert written.size == n * ln and np.array_equal(written, m[512:512 + n * ln])
        del m
        reg.close()
    finally:
        h.close()


def test_slots_of_an_odd_size_gang_only_within_one_registered_buffer(data_file) -> None:
    """96 KiB slots: 10,922 of them fit one 1 GiB registered buffer, an even number but not a
    multiple of 4, so 1 MiB entries get slots of two (192 KiB), never four."""
    path, data = data_file
    h = Hub(mode="staged")
    batch.configure_batch(h, depth=32, slot=96 * KiB, slots=256)
    try:
        mem = mmap.mmap(-1, 12 * MiB)
        reg = h.register(mem)
        n, ln = 10, 1 * MiB
        offs = np.arange(n) * ln + 4096
        dst = np.arange(n) * (ln + 4096) + 512
        f = h.load_batch(storage=path, offsets=offs, lengths=np.full(n, ln), memory=reg,
                         mem_offsets=dst, direct=True)
        f.wait(60)
        assert (f.stats["slot_bytes"], f.stats["slots"]) == (192 * KiB, 128)
        m = np.frombuffer(mem, np.uint8)
        for o, d in zip(offs, dst):
            assert np.array_equal(m[d:d + ln], data[o:o + ln])
        del m
        reg.close()
    finally:
        h.close()
