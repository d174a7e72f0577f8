"""`p2phub bench register`: what one registration costs, next to ibv_reg_mr over the same pages.

For each size, one udmabuf (memfd pages) is registered with p2phub and as a
verbs MR over the very same pages, in the same run:

- cold: ``hub.register_dmabuf(fd, device=...)`` then ``close()``: REGISTER with the
  device (the exporter attaches, pins and maps the pages for that PCI device)
  and UNREGISTER, through the public API;
- ioctl: the same two ioctls issued bare, with prepared arguments: what the
  kernel costs, so cold - ioctl is the Python API's own share;
- hit: the same call while a registration of those pages is open: the live
  registration comes back from the Hub's cache (a new handle on the same pin),
  and its close() only drops the reference;
- ibv_reg_mr: ``ibv_reg_mr`` + ``ibv_dereg_mr`` (pyverbs) over the udmabuf's memfd
  mapping, on the RDMA device given.

cold, ioctl and ibv_reg_mr are timed one call of each in turn, so all three see the same
machine even where its speed drifts (a shared host, an emulator).

udmabuf caps one buffer at its ``size_limit_mb`` parameter (64 MiB by default):
raise it (``/sys/module/udmabuf/parameters/size_limit_mb``, or the kernel command
line ``udmabuf.size_limit_mb=N``) to measure larger sizes.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import errno
import fcntl
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from .. import uapi
from ..errors import P2PHubError, P2PHubOSError, UsageError
from ..exitcodes import Exit
from ..hostmem import Udmabuf
from ..hub import Hub
from ..pci import PciAddress
from . import bench_kv, bench_load, bench_nvme, bench_ordering, bench_restore
from . import plot
from .argtypes import comma_list, new_file, non_negative_seconds, pci_address, positive, size_bytes
from .progress import steps

SCHEMA = "p2phub.bench.register/2"
DEFAULT_SIZES = "64K,1M,16M,256M,1G"
UDMABUF_LIMIT = Path("/sys/module/udmabuf/parameters/size_limit_mb")


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


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    bench_nvme.add_parser(sub)
    bench_ordering.add_parsers(sub)
    bench_load.add_parsers(sub)
    bench_kv.add_parser(sub)
    bench_restore.add_parser(sub)
    r = sub.add_parser("register", help="register+unregister latency and cache hits vs ibv_reg_mr")
    r.add_argument("--sizes", type=comma_list(size_bytes), default=DEFAULT_SIZES,
                   help=f"comma-separated (default {DEFAULT_SIZES})")
    r.add_argument("--device", type=pci_address, default=os.environ.get("P2PHUB_BENCH_DEVICE"),
                   help="PCI address to map for (default: $P2PHUB_BENCH_DEVICE)")
    r.add_argument("--rdma-dev", default=os.environ.get("P2PHUB_BENCH_RDMA_DEV"),
                   help="verbs device for the ibv_reg_mr baseline (default: $P2PHUB_BENCH_RDMA_DEV)")
    r.add_argument("--min-time", type=non_negative_seconds, default=1.0,
                   help="seconds per size and method (default 1; 0: three calls)")
    r.add_argument("--max-iters", type=positive, default=200,
                   help="most timed calls per size and method (default 200)")
    r.add_argument("--json", action="store_true", help="print JSON")
    r.set_defaults(_needs=("pyverbs",), _check=_check_register)
    for p in dict.fromkeys(sub.choices.values()):   # every bench draws its report on request
        p.add_argument("--plot", metavar="FILE.png", type=new_file,
                       help="also draw the report as a chart into FILE (.png, .svg, .pdf; needs matplotlib)")


def _check_register(args: argparse.Namespace) -> None:
    if not args.device:
        raise UsageError("no --device (PCI address to map for) and no $P2PHUB_BENCH_DEVICE")
    if not args.rdma_dev:
        raise UsageError("no --rdma-dev (verbs device for the baseline) and no $P2PHUB_BENCH_RDMA_DEV")


@dataclass
class Timing:
    iters: int
    median_us: float
    mean_us: float
    min_us: float
    max_us: float


def _timing(samples: list[float]) -> Timing:
    return Timing(len(samples), statistics.median(samples), statistics.fmean(samples),
                  min(samples), max(samples))


def _time(fn: Callable[[], None], min_time: float, max_iters: int) -> Timing:
    return _time_in_turn({"": fn}, min_time, max_iters)[""]


def _time_in_turn(fns: dict[str, Callable[[], None]], min_time: float,
                  max_iters: int) -> dict[str, Timing]:
    """Time each fn, one call of each in turn, until each has 3 samples and either `min_time`
    seconds of its own or `max_iters` samples: methods compared in one table see the same
    machine, even when its speed drifts."""
    for fn in fns.values():
        fn()  # warm-up: first-touch faults, lazy allocations
    samples: dict[str, list[float]] = {name: [] for name in fns}
    spent = dict.fromkeys(fns, 0.0)

    def more(name: str) -> bool:
        n = len(samples[name])
        return n < 3 or (spent[name] < min_time and n < max_iters)

    while any(more(name) for name in fns):
        for name, fn in fns.items():
            if not more(name):
                continue
            t0 = time.perf_counter_ns()
            fn()
            dt = time.perf_counter_ns() - t0
            samples[name].append(dt / 1000)
            spent[name] += dt / 1e9
    return {name: _timing(v) for name, v in samples.items()}


def _udmabuf(size: int) -> Udmabuf:
    try:
        return Udmabuf(size)
    except P2PHubOSError as exc:
        limit = UDMABUF_LIMIT.read_text().strip() if UDMABUF_LIMIT.exists() else "?"
        if exc.errno == errno.E2BIG or (limit.isdigit() and size > int(limit) << 20):
            raise P2PHubError(f"a {_fmt_size(size)} udmabuf is over udmabuf's size_limit_mb={limit}: "
                              f"raise it (echo {-(-size >> 20)} > {UDMABUF_LIMIT}) or leave this size "
                              "out of --sizes") from None
        raise


def _bench_register(args: argparse.Namespace) -> dict:
    import pyverbs.device as vdev
    import pyverbs.enums as venums
    from pyverbs.mr import MR
    from pyverbs.pd import PD

    device = PciAddress.parse(args.device)
    access = venums.IBV_ACCESS_LOCAL_WRITE | venums.IBV_ACCESS_REMOTE_WRITE | venums.IBV_ACCESS_REMOTE_READ
    results = []
    with Hub() as hub, vdev.Context(name=args.rdma_dev) as ctx, PD(ctx) as pd:
        dev_fd = hub.device.fd
        sizes = [_parse_size(s) for s in args.sizes.split(",")]
        with steps(args, "bench register", len(sizes)) as bar:
            for size in sizes:
                bar.describe(f"register + unregister {_fmt_size(size)}")
                buf = _udmabuf(size)
                cpu = buf.mmap()
                try:
                    # udmabuf made the memfd's pages; each method's warm-up call maps them
                    c = ctypes.c_char.from_buffer(cpu)
                    addr = ctypes.addressof(c)
                    del c
                    reg_arg = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF | uapi.REGISTER_F_DEVICE,
                                                fd=buf.fd, offset=0, length=size, domain=device.domain,
                                                bus=device.bus, devfn=device.devfn)
                    unreg_arg = uapi.Unregister.new()
                    # Outputs must come in as 0 (the UAPI's rule): each call starts from a copy.
                    reg_tmpl = bytes(reg_arg)

                    def cold() -> None:
                        hub.register_dmabuf(buf.fd, 0, size, device=device).close()

                    def bare() -> None:
                        ctypes.memmove(ctypes.addressof(reg_arg), reg_tmpl, len(reg_tmpl))
                        fcntl.ioctl(dev_fd, uapi.REGISTER, reg_arg, True)
                        unreg_arg.handle = reg_arg.out_handle
                        fcntl.ioctl(dev_fd, uapi.UNREGISTER, unreg_arg, True)

                    def verbs() -> None:
                        MR(pd, size, access, address=addr).close()

                    # the cold path, the bare ioctls and verbs, one call of each in turn
                    turns = _time_in_turn({"cold": cold, "bare": bare, "verbs": verbs},
                                          args.min_time, args.max_iters)
                    tc, tb, tv = turns["cold"], turns["bare"], turns["verbs"]
                    with hub.register_dmabuf(buf.fd, 0, size, device=device) as held:
                        def hit() -> None:
                            hub.register_dmabuf(buf.fd, 0, size, device=device).close()
                        th = _time(hit, args.min_time, args.max_iters)
                        assert held.shared == 1
                        # what a hit is made of: naming the memory (one fstat) and the
                        # revocation check (one P2PHUB_REG_INFO)
                        info_arg = uapi.RegInfo.new(handle=held.handle)
                        info_tmpl = bytes(info_arg)

                        def info() -> None:
                            ctypes.memmove(ctypes.addressof(info_arg), info_tmpl, len(info_tmpl))
                            fcntl.ioctl(dev_fd, uapi.REG_INFO, info_arg, True)
                        tstat = _time(lambda: os.fstat(buf.fd), args.min_time, args.max_iters)
                        tinfo = _time(info, args.min_time, args.max_iters)
                finally:
                    cpu.close()
                    buf.close()
                results.append({"size": size, "source": "udmabuf", "same_memory": True,
                                "p2phub": asdict(tc), "ioctl": asdict(tb), "hit": asdict(th),
                                "hit_fstat": asdict(tstat), "hit_reg_info": asdict(tinfo),
                                "ibv_reg_mr": asdict(tv),
                                "ratio": round(tc.median_us / tv.median_us, 3),
                                "ioctl_ratio": round(tb.median_us / tv.median_us, 3),
                                "python_us": round(tc.median_us - tb.median_us, 1)})
                bar.advance()
    return {
        "schema": SCHEMA,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kernel": platform.release(),
        "iommu": bool(os.path.isdir("/sys/class/iommu") and os.listdir("/sys/class/iommu")),
        "cpus": os.cpu_count(),
        "device": str(device),
        "rdma_dev": args.rdma_dev,
        "p2phub": "hub.register_dmabuf(fd, device=...).close(): REGISTER(F_DMABUF|F_DEVICE) + UNREGISTER",
        "ioctl": "the same REGISTER + UNREGISTER ioctls, bare",
        "hit": "the same call while a registration of the same pages is open (cache hit + release)",
        "hit_fstat": "os.fstat of the dma-buf alone (how a hit names the memory)",
        "hit_reg_info": "P2PHUB_REG_INFO alone (how a hit checks that the memory was not revoked)",
        "ibv_reg_mr": "ibv_reg_mr + ibv_dereg_mr over the same pages",
        "ratio": "p2phub median / ibv_reg_mr median",
        "results": results,
    }


def _render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"register + unregister of a udmabuf for {report['device']} vs ibv_reg_mr on "
                    f"{report['rdma_dev']} ({report['kernel']}, iommu={report['iommu']})")
    for col in ("size", "p2phub median", "bare ioctls", "cache hit", "ibv_reg_mr median", "ratio",
                "iters"):
        t.add_column(col, justify="right")
    for r in report["results"]:
        p, b, h, v = r["p2phub"], r["ioctl"], r["hit"], r["ibv_reg_mr"]
        t.add_row(_fmt_size(r["size"]), f"{p['median_us']:.0f} us", f"{b['median_us']:.0f} us",
                  f"{h['median_us']:.1f} us", f"{v['median_us']:.0f} us", f"{r['ratio']:.2f}",
                  f"{p['iters']}/{h['iters']}/{v['iters']}")
    Console().print(t)


def run(args: argparse.Namespace) -> int:
    if args.bench == "nvme":
        return bench_nvme.run(args)
    if args.bench in ("ordering", "fence"):
        return bench_ordering.run(args)
    if args.bench in ("load", "save"):
        return bench_load.run(args)
    if args.bench == "kv":
        return bench_kv.run(args)
    if args.bench == "restore":
        return bench_restore.run(args)
    report = _bench_register(args)  # errors: one line from the dispatcher (p2phub/cli.py)
    plot.maybe(args, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _render(report)
    return Exit.OK
