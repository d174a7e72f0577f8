"""Disk faults below the storage engine, from the kernel's own device-mapper: a block device
whose first 256 KiB answer every I/O with EIO (dm-error) and whose rest maps a loop device over
a file of known bytes through dm-delay (every good I/O takes 30 ms more). An entry that covers
bad sectors and good ones is split into pieces, and the bad ones always complete first
(dm-error answers at once), so the test sees whether a later good piece turns a failed entry
back into success.

For every storage route (hub.load / hub.save, load_batch / save_batch by path, O_DIRECT and
buffered, on a hub.open() file, with per-entry fences, p2phub.nixl FILE, and the real NIXL
with libplugin_P2PHUB.so): the entries that failed are exactly those reported failed, with
EIO; the good entries' bytes arrive (checked against the backing file); memory outside the
entries keeps its sentinel; a failed save writes nothing outside its own range."""

from __future__ import annotations

import errno
import json
import mmap
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from p2phub import batch
from p2phub.errors import P2PHubOSError
from p2phub.hub import Hub

pytestmark = pytest.mark.lab

KiB, MiB = 1 << 10, 1 << 20
SECTOR = 512
BAD = 256 * KiB          # [0, BAD) fails: two 128 KiB pieces, while the good ones fly
SIZE = 16 * MiB
DM = "p2phub-faulty"
DELAY_MS = 30            # each good I/O's added latency
TOP = Path(__file__).resolve().parents[2]


def _sh(*cmd: str, inp: str | None = None) -> str:
    p = subprocess.run(cmd, input=inp, capture_output=True, text=True)
    assert p.returncode == 0, f"{' '.join(cmd)}: {p.stderr.strip()}"
    return p.stdout.strip()


class FaultyDisk:
    def __init__(self, root: Path) -> None:
        _sh("modprobe", "-a", "dm_mod", "dm_delay", "loop")
        self.data = np.random.default_rng(7).integers(0, 256, SIZE, np.uint8)
        self.backing = root / "backing.img"
        self.data.tofile(self.backing)
        self.loop = _sh("losetup", "--find", "--show", str(self.backing))
        bad = BAD // SECTOR
        table = (f"0 {bad} error\n"
                 f"{bad} {SIZE // SECTOR - bad} delay {self.loop} {bad} {DELAY_MS}\n")
        _sh("dmsetup", "create", DM, inp=table)
        self.path = f"/dev/mapper/{DM}"
        _sh("udevadm", "settle") if os.path.exists("/usr/bin/udevadm") else None
        if not os.path.exists(self.path):     # no udev in the VM: the node by its numbers
            major, minor = _sh("dmsetup", "info", "-c", "--noheadings", "-o", "major,minor",
                               DM).split(":")
            os.makedirs("/dev/mapper", exist_ok=True)
            os.mknod(self.path, 0o600 | 0o060000, os.makedev(int(major), int(minor)))

    def on_disk(self, off: int, n: int) -> bytes:
        """The backing file's bytes (what the good part of the device holds)."""
        with open(self.backing, "rb") as f:
            f.seek(off)
            return f.read(n)

    def close(self) -> None:
        subprocess.run(["dmsetup", "remove", DM], capture_output=True)
        subprocess.run(["losetup", "-d", self.loop], capture_output=True)


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Iterator[FaultyDisk]:
    d = FaultyDisk(tmp_path_factory.mktemp("faulty"))
    yield d
    d.close()


@pytest.fixture
def hub() -> Iterator[Hub]:
    h = Hub(mode="staged")
    # small pieces: an entry of 4 MiB goes as 32 of them, up to 16 in flight
    batch.configure_batch(h, depth=16, slot=128 * KiB, slots=32)
    yield h
    h.close()


def _mem(n: int) -> mmap.mmap:
    m = mmap.mmap(-1, n)
    m[:] = b"\xee" * n
    return m


# entries of 512 KiB over the first 8 MiB: the first four lie in the bad region
OFFS = np.arange(16, dtype=np.int64) * 512 * KiB
LEN = 512 * KiB
FAILING = set(np.flatnonzero(OFFS < BAD).tolist())


@pytest.mark.parametrize("direct,moff", [(True, 0), (True, 512), (False, 0)],
                         ids=["odirect-in-place", "odirect-staged", "buffered"])
def test_an_entry_over_bad_and_good_sectors_fails_whole(hub, disk, direct, moff) -> None:
    """One 4 MiB read whose first 256 KiB are bad: EIO, never success with holes (in place,
    one piece; through the staging, 128 KiB pieces; buffered, slot-sized pieces)."""
    m = _mem(4 * MiB + 4096)
    reg = hub.register(m)
    f = hub.load_batch(storage=disk.path, offsets=[0], lengths=[4 * MiB], memory=reg,
                       mem_offsets=[moff], direct=direct)
    err = f.exception(60)
    assert isinstance(err, P2PHubOSError) and err.errno == errno.EIO, err
    assert "entry 0" in str(err)
    assert int(f.results[0]) == -errno.EIO
    reg.close()


