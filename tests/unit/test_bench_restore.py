"""`p2phub bench restore` on the host: host memory as the destination, a small file, every
method that can run here runs and is checked; those that cannot say what they need."""

from __future__ import annotations

import importlib.util
import json

import pytest

from p2phub.cli import main

MiB = 1 << 20


def _nixl_installed() -> bool:
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12", "nixl_cu13"))


def test_restore_bench_in_host_memory(tmp_path, capsys) -> None:
    f = str(tmp_path / "bench.bin")
    rc = main(["bench", "restore", "--file", f, "--size", "16M", "--count", "64",
               "--sizes", "4K,64K", "--runs", "3", "--depths", "64", "--device", "host",
               "--sample", "16", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0, rep
    assert rep["schema"] == "p2phub.bench.restore/1" and rep["device"] == "host"
    assert rep["primed"] is True
    for row in rep["sizes"].values():
        assert row["count"] == 64
        assert len(row["per_s"]["p2phub"]) == 3 and len(row["per_s"]["ceiling"]) == 3
        assert row["verified"]["p2phub"] and row["verified"]["p2phub:perrequest"]
        assert row["ratios"]["p2phub_vs_ceiling"] > 0
        assert row["ratios"]["perrequest_vs_p2phub"] > 0
        assert row["p2phub_batch"]["io"] == {f: "O_DIRECT"}
        assert row["p2phub_batch"]["submit_path"] in ("io_uring", "aio")
    if importlib.util.find_spec("kvikio") is None:
        assert rep["errors"]["kvikio8"] == "needs kvikio"
        assert rep["errors"]["kvikio64"] == "needs kvikio"
    assert "needs a CUDA destination" in rep["errors"]["torch"]


def test_restore_bench_against_nixl_posix(tmp_path, capsys) -> None:
    """Host memory against NIXL's POSIX plugin (both modes), the same offsets, large reads
    with fewer requests under --max-bytes; every method's sampled bytes are checked."""
    f = str(tmp_path / "bench.bin")
    rc = main(["bench", "restore", "--file", f, "--size", "32M", "--count", "32",
               "--sizes", "4K,4M", "--max-bytes", "16M", "--runs", "2", "--memory", "host",
               "--methods", "p2phub,nixl-posix,nixl-posix:uring", "--sample", "8", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0, rep
    four_k, four_m = rep["sizes"][str(4096)], rep["sizes"][str(4 * MiB)]
    assert four_k["count"] == 32 and four_m["count"] == 4
    # aligned reads into host memory land in place, whole (not cut into split pieces)
    assert four_m["p2phub_batch"]["split_entries"] == 0
    assert four_m["p2phub_batch"]["in_place"] == four_m["p2phub_batch"]["pieces"] > 0
    if not _nixl_installed():
        assert rep["errors"]["nixl-posix"].startswith("needs nixl")
        return
    for row in (four_k, four_m):
        assert row["verified"] == {"p2phub": True, "nixl-posix": True, "nixl-posix:uring": True}
        assert row["ratios"]["p2phub_vs_best_nixl"] > 0
    assert rep["info"]["nixl-posix:uring"]["mode"] == "uring"


def test_restore_bench_refuses_reads_over_16m(tmp_path, capsys) -> None:
    rc = main(["bench", "restore", "--file", str(tmp_path / "b.bin"), "--size", "64M",
               "--sizes", "32M", "--memory", "host", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 1 and "over 16M" in rep["error"]


@pytest.mark.parametrize("method, why", [
    ("nosuch", "unknown method 'nosuch'"),
    ("p2phub:zz", "unknown setting 'zz'"),
    ("p2phub:inflight-1", "'inflight-1': want inflightSIZE, SIZE at least 0"),
    ("p2phub:inflightfoo", "'inflightfoo': want inflightSIZE"),
    ("p2phub:split1000", "'split1000': want splitSIZE, SIZE at least 0 and a multiple of 4096"),
    ("p2phub:s0", "'s0': want sSIZE, SIZE at least 4096"),
])
def test_restore_bench_names_an_unknown_method_as_a_usage_error(tmp_path, capsys, method,
                                                                 why) -> None:
    f = tmp_path / "never.bin"
    rc = main(["bench", "restore", "--file", str(f), "--size", "16M", "--methods",
               f"p2phub,{method}", "--memory", "host", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 4 and rep["exit_name"] == "USAGE" and why in rep["error"]
    assert not f.exists()       # refused before the file was made or anything ran


def test_cli_knows_restore(capsys) -> None:
    assert main(["bench", "restore", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--sizes" in out and "--memory" in out and "--max-bytes" in out


def test_restore_bench_without_priming(tmp_path, capsys) -> None:
    f = str(tmp_path / "bench.bin")
    rc = main(["bench", "restore", "--file", f, "--size", "4M", "--count", "16", "--sizes", "4K",
               "--runs", "1", "--methods", "p2phub", "--device", "host", "--no-prime", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["primed"] is False and rep["sizes"]["4096"]["verified"]["p2phub"]
