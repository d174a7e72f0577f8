"""Page lists and PRPs: how a buffer is described to the controller.

A :class:`PageList` is a buffer as the controller sees it: one DMA address
per 4 KiB page (``spec.PAGE``), valid for *that* controller (through the
IOMMU if one is on). The C hot path turns a byte range of it into PRP1/PRP2
and, past two pages, a PRP list; :func:`build_prps` is the same rule in
Python, the reference the unit tests hold the C code to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..errors import UsageError
from . import spec


@dataclass
class PageList:
    """4 KiB-granular DMA addresses of a buffer, for one controller.

    ``addrs`` is a cffi ``uint64_t[]`` (what the hot path reads);
    ``check`` raises if the memory behind it is gone (closed or revoked
    registration); ``owner`` is kept alive as long as the page list is.
    """

    addrs: Any
    npages: int
    nbytes: int
    check: Callable[[], None] = field(default=lambda: None)
    owner: object = None
    name: str = "buffer"

    def validate_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            raise UsageError(
                f"buffer range offset={offset} nbytes={nbytes} is outside {self.name} "
                f"of {self.nbytes} bytes")
        if offset % 4:
            raise UsageError(f"offset={offset} must be a multiple of 4 (PRP dword alignment)")


def expand(page_size: int, addrs: Sequence[int]) -> list[int]:
    """Expand a page list of page_size pages (4 KiB, 64 KiB, ...) to 4 KiB pages."""
    if page_size % spec.PAGE:
        raise UsageError(f"page size {page_size} is not a multiple of {spec.PAGE}")
    k = page_size // spec.PAGE
    out: list[int] = []
    for a in addrs:
        if a % spec.PAGE:
            raise UsageError(f"DMA address 0x{a:x} is not {spec.PAGE}-aligned")
        out.extend(a + i * spec.PAGE for i in range(k))
    return out


def build_prps(pages: Sequence[int], offset: int, nbytes: int, list_dma: int) -> tuple[int, int, list[int]]:
    """(prp1, prp2, prp_list_entries) for nbytes at offset; list_dma is where the list would live."""
    first = offset // spec.PAGE
    last = (offset + nbytes - 1) // spec.PAGE
    prp1 = pages[first] + offset % spec.PAGE
    more = last - first
    if more == 0:
        return prp1, 0, []
    if more == 1:
        return prp1, pages[first + 1], []
    return prp1, list_dma, list(pages[first + 1:last + 1])


def split(lba: int, nbytes: int, offset: int, lba_size: int, max_bytes: int) -> list[tuple[int, int, int]]:
    """Split one request into (lba, nbytes, offset) pieces of at most max_bytes (MDTS)."""
    step = max_bytes - max_bytes % lba_size
    if step <= 0:
        raise UsageError(f"max transfer {max_bytes} is smaller than one block of {lba_size}")
    out = []
    done = 0
    while done < nbytes:
        n = min(step, nbytes - done)
        out.append((lba + done // lba_size, n, offset + done))
        done += n
    return out
