"""`p2phub bench ... --plot FILE.png`: a bench's report as a chart (matplotlib, optional:
``pip install 'p2phub[plot]'``). Throughput or rate against size on the left, the distribution
of the runs (time per transfer or latency) on the right; p2phub and its peers on the same axes."""

from __future__ import annotations

import argparse
from typing import Any, Callable

PEER_ORDER = ("raw", "p2phub", "nixl", "mooncake", "torch", "public", "c_loop", "fio_io_uring")


def _fig(title: str, ncols: int = 2) -> tuple[Any, Any]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, ncols, figsize=(6.2 * ncols, 4.4), squeeze=False)
    fig.suptitle(title, fontsize=11)
    return fig, axes[0]


def _runs_box(ax: Any, data: list[list[float]], labels: list[str], ylabel: str, fontsize: int = 8,
              rotation: int = 0) -> None:
    """The right-hand panel: each label's runs as a box."""
    if data:
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=fontsize, rotation=rotation)
    ax.set_ylabel(ylabel)
    ax.set_title("distribution over runs", fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def _size_label(n: int) -> str:
    for unit, sh in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << sh:
            return f"{n / (1 << sh):g} {unit}"
    return f"{n} B"


def _kv(rep: dict) -> Any:
    where = "GPU -> GPU, " if rep.get("device") == "cuda" else ""
    fig, (left, right) = _fig(f"p2phub bench kv: {where}TCP loopback, {_size_label(rep['total_bytes'])} "
                              f"per transfer, {rep['runs']} runs x {rep['iters']} transfers")
    blocks = [e["block"] for e in rep["results"]]
    methods = [m for m in PEER_ORDER if any(m in e["methods"] and "skipped" not in e["methods"][m]
                                            for e in rep["results"])]
    for m in methods:
        xs, ys, lo, hi = [], [], [], []
        for e in rep["results"]:
            r = e["methods"].get(m, {})
            if r.get("median_gbps") is None:
                continue
            xs.append(e["block"])
            ys.append(r["median_gbps"])
            lo.append(r["median_gbps"] - r["min_gbps"])
            hi.append(r["max_gbps"] - r["median_gbps"])
        left.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=m,
                      linewidth=2.5 if m == "p2phub" else 1.5)
    left.set_xscale("log", base=2)
    left.set_xticks(blocks, [_size_label(b) for b in blocks])
    left.set_xlabel("page size")
    left.set_ylabel("GB/s (median; bars: min..max of runs)")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    left.legend()
    # the runs' time per transfer at each size, every method side by side
    data, labels = [], []
    for e in rep["results"]:
        for m in methods:
            runs = e["methods"].get(m, {}).get("gbps_runs") or []
            if runs:
                data.append([rep["total_bytes"] / (g * 1e9) * 1e3 for g in runs])
                labels.append(f"{m}\n{_size_label(e['block'])}")
    _runs_box(right, data, labels, "ms per transfer (each run)", fontsize=7)
    return fig


def _nvme(rep: dict) -> Any:
    fig, (left, right) = _fig(f"p2phub bench nvme: {rep['bs']} B random reads, CPU {rep['cpu']}")
    sides = {"public": rep.get("engine", {}).get("public", {}), "c_loop": rep.get("engine", {}).get("c_loop", {}),
             "fio_io_uring": rep.get("fio_io_uring", {})}
    pcts = ("p50_us", "p90_us", "p99_us", "p99.9_us")
    for side, rows in sides.items():
        qds = sorted(int(k[2:]) for k in rows if k.startswith("qd"))
        if not qds:
            continue
        left.plot(qds, [rows[f"qd{q}"]["iops"] for q in qds], marker="o", label=side)
        for q in qds:
            r = rows[f"qd{q}"]
            right.plot(range(len(pcts)), [r.get(p, float("nan")) for p in pcts], marker="o",
                       label=f"{side} QD{q}")
    left.set_xscale("log", base=2)
    left.set_xlabel("queue depth")
    left.set_ylabel("IOPS")
    left.grid(alpha=0.3)
    left.legend()
    right.set_xticks(range(len(pcts)), [p[:-3] for p in pcts])
    right.set_yscale("log")
    right.set_ylabel("latency, us")
    right.set_title("latency percentiles", fontsize=9)
    right.grid(alpha=0.3)
    right.legend(fontsize=7)
    return fig


