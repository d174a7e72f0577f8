"""`p2phub bench kv`: KV transfer over TCP loopback, p2phub next to its peers, in one run.

For each page size, each run starts a target and an initiator process per method and
moves --total bytes per transfer (--iters timed transfers after one warm-up), every page
to a scattered place on the target; the target checks every byte of the last transfer.
Methods: raw (one socket stream of the same bytes into one buffer: the ceiling), p2phub
(p2phub.kv.Agent, a request of 4 layers x K/V), nixl (nixl-cu12, UCX forced to tcp, prepped
lists), mooncake (Transfer Engine, tcp, P2PHANDSHAKE, batches of 512), p2phub-nixl (the nixl
method's calls unchanged on p2phub.nixl, NIXL's API over p2phub) and p2phub-xfer (p2phub's own
API in the same shape: prep_local / prep_remote / make_xfer / post; the adapter's cost is
p2phub-nixl against it). Methods whose
package is missing are reported as skipped. Ratios are against raw, run by run.

``--device cuda``: the pools are torch CUDA tensors on cuda:0 on both sides; p2phub moves them
GPU -> GPU over TCP (staged through pinned host memory), next to the raw host socket stream
of the same bytes (the ceiling) and ``torch`` (one contiguous D2H copy into pinned memory, a
socket stream, one H2D copy, in sequence). NIXL and Mooncake are not run there.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from . import plot
from .argtypes import (choice_list, comma_list, gpu_present, mem_available, positive, seconds,
                       size_bytes, size_text)

SCHEMA = "p2phub.bench.kv/1"
METHODS = ("raw", "p2phub", "nixl", "mooncake", "p2phub-xfer", "p2phub-nixl")
CUDA_METHODS = ("raw", "p2phub", "p2phub-read", "torch")


def _size(text: str) -> int:
    return size_bytes(text)


def add_parser(sub: Any) -> None:
    k = sub.add_parser("kv", help="KV transfer over TCP loopback: p2phub vs NIXL, Mooncake and a raw stream")
    k.add_argument("--blocks", type=comma_list(size_bytes), default="64K,1M",
                   help="page sizes, comma-separated (default 64K,1M)")
    k.add_argument("--total", type=size_text, default="64M", help="bytes per transfer (default 64M)")
    k.add_argument("--iters", type=positive, default=32,
                   help="timed transfers per run (default 32: fewer time too little to settle)")
    k.add_argument("--runs", type=positive, default=5, help="runs per method and size (default 5)")
    k.add_argument("--methods", type=choice_list(tuple(dict.fromkeys(METHODS + CUDA_METHODS))), default=None,
                   help=f"subset of {','.join(METHODS)} (with --device cuda: of {','.join(CUDA_METHODS)}); "
                        "default all")
    k.add_argument("--timeout", type=seconds, default=120.0, help="seconds per run of one method")
    k.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the KV pools live: cpu (host memory) or cuda (torch tensors on "
                        "cuda:0, staged through pinned memory; methods raw, p2phub, "
                        "p2phub-read (VRAM descriptors pulled with READ), torch)")
    k.add_argument("--json", action="store_true", help="print JSON")
    k.set_defaults(_needs=lambda a: ["torch"] if a.device == "cuda" else [], _check=check)


def check(args: argparse.Namespace) -> None:
    """What can be refused before the first process starts: sizes, memory, the GPU."""
    from ..errors import MissingDependencyError, UsageError
    total = _size(args.total)
    for b in (_size(x) for x in args.blocks.split(",") if x.strip()):
        if total % (8 * b):
            raise UsageError(f"--total {args.total} must be a multiple of 8 pages of {b} bytes "
                             f"({8 * b} bytes)")
    avail = mem_available()
    if avail is not None and 2 * total > avail:
        raise UsageError(f"--total {args.total}: a run holds it twice (target and initiator), "
                         f"{2 * total >> 20} MiB, and this host has {avail >> 20} MiB available")
    known = CUDA_METHODS if args.device == "cuda" else METHODS
    for m in (x.strip() for x in (args.methods or "").split(",") if x.strip()):
        if m not in known:
            raise UsageError(f"--methods: {m!r} is not run with --device {args.device} "
                             f"(one of {', '.join(known)})")
    if args.device == "cuda" and gpu_present() is None:
        raise MissingDependencyError("a GPU", "--device cuda found no GPU driver here "
                                     "(no /dev/nvidiactl or /dev/kfd); use --device cpu")


def _available(method: str) -> str | None:
    mod = {"nixl": "nixl_cu12._api", "mooncake": "mooncake.engine", "torch": "torch",
           "p2phub-nixl": "numpy"}.get(method)
    if mod is None:
        return None
    try:
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        return f"import {mod} timed out"
    if r.returncode:
        err = r.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        if "No module named" in err[0]:
            from ..deps import error_for
            return str(error_for(mod))
        return f"import {mod} failed: {err[0]}"
    return None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(UCX_TLS="tcp", UCX_NET_DEVICES="lo", NIXL_LOG_LEVEL="ERROR", GLOG_minloglevel="2",
               MC_LOG_LEVEL="ERROR")
    return env


def run_pair(method: str, total: int, block: int, iters: int, timeout: float,
             device: str = "cpu") -> dict:
    """One run of one method: {"gbps", "bytes_ok"} or {"error"}."""
    cmd = [sys.executable, "-m", "p2phub.commands.bench_kv_peer", "--method", method, "--total", str(total),
           "--block", str(block), "--iters", str(iters), "--device", device]
    env = _env()
    procs: list[subprocess.Popen] = []

    def spawn(role: str) -> subprocess.Popen:
        p = subprocess.Popen(cmd + ["--role", role], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        procs.append(p)
        return p

    def kill_all() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()

    timer = threading.Timer(timeout, kill_all)
    timer.start()
    try:
        tgt = spawn("target")
        line = tgt.stdout.readline()  # type: ignore[union-attr]
        if not line:
            return {"error": f"target: {_tail(tgt)}"}
        ini = spawn("initiator")
        ini.stdin.write(line)  # type: ignore[union-attr]
        ini.stdin.flush()  # type: ignore[union-attr]
        md = ini.stdout.readline()  # type: ignore[union-attr]
        if not md:
            return {"error": f"initiator: {_tail(ini)}"}
        tgt.stdin.write(md)  # type: ignore[union-attr]
        tgt.stdin.flush()  # type: ignore[union-attr]
        res = ini.stdout.readline()  # type: ignore[union-attr]
        if not res:
            return {"error": f"initiator: {_tail(ini)}"}
        tgt.stdin.write(res)  # type: ignore[union-attr]
        tgt.stdin.flush()  # type: ignore[union-attr]
        tres = tgt.stdout.readline()  # type: ignore[union-attr]
        if not tres:
            return {"error": f"target: {_tail(tgt)}"}
        r, t = json.loads(res), json.loads(tres)
        return {"gbps": r["bytes"] / r["seconds"] / 1e9, "bytes_ok": bool(t["bytes_ok"])}
    except (OSError, ValueError, KeyError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    except BaseException:   # Ctrl-C: the peers go at once, not after their own timeouts
        kill_all()
        raise
    finally:
        timer.cancel()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _tail(p: subprocess.Popen) -> str:
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        p.kill()
    err = (p.stderr.read() if p.stderr else "") or ""
    # the last line of a traceback is the error itself; the frames above it help nobody here
    last = next((ln.strip() for ln in reversed(err.strip().splitlines()) if ln.strip()), "no output")
    return f"exit {p.returncode}: {last}"


def bench(args: argparse.Namespace, progress: Any = None) -> dict:
    total = _size(args.total)
    blocks = [_size(b) for b in args.blocks.split(",")]
    device = getattr(args, "device", "cpu")
    known = CUDA_METHODS if device == "cuda" else METHODS
    methods = [m.strip() for m in (args.methods or ",".join(known)).split(",") if m.strip()]
    for m in methods:
        if m not in known:
            raise ValueError(f"unknown method {m!r} for --device {device} (one of {', '.join(known)})")
    if "raw" not in methods:
        methods.insert(0, "raw")
    for b in blocks:
        if b <= 0 or total % (8 * b):
            raise ValueError(f"--total {total} must be a multiple of 8 pages of {b} bytes")
    skipped = {m: why for m in methods if (why := _available(m))}
    live = [m for m in methods if m not in skipped]
    task = progress.add_task("kv bench", total=len(blocks) * args.runs * len(live)) if progress else None
    results = []
    for block in blocks:
        runs: dict[str, list[dict]] = {m: [] for m in live}
        for r in range(args.runs):
            for m in live:  # interleaved, so every method sees the same machine noise
                if progress:
                    progress.update(task, description=f"{block >> 10} KiB run {r + 1}/{args.runs}: {m}")
                runs[m].append(run_pair(m, total, block, args.iters, args.timeout, device))
                if progress:
                    progress.advance(task)
        entry: dict[str, Any] = {"block": block, "pages": total // block, "methods": {}}
        raw_runs = runs["raw"]
        for m in live:
            rs = runs[m]
            good = [x["gbps"] for x in rs if "gbps" in x]
            ratios = [x["gbps"] / y["gbps"] for x, y in zip(rs, raw_runs) if "gbps" in x and "gbps" in y]
            entry["methods"][m] = {
                "gbps_runs": [round(g, 3) for g in good],
                "median_gbps": round(statistics.median(good), 3) if good else None,
                "min_gbps": round(min(good), 3) if good else None,
                "max_gbps": round(max(good), 3) if good else None,
                "ratio_to_raw_median": round(statistics.median(ratios), 3) if ratios else None,
                "bytes_ok": all(x.get("bytes_ok") for x in rs if "gbps" in x) and bool(good),
                "errors": [x["error"] for x in rs if "error" in x],
            }
        for m, why in skipped.items():
            entry["methods"][m] = {"skipped": why}
        if "p2phub-nixl" in runs and "p2phub-xfer" in runs:
            # the NIXL adapter's cost: its path against the own API's, run by run
            pairs = [x["gbps"] / y["gbps"] for x, y in zip(runs["p2phub-nixl"], runs["p2phub-xfer"])
                     if "gbps" in x and "gbps" in y]
            if pairs:
                entry["nixl_over_xfer"] = {"runs": [round(v, 3) for v in pairs],
                                           "median": round(statistics.median(pairs), 3)}
        results.append(entry)
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(), "kernel": platform.release(), "cpus": os.cpu_count(),
        "total_bytes": total, "iters": args.iters, "runs": args.runs,
        "transport": "TCP over 127.0.0.1, two processes per method",
        "device": device,
        "ratio": "method GB/s / raw GB/s of the same run, median over runs",
        "results": results,
    }


def _render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    where = "GPU -> GPU (cuda:0, staged), " if report.get("device") == "cuda" else ""
    t = Table(title=f"KV transfer, {where}TCP loopback, {report['total_bytes'] >> 20} MiB per transfer, "
                    f"{report['iters']} transfers x {report['runs']} runs (GB/s = 1e9 B/s)")
    for col in ("page", "method", "median GB/s", "min", "max", "x raw", "bytes"):
        t.add_column(col, justify="right")
    notes: dict[str, None] = {}   # one line per distinct error, under the table
    for e in report["results"]:
        for m, r in e["methods"].items():
            if "skipped" in r:
                t.add_row(f"{e['block'] >> 10} KiB", m, "skipped", "", "", "", "")
                notes.setdefault(f"{m}: skipped: {r['skipped']}", None)
                continue
            f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            t.add_row(f"{e['block'] >> 10} KiB", m, f(r["median_gbps"]), f(r["min_gbps"]),
                      f(r["max_gbps"]), f(r["ratio_to_raw_median"]),
                      "ok" if r["bytes_ok"] else "[red]failed[/] (below)")
            for err in r["errors"]:
                notes.setdefault(f"{m} at {e['block'] >> 10} KiB: {err}", None)
    console = Console()
    console.print(t)
    for e in report["results"]:
        if "nixl_over_xfer" in e:
            a = e["nixl_over_xfer"]
            console.print(f"{e['block'] >> 10} KiB: p2phub-nixl / p2phub-xfer, run by run "
                          f"{', '.join(f'{v:.2f}' for v in a['runs'])}: median {a['median']:.3f}",
                          markup=False, highlight=False)
    for note in notes:
        console.print(note, markup=False, highlight=False)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    try:
        with Progress(console=Console(stderr=True), transient=True) as prog:
            report = bench(args, prog)
    except ValueError as exc:
        from ..errors import UsageError
        raise UsageError(str(exc)) from None
    plot.maybe(args, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _render(report)
    bad = [m for e in report["results"] for m, r in e["methods"].items()
           if "skipped" not in r and not r["bytes_ok"]]
    return 1 if bad else 0
