"""A fake NVMe controller and controller fd, in host memory, for the engine's unit tests.

:class:`FakeControllerFile` has the interface of p2phub.nvme.kdev.ControllerFile
(BAR0 registers, status page, DMA memory, MAP_REG/UNMAP_REG, RESUME, REQ_SET) and
runs a device thread that does what a controller does with them: CC.EN/CSTS.RDY,
the admin queue, Identify, Set Features, Create I/O CQ/SQ, Abort, and reads and
writes through PRPs into DMA memory or registrations. Test controls: hold
commands at an LBA, revoke a registration (the kernel's fence), remove the
device, set CSTS.CFS or all ones, refuse to disable.
"""

from __future__ import annotations

import errno
import itertools
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from p2phub import uapi
from p2phub.errors import P2PHubOSError, RevokedError
from p2phub.memory import Memory, MemoryInfo, MemoryShare, MemPath
from p2phub.nvme import spec
from p2phub.nvme.kdev import DmaMemory, RegMapInfo
from p2phub.ordering import for_registration
from p2phub.policy import PathPolicy

PAGE = 4096


class _Unmappable:
    def close(self) -> None:
        pass


@dataclass
class FakeNamespace:
    blocks: int = 4096
    lbads: int = 9
    ms: int = 0
    flbas: int = 0
    dps: int = 0
    data: bytearray = field(default_factory=bytearray)

    def __post_init__(self) -> None:
        if not self.data:
            self.data = bytearray(self.blocks << self.lbads)


class FakeRegistration(Memory):
    """The memory contract over host memory, as p2phub.ko would pin it: a handle valid in the
    fake controller's /dev/p2phub (``device_file``)."""

    _handles = itertools.count(1)
    mode = "p2p"
    source = None
    gpu = None

    def __init__(self, hub: "FakeHub", size: int) -> None:
        self._owner = hub
        self._share = MemoryShare()
        self._handle = next(self._handles)
        self.length = size
        self.what = f"fake registration {self._handle}"
        self.mem = bytearray(size)

    @property
    def handle(self) -> int:
        return self._handle

    @property
    def device_file(self) -> Any:
        return self._owner.device

    def info(self) -> MemoryInfo:
        return MemoryInfo(self.length, self.mode)

    @property
    def ordering(self) -> None:  # type: ignore[override]
        """The engine's tests run without the ordering layer (test_ordering.py and the lab's
        test_ordering.py cover NVMe requests ordered): requests here may overlap freely."""
        return None

    def close(self, force: bool = False, timeout: float | None = None) -> None:
        self._closed = True

    def __repr__(self) -> str:
        return f"<FakeRegistration {self.handle} {self.length} bytes>"


class FakeHub:
    """The owner of fake registrations: the real path policy and ordering layer."""

    strict_ordering = False
    foreign = False

    def __init__(self, device: object) -> None:
        from p2phub.batch import Engines
        self.device = device
        self.policy = PathPolicy()
        self.engines = Engines()   # what hub.load_batch runs on; closed by the test

    def register(self, size: int) -> FakeRegistration:
        return FakeRegistration(self, size)

    def _ordering_for(self, mem: Memory) -> Any:
        return for_registration(mem, strict=self.strict_ordering)

    def _choose_path(self, mem: Memory, device: Any) -> MemPath:
        return self.policy.choose(mem, device)

    def _check_owner(self) -> None:
        pass


