"""`p2phub bench restore` on the host: host memory as the destination, a small file, every
method that can run here runs and is checked; those that cannot say what they need."""

from __future__ import annotations

import importlib.util
import json

from p2phub.cli import main

MiB = 1 << 20


def test_restore_bench_in_host_memory(tmp_path, capsys) -> None:
    f = str(tmp_path / "bench.bin")
    rc = main(["bench", "restore", "--file", f, "--size", "16M", "--count", "64",
               "--sizes", "4K,64K", "--runs", "3", "--depths", "64", "--device", "host",
               "--sample", "16", "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0, rep
    assert rep["schema"] == "p2phub.bench.restore/1" and rep["device"] == "host"
    for row in rep["sizes"].values():
        assert len(row["per_s"]["p2phub"]) == 3 and len(row["per_s"]["ceiling"]) == 3
        assert row["verified"]["p2phub"] and row["verified"]["p2phub-load"]
        assert row["ratios"]["p2phub_vs_ceiling"] > 0
        assert row["p2phub_batch"]["io"] == {f: "O_DIRECT"}
    if importlib.util.find_spec("kvikio") is None:
        assert rep["errors"]["kvikio8"] == "needs kvikio"
    assert "needs a CUDA destination" in rep["errors"]["torch"]


def test_cli_knows_restore(capsys) -> None:
    assert main(["bench", "restore", "--help"]) == 0
    assert "--sizes" in capsys.readouterr().out
