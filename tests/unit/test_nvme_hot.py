"""The NVMe hot path (p2phub/nvme/_hot.c) against a fake controller in host memory.

The fake reads the SQ up to the tail doorbell, posts completions (in order or
shuffled) with the phase tag and SQ head a controller would, and honours the
CQ head doorbell. No kernel module, no device.
"""

from __future__ import annotations

import random
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from p2phub.nvme import _build, prp, spec

pytestmark = pytest.mark.unit

hot = _build.load()
ffi, lib = hot.ffi, hot.lib


class FakeController:
    """The device side of one queue pair, in host memory."""

    def __init__(self, depth: int, ntrk: int | None = None, prp_stride: int = 1024) -> None:
        self.depth = depth
        self.sq = ffi.new("uint8_t[]", depth * 64)
        self.cq = ffi.new("uint8_t[]", depth * 16)
        self.db = ffi.new("uint32_t[]", 2)  # [0] SQ tail, [1] CQ head
        self.prp = ffi.new("uint8_t[]", (ntrk or depth - 1) * prp_stride)
        self.prp_dma = 0x7000_0000_0000
        self.qp = lib.p2h_qp_create(1, depth, ntrk or depth - 1, self.sq, self.cq, self.db,
                                    self.db + 1, self.prp, self.prp_dma, prp_stride)
        assert self.qp != ffi.NULL
        self.sq_head = 0
        self.cq_tail = 0
        self.phase = 1
        self.fetched: list[bytes] = []  # SQEs fetched, not yet completed
        self.seen: list[bytes] = []

    def close(self) -> None:
        lib.p2h_qp_destroy(self.qp)

    def fetch(self) -> int:
        """Consume SQEs up to the tail doorbell."""
        n = 0
        while self.sq_head != self.db[0]:
            e = bytes(ffi.buffer(self.sq + self.sq_head * 64, 64))
            self.fetched.append(e)
            self.seen.append(e)
            self.sq_head = (self.sq_head + 1) % self.depth
            n += 1
        return n

    def cq_free(self) -> int:
        used = (self.cq_tail - self.db[1]) % self.depth
        return self.depth - 1 - used

    def complete(self, k: int | None = None, *, shuffle: bool = False, status: int = 0,
                 cid: int | None = None, sqhd: int | None = None) -> int:
        """Post completions for up to k fetched commands."""
        if shuffle:
            random.shuffle(self.fetched)
        n = 0
        while self.fetched and (k is None or n < k) and self.cq_free() > 0:
            e = self.fetched.pop(0)
            c = cid if cid is not None else struct.unpack_from("<H", e, 2)[0]
            self.post(c, status=status, dw0=struct.unpack_from("<I", e, 40)[0],
                      sqhd=self.sq_head if sqhd is None else sqhd)
            n += 1
        return n

    def post(self, cid: int, *, status: int = 0, dw0: int = 0, sqhd: int | None = None) -> None:
        off = self.cq_tail * 16
        e = struct.pack("<IIHHHH", dw0, 0, self.sq_head if sqhd is None else sqhd, 1, cid,
                        (status << 1) | self.phase)
        # The phase tag goes in last, as a controller's would: struct.pack_into zeroes the whole
        # entry before it writes the fields, which on an odd lap briefly shows a phase-0 entry
        # with cid 0 to a host running on another thread.
        cq = ffi.buffer(self.cq)
        cq[off:off + 14] = e[:14]
        cq[off + 14:off + 16] = e[14:]
        self.cq_tail += 1
        if self.cq_tail == self.depth:
            self.cq_tail = 0
            self.phase ^= 1


def raw(n: int, start: int = 0) -> tuple[object, object]:
    cmds = ffi.new("uint32_t[]", 16 * n)
    for i in range(n):
        cmds[16 * i] = spec.ADM_IDENTIFY
        cmds[16 * i + 10] = start + i  # echoed back as DW0 by the fake
    tags = ffi.new("uint64_t[]", [start + i for i in range(n)])
    return cmds, tags


def reap_all(f: FakeController) -> list:
    out = ffi.new("struct p2h_cpl[]", 64)
    got = []
    while True:
        n = lib.p2h_reap(f.qp, out, 64)
        got += [(out[i].tag, out[i].status, out[i].cid, out[i].dw0) for i in range(n)]
        if n < 64:
            return got