class FakeControllerFile:
    """The controller fd and the controller behind it."""

    def __init__(self, hot: Any, *, namespaces: dict[int, FakeNamespace] | None = None,
                 mqes: int = 255, mdts: int = 5, queues: int = 4) -> None:
        self.hot = hot
        ffi = hot.ffi
        self.bdf = "0000:00:1f.0"
        self.device = object()
        self.fd = 99
        self.nr_irqs = 0
        self.bar0_size = self.bar_len = 0x4000
        self._regs = ffi.new("uint32_t[]", self.bar_len // 4)
        self.regs = self._regs
        self._status = ffi.new("struct p2h_status *")
        self._status.abi = uapi.NVME_STATUS_ABI
        self.status = self._status
        self.ns = namespaces if namespaces is not None else {1: FakeNamespace()}
        self.mdts = mdts
        self.max_queues = queues
        cap = (mqes & 0xFFFF) | (2 << 24) | (1 << 37)  # MQES, TO = 1 s, DSTRD 0, NVM command set
        self._regs[0], self._regs[1] = cap & 0xFFFFFFFF, cap >> 32
        self._regs[spec.REG_VS // 4] = 0x10400
        self._next_dma = itertools.count(0x1_0000_0000, 0x100_0000)
        self._mem: list[tuple[int, int, Any]] = []   # (dma base, size, writable buffer)
        self._mems: list[DmaMemory] = []
        self.maps: dict[int, tuple[int, int, FakeRegistration]] = {}  # handle -> (slot, gen, reg)
        self.revoked_handles: set[int] = set()
        self._gen = itertools.count(7)
        self.sqs: dict[int, dict] = {}
        self.cqs: dict[int, dict] = {}
        self.hold_lbas: set[int] = set()
        self.held: dict[tuple[int, int], tuple[int, int]] = {}  # (qid, cid) -> (sqid for completion, cid)
        self.aborts_seen = 0
        self.bme = True
        self.stuck_enabled = False   # CC.EN = 0 does not bring RDY down
        self.refuse_abort = False    # answer every Abort "not aborted" (as QEMU 7.2 does)
        self.log: list[str] = []
        self.req_efd = -1
        self.closed = False
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the ControllerFile interface
    def alloc_dma(self, size: int, name: str) -> DmaMemory:
        ffi = self.hot.ffi
        buf = ffi.new("uint8_t[]", size)
        base = next(self._next_dma)
        self._mem.append((base, size, ffi.buffer(buf)))
        mem = DmaMemory(len(self._mems), size, base, ffi.cast("void *", buf), memoryview(ffi.buffer(buf)),
                        _Unmappable(), buf)
        self._mems.append(mem)
        return mem

    def map_reg(self, handle: int, addrs: Any, first: int, count: int, page_size: int) -> RegMapInfo:
        self.log.append(f"map {handle}")
        reg = self._reg_by_handle.get(handle) if hasattr(self, "_reg_by_handle") else None
        if reg is None:
            raise P2PHubOSError(errno.ENOENT, f"P2PHUB_NVME_MAP_REG handle {handle}")
        if handle in self.revoked_handles:
            raise RevokedError(f"registration {handle} was revoked (ESTALE)")
        if handle not in self.maps:
            if self._status.state:
                raise P2PHubOSError(errno.EIO, "P2PHUB_NVME_MAP_REG")
            slot = next(i for i in range(uapi.NVME_MAX_MAPS)
                        if i not in {s for s, _g, _r in self.maps.values()})
            gen = next(self._gen)
            base = next(self._next_dma)
            self._mem.append((base, reg.length, reg.mem))
            self.maps[handle] = (slot, gen, reg)
            reg._fake_base = base  # type: ignore[attr-defined]
            self._status.reg_gen[slot] = gen
        slot, gen, reg = self.maps[handle]
        if self._status.reg_gen[slot] != gen:
            raise RevokedError(f"registration {handle} was revoked")
        for i in range(count):
            addrs[i] = reg._fake_base + (first + i) * page_size  # type: ignore[attr-defined]
        return RegMapInfo(reg.length // page_size, gen, slot)

    def unmap_reg(self, handle: int) -> None:
        self.log.append(f"unmap {handle}")
        if handle not in self.maps:
            raise P2PHubOSError(errno.ENOENT, f"P2PHUB_NVME_UNMAP_REG handle {handle}")
        slot, _gen, _reg = self.maps.pop(handle)
        self._status.reg_gen[slot] = 0

    def resume(self) -> None:
        self.log.append("resume")
        if self._regs[spec.REG_CC // 4] & 1 or self._regs[spec.REG_CSTS // 4] & 1:
            raise P2PHubOSError(errno.EBUSY, "P2PHUB_NVME_RESUME")
        if self._status.state & uapi.NVME_ST_REMOVING:
            raise P2PHubOSError(errno.ENODEV, "P2PHUB_NVME_RESUME")
        self._status.state &= ~(uapi.NVME_ST_FENCED | uapi.NVME_ST_ERROR)
        self.bme = True

    def irq_set(self, vector: int, eventfd: int) -> None:
        pass

    def req_set(self, eventfd: int) -> None:
        self.req_efd = eventfd

    def close(self) -> None:
        self.log.append("close")
        self.closed = True
        self.fd = -1
        self.bme = False
        self.regs = None
        self.status = None
        self.maps.clear()
        self._stop.set()

    # ------------------------------------------------------------ test controls
    def add_registration(self, reg: FakeRegistration) -> None:
        if not hasattr(self, "_reg_by_handle"):
            self._reg_by_handle: dict[int, FakeRegistration] = {}
        self._reg_by_handle[reg.handle] = reg

    def revoke(self, handle: int, *, fence: bool = True) -> None:
        """What the kernel does when a held registration's owner takes it back."""
        slot, _gen, _reg = self.maps[handle]
        self.revoked_handles.add(handle)
        if fence:
            self.bme = False
            self._status.state |= uapi.NVME_ST_FENCED
        self._status.reg_gen[slot] = 0
        self._status.events += 1
        if self.req_efd >= 0 and fence:
            os.eventfd_write(self.req_efd, 1)  # the kernel signals every change of state

    def request_removal(self) -> None:
        self._status.state |= uapi.NVME_ST_REMOVING
        if self.req_efd >= 0:
            os.eventfd_write(self.req_efd, 1)

    def set_csts(self, value: int) -> None:
        self._regs[spec.REG_CSTS // 4] = value

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    # ------------------------------------------------------------ the device
    def _buf(self, addr: int, n: int) -> tuple[Any, int]:
        for base, size, buf in self._mem:
            if base <= addr and addr + n <= base + size:
                return buf, addr - base
        raise AssertionError(f"fake device: DMA to unmapped address 0x{addr:x} (+{n})")

    def _read(self, addr: int, n: int) -> bytes:
        buf, off = self._buf(addr, n)
        return bytes(buf[off:off + n])

    def _write(self, addr: int, data: bytes) -> None:
        buf, off = self._buf(addr, len(data))
        buf[off:off + len(data)] = data

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as exc:  # noqa: BLE001 - surfaced through the log
                self.log.append(f"device error: {exc!r}")
                time.sleep(0.01)
            time.sleep(0.0002)

    def _step(self) -> None:
        regs = self._regs
        cc = regs[spec.REG_CC // 4]
        csts = regs[spec.REG_CSTS // 4]
        if csts == 0xFFFFFFFF:
            return
        if cc & 1 and not csts & 1:
            aqa = regs[spec.REG_AQA // 4]
            asq = regs[spec.REG_ASQ // 4] | regs[spec.REG_ASQ // 4 + 1] << 32
            acq = regs[spec.REG_ACQ // 4] | regs[spec.REG_ACQ // 4 + 1] << 32
            self.sqs = {0: {"base": asq, "depth": (aqa & 0xFFF) + 1, "head": 0, "cq": 0}}
            self.cqs = {0: {"base": acq, "depth": ((aqa >> 16) & 0xFFF) + 1, "tail": 0, "phase": 1}}
            self.held.clear()
            regs[spec.REG_CSTS // 4] = csts | 1
            return
        if not cc & 1 and csts & 1:
            if not self.stuck_enabled:
                self.sqs, self.cqs = {}, {}
                self.held.clear()
                for i in range(0x1000 // 4, self.bar_len // 4):
                    regs[i] = 0  # a reset forgets the doorbells
                regs[spec.REG_CSTS // 4] = csts & ~1 & ~spec.CSTS_CFS  # a reset clears CFS
            return
        if not csts & 1 or not self.bme or csts & spec.CSTS_CFS:
            return
        for qid, sq in list(self.sqs.items()):
            tail = regs[(0x1000 + 8 * qid) // 4]
            while sq["head"] != tail and self.bme:
                e = self._read(sq["base"] + sq["head"] * 64, 64)
                sq["head"] = (sq["head"] + 1) % sq["depth"]
                self._execute(qid, sq, e)

    def _post(self, cqid: int, sqid: int, cid: int, status: int = 0, dw0: int = 0) -> None:
        cq = self.cqs[cqid]
        sqhd = self.sqs[sqid]["head"] if sqid in self.sqs else 0
        entry = struct.pack("<IIHHHH", dw0, 0, sqhd, sqid, cid, (status << 1) | cq["phase"])
        self._write(cq["base"] + cq["tail"] * 16, entry[:14])
        self._write(cq["base"] + cq["tail"] * 16 + 14, entry[14:])  # phase last
        cq["tail"] += 1
        if cq["tail"] == cq["depth"]:
            cq["tail"] = 0
            cq["phase"] ^= 1

    def _execute(self, qid: int, sq: dict, e: bytes) -> None:
        dw = struct.unpack("<16I", e)
        opc, cid = dw[0] & 0xFF, dw[0] >> 16
        nsid, prp1, prp2 = dw[1], dw[6] | dw[7] << 32, dw[8] | dw[9] << 32
        cq = sq["cq"]
        if qid == 0:
            self._admin(cid, opc, nsid, prp1, dw)
            return
        ns = self.ns.get(nsid)
        if ns is None:
            self._post(cq, qid, cid, 0x0B)
            return
        slba, nlb = dw[10] | dw[11] << 32, (dw[12] & 0xFFFF) + 1
        if opc in (spec.OPC_READ, spec.OPC_WRITE) and slba in self.hold_lbas:
            self.held[(qid, cid)] = (cq, cid)
            return
        if opc == spec.OPC_FLUSH:
            self._post(cq, qid, cid)
            return
        if slba + nlb > ns.blocks:
            self._post(cq, qid, cid, 0x80)
            return
        lb = 1 << ns.lbads
        if opc == spec.OPC_WRITE_ZEROES:
            ns.data[slba * lb:(slba + nlb) * lb] = bytes(nlb * lb)
            self._post(cq, qid, cid)
            return
        n = nlb * lb
        pages = self._prps(prp1, prp2, n)
        off = slba * lb
        for addr, k in pages:
            if opc == spec.OPC_READ:
                self._write(addr, bytes(ns.data[off:off + k]))
            else:
                ns.data[off:off + k] = self._read(addr, k)
            off += k
        self._post(cq, qid, cid)

    def _prps(self, prp1: int, prp2: int, n: int) -> list[tuple[int, int]]:
        first = min(n, PAGE - prp1 % PAGE)
        out = [(prp1, first)]
        left = n - first
        if left <= 0:
            return out
        if left <= PAGE:
            return out + [(prp2, left)]
        count = (left + PAGE - 1) // PAGE
        entries = struct.unpack(f"<{count}Q", self._read(prp2, 8 * count))
        for a in entries:
            out.append((a, min(PAGE, left)))
            left -= PAGE
        return out

    def _admin(self, cid: int, opc: int, nsid: int, prp1: int, dw: tuple) -> None:
        cdw10, cdw11 = dw[10], dw[11]
        if opc == spec.ADM_IDENTIFY:
            page = bytearray(PAGE)
            cns = cdw10 & 0xFF
            if cns == spec.CNS_CONTROLLER:
                struct.pack_into("<H", page, 0, 0x1B36)
                page[4:24] = b"FAKE0001".ljust(20)
                page[24:64] = b"p2phub fake controller".ljust(40)
                page[77] = self.mdts
                struct.pack_into("<I", page, 516, max(self.ns) if self.ns else 0)
            elif cns == spec.CNS_ACTIVE_NSIDS:
                for i, k in enumerate(sorted(self.ns)):
                    struct.pack_into("<I", page, 4 * i, k)
            elif cns == spec.CNS_NAMESPACE:
                ns = self.ns.get(nsid)
                if ns is not None:
                    struct.pack_into("<QQQ", page, 0, ns.blocks, ns.blocks, 0)
                    page[26] = ns.flbas
                    page[29] = ns.dps
                    fmt = (ns.flbas & 0xF) | (((ns.flbas >> 5) & 3) << 4)
                    struct.pack_into("<HBB", page, 128 + 4 * fmt, ns.ms, ns.lbads, 0)
            self._write(prp1, bytes(page))
            self._post(0, 0, cid)
        elif opc == spec.ADM_SET_FEATURES:
            n = self.max_queues - 1
            self._post(0, 0, cid, dw0=n | n << 16)
        elif opc == spec.ADM_CREATE_CQ:
            qid = cdw10 & 0xFFFF
            self.cqs[qid] = {"base": prp1, "depth": (cdw10 >> 16) + 1, "tail": 0, "phase": 1}
            self._post(0, 0, cid)
        elif opc == spec.ADM_CREATE_SQ:
            qid = cdw10 & 0xFFFF
            self.sqs[qid] = {"base": prp1, "depth": (cdw10 >> 16) + 1, "head": 0, "cq": cdw11 >> 16}
            self._post(0, 0, cid)
        elif opc == spec.ADM_ABORT:
            self.aborts_seen += 1
            key = (cdw10 & 0xFFFF, cdw10 >> 16)
            held = None if self.refuse_abort else self.held.pop(key, None)
            if held is not None:
                self._post(held[0], key[0], held[1], 0x07)  # Command Abort Requested
                self._post(0, 0, cid, dw0=0)
            else:
                self._post(0, 0, cid, dw0=1)  # not aborted
        else:
            self._post(0, 0, cid, 0x01)  # Invalid Command Opcode
