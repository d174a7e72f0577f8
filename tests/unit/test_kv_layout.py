"""KV layout: validation, the page -> (segment, offset) map and its inverse, the wire form."""

from __future__ import annotations

import pytest

from p2phub.errors import UsageError
from p2phub.kv import CONTIGUOUS, PER_LAYER, KVLayout, KVPool


def test_per_layer_offsets_follow_vllm_kv_first() -> None:
    lay = KVLayout(num_layers=4, blocks_per_layer=10, block_bytes=4096)
    assert lay.num_segments == 4 and lay.segment_bytes == 2 * 10 * 4096
    assert lay.offset(2, 0, 3) == (2, 3 * 4096, 4096)
    assert lay.offset(2, 1, 3) == (2, (10 + 3) * 4096, 4096)
    assert lay.total_bytes == 4 * 2 * 10 * 4096


def test_contiguous_offsets_and_inverse() -> None:
    lay = KVLayout(num_layers=3, blocks_per_layer=5, block_bytes=64, arrangement=CONTIGUOUS)
    assert lay.num_segments == 1
    seen = set()
    for ly in range(3):
        for kv in range(2):
            for b in range(5):
                seg, off, n = lay.offset(ly, kv, b)
                assert seg == 0 and n == 64 and off % 64 == 0
                assert lay.locate(seg, off) == (ly, kv, b)
                assert lay.locate(seg, off + 63) == (ly, kv, b)
                seen.add(off)
    assert len(seen) == 30 and max(seen) + 64 == lay.total_bytes


def test_mla_has_one_latent_per_layer() -> None:
    lay = KVLayout(num_layers=2, blocks_per_layer=4, block_bytes=576 * 2, kv=1)
    assert lay.layer_bytes == 4 * 1152
    with pytest.raises(UsageError, match="kv=1 is not in"):
        lay.block_base(0, 1)


@pytest.mark.parametrize("kw, match", [
    ({"num_layers": 0}, "num_layers=0 must be > 0"),
    ({"blocks_per_layer": -1}, "blocks_per_layer=-1"),
    ({"block_bytes": 0}, "block_bytes=0"),
    ({"block_bytes": 4097}, "not a multiple of bfloat16"),
    ({"kv": 3}, "kv=3 must be 2"),
    ({"tp_rank": 2, "tp_size": 2}, "tp_rank=2 is not in"),
    ({"dtype": "float64x"}, "dtype 'float64x' unknown"),
    ({"arrangement": "paged"}, "arrangement 'paged'"),
    ({"num_layers": 1.5}, "must be an int"),
    ({"num_layers": True}, "must be an int"),
    ({"num_layers": 1 << 20, "blocks_per_layer": 1 << 20, "block_bytes": 1 << 20}, "2\\^48"),
])
def test_bad_layouts_are_refused(kw: dict, match: str) -> None:
    base = dict(num_layers=2, blocks_per_layer=4, block_bytes=4096)
    base.update(kw)
    with pytest.raises(UsageError, match=match):
        KVLayout(**base)


def test_out_of_range_pages_are_refused() -> None:
    lay = KVLayout(num_layers=2, blocks_per_layer=4, block_bytes=4096)
    with pytest.raises(UsageError, match="layer 2 is not in"):
        lay.offset(2, 0, 0)
    with pytest.raises(UsageError, match="block 4 is not in"):
        lay.offset(0, 0, 4)
    with pytest.raises(UsageError, match="outside the layout"):
        lay.locate(2, 0)


def test_wire_form_round_trips_and_rejects_junk() -> None:
    lay = KVLayout(num_layers=2, blocks_per_layer=4, block_bytes=4096, tp_rank=1, tp_size=2)
    assert KVLayout.from_json(lay.to_json()) == lay
    with pytest.raises(UsageError, match="unknown fields"):
        KVLayout.from_dict({**lay.to_dict(), "heads": 8})
    with pytest.raises(UsageError, match="not JSON"):
        KVLayout.from_json("{")
    with pytest.raises(UsageError, match="missing"):
        KVLayout.from_dict({"num_layers": 2})


def test_compatibility_names_every_difference() -> None:
    a = KVLayout(num_layers=2, blocks_per_layer=4, block_bytes=4096)
    a.check_compatible(KVLayout(num_layers=2, blocks_per_layer=100, block_bytes=4096,
                                arrangement=CONTIGUOUS))
    with pytest.raises(UsageError, match="num_layers: 2 here, 3 there; block_bytes"):
        a.check_compatible(KVLayout(num_layers=3, blocks_per_layer=4, block_bytes=8192))


@pytest.mark.parametrize("arr", [PER_LAYER, CONTIGUOUS])
def test_host_pool_pages_are_where_the_layout_says(arr: str) -> None:
    lay = KVLayout(num_layers=3, blocks_per_layer=4, block_bytes=64, arrangement=arr)
    with KVPool.host(lay) as pool:
        assert len(pool.segments) == lay.num_segments
        v = pool.block(1, 1, 2)
        v[:] = b"\xab" * 64
        seg, off, _ = lay.offset(1, 1, 2)
        assert bytes(pool.segments[seg].view[off:off + 64]) == b"\xab" * 64
        assert pool.segments[seg].view[off - 1] == 0
        v.release()
    assert pool.closed


def test_page_runs_merge_consecutive_pages_for_the_ordering() -> None:
    from p2phub.kv.pool import page_runs
    assert page_runs([7, 3, 4, 5, 9, 8, 3]) == [(3, 3), (7, 3)]
    assert page_runs([]) == []
    assert page_runs([0]) == [(0, 1)]
