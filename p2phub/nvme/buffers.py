"""What the controller may DMA to: its own DMA buffers, and registrations it holds.

A registration is used by a controller through a :class:`RegMapping`:
``P2PHUB_NVME_MAP_REG`` on the controller fd holds it for the controller (so
UNREGISTER fails with EBUSY while held) and gives its 4 KiB DMA addresses,
its status-page slot and its generation. Every command that references it
carries (slot, generation); the hot path compares them with the status page
before each doorbell. The mapping counts the commands in flight on it and is
released (``P2PHUB_NVME_UNMAP_REG``) only when that count is 0:
:meth:`Mappings.quiesce` is what ``Registration.close()`` / ``Hub.close()``
call (through :func:`p2phub.nvme.quiesce_registration`).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from .. import uapi
from .._resource import Resource
from ..errors import P2PHubError, RevokedError, UsageError
from ..memory import Memory
from . import prp, spec
from .errors import RegistrationRevokedError
from .kdev import DmaMemory

if TYPE_CHECKING:
    from .kdev import ControllerFile

NO_SLOT = 0xFFFFFFFF


class DmaBuffer(Resource):
    """DMA-coherent host memory made by p2phub.ko for this controller.

    Usable wherever a registration is: ``ns.read(buf, ...)``. ``view`` is a
    writable memoryview of it.
    """

    def __init__(self, mem: DmaMemory, name: str, owner: object, hot: Any) -> None:
        self._mem = mem
        self.owner = owner
        self.name = name
        self.size = mem.size
        self.dma_addr = mem.dma_addr
        self.cptr = mem.cptr
        self.view = mem.view
        self._hot = hot
        self._pages: prp.PageList | None = None

    @property
    def nbytes(self) -> int:
        return self.size

    def page_list(self) -> prp.PageList:
        if self._pages is None:
            n = self.size // spec.PAGE
            addrs = self._hot.ffi.new("uint64_t[]", [self.dma_addr + i * spec.PAGE for i in range(n)])
            self._pages = prp.PageList(addrs, n, self.size, owner=self, name=f"DMA buffer {self.name}")
        return self._pages

    def _close(self) -> None:
        """Unmap; the memory itself is freed when the controller closes."""
        self._mem.close()

    @property
    def closed(self) -> bool:
        return self._closed or self._mem.closed  # the controller's close unmaps it too


class RegMapping:
    """One registration held by one controller: its page list, slot, generation and in-flight count."""

    def __init__(self, reg: Memory, pages: prp.PageList, slot: int, generation: int) -> None:
        self.reg = reg
        self.handle = int(reg.handle)
        self.pages = pages
        self.slot = slot
        self.generation = generation
        self.inflight = 0
        # guards inflight; nobody sleeps on it (Mappings.quiesce polls, driving the queues)
        self.lock = threading.Lock()
        self.unmapped = False
        # same-sized batches' command templates by (opcode, nsid, bytes): they name this
        # mapping's pages, slot and generation, so they live as long as it does
        self.templates: dict[tuple[int, int, int], Any] = {}

    def hold(self, count: int = 1) -> None:
        with self.lock:
            self.inflight += count

    def release(self, count: int = 1) -> None:
        with self.lock:
            self.inflight -= count

    def release_for(self, _future: Any) -> None:
        """A done-callback: the future that held this mapping (once) is done."""
        self.release()


def _same_memory(a: Memory, b: Memory) -> bool:
    """Two Registrations of the same pin (the Hub's cache hands out several) are the same memory."""
    return a.same_memory(b)


class Mappings:
    """The registrations one controller holds, by registration object."""

    def __init__(self, kfile: "ControllerFile", hot: Any, device: Any, bdf: str) -> None:
        self.kfile = kfile
        self.hot = hot
        self.device = device   # the /dev/p2phub Device the controller fd came from
        self.bdf = bdf
        # the controller: a user of every registration it maps (p2phub.hub.RegistrationUser),
        # so Registration.close() / Hub.close() ask it to quiesce before they UNREGISTER
        self.owner: Any = None
        self.lock = threading.RLock()
        self._by_handle: dict[int, RegMapping] = {}
        self._by_slot: dict[int, RegMapping] = {}

    def get(self, reg: Memory) -> RegMapping:
        """The mapping of `reg` for this controller, made (MAP_REG) on first use: the memory
        is bound to the controller (``reg.bind(bdf)``), which refuses staged memory."""
        if reg.closed:   # refused even while still mapped: its owner let go of it
            raise UsageError(f"{reg!r} is closed")
        m = self._by_handle.get(reg.handle)
        if m is not None and (m.reg is reg or _same_memory(m.reg, reg)) and not m.unmapped:
            return m
        binding = reg.bind(self.bdf)
        binding.require_direct(f"an NVMe transfer by {self.bdf}")
        if binding.device_file is not self.device:
            raise UsageError(
                f"{reg!r} was registered through another /dev/p2phub file than the one {self.bdf} was "
                "opened from; open the controller with hub.nvme(bdf) (or nvme.open(bdf, hub=hub)) "
                "of the Hub that made the registration")
        with self.lock:
            m = self._by_handle.get(int(reg.handle))
            if m is not None and _same_memory(m.reg, reg) and not m.unmapped:
                return m
            total = int(reg.length) // spec.PAGE
            ffi = self.hot.ffi
            addrs = ffi.new("uint64_t[]", max(total, 1))
            done = 0
            info = None
            while done < total or info is None:
                n = min(total - done, uapi.DMA_PAGES_MAX)
                info = self.kfile.map_reg(reg.handle, addrs + done, done, n, spec.PAGE)
                done += n
                if n == 0:
                    break
            if info.total != total:
                self.kfile.unmap_reg(reg.handle)
                raise P2PHubError(f"{reg!r}: the kernel lists {info.total} pages of 4 KiB, expected {total}")
            pages = prp.PageList(addrs, total, total * spec.PAGE, owner=None,
                                 name=f"registration {reg.handle}")
            m = RegMapping(reg, pages, info.slot, info.generation)
            self._by_handle[m.handle] = m
            self._by_slot[m.slot] = m
            if self.owner is not None:
                reg.add_user(self.owner)
            return m

    def by_slot(self, slot: int) -> RegMapping | None:
        return self._by_slot.get(slot)

    def revoked(self) -> list[RegMapping]:
        """Mappings whose generation in the status page no longer matches (or the slot reads 0)."""
        st = self.kfile.status
        if st is None:
            return []
        return [m for m in list(self._by_handle.values()) if int(st.reg_gen[m.slot]) != m.generation]

    def revoked_error(self, m: RegMapping, what: str = "") -> RegistrationRevokedError:
        return RegistrationRevokedError(
            f"{what + ': ' if what else ''}registration {m.handle} ({m.reg!r}) was revoked by its owner "
            f"(status page slot {m.slot}: generation {m.generation} is gone); nothing more is sent to it. "
            "Register the memory again", handle=m.handle)

    def check_live(self, m: RegMapping) -> None:
        st = self.kfile.status
        if st is not None and int(st.reg_gen[m.slot]) != m.generation:
            raise self.revoked_error(m)

    def inflight(self, reg: Any) -> int:
        m = self._by_handle.get(int(reg.handle))
        return m.inflight if m is not None and _same_memory(m.reg, reg) else 0

    def quiesce(self, reg: Any, timeout: float | None, drive: Any) -> bool:
        """Wait (driving the queues with drive()) until no command references reg, then UNMAP_REG.

        Returns False (and keeps the mapping) if commands are still outstanding after
        timeout seconds; True once the controller no longer holds reg (or never did).
        """
        m = self._by_handle.get(int(reg.handle))
        if m is None or not _same_memory(m.reg, reg) or m.unmapped:
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with m.lock:
                if m.inflight == 0:
                    break
            if deadline is not None and time.monotonic() >= deadline:
                return False
            drive()
        with self.lock:
            self._unmap(m)
        return True

    def _unmap(self, m: RegMapping) -> None:
        if m.unmapped:
            return
        m.unmapped = True
        self._by_handle.pop(m.handle, None)
        if self._by_slot.get(m.slot) is m:
            del self._by_slot[m.slot]
        if not self.kfile.closed:
            self.kfile.unmap_reg(m.handle)
        if self.owner is not None:
            m.reg.remove_user(self.owner)

    def drop_idle_revoked(self) -> list[RegMapping]:
        """Unmap every revoked mapping with nothing in flight (after a fence)."""
        out = []
        with self.lock:
            for m in self.revoked():
                if m.inflight == 0:
                    self._unmap(m)
                    out.append(m)
        return out

    def mapped(self) -> list[RegMapping]:
        """The mappings held now (a copy: read without the lock, for gauges)."""
        return list(self._by_handle.values())

    def forget_all(self) -> None:
        """The controller fd is closed: every hold went with it."""
        with self.lock:
            for m in self._by_handle.values():
                m.unmapped = True
            self._by_handle.clear()
            self._by_slot.clear()

    def holds(self, reg: Any) -> bool:
        m = self._by_handle.get(int(reg.handle))
        return m is not None and _same_memory(m.reg, reg) and not m.unmapped


__all__ = ["DmaBuffer", "Mappings", "RegMapping", "RevokedError"]