@pytest.mark.parametrize("how", ["path", "opened", "odirect-off"])
def test_exactly_the_failed_entries_are_reported_failed(hub, disk, how) -> None:
    m = _mem(16 * MiB)
    reg = hub.register(m)
    dst = (np.arange(16, dtype=np.int64)[::-1] * 1 * MiB)       # 1 MiB apart, reversed
    storage = hub.open(disk.path) if how == "opened" else disk.path
    f = hub.load_batch(storage=storage, offsets=OFFS, lengths=LEN, memory=reg, mem_offsets=dst,
                       per_entry=True, direct=how != "odirect-off")
    assert isinstance(f.exception(60), P2PHubOSError)
    failed = {i for i, e in enumerate(f.entries) if e.exception() is not None}
    assert failed == FAILING
    for i in FAILING:
        assert f.entries[i].exception().errno == errno.EIO
        assert int(f.results[i]) == -errno.EIO
    mem = np.frombuffer(m, np.uint8)
    for i in set(range(16)) - FAILING:
        d, o = int(dst[i]), int(OFFS[i])
        assert mem[d:d + LEN].tobytes() == disk.on_disk(o, LEN), f"entry {i}"
        assert int(f.results[i]) == LEN
        assert (mem[d + LEN:d + MiB] == 0xEE).all(), f"bytes past entry {i}"
    del mem
    if how == "opened":
        storage.close()
    reg.close()


def test_single_load_and_save_over_bad_sectors_raise(hub, disk) -> None:
    m = _mem(4 * MiB)
    reg = hub.register(m)
    err = hub.load(disk.path, reg, 0, 4 * MiB).exception(60)
    assert isinstance(err, P2PHubOSError) and err.errno == errno.EIO, err
    err = hub.save(reg, disk.path, 0, 2 * MiB).exception(60)
    assert isinstance(err, P2PHubOSError) and err.errno == errno.EIO, err
    reg.close()


def test_save_batch_reports_the_writes_that_failed_and_lands_the_others(hub, disk) -> None:
    m = mmap.mmap(-1, 8 * MiB)
    fresh = np.random.default_rng(11).integers(0, 256, 8 * MiB, np.uint8).tobytes()
    m[:] = fresh
    reg = hub.register(m)
    # entry 0: [0, 4 MiB), its first 256 KiB bad; entries 1, 2: good, 2 MiB each
    offs, lens, src = [0, 8 * MiB, 12 * MiB], [4 * MiB, 2 * MiB, 2 * MiB], [0, 4 * MiB, 6 * MiB]
    before = disk.on_disk(0, SIZE)
    f = hub.save_batch(storage=disk.path, offsets=offs, lengths=lens, memory=reg,
                       mem_offsets=src, per_entry=True)
    err = f.exception(60)
    assert isinstance(err, P2PHubOSError) and err.errno == errno.EIO and "entry 0" in str(err), err
    assert [e.exception() is not None for e in f.entries] == [True, False, False]
    after = disk.on_disk(0, SIZE)
    assert after[8 * MiB:10 * MiB] == fresh[4 * MiB:6 * MiB]
    assert after[12 * MiB:14 * MiB] == fresh[6 * MiB:8 * MiB]
    # nothing outside the entries' ranges moved
    for a, b in ((4 * MiB, 8 * MiB), (10 * MiB, 12 * MiB), (14 * MiB, SIZE)):
        assert after[a:b] == before[a:b], f"bytes {a}..{b} changed"
    reg.close()


SCRIPT = r'''
import ctypes, json, mmap, os, sys, time
impl, path, plugin_dir = sys.argv[1], sys.argv[2], sys.argv[3]
if impl == "adapter":
    from p2phub.nixl._api import nixl_agent, nixl_agent_config
else:
    os.environ["NIXL_PLUGIN_DIR"] = plugin_dir
    from nixl_cu12._api import nixl_agent, nixl_agent_config
MiB = 1 << 20
a = nixl_agent("store", nixl_agent_config(backends=[]))
a.create_backend("POSIX")
m = mmap.mmap(-1, 8 * MiB)
m[:] = b"\xee" * (8 * MiB)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
a.register_memory([(base, 8 * MiB, 0, "")], "DRAM")
fd = os.open(path, os.O_RDWR | os.O_DIRECT)
a.register_memory([(0, 16 * MiB, fd, "")], "FILE")
out = {}
def run(op, pairs):
    loc = a.get_xfer_descs([(base + mo, n, 0) for mo, fo, n in pairs], "DRAM")
    rem = a.get_xfer_descs([(fo, n, fd) for mo, fo, n in pairs], "FILE")
    h = a.initialize_xfer(op, loc, rem, "store")
    try:
        st = a.transfer(h)
        while st == "PROC":
            time.sleep(0.001)
            st = a.check_xfer_state(h)
    except Exception as exc:
        st = "EXC:" + type(exc).__name__
    a.release_xfer_handle(h)
    return st
out["read_half_bad"] = run("READ", [(0, 0, 4 * MiB)])
out["read_good"] = run("READ", [(0, 4 * MiB, 2 * MiB)])
out["read_good_bytes"] = m[0:2 * MiB] == open(sys.argv[4], "rb").read()[4 * MiB:6 * MiB]
out["write_half_bad"] = run("WRITE", [(0, 0, 4 * MiB)])
print(json.dumps(out), flush=True)
os._exit(0)
'''


