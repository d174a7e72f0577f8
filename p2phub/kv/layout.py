"""The KV-cache layout: which bytes of a pool hold (layer, K/V, block), in one place.

Serving engines keep a paged KV cache either as one tensor per layer, shaped
``[kv, blocks, ...]`` (vLLM's per-layer K/V cache), or as one contiguous region
``[layers, kv, blocks, ...]``. Both are described here; every block -> (segment,
offset, length) question is answered by :meth:`KVLayout.offset` and
:meth:`KVLayout.block_base`, nowhere else.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import UsageError

__all__ = ["KVLayout", "DTYPE_BYTES", "PER_LAYER", "CONTIGUOUS"]

PER_LAYER = "per_layer"      # one segment per layer: [kv, blocks, block_bytes]
CONTIGUOUS = "contiguous"    # one segment: [layers, kv, blocks, block_bytes]

DTYPE_BYTES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1,
}

_MAX_BYTES = 1 << 48  # no pool of a single process is larger than 256 TiB


@dataclass(frozen=True)
class KVLayout:
    """A paged KV cache of one tensor-parallel rank.

    num_layers: transformer layers; kv: 2 for separate K and V, 1 for one latent (MLA);
    blocks_per_layer: pages per layer (per K or V); block_bytes: bytes of one page of K
    (or V) of one layer on this rank; dtype: element type (block_bytes is a multiple of
    its size); tp_rank / tp_size: this rank of the tensor-parallel group;
    arrangement: PER_LAYER (one segment per layer) or CONTIGUOUS (one segment).
    """

    num_layers: int
    blocks_per_layer: int
    block_bytes: int
    kv: int = 2
    dtype: str = "bfloat16"
    tp_rank: int = 0
    tp_size: int = 1
    arrangement: str = PER_LAYER

    def __post_init__(self) -> None:
        for name in ("num_layers", "blocks_per_layer", "block_bytes", "kv", "tp_rank", "tp_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise UsageError(f"KV layout: {name}={v!r} must be an int")
        for name in ("num_layers", "blocks_per_layer", "block_bytes", "tp_size"):
            if getattr(self, name) <= 0:
                raise UsageError(f"KV layout: {name}={getattr(self, name)} must be > 0")
        if self.kv not in (1, 2):
            raise UsageError(f"KV layout: kv={self.kv} must be 2 (K and V) or 1 (one latent, MLA)")
        if not 0 <= self.tp_rank < self.tp_size:
            raise UsageError(f"KV layout: tp_rank={self.tp_rank} is not in [0, tp_size={self.tp_size})")
        if self.dtype not in DTYPE_BYTES:
            raise UsageError(f"KV layout: dtype {self.dtype!r} unknown (one of {', '.join(DTYPE_BYTES)})")
        if self.block_bytes % DTYPE_BYTES[self.dtype]:
            raise UsageError(f"KV layout: block_bytes={self.block_bytes} is not a multiple of "
                             f"{self.dtype}'s {DTYPE_BYTES[self.dtype]} bytes")
        if self.arrangement not in (PER_LAYER, CONTIGUOUS):
            raise UsageError(f"KV layout: arrangement {self.arrangement!r} must be "
                             f"{PER_LAYER!r} or {CONTIGUOUS!r}")
        if self.total_bytes > _MAX_BYTES:
            raise UsageError(f"KV layout: {self.total_bytes} bytes in all is more than 2^48")

    # ------------------------------------------------------------------ sizes
    @property
    def layer_bytes(self) -> int:
        return self.kv * self.blocks_per_layer * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def num_segments(self) -> int:
        return self.num_layers if self.arrangement == PER_LAYER else 1

    @property
    def segment_bytes(self) -> int:
        return self.layer_bytes if self.arrangement == PER_LAYER else self.total_bytes

    # ------------------------------------------------------------------ addressing
    def check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise UsageError(f"layer {layer} is not in [0, {self.num_layers})")

    def block_base(self, layer: int, kv: int) -> tuple[int, int]:
        """(segment, offset of block 0) of `layer`'s K (kv=0) or V (kv=1) pages."""
        self.check_layer(layer)
        if not 0 <= kv < self.kv:
            raise UsageError(f"kv={kv} is not in [0, {self.kv})")
        if self.arrangement == PER_LAYER:
            return layer, kv * self.blocks_per_layer * self.block_bytes
        return 0, (layer * self.kv + kv) * self.blocks_per_layer * self.block_bytes

    def offset(self, layer: int, kv: int, block: int) -> tuple[int, int, int]:
        """(segment, offset, length) of one page."""
        if not 0 <= block < self.blocks_per_layer:
            raise UsageError(f"block {block} is not in [0, {self.blocks_per_layer})")
        seg, base = self.block_base(layer, kv)
        return seg, base + block * self.block_bytes, self.block_bytes

    def locate(self, segment: int, offset: int) -> tuple[int, int, int]:
        """The inverse of offset(): (layer, kv, block) of the page holding `offset`."""
        if not 0 <= segment < self.num_segments or not 0 <= offset < self.segment_bytes:
            raise UsageError(f"segment {segment} offset {offset} is outside the layout")
        if self.arrangement == PER_LAYER:
            layer, rest = segment, offset
        else:
            layer, rest = divmod(offset, self.layer_bytes)
        kv, rest = divmod(rest, self.blocks_per_layer * self.block_bytes)
        return layer, kv, rest // self.block_bytes

    def check_compatible(self, remote: "KVLayout") -> None:
        """Raise unless pages of this layout can be copied into `remote`'s, page for page."""
        diffs = [f"{n}: {getattr(self, n)} here, {getattr(remote, n)} there"
                 for n in ("num_layers", "kv", "block_bytes", "dtype", "tp_size", "tp_rank")
                 if getattr(self, n) != getattr(remote, n)]
        if diffs:
            raise UsageError("KV layouts differ: " + "; ".join(diffs))

    # ------------------------------------------------------------------ wire form
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVLayout":
        if not isinstance(d, dict):
            raise UsageError(f"KV layout must be a mapping, not {type(d).__name__}")
        known = set(cls.__dataclass_fields__)
        extra = set(d) - known
        if extra:
            raise UsageError(f"KV layout: unknown fields {sorted(extra)}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise UsageError(f"KV layout: {exc}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "KVLayout":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise UsageError(f"KV layout: not JSON: {exc}") from None
