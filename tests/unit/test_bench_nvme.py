"""`p2phub bench nvme`'s interleaving: sides in turn, and the cycle collector's time said per side."""

from __future__ import annotations

import gc

from p2phub.commands.bench_nvme import _interleaved, _percentiles


def test_sides_alternate_and_the_collector_is_charged_to_the_side_that_ran_it() -> None:
    order: list[str] = []

    def quiet() -> list[int]:
        order.append("quiet")
        return [1000, 3000]

    def collecting() -> list[int]:
        order.append("collecting")
        gc.collect()            # what a side that leaves cycles behind ends up paying
        return [2000]

    gc.collect()                # nothing owed from before: only the collecting side runs it
    got = _interleaved({"quiet": quiet, "collecting": collecting}, seconds=1e-9, warmup=0.0)
    assert order[:2] == ["quiet", "collecting"]
    n, secs, lat, gc_s, full = got["quiet"]
    assert (n, list(lat), gc_s, full) == (2, [1000, 3000], 0.0, 0)
    n, secs, lat, gc_s, full = got["collecting"]
    assert n == 1 and list(lat) == [2000] and gc_s > 0 and full >= 1
    assert _percentiles(got["quiet"][2])["mean_us"] == 2.0
