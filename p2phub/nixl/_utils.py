"""``nixl._utils``: the helpers NIXL's tests and examples use for raw host buffers."""

from __future__ import annotations

import ctypes

_libc = ctypes.CDLL(None)
_libc.aligned_alloc.restype = ctypes.c_void_p
_libc.aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]

_ALIGN = 4096


def malloc_passthru(size: int) -> int:
    """A 4096-aligned host buffer of `size` bytes (free it with free_passthru)."""
    if size <= 0:
        raise ValueError(f"malloc_passthru: size {size} must be > 0")
    addr = _libc.aligned_alloc(_ALIGN, (size + _ALIGN - 1) // _ALIGN * _ALIGN)
    if not addr:
        raise MemoryError(f"malloc_passthru: no memory for {size} bytes")
    return int(addr)


def free_passthru(addr: int) -> None:
    _libc.free(ctypes.c_void_p(addr))


def ba_buf(addr: int, size: int) -> None:
    """Fill `size` bytes at `addr` with 0xba."""
    ctypes.memset(addr, 0xBA, size)


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Assert the `size` bytes at addr1 and addr2 are equal."""
    if ctypes.string_at(addr1, size) != ctypes.string_at(addr2, size):
        raise AssertionError(f"{size} bytes at {addr1:#x} and {addr2:#x} differ")
