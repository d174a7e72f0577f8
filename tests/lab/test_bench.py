"""The benchmark commands run end to end in the lab (their figures are in docs/benchmarks.md;
here only that every method ran and reported)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_register_reports_every_method(lab: dict[str, str]) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "p2phub", "bench", "register", "--json", "--sizes", "64K",
         "--min-time", "0", "--max-iters", "3", "--device", lab["nvme_target"],
         "--rdma-dev", lab["node_a_rdma"]],
        capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(res.stdout)
    assert "error" not in report, report
    (row,) = report["results"]
    assert row["size"] == 64 << 10 and row["same_memory"]
    for method in ("p2phub", "ioctl", "hit", "hit_fstat", "hit_reg_info", "ibv_reg_mr"):
        assert row[method]["iters"] >= 3 and row[method]["median_us"] > 0, method
