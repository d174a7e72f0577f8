"""`p2phub bench nvme`: 4 KiB random reads: the public batch API, the C loop, and fio io_uring.

Three sides, in the same run, each pinned to the same CPU:

- ``public``: what a user runs. ``hub.nvme(bdf)``, a host-memory registration
  (``hub.alloc_host``, mapped for the controller through P2PHUB_NVME_MAP_REG),
  and ``ns.read_batch(reg, lbas, offsets, 4096, qd=QD)`` in chunks of 4096
  requests: encoded and checked in C, submitted and reaped by the hot path's
  pump, the revocation gate checked before every doorbell; no system call per
  I/O. The random LBAs are drawn before the clock starts (a user brings their own).
- ``c_loop``: the engine's own loop (``Namespace.run_generated``: requests
  generated in C, no request array) on a DMA-coherent buffer: the ceiling of
  the engine. The public path and the C loop run chunk by chunk in turn (4096
  requests each), so drifting machine speed slows both alike.
- ``fio_io_uring``: fio with io_uring (polled completion: --hipri, registered
  buffers and files) on a controller left on the kernel nvme driver.

The controllers come from --device/--baseline, or $P2PHUB_BENCH_DEVICE and
$P2PHUB_BENCH_BASELINE; nothing is assumed about the machine.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import platform
import random
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from ..pci import normalize

from . import plot
from .argtypes import comma_list, non_negative, non_negative_seconds, nvme_controller, positive, seconds
from .gc_clock import GcClock
from .progress import activity

SCHEMA = "p2phub.bench.nvme/2"
PCTS = (50.0, 90.0, 99.0, 99.9)
CHUNK = 4096


def add_parser(sub: Any) -> None:
    p = sub.add_parser("nvme", help="4 KiB random read IOPS/latency: public batch API, C loop, fio io_uring")
    p.add_argument("--device", type=nvme_controller, default=os.environ.get("P2PHUB_BENCH_DEVICE"),
                   help="controller for the engine (PCI address or /dev/nvmeN; default $P2PHUB_BENCH_DEVICE)")
    p.add_argument("--baseline", default=os.environ.get("P2PHUB_BENCH_BASELINE"),
                   help="controller (PCI address) or block device left on the kernel driver, for fio "
                        "(default $P2PHUB_BENCH_BASELINE)")
    p.add_argument("--nsid", type=positive, default=1, help="namespace id (default 1)")
    p.add_argument("--qd", type=comma_list(positive), default="1,32", help="queue depths (default 1,32)")
    p.add_argument("--bs", type=positive, default=4096, help="bytes per read (default 4096)")
    p.add_argument("--seconds", type=seconds, default=8.0, help="measured seconds per run (default 8)")
    p.add_argument("--warmup", type=non_negative_seconds, default=1.0,
                   help="seconds run before measuring (default 1)")
    p.add_argument("--cpu", type=non_negative, default=0, help="CPU every side is pinned to (default 0)")
    p.add_argument("--no-fio", action="store_true", help="engine only")
    p.add_argument("--keep-bound", action="store_true", help="leave the target on p2phub-nvme afterwards")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(_check=_check)


def _check(args: argparse.Namespace) -> None:
    from ..errors import UsageError
    if not args.device:
        raise UsageError("no --device (the controller for the engine) and no $P2PHUB_BENCH_DEVICE")
    if args.cpu not in os.sched_getaffinity(0):
        raise UsageError(f"--cpu {args.cpu} is not one this process may run on "
                         f"({sorted(os.sched_getaffinity(0))})")
    if args.bs % 512:
        raise UsageError(f"--bs {args.bs} is not a multiple of 512")

def _percentiles(lat_ns: Any) -> dict[str, float]:
    lat = sorted(lat_ns)
    out = {"mean_us": sum(lat) / len(lat) / 1e3}
    for p in PCTS:
        out[f"p{p:g}_us"] = lat[min(len(lat) - 1, int(len(lat) * p / 100))] / 1e3
    return out


def _interleaved(chunks: dict[str, Any], seconds: float,
                 warmup: float) -> dict[str, tuple[int, float, Any, float, int]]:
    """Call each run_chunk() -> latencies in turn until each has run `seconds` (after `warmup`
    of each): the sides alternate chunk by chunk, so a machine whose speed drifts (a shared host,
    an emulator) slows them alike. Per side: (requests, seconds spent in its own chunks,
    latencies, seconds of those the cycle collector ran, full collections among them)."""
    for run_chunk in chunks.values():
        t_end = time.monotonic() + warmup
        while time.monotonic() < t_end:
            run_chunk()
    acc: dict[str, list[Any]] = {name: [0, 0.0, array.array("Q"), GcClock()] for name in chunks}
    while min(a[1] for a in acc.values()) < seconds:
        for name, run_chunk in chunks.items():
            a = acc[name]
            t0 = time.monotonic()
            with a[3]:
                lat = run_chunk()
            a[1] += time.monotonic() - t0
            a[0] += len(lat)
            a[2].extend(lat)
    return {name: (a[0], a[1], a[2], a[3].seconds, a[3].full) for name, a in acc.items()}


def bench_engine(bdf: str, nsid: int, qds: list[int], bs: int, seconds: float, warmup: float) -> dict:
    """The public batch API and the engine's C loop, chunk by chunk in turn, at each QD."""
    from ..hub import Hub

    from .. import metrics

    # metrics: whether the public path fed Prometheus (prometheus_client installed), as a user's would
    out: dict[str, Any] = {"public": {}, "c_loop": {}, "public_vs_c_loop": {}, "interleaved": True,
                           "metrics": metrics.ENABLED}
    with Hub() as hub:
        ctrl = hub.nvme(bdf, io_queues=1, queue_depth=max(64, 2 * max(qds)))
        reg = None
        try:
            ns = ctrl.namespace(nsid)
            if bs % ns.lba_size:
                raise ValueError(f"block size {bs} is not a multiple of the LBA size {ns.lba_size}")
            qp = ctrl.io_qps[0]
            out.update({"controller": ctrl.ident.model, "namespace_blocks": ns.blocks, "lba_size": ns.lba_size})
            nslots = max(qds)
            reg = hub.alloc_host(nslots * bs, device=bdf)
            dma = ctrl.alloc_dma(nslots * bs, "bench")   # the C loop's own DMA-coherent buffer
            units = ns.blocks // (bs // ns.lba_size)
            rnd = random.Random(0x5EED)
            pools = [array.array("Q", [rnd.randrange(units) * (bs // ns.lba_size) for _ in range(CHUNK)])
                     for _ in range(8)]
            for qd in qds:
                offsets = array.array("Q", [(i % qd) * bs for i in range(CHUNK)])
                k = [0]
                seed = [0x1234567 + qd]

                def public_chunk() -> list[int]:
                    k[0] += 1
                    fut = ns.read_batch(reg, pools[k[0] % len(pools)], offsets, bs, qd=qd, qpair=qp,
                                        latencies=True)
                    fut.result(timeout=60)
                    return fut.latencies_ns()

                def c_chunk() -> list[int]:
                    seed[0] += 1
                    return ns.run_generated("read", dma, bs, CHUNK, qd=qd, seed=seed[0] - 1, qpair=qp,
                                            timeout=5.0, slots=qd, latencies=True)

                got = _interleaved({"public": public_chunk, "c_loop": c_chunk}, seconds, warmup)
                for side, (total, elapsed, samples, gc_s, gc_full) in got.items():
                    out[side][f"qd{qd}"] = {"ios": total, "seconds": elapsed, "iops": total / elapsed,
                                            "gc_ms": round(gc_s * 1e3, 2), "gc_full": gc_full,
                                            **_percentiles(samples)}
                key = f"qd{qd}"
                out["public_vs_c_loop"][key] = out["public"][key]["iops"] / out["c_loop"][key]["iops"]
            stats = qp.stats()
            out["public"]["gate"] = {"refused": stats["refused"],
                                     "registration_inflight_after": ctrl.inflight(reg)}
            ctrl.quiesce_registration(reg, timeout=10)
            out["doorbells"] = stats["doorbells"]
            out["submitted"] = stats["submitted"]
        finally:
            ctrl.close()
            if reg is not None:
                reg.close()
    return out


def _baseline_dev(baseline: str, nsid: int) -> str:
    if baseline.startswith("/dev/"):
        return baseline
    from ..nvme import bind

    for dev in bind.block_devices(baseline):
        if int(Path(f"/sys/class/block/{os.path.basename(dev)}/nsid").read_text()) == nsid:
            return dev
    raise RuntimeError(f"no block device for nsid {nsid} of {baseline} (is it on the kernel nvme driver?)")


def bench_fio(dev: str, qds: list[int], bs: int, seconds: float, warmup: float, cpu: int) -> dict:
    fio = shutil.which("fio")
    if fio is None:
        raise RuntimeError("fio is not installed (tools/setup installs it)")
    out: dict[str, Any] = {"device": dev, "fio": subprocess.run([fio, "--version"], capture_output=True,
                                                                 text=True).stdout.strip()}
    for qd in qds:
        cmd = [fio, f"--name=qd{qd}", f"--filename={dev}", "--ioengine=io_uring", "--hipri",
               "--fixedbufs", "--registerfiles", "--direct=1", "--rw=randread", f"--bs={bs}",
               f"--iodepth={qd}",
               "--time_based", f"--runtime={seconds:g}", f"--ramp_time={warmup:g}",
               f"--cpus_allowed={cpu}", "--norandommap", "--randrepeat=0", "--lat_percentiles=1",
               "--clat_percentiles=0", "--percentile_list=50:90:99:99.9", "--output-format=json"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"fio failed: {res.stderr.strip()[-400:]}")
        job = json.loads(res.stdout[res.stdout.index("{"):])["jobs"][0]["read"]
        lat = job["lat_ns"]
        pct = lat.get("percentile", {})
        row = {"ios": job["total_ios"], "iops": job["iops"], "mean_us": lat["mean"] / 1e3,
               "command": " ".join(cmd[1:])}
        for p in PCTS:
            key = f"{p:.6f}"
            if key in pct:
                row[f"p{p:g}_us"] = pct[key] / 1e3
        out[f"qd{qd}"] = row
    return out


def run_bench(args: argparse.Namespace) -> dict:
    if not args.device:
        raise RuntimeError("no --device (PCI address of the controller for the engine; or $P2PHUB_BENCH_DEVICE)")
    qds = [int(x) for x in args.qd.split(",")]
    os.sched_setaffinity(0, {args.cpu})
    from ..nvme import bind

    report: dict[str, Any] = {
        "schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kernel": platform.release(), "machine": platform.machine(), "cpu": args.cpu, "bs": args.bs,
        "seconds": args.seconds, "device": args.device, "baseline": args.baseline,
        "iommu_groups": any(Path("/sys/kernel/iommu_groups").glob("*")),
    }
    try:
        report["engine"] = bench_engine(args.device, args.nsid, qds, args.bs, args.seconds, args.warmup)
    finally:
        if not args.keep_bound and bind.current_driver(normalize(args.device)) == bind.DRIVER:
            bind.unbind(args.device)
    if not args.no_fio and args.baseline:
        dev = _baseline_dev(args.baseline, args.nsid)
        report["fio_io_uring"] = bench_fio(dev, qds, args.bs, args.seconds, args.warmup, args.cpu)
        cmp: dict[str, Any] = {}
        for qd in qds:
            f = report["fio_io_uring"][f"qd{qd}"]
            row: dict[str, Any] = {}
            for side in ("public", "c_loop"):
                e = report["engine"][side][f"qd{qd}"]
                row[side] = {"iops_ratio": e["iops"] / f["iops"] if f["iops"] else None,
                             "p50_latency_ratio": (e["p50_us"] / f["p50_us"]) if f.get("p50_us") else None,
                             "mean_latency_ratio": e["mean_us"] / f["mean_us"] if f["mean_us"] else None}
            cmp[f"qd{qd}"] = row
        report["comparison"] = cmp
    return report


def render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"4 KiB random read, CPU {report['cpu']}, {report['seconds']:g} s per run")
    for col in ("side", "QD", "IOPS", "mean", "p50", "p99", "p99.9"):
        t.add_column(col, justify="right" if col not in ("side",) else "left")
    sides = [("public batch API", report.get("engine", {}).get("public", {})),
             ("C loop", report.get("engine", {}).get("c_loop", {})),
             ("fio io_uring", report.get("fio_io_uring", {}))]
    for side, rows in sides:
        for key, row in rows.items():
            if not key.startswith("qd"):
                continue
            t.add_row(side, key[2:], f"{row['iops']:,.0f}", f"{row['mean_us']:.0f} us",
                      f"{row.get('p50_us', 0):.0f} us", f"{row.get('p99_us', 0):.0f} us",
                      f"{row.get('p99.9_us', 0):.0f} us")
    Console().print(t)
    for qd, r in report.get("engine", {}).get("public_vs_c_loop", {}).items():
        Console().print(f"{qd} public: IOPS x{r:.2f} vs the C loop")
    for qd, c in report.get("comparison", {}).items():
        for side, r in c.items():
            Console().print(f"{qd} {side}: IOPS x{r['iops_ratio']:.2f} vs io_uring, "
                            f"p50 latency x{r['p50_latency_ratio']:.2f}")


def run(args: argparse.Namespace) -> int:
    # errors (and Ctrl-C) are reported by the dispatcher, p2phub/cli.py
    qds = len(args.qd.split(","))
    sides = 2 + (0 if args.no_fio or not args.baseline else 1)
    with activity(args, f"bench nvme: {sides} sides x {qds} queue depths x "
                        f"{args.seconds + args.warmup:g} s"):
        report = run_bench(args)
    plot.maybe(args, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    return 0
