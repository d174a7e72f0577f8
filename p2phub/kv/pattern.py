"""Page contents that a receiver can check on its own: an id, then seeded random bytes."""

from __future__ import annotations

import random
import struct

_BASE: dict[int, bytes] = {}


def page(seed: int, layer: int, kv: int, block: int, n: int) -> bytes:
    """The content of page (layer, kv, block) for `seed`, `n` bytes long."""
    base = _BASE.get(seed)
    if base is None:
        base = _BASE[seed] = random.Random(seed).randbytes(1 << 17)
    off = (layer * 7919 + kv * 104729 + block * 131) % (1 << 16)
    head = struct.pack("<QIII", seed, layer, kv, block)
    body = base[off:off + max(0, n - len(head))]
    while len(head) + len(body) < n:  # pages above 112 KiB repeat the base
        body += base[:n - len(head) - len(body)]
    return (head + body)[:n]