def test_wraparound_many_times_in_order() -> None:
    f = FakeController(depth=8)
    cids = ffi.new("uint16_t[]", 64)
    done = 0
    total = 5000
    next_tag = 0
    while done < total:
        k = min(5, total - next_tag)
        if k:
            cmds, tags = raw(k, next_tag)
            got = lib.p2h_submit_raw(f.qp, cmds, tags, k, cids)
            next_tag += got
        f.fetch()
        f.complete()
        cpl = reap_all(f)
        for tag, status, _cid, dw0 in cpl:
            assert status == 0 and dw0 == tag
        assert [c[0] for c in cpl] == list(range(done, done + len(cpl)))
        done += len(cpl)
    assert f.qp.completed == total and f.qp.stale_cqes == 0
    # 5000 commands through a ring of 8: the phase flipped hundreds of times.
    assert f.qp.cq_head == total % 8 and f.qp.phase == (1 if (total // 8) % 2 == 0 else 0)
    f.close()


def test_out_of_order_completion_cids_independent_of_slots() -> None:
    random.seed(7)
    f = FakeController(depth=16)
    cids = ffi.new("uint16_t[]", 64)
    outstanding: dict[int, int] = {}
    seen_tags: set[int] = set()
    tag = 0
    for _round in range(400):
        k = random.randint(0, 6)
        cmds, tags = raw(k, tag)
        got = lib.p2h_submit_raw(f.qp, cmds, tags, k, cids)
        for i in range(got):
            assert cids[i] not in outstanding, "a cid is reused while outstanding"
            assert cids[i] != 0xFFFF
            outstanding[cids[i]] = tag + i
        tag += got
        f.fetch()
        f.complete(random.randint(0, 4), shuffle=True)
        for t, status, cid, _dw0 in reap_all(f):
            assert outstanding.pop(cid) == t
            assert t not in seen_tags
            seen_tags.add(t)
    f.complete()
    for t, _s, cid, _d in reap_all(f):
        assert outstanding.pop(cid) == t
    assert not outstanding
    # Out-of-order completion means the cid is not the SQ slot.
    slots = [struct.unpack_from("<H", e, 2)[0] & 0xFFF for e in f.seen]
    assert any(s != i % 16 for i, s in enumerate(slots))
    f.close()


def test_queue_full_is_bounded_by_sq_head_from_cqe() -> None:
    f = FakeController(depth=8, ntrk=7)
    cids = ffi.new("uint16_t[]", 16)
    cmds, tags = raw(10)
    assert lib.p2h_submit_raw(f.qp, cmds, tags, 10, cids) == 7  # depth - 1
    assert f.qp.doorbells == 1 and f.db[0] == 7  # one doorbell for the batch
    f.fetch()
    # The controller completes 2 but reports it has fetched nothing beyond slot 2.
    f.complete(2, sqhd=2)
    assert len(reap_all(f)) == 2
    assert f.qp.sq_head == 2
    cmds, tags = raw(10, 100)
    # Two trackers are free and SQ head 2 frees two slots.
    assert lib.p2h_submit_raw(f.qp, cmds, tags, 10, cids) == 2
    f.close()


def test_stale_and_duplicate_completions_are_dropped() -> None:
    f = FakeController(depth=8)
    cids = ffi.new("uint16_t[]", 4)
    cmds, tags = raw(1)
    assert lib.p2h_submit_raw(f.qp, cmds, tags, 1, cids) == 1
    f.fetch()
    real = cids[0]
    f.post(real ^ 0x1000)  # right tracker, wrong generation
    f.post(0x0005)  # a tracker that is not busy
    f.post(real)
    f.post(real)  # duplicate
    got = reap_all(f)
    assert [(t, c) for t, _s, c, _d in got] == [(0, real)]
    assert f.qp.stale_cqes == 3
    assert f.db[1] == 4  # all four entries consumed, one CQ doorbell
    f.close()


def test_error_status_and_outstanding_and_forget() -> None:
    f = FakeController(depth=8)
    cids = ffi.new("uint16_t[]", 4)
    cmds, tags = raw(3)
    assert lib.p2h_submit_raw(f.qp, cmds, tags, 3, cids) == 3
    f.fetch()
    f.complete(1, status=0x0080 | spec.STATUS_DNR)  # LBA out of range, DNR
    (t, status, _cid, _dw0), = reap_all(f)
    assert status == 0x4080
    assert "LBA Out of Range" in spec.status_str(status) and "DNR" in spec.status_str(status)
    n = 8
    ocids, otags, ages = ffi.new("uint16_t[]", n), ffi.new("uint64_t[]", n), ffi.new("uint64_t[]", n)
    assert lib.p2h_outstanding(f.qp, 0, ocids, otags, ages, n) == 2
    assert lib.p2h_outstanding(f.qp, 3600 * 10**9, ocids, otags, ages, n) == 0
    assert lib.p2h_forget(f.qp, cids[1]) == 0
    assert lib.p2h_forget(f.qp, cids[1]) != 0
    assert lib.p2h_outstanding(f.qp, 0, ocids, otags, ages, n) == 1
    lib.p2h_qp_reset(f.qp)
    assert lib.p2h_outstanding(f.qp, 0, ocids, otags, ages, n) == 0
    f.close()


@pytest.mark.parametrize("seed", range(20))
def test_prp_encoding_matches_reference(seed: int) -> None:
    rnd = random.Random(seed)
    f = FakeController(depth=8, prp_stride=1024)
    npages = 300
    pages = [0x1_0000_0000 + rnd.randrange(1 << 20) * spec.PAGE for _ in range(npages)]
    cpages = ffi.new("uint64_t[]", pages)
    io = ffi.new("struct p2h_io[]", 1)
    io[0].opc = spec.OPC_READ
    io[0].nsid = 1
    io[0].slba = 0x1_2345_6789
    io[0].pages = cpages
    io[0].npages = npages
    offset = rnd.randrange(0, 40 * spec.PAGE) & ~3
    nbytes = rnd.choice([512, 4096, 8192, 12288, 65536, 128 * 4096]) - rnd.choice([0, 0, 4])
    io[0].buf_off = offset
    io[0].nbytes = nbytes
    io[0].nlb = 8
    cids = ffi.new("uint16_t[]", 1)
    bad = ffi.new("int *")
    assert lib.p2h_submit_io(f.qp, io, 1, cids, bad) == 1
    f.fetch()
    e = f.seen[0]
    dw = struct.unpack("<16I", e)
    prp1 = dw[6] | dw[7] << 32
    prp2 = dw[8] | dw[9] << 32
    idx = cids[0] & 0xFFF
    list_dma = f.prp_dma + idx * 1024
    r1, r2, entries = prp.build_prps(pages, offset, nbytes, list_dma)
    assert (prp1, prp2) == (r1, r2)
    if entries:
        got = struct.unpack_from(f"<{len(entries)}Q", ffi.buffer(f.prp), idx * 1024)
        assert list(got) == entries
    assert dw[0] & 0xFF == spec.OPC_READ and dw[1] == 1
    assert dw[10] | dw[11] << 32 == 0x1_2345_6789 and dw[12] & 0xFFFF == 7
    f.close()


def test_prp_range_outside_page_list_is_refused() -> None:
    f = FakeController(depth=8)
    cpages = ffi.new("uint64_t[]", [0x1000, 0x2000])
    io = ffi.new("struct p2h_io[]", 1)
    io[0].opc = spec.OPC_WRITE
    io[0].pages = cpages
    io[0].npages = 2
    io[0].buf_off = 4096
    io[0].nbytes = 8192  # runs past the second page
    io[0].nlb = 16
    cids = ffi.new("uint16_t[]", 1)
    bad = ffi.new("int *")
    assert lib.p2h_submit_io(f.qp, io, 1, cids, bad) < 0
    assert bad[0] == 0 and f.qp.submitted == 0 and f.db[0] == 0
    f.close()


def test_split_by_mdts() -> None:
    assert prp.split(10, 1 << 20, 0, 512, 512 << 10) == [(10, 512 << 10, 0), (10 + 1024, 512 << 10, 512 << 10)]
    pieces = prp.split(0, 3 * 4096 + 4096, 100 * 4, 4096, 8192)
    assert [p[1] for p in pieces] == [8192, 8192]
    assert sum(p[1] for p in pieces) == 4 * 4096


def test_status_strings() -> None:
    assert spec.status_str(0x0001) == "Invalid Command Opcode (sct 0x0, sc 0x01)"
    assert "Invalid Queue Identifier" in spec.status_str(0x0101)
    assert spec.status_fields(0x4281) == (2, 0x81, True, False)


# --------------------------------------------------------------------------- the gate and the pump


def _ios(n: int, slot: int, gen: int, pages) -> object:
    io = ffi.new("struct p2h_io[]", n)
    for i in range(n):
        io[i].opc = spec.OPC_READ
        io[i].nsid = 1
        io[i].slba = 8 * i
        io[i].nlb = 8
        io[i].nbytes = 4096
        io[i].buf_off = 4096 * (i % 4)
        io[i].pages = pages
        io[i].npages = 4
        io[i].tag = 100 + i
        io[i].slot = slot
        io[i].gen = gen
    return io


def test_gate_refuses_a_stale_generation_before_the_doorbell_and_gives_everything_back() -> None:
    f = FakeController(depth=16)
    st = ffi.new("struct p2h_status *")
    st.reg_gen[3] = 42
    f.qp.st = st
    pages = ffi.new("uint64_t[]", [0x1000 * (i + 1) for i in range(4)])
    cids, bad = ffi.new("uint16_t[]", 8), ffi.new("int *")
    ios = _ios(4, 3, 42, pages)
    ios[2].gen = 41  # one request of the batch carries an old generation
    nfree, tail = f.qp.nfree, f.qp.sq_tail
    assert lib.p2h_submit_io(f.qp, ios, 4, cids, bad) == -116  # ESTALE
    assert bad[0] == 2 and f.db[0] == 0 and f.qp.doorbells == 0 and f.qp.submitted == 0
    assert (f.qp.nfree, f.qp.sq_tail, f.qp.refused) == (nfree, tail, 1)
    ios[2].gen = 42
    assert lib.p2h_submit_io(f.qp, ios, 4, cids, bad) == 4 and f.db[0] == 4
    st.reg_gen[3] = 0  # revoked: the slot's word reads 0
    assert lib.p2h_submit_io(f.qp, _ios(1, 3, 42, pages), 1, cids, bad) == -116
    ios = _ios(2, 0xFFFFFFFF, 0, pages)  # DMA buffers have no slot: unaffected
    assert lib.p2h_submit_io(f.qp, ios, 2, cids, bad) == 2
    st.state = 1  # FENCED: nothing is rung at all, admin commands included
    assert lib.p2h_submit_io(f.qp, ios, 2, cids, bad) == -5
    cmds, tags = raw(1)
    assert lib.p2h_submit_raw(f.qp, cmds, tags, 1, cids) == -5
    assert f.db[0] == 6
    f.fetch()
    f.complete()
    st.state = 2  # REMOVING: reaping does not touch the CQ doorbell either
    assert len(reap_all(f)) == 6 and f.db[1] == 0
    f.qp.st = ffi.NULL
    f.close()


def test_pump_runs_batches_and_hands_back_single_commands() -> None:
    f = FakeController(depth=32)
    pages = ffi.new("uint64_t[]", [0x1000 * (i + 1) for i in range(4)])
    n = 100
    ios = _ios(n, 0xFFFFFFFF, 0, pages)
    status = ffi.new("uint16_t[]", n)
    b = ffi.new("struct p2h_batch *")
    b.ios, b.status, b.n, b.qd = ios, status, n, 7
    assert lib.p2h_batch_attach(f.qp, b) == 0
    cmds, tags = raw(1, 5000)
    cids = ffi.new("uint16_t[]", 1)
    assert lib.p2h_submit_raw(f.qp, cmds, tags, 1, cids) == 1
    out = ffi.new("struct p2h_cpl[]", 16)
    singles = []
    while b.done < n:
        got = lib.p2h_pump(f.qp, out, 16, 0)
        assert b.next - b.done <= 7  # the batch's qd bounds it
        singles += [out[i].tag for i in range(got)]
        f.fetch()
        f.complete(3, shuffle=True)
    lib.p2h_batch_detach(f.qp, b)
    assert singles == [5000] and b.errors == 0 and list(status) == [0] * n and f.qp.nbatch == 0
    f.close()


def test_batch_run_generates_random_requests_in_the_one_pump() -> None:
    f = FakeController(depth=64)
    pages = ffi.new("uint64_t[]", [0x1000 * (i + 1) for i in range(8)])
    tmpl = ffi.new("struct p2h_io *")
    tmpl.opc, tmpl.nsid, tmpl.nlb, tmpl.nbytes = spec.OPC_READ, 1, 8, 4096
    tmpl.pages, tmpl.npages, tmpl.slot = pages, 8, 0xFFFFFFFF
    b = ffi.new("struct p2h_batch *")
    b.tmpl, b.span_blocks, b.nslots, b.n, b.qd = tmpl, 1 << 20, 8, 300, 16
    import threading

    stop = threading.Event()

    def device() -> None:
        while not stop.is_set():
            f.fetch()
            f.complete()

    t = threading.Thread(target=device)
    t.start()
    try:
        assert lib.p2h_batch_run(f.qp, b, 60 * 10**9) == 300
    finally:
        stop.set()
        t.join()
    lbas = {struct.unpack_from("<Q", e, 40)[0] for e in f.seen}
    assert len(lbas) > 250 and all(lba % 8 == 0 and lba < 1 << 20 for lba in lbas)
    f.close()


def test_status_page_layout_matches_the_uapi() -> None:
    """struct p2h_status (what the hot path reads) is struct p2phub_nvme_status (what the kernel writes);
    test_uapi.py holds uapi.NvmeStatus to the C header."""
    import ctypes

    from p2phub import uapi

    assert ffi.sizeof("struct p2h_status") == ctypes.sizeof(uapi.NvmeStatus)
    for name in ("abi", "state", "events", "reg_gen"):
        assert ffi.offsetof("struct p2h_status", name) == getattr(uapi.NvmeStatus, name).offset, name
    assert len(ffi.new("struct p2h_status *").reg_gen) == uapi.NVME_MAX_MAPS


HOT_C = Path(_build.__file__).with_name("_hot.c")


def _barrier_bodies(tmp_path: Path, arch_macro: str) -> dict[str, str]:
    """The bodies p2h_wmb()/p2h_rmb() get when _hot.c is compiled for another architecture.

    No cross compiler is needed: the preprocessor picks the barrier, the system headers are
    replaced by empty ones (the barriers do not depend on them)."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for name in ("errno.h", "stdint.h", "stdlib.h", "string.h", "time.h"):
        (stubs / name).write_text("")
    out = subprocess.run(["gcc", "-E", "-P", "-nostdinc", "-I", str(stubs), "-I", str(HOT_C.parent),
                          "-U__x86_64__", "-U__i386__", f"-D{arch_macro}", str(HOT_C)],
                         check=True, capture_output=True, text=True).stdout
    bodies = {}
    for fn in ("p2h_wmb", "p2h_rmb"):
        m = re.search(rf"\b{fn}\(void\)\s*\{{(.*?)\}}", out, re.S)
        assert m, f"{fn} is not defined for {arch_macro}"
        bodies[fn] = " ".join(m.group(1).split())
    return bodies


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for the preprocessor")
def test_arm64_doorbell_barriers_order_against_the_device(tmp_path: Path) -> None:
    """M5: on arm64 (Grace, GH200) the SQE stores must be ordered before the MMIO doorbell with
    the kernel's wmb() (dsb st) and the CQE reads after the phase tag with dma_rmb() (dmb oshld);
    a C11 fence is an inner-shareable dmb, which does not order against a device. This host is
    x86, so what is checked is what the arm64 build would execute."""
    bodies = _barrier_bodies(tmp_path, "__aarch64__")
    assert '"dsb st"' in bodies["p2h_wmb"], bodies["p2h_wmb"]
    assert '"dmb oshld"' in bodies["p2h_rmb"], bodies["p2h_rmb"]