@pytest.mark.parametrize("impl", ["adapter", "plugin"])
def test_nixl_file_transfers_over_bad_sectors_fail(disk, impl, tmp_path) -> None:
    plugin = TOP / "p2phub" / "nixl" / "plugin" / "build" / "alias"
    if impl == "plugin":
        p = subprocess.run(["make", "-s", "-C", str(plugin.parent.parent), "aliases"],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        try:
            import nixl_cu12  # noqa: F401
        except ImportError as exc:
            pytest.fail(f"the pip nixl is not installed (tools/setup installs it): {exc}")
    script = tmp_path / "nixl_faults.py"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, str(script), impl, disk.path, str(plugin),
                        str(disk.backing)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, NIXL_LOG_LEVEL="ERROR"))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert lines, p.stdout + p.stderr
    out = json.loads(lines[-1])
    bad = ("ERR", "EXC:nixlBackendError")
    assert out["read_half_bad"] in bad, out
    assert out["write_half_bad"] in bad, out
    assert out["read_good"] == "DONE" and out["read_good_bytes"], out


# ---------------------------------------------------------------------------- a full disk
@pytest.fixture
def small_fs(tmp_path) -> Iterator[Path]:
    """An 8 MiB ext4 file system on a loop device: it fills up."""
    _sh("modprobe", "loop")
    img = tmp_path / "small.img"
    with open(img, "wb") as f:
        f.truncate(8 * MiB)
    _sh("mkfs.ext4", "-q", "-F", "-O", "^has_journal", str(img))
    loop = _sh("losetup", "--find", "--show", str(img))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _sh("mount", loop, str(mnt))
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)
    subprocess.run(["losetup", "-d", loop], capture_output=True)


@pytest.mark.parametrize("direct", [True, False], ids=["odirect", "buffered"])
def test_a_save_that_fills_the_disk_reports_exactly_what_did_not_land(hub, small_fs, direct) -> None:
    """16 entries of 1 MiB into a file on an 8 MiB file system: the ones that fail say ENOSPC
    (or EIO), and every entry reported done reads back whole from the disk."""
    m = mmap.mmap(-1, 16 * MiB)
    fresh = np.random.default_rng(5).integers(0, 256, 16 * MiB, np.uint8).tobytes()
    m[:] = fresh
    reg = hub.register(m)
    path = small_fs / "kv.bin"
    path.touch()
    offs = np.arange(16, dtype=np.int64) * MiB
    f = hub.save_batch(storage=str(path), offsets=offs, lengths=MiB, memory=reg,
                       mem_offsets=offs, per_entry=True, direct=direct)
    err = f.exception(120)
    failed = [i for i, e in enumerate(f.entries) if e.exception() is not None]
    assert isinstance(err, P2PHubOSError) and err.errno in (errno.ENOSPC, errno.EIO), err
    assert failed, "the file system took 16 MiB: not full"
    for i in failed:
        assert f.entries[i].exception().errno in (errno.ENOSPC, errno.EIO)
        assert int(f.results[i]) < 0
    os.sync()
    subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=False)
    data = path.read_bytes()
    for i in set(range(16)) - set(failed):
        assert data[i * MiB:(i + 1) * MiB] == fresh[i * MiB:(i + 1) * MiB], \
            f"entry {i} reported done but its bytes are not on disk"
    reg.close()


def test_a_file_truncated_under_a_load_never_reports_holes_as_done(hub, tmp_path) -> None:
    """A 64 MiB file cut to 8 MiB while 64 reads of 1 MiB run: an entry reported done holds
    the file's bytes; the others fail with EIO (the end moved before them)."""
    path = tmp_path / "cut.bin"
    content = np.random.default_rng(9).integers(0, 256, 64 * MiB, np.uint8)
    content.tofile(path)
    m = _mem(64 * MiB)
    reg = hub.register(m)
    offs = np.arange(64, dtype=np.int64)[::-1] * MiB      # the far end first
    f = hub.load_batch(storage=str(path), offsets=offs, lengths=MiB, memory=reg,
                       mem_offsets=offs, per_entry=True)
    os.truncate(path, 8 * MiB)
    f.exception(120)
    mem = np.frombuffer(m, np.uint8)
    done = [i for i, e in enumerate(f.entries) if e.exception() is None]
    for i, e in enumerate(f.entries):
        o = int(offs[i])
        if e.exception() is None:
            assert np.array_equal(mem[o:o + MiB], content[o:o + MiB]), f"entry {i} has holes"
        else:
            assert e.exception().errno == errno.EIO, e.exception()
    assert all(int(offs[i]) + MiB <= 64 * MiB for i in done)
    del mem
    reg.close()
