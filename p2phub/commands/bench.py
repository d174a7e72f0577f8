"""`p2phub bench register`: what one registration costs, next to ibv_reg_mr over the same memory.

For each size, the same host memory (a udmabuf where /dev/udmabuf exists, else
a vgem buffer) is registered with p2phub (REGISTER with the device, so the
exporter attaches, pins and maps it for that PCI device, then UNREGISTER), and
registered as a verbs MR (ibv_reg_mr + ibv_dereg_mr on the RDMA device; over
the udmabuf's own pages, or over an anonymous mapping of the same size when
the source is vgem, whose CPU mapping verbs cannot pin).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .. import labenv
from ..errors import P2PHubError
from ..hostmem import Udmabuf, VgemBuffer
from ..hub import Hub, PciAddress
from . import bench_kv, bench_nvme

SCHEMA = "p2phub.bench.register/1"
DEFAULT_SIZES = "64K,1M,16M,256M,1G"


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(text[:-1]) * units[text[-1]]
    return int(text)


def _fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _lab_env() -> dict[str, str]:
    return labenv.read()


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    bench_nvme.add_parser(sub)
    bench_kv.add_parser(sub)
    r = sub.add_parser("register", help="register+unregister latency vs ibv_reg_mr")
    lab = _lab_env()
    r.add_argument("--sizes", default=DEFAULT_SIZES, help=f"comma-separated (default {DEFAULT_SIZES})")
    r.add_argument("--device", default=lab.get("nvme_target"),
                   help="PCI address to map for (default: the lab's NVMe target)")
    r.add_argument("--rdma-dev", default=lab.get("node_a_rdma", "rxe-a"),
                   help="verbs device for the ibv_reg_mr baseline (default rxe-a)")
    r.add_argument("--source", choices=("auto", "udmabuf", "vgem"), default="auto")
    r.add_argument("--min-time", type=float, default=1.0, help="seconds per size and method")
    r.add_argument("--max-iters", type=int, default=200)
    r.add_argument("--json", action="store_true", help="print JSON")


@dataclass
class Timing:
    iters: int
    median_us: float
    mean_us: float
    min_us: float
    max_us: float


def _time(fn: Callable[[], None], min_time: float, max_iters: int) -> Timing:
    fn()  # warm-up: first-touch faults, lazy allocations
    samples: list[float] = []
    start = time.monotonic()
    while len(samples) < 3 or (time.monotonic() - start < min_time and len(samples) < max_iters):
        t0 = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - t0) / 1000)
    return Timing(len(samples), statistics.median(samples), statistics.fmean(samples),
                  min(samples), max(samples))


class _Source:
    """The memory for one size: a dma-buf fd for p2phub and an address for verbs."""

    def __init__(self, kind: str, size: int) -> None:
        self.kind = kind
        self.size = size
        if kind == "udmabuf":
            self.buf: Udmabuf | VgemBuffer = Udmabuf(size)
            self.map = self.buf.mmap()
            self.same_memory = True
        else:
            self.buf = VgemBuffer(size)
            self.map = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.same_memory = False
        for off in range(0, size, mmap.PAGESIZE):   # make the pages resident
            self.map[off] = 1
        c = ctypes.c_char.from_buffer(self.map)
        self.addr = ctypes.addressof(c)
        del c

    @property
    def fd(self) -> int:
        return self.buf.fd

    def close(self) -> None:
        self.map.close()
        self.buf.close()


def _bench_register(args: argparse.Namespace) -> dict:
    import pyverbs.device as vdev
    import pyverbs.enums as venums
    from pyverbs.mr import MR
    from pyverbs.pd import PD

    if not args.device:
        raise P2PHubError("no --device given and no lab environment to take the NVMe target from")
    device = PciAddress.parse(args.device)
    def source_for(size: int) -> str:
        if args.source != "auto":
            return args.source
        # udmabuf caps one buffer at its size_limit_mb parameter (default 64).
        limit = Path("/sys/module/udmabuf/parameters/size_limit_mb")
        if Path("/dev/udmabuf").exists() and (
                not limit.exists() or size <= int(limit.read_text()) << 20):
            return "udmabuf"
        return "vgem"

    access = venums.IBV_ACCESS_LOCAL_WRITE | venums.IBV_ACCESS_REMOTE_WRITE | venums.IBV_ACCESS_REMOTE_READ
    results = []
    with Hub() as hub, vdev.Context(name=args.rdma_dev) as ctx, PD(ctx) as pd:
        for size in (_parse_size(s) for s in args.sizes.split(",")):
            kind = source_for(size)
            src = _Source(kind, size)
            try:
                def p2p() -> None:
                    hub.register_dmabuf(src.fd, 0, size, device=device).close()

                def verbs() -> None:
                    MR(pd, size, access, address=src.addr).close()

                tp = _time(p2p, args.min_time, args.max_iters)
                tv = _time(verbs, args.min_time, args.max_iters)
            finally:
                src.close()
            results.append({"size": size, "p2phub": asdict(tp), "ibv_reg_mr": asdict(tv),
                            "ratio": round(tp.median_us / tv.median_us, 3),
                            "source": kind, "same_memory": src.same_memory})
    lab = _lab_env()
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kernel": platform.release(),
        "iommu": lab.get("iommu"),
        "accel": lab.get("accel"),
        "cpus": os.cpu_count(),
        "source": args.source,
        "device": str(device),
        "rdma_dev": args.rdma_dev,
        "p2phub": "REGISTER(F_DMABUF|F_DEVICE) + UNREGISTER",
        "ibv_reg_mr": "ibv_reg_mr + ibv_dereg_mr",
        "ratio": "p2phub median / ibv_reg_mr median",
        "results": results,
    }


def _render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"register + unregister, {report['source']} for {report['device']} "
                    f"vs ibv_reg_mr on {report['rdma_dev']} ({report['kernel']}, "
                    f"iommu={report['iommu']})")
    for col in ("size", "source", "p2phub median", "p2phub min", "ibv_reg_mr median", "ibv_reg_mr min",
                "ratio", "iters"):
        t.add_column(col, justify="right")
    for r in report["results"]:
        p, v = r["p2phub"], r["ibv_reg_mr"]
        t.add_row(_fmt_size(r["size"]), r["source"], f"{p['median_us']:.0f} us", f"{p['min_us']:.0f} us",
                  f"{v['median_us']:.0f} us", f"{v['min_us']:.0f} us", f"{r['ratio']:.2f}",
                  f"{p['iters']}/{v['iters']}")
    Console().print(t)


def run(args: argparse.Namespace) -> int:
    if args.bench == "nvme":
        return bench_nvme.run(args)
    if args.bench == "kv":
        return bench_kv.run(args)
    try:
        report = _bench_register(args)
    except (P2PHubError, OSError) as exc:
        if args.json:
            print(json.dumps({"schema": SCHEMA, "error": str(exc)}))
        else:
            print(f"p2phub bench: {exc}")
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _render(report)
    return 0
