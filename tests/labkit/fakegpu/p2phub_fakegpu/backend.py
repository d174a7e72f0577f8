"""The stand-in GPU as a p2phub backend plugin (entry point ``fakegpu`` of ``p2phub.backends``).

What a vendor's backend gives p2phub, for the lab's stand-in GPU:

- ``claims``/``resolve``: a `GpuMemory` range becomes a dma-buf of exactly that
  range (P2PHUB_FAKEGPU_EXPORT_DMABUF), or its fake GPU VA for the NVIDIA P2P
  path the stand-in also implements;
- ``cache_key``: the BAR range, so a second registration of it finds the first;
- ``discover_gpu``: QEMU's ivshmem-plain function (1af4:1110) is a GPU while
  p2phub_fakegpu.ko is bound to it; its memory is BAR2, all of it;
- ``test_buffer``: the doctor's active test gets the BAR's last bytes.
"""

from __future__ import annotations

import os
from typing import Any

from p2phub.backend import GpuBuffer, GpuClaim, GpuRange, PciFunction, check_range
from p2phub.errors import UsageError

from . import DEVICE_PATH, EXPORT_ALIGN, MODULE, VA_BASE, FakeGpu, GpuMemory

IVSHMEM = (0x1AF4, 0x1110)


def _bus_id() -> str:
    """The stand-in's PCI address (the one function its driver is bound to), as a vendor runtime
    names its GPU's; "" when that is not exactly one."""
    try:
        found = [n for n in os.listdir(f"/sys/bus/pci/drivers/{MODULE}") if n.count(":") == 2]
    except OSError:
        return ""
    return found[0].lower() if len(found) == 1 else ""
KiB = 1 << 10


class StandinBuffer(GpuBuffer):
    """The last `length` bytes (64 KiB aligned) of the stand-in GPU's BAR; restored on close."""

    def __init__(self, length: int, path: str = DEVICE_PATH) -> None:
        self.gpu = FakeGpu(path)
        try:
            q = self.gpu.query()
            self.length = -(-length // (64 * KiB)) * (64 * KiB)
            if self.length > q.bar_size:
                raise OSError(f"stand-in BAR is {q.bar_size} bytes, {self.length} needed")
            self.offset = q.bar_size - self.length
            self.map = self.gpu.map_bar(self.offset, self.length)
            self.saved = bytes(self.map[:])
            self.fd = self.gpu.export_dmabuf(self.offset, self.length)
            self.bus_address = q.bar_addr + self.offset
            self.describe = (f"stand-in GPU BAR2 [{self.offset:#x}, +{self.length:#x}) "
                             f"(bus {self.bus_address:#x})")
        except BaseException:
            self.gpu.close()
            raise

    def write(self, data: bytes) -> None:
        self.map[:len(data)] = data

    def read(self, n: int) -> bytes:
        return bytes(self.map[:n])

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.gpu.closed:
            self.map[:] = self.saved
            self.map.close()
            self.gpu.close()


class FakeGpuBackend:
    name = "fakegpu"

    def claims(self, obj: Any) -> bool:
        return isinstance(obj, GpuMemory)

    @staticmethod
    def _range(obj: GpuMemory, offset: int, length: int | None) -> tuple[int, int]:
        offset, length = check_range(offset, length, obj.length, f"stand-in memory {obj.offset:#x}")
        return obj.offset + offset, length

    def cache_key(self, obj: GpuMemory, offset: int = 0, length: int | None = None) -> Any:
        return self._range(obj, offset, length)

    def resolve(self, obj: GpuMemory, offset: int = 0, length: int | None = None,
                export_dmabuf: bool = True) -> GpuRange:
        start, length = self._range(obj, offset, length)
        if obj.gpu.closed:
            raise UsageError(f"stand-in memory {start:#x}: its FakeGpu is closed")
        bar = obj.gpu.query().bar_size
        if start + length > bar:
            raise UsageError(f"stand-in memory [{start:#x}, +{length:#x}) runs past the "
                             f"{bar:#x}-byte BAR")
        rng = GpuRange(self.name, 0, VA_BASE + start, length, VA_BASE, bar, _bus_id(),
                       keepalive=[obj])
        if export_dmabuf:
            if start % EXPORT_ALIGN or length % EXPORT_ALIGN:
                raise UsageError(f"stand-in memory [{start:#x}, +{length:#x}): dma-buf export "
                                 f"needs {EXPORT_ALIGN}-byte alignment")
            rng.dmabuf_fd = obj.gpu.export_dmabuf(start, length)
        return rng

    def discover_gpu(self, fn: PciFunction) -> GpuClaim | None:
        if (fn.vendor, fn.device) != IVSHMEM or fn.driver != MODULE:
            return None  # an ivshmem device without the stand-in's driver is an ordinary function
        return GpuClaim(flavour="standin", name="lab stand-in GPU (ivshmem)",
                        vendor="p2phub stand-in", p2p_bar=2, info={"bar_covers_memory": True})

    def test_buffer(self, bdf: str, length: int) -> StandinBuffer:
        return StandinBuffer(length)


_BACKEND: FakeGpuBackend | None = None


def backend() -> FakeGpuBackend:
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = FakeGpuBackend()
    return _BACKEND


__all__ = ["FakeGpuBackend", "StandinBuffer", "backend"]