def _ordering(rep: dict) -> Any:
    fig, (left, right) = _fig("p2phub bench ordering: one access (enter + bind + release)")
    rows = rep["results"]
    live = [max(r["live"], 1) for r in rows]
    left.plot(live, [r["access_us"] for r in rows], marker="o", label="access (tracker + fence)",
              linewidth=2.5)
    left.plot(live, [r["fence_only_us"] for r in rows], marker="o", label="fence alone")
    left.plot(live, [r["lookup_us"] for r in rows], marker="o", label="lookup")
    left.set_xscale("log")
    left.set_xlabel("live ranges on the registration")
    left.set_ylabel("us per access (median of runs)")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)
    left.legend()
    _runs_box(right, [r["access_runs_us"] for r in rows], [f"{r['live']:,}" for r in rows],
              "us per access (each run)")
    right.set_xlabel("live ranges")
    return fig


def _register(rep: dict) -> Any:
    fig, (left, right) = _fig(f"p2phub bench register: {rep['device']} vs ibv_reg_mr on {rep['rdma_dev']}")
    rows = rep["results"]
    sizes = [r["size"] for r in rows]
    for key, label in (("p2phub", "p2phub register+close"), ("ioctl", "bare ioctls"),
                       ("hit", "cache hit"), ("ibv_reg_mr", "ibv_reg_mr+dereg")):
        left.plot(sizes, [r[key]["median_us"] for r in rows], marker="o", label=label)
        right.plot(sizes, [r[key]["max_us"] for r in rows], marker="o", label=label)
    for ax, what in ((left, "median"), (right, "worst")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes, [_size_label(s) for s in sizes], fontsize=8)
        ax.set_xlabel("registration size")
        ax.set_ylabel(f"us ({what})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def _io(rep: dict) -> Any:
    fig, (left, right) = _fig(f"p2phub bench {rep.get('bench', 'load')}: "
                              f"{rep.get('bytes', 0) / (1 << 30):.1f} GiB, {rep.get('runs')} runs")
    names = list(rep["methods"])
    left.bar(range(len(names)), [rep["methods"][n]["median_gbps"] for n in names],
             color=["tab:orange" if n.startswith("p2phub") else "tab:blue" for n in names])
    left.set_xticks(range(len(names)), names, rotation=30, fontsize=8)
    left.set_ylabel("GB/s (median)")
    left.grid(alpha=0.3, axis="y")
    _runs_box(right, [rep["methods"][n]["gbps"] for n in names], names, "GB/s (each run)", rotation=30)
    return fig


def _fence(rep: dict) -> Any:
    fig, (left, right) = _fig(f"p2phub bench fence on {rep['gpu']}")
    modes = (("on_stream", "fence.on_stream"), ("round_trip", "wait() then launch"))
    for i, pct in enumerate(("p50_us", "p99_us", "min_us", "mean_us")):
        left.bar([i - 0.2, i + 0.2], [rep[m][pct] for m, _ in modes], width=0.4,
                 color=["tab:orange", "tab:blue"])
    left.set_xticks(range(4), ["p50", "p99", "min", "mean"])
    left.set_ylabel("us, fence completed -> kernel started")
    left.legend([lbl for _, lbl in modes])
    right.boxplot([[r["p50_us"] for r in rep["runs_detail"][m]] for m, _ in modes])
    right.set_xticks([1, 2], [lbl for _, lbl in modes])
    right.set_ylabel("p50 us (each run)")
    return fig


PLOTTERS: dict[str, Callable[[dict], Any]] = {
    "p2phub.bench.kv/": _kv, "p2phub.bench.nvme/": _nvme, "p2phub.bench.ordering/": _ordering,
    "p2phub.bench.register/": _register, "p2phub.bench.load/": _io, "p2phub.bench.fence/": _fence,
}


def plot(report: dict, path: str) -> None:
    """Write `report`'s chart to `path` (the format from its suffix: .png, .svg, .pdf)."""
    schema = report.get("schema", "")
    fn = next((f for prefix, f in PLOTTERS.items() if schema.startswith(prefix)), None)
    if fn is None:
        raise ValueError(f"no chart for a {schema or 'schema-less'} report")
    fig = fn(report)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt
    plt.close(fig)


def maybe(args: argparse.Namespace, report: dict) -> None:
    """The chart of `report` when the command line asked for one (--plot FILE)."""
    path = getattr(args, "plot", None)
    if path:
        plot(report, path)
