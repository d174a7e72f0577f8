"""`p2phub bench nvme`: 4 KiB random reads through the engine vs fio io_uring on the kernel driver.

The engine side binds the target controller, makes one I/O queue and a
DMA-coherent buffer, and runs the C benchmark loop of the hot path
(p2h_bench_rand: uniformly random aligned LBAs over the whole namespace,
`qd` in flight, one doorbell per submission batch, latency = submit to reap
on the wall clock) pinned to one CPU. The baseline is fio with io_uring
(polled completion: --hipri, registered buffers and files) on a controller
left on the kernel nvme driver, pinned to the same CPU. Both run in the same
boot, on the same kind of backing (`tools/lab run --nvme-backing null` makes
both namespaces null-co devices, so neither measures a disk file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any


SCHEMA = "p2phub.bench.nvme/1"
PCTS = (50.0, 90.0, 99.0, 99.9)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("nvme", help="4 KiB random read IOPS/latency: engine vs fio io_uring")
    p.add_argument("--device", default=os.environ.get("P2PHUB_BENCH_DEVICE"),
                   help="controller for the engine (PCI address; default: $P2PHUB_BENCH_DEVICE)")
    p.add_argument("--baseline", default=os.environ.get("P2PHUB_BENCH_BASELINE"),
                   help="controller (PCI address) or block device left on the kernel driver, for fio "
                        "(default: $P2PHUB_BENCH_BASELINE)")
    p.add_argument("--nsid", type=int, default=1)
    p.add_argument("--qd", default="1,32", help="queue depths (default 1,32)")
    p.add_argument("--bs", type=int, default=4096)
    p.add_argument("--seconds", type=float, default=8.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--cpu", type=int, default=0, help="CPU both sides are pinned to")
    p.add_argument("--no-fio", action="store_true", help="engine only")
    p.add_argument("--keep-bound", action="store_true", help="leave the target on p2phub-nvme afterwards")
    p.add_argument("--json", action="store_true", help="print JSON")


def _percentiles(lat_ns: list[int]) -> dict[str, float]:
    lat = sorted(lat_ns)
    out = {"mean_us": sum(lat) / len(lat) / 1e3}
    for p in PCTS:
        out[f"p{p:g}_us"] = lat[min(len(lat) - 1, int(len(lat) * p / 100))] / 1e3
    return out


def bench_engine(bdf: str, nsid: int, qds: list[int], bs: int, seconds: float, warmup: float) -> dict:
    from ..nvme import controller as nvc

    with nvc.open(bdf, io_queues=1, queue_depth=max(64, 2 * max(qds))) as ctrl:
        hot = ctrl.hot
        ffi, lib = hot.ffi, hot.lib
        ns = ctrl.namespace(nsid)
        if bs % ns.lba_size:
            raise ValueError(f"block size {bs} is not a multiple of the LBA size {ns.lba_size}")
        qp = ctrl.io_qps[0]
        buf = ctrl.alloc_dma(max(qds) * bs, "bench")
        pl = buf.page_list()
        tmpl = ffi.new("struct p2h_io *")
        tmpl.opc = 0x02
        tmpl.nsid = nsid
        tmpl.nlb = bs // ns.lba_size
        tmpl.nbytes = bs
        tmpl.pages = pl.addrs
        tmpl.npages = pl.npages
        errors = ffi.new("uint64_t *")
        out: dict[str, Any] = {"controller": ctrl.ident.model, "namespace_blocks": ns.blocks,
                               "lba_size": ns.lba_size}
        chunk = 4096
        lat = ffi.new("uint32_t[]", chunk)
        for qd in qds:
            samples: list[int] = []
            total = errs = 0
            seed = 0x1234567 + qd
            with qp.lock:
                t_end = time.monotonic() + warmup
                while time.monotonic() < t_end:
                    lib.p2h_bench_rand(qp.c, tmpl, ns.blocks, qd, seed, 512, qd, 5 * 10**9, lat, errors)
                    seed += 1
                t0 = time.monotonic()
                t_end = t0 + seconds
                while True:
                    n = lib.p2h_bench_rand(qp.c, tmpl, ns.blocks, qd, seed, chunk, qd, 5 * 10**9, lat, errors)
                    seed += 1
                    if n < chunk:
                        raise RuntimeError(f"benchmark stalled at QD{qd}: {n} of {chunk} completed")
                    total += n
                    errs += errors[0]
                    samples.extend(lat[0:n])
                    if time.monotonic() >= t_end:
                        break
                elapsed = time.monotonic() - t0
            out[f"qd{qd}"] = {"ios": total, "errors": errs, "seconds": elapsed,
                              "iops": total / elapsed, **_percentiles(samples)}
        out["doorbells"] = int(qp.c.doorbells)
        out["submitted"] = int(qp.c.submitted)
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
        raise RuntimeError("no --device (PCI address of the controller for the engine) and no $P2PHUB_BENCH_DEVICE")
    qds = [int(x) for x in args.qd.split(",")]
    os.sched_setaffinity(0, {args.cpu})
    from ..nvme import bind

    report: dict[str, Any] = {
        "schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kernel": platform.release(), "cpu": args.cpu, "bs": args.bs, "seconds": args.seconds,
        "iommu_groups": any(Path("/sys/kernel/iommu_groups").glob("*")),
    }
    try:
        report["engine"] = bench_engine(args.device, args.nsid, qds, args.bs, args.seconds, args.warmup)
    finally:
        if not args.keep_bound and bind.current_driver(bind.normalize_bdf(args.device)) == bind.DRIVER:
            bind.unbind(args.device)
    if not args.no_fio and args.baseline:
        dev = _baseline_dev(args.baseline, args.nsid)
        report["fio_io_uring"] = bench_fio(dev, qds, args.bs, args.seconds, args.warmup, args.cpu)
        cmp: dict[str, Any] = {}
        for qd in qds:
            e, f = report["engine"][f"qd{qd}"], report["fio_io_uring"][f"qd{qd}"]
            cmp[f"qd{qd}"] = {"iops_ratio": e["iops"] / f["iops"] if f["iops"] else None,
                              "p50_latency_ratio": (e["p50_us"] / f["p50_us"]) if f.get("p50_us") else None,
                              "mean_latency_ratio": e["mean_us"] / f["mean_us"] if f["mean_us"] else None}
        report["comparison"] = cmp
        goals = {}
        if "qd32" in cmp:
            goals["qd32_iops_at_least_2x"] = (cmp["qd32"]["iops_ratio"] or 0) >= 2.0
        if "qd1" in cmp:
            goals["qd1_latency_lower"] = (cmp["qd1"]["p50_latency_ratio"] or 9) < 1.0
        report["goals"] = goals
    return report


def render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"4 KiB random read, CPU {report['cpu']}, {report['seconds']:g} s per run")
    for col in ("side", "QD", "IOPS", "mean", "p50", "p99", "p99.9"):
        t.add_column(col, justify="right" if col not in ("side",) else "left")
    for side in ("engine", "fio_io_uring"):
        if side not in report:
            continue
        for key, row in report[side].items():
            if not key.startswith("qd"):
                continue
            t.add_row(side, key[2:], f"{row['iops']:,.0f}", f"{row['mean_us']:.0f} us",
                      f"{row.get('p50_us', 0):.0f} us", f"{row.get('p99_us', 0):.0f} us",
                      f"{row.get('p99.9_us', 0):.0f} us")
    Console().print(t)
    for qd, c in report.get("comparison", {}).items():
        Console().print(f"{qd}: IOPS x{c['iops_ratio']:.2f} vs io_uring, p50 latency x{c['p50_latency_ratio']:.2f}")


def run(args: argparse.Namespace) -> int:
    try:
        report = run_bench(args)
    except Exception as exc:  # noqa: BLE001 - reported, with the schema, as a failed run
        if args.json:
            print(json.dumps({"schema": SCHEMA, "error": f"{type(exc).__name__}: {exc}"}))
        else:
            print(f"p2phub bench nvme: {exc}")
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render(report)
    return 0
