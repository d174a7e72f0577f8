"""`p2phub bench ordering` and `p2phub bench fence`.

ordering: what declaring an access costs with 1, 1k and 100k other accesses live on
  the same registration: enter (conflict check + insert), bind to a fence, complete
  (release). Baseline in the same run: the fence alone (make one, complete it).
fence (a CUDA machine): how soon a GPU kernel starts after the host completes a fence.
  on_stream: the kernel is enqueued behind ``fence.on_stream(stream)``
  (cuStreamWaitValue32 on a pinned host word); the host completes the fence and
  watches for the kernel's first store. Round trip: a thread blocked in
  ``fence.wait()`` launches the kernel once it returns (the public API's CPU path).
  Each kernel reads a host word written just before the fence completed and
  records it: every value must be the new one (the kernel never started early).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import queue
import statistics
import sys
import threading
import time
from typing import Any

from . import plot
from .argtypes import comma_list, gpu_present, non_negative, non_negative_seconds, positive
from .progress import steps

SCHEMA_ORDERING = "p2phub.bench.ordering/1"
SCHEMA_FENCE = "p2phub.bench.fence/1"


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("ordering", help="per-access cost of the range tracker at 1, 1k, 100k live ranges")
    p.add_argument("--live", type=comma_list(non_negative), default="1,1000,100000",
                   help="live ranges, comma-separated (default 1,1000,100000)")
    p.add_argument("--ops", type=positive, default=20000, help="timed accesses per run (default 20000)")
    p.add_argument("--runs", type=positive, default=5, help="runs; medians are reported (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON")
    f = sub.add_parser("fence", help="GPU stream released by fence.on_stream vs a CPU round trip (CUDA)")
    f.add_argument("--iters", type=positive, default=2000, help="kernels per run and mode (default 2000)")
    f.add_argument("--runs", type=positive, default=3, help="runs; medians are reported (default 3)")
    f.add_argument("--hold-us", type=non_negative_seconds, default=100.0,
                   help="how long the host holds each fence before completing it (default 100 us)")
    f.add_argument("--json", action="store_true", help="print JSON")
    f.set_defaults(_needs=("cupy", "numpy", "p2phub_cuda"), _check=_check_fence)


def _check_fence(args: argparse.Namespace) -> None:
    from ..errors import MissingDependencyError
    if gpu_present() is None:
        raise MissingDependencyError("a CUDA GPU", "bench fence found no GPU driver here "
                                     "(no /dev/nvidiactl)")


def _pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(len(v) * p / 100))]


def _meta() -> dict:
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(),
            "machine": platform.machine()}


# ------------------------------------------------------------------------- ordering


def bench_ordering(live_counts: list[int], ops: int, runs: int, bar: Any = None) -> dict:
    from ..ordering import AccessKind, HostFence, Ordering

    stride = 8192
    rows = []
    for live in live_counts:
        length = (live + ops + 2) * stride
        o = Ordering("bench", length)
        keep = []
        for i in range(live):  # live ranges: every other 4 KiB, held by pending fences
            a = o.enter(i * stride, 4096, AccessKind.NVME_READ)
            f = HostFence()
            a.bind(f)
            keep.append(f)
        base_runs, acc_runs, check_runs = [], [], []
        base_cpu, acc_cpu = [], []
        for _ in range(runs):
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            for _i in range(ops):
                f = HostFence()
                f.set()
            base_runs.append((time.perf_counter_ns() - t0) / ops)
            base_cpu.append((time.thread_time_ns() - c0) / ops)

            # The declared accesses land between the live ones (no conflict, no wait),
            # spread over the whole registration.
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            for i in range(ops):
                off = (i % max(live, 1)) * stride + 4096
                a = o.acquire(off, 4096, AccessKind.RDMA_SEND)
                f = HostFence()
                a.bind(f)
                f.set()
            acc_runs.append((time.perf_counter_ns() - t0) / ops)
            acc_cpu.append((time.thread_time_ns() - c0) / ops)

            t0 = time.perf_counter_ns()
            for i in range(ops):
                o.overlapping((i % max(live, 1)) * stride, 8192)
            check_runs.append((time.perf_counter_ns() - t0) / ops)
            if bar is not None:
                bar.advance(description=f"{live:,} live ranges")
        if len(o) != live:
            raise RuntimeError(f"the tracker holds {len(o)} ranges, expected {live}")
        for f in keep:
            f.set()
        if len(o):
            raise RuntimeError(f"the tracker holds {len(o)} ranges after every fence completed")
        base = statistics.median(base_runs)
        acc = statistics.median(acc_runs)
        bcpu, acpu = statistics.median(base_cpu), statistics.median(acc_cpu)
        rows.append({"live": live, "runs": runs, "ops_per_run": ops,
                     "fence_only_us": base / 1e3, "access_us": acc / 1e3,
                     "lookup_us": statistics.median(check_runs) / 1e3,
                     "tracker_us": (acc - base) / 1e3, "ratio": acc / base,
                     # CPU time of this thread: what the host's other load does not inflate
                     "fence_only_cpu_us": bcpu / 1e3, "access_cpu_us": acpu / 1e3,
                     "tracker_cpu_us": (acpu - bcpu) / 1e3, "cpu_ratio": acpu / bcpu,
                     "access_runs_us": [x / 1e3 for x in acc_runs],
                     "access_cpu_runs_us": [x / 1e3 for x in acc_cpu]})
    return {"schema": SCHEMA_ORDERING, **_meta(), "results": rows}


def _render_ordering(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="p2phub bench ordering: one access (enter + bind + release), medians")
    for col in ("live ranges", "fence only", "access", "tracker share", "access CPU",
                "tracker CPU", "lookup", "CPU ratio"):
        t.add_column(col, justify="right")
    for r in rep["results"]:
        t.add_row(f"{r['live']:,}", f"{r['fence_only_us']:.2f} us", f"{r['access_us']:.2f} us",
                  f"{r['tracker_us']:.2f} us", f"{r['access_cpu_us']:.2f} us",
                  f"{r['tracker_cpu_us']:.2f} us", f"{r['lookup_us']:.2f} us",
                  f"{r['cpu_ratio']:.2f}")
    Console().print(t)


# ------------------------------------------------------------------------- fence (GPU)

_KERNEL = r"""
extern "C" __global__ void consume(const volatile unsigned int *data, volatile unsigned int *flag,
                                   unsigned int *out, unsigned int i) {
    unsigned int v = *data;       // what the host wrote before completing the fence
    out[i] = v;
    __threadfence_system();
    *flag = i + 1u;               // the host watches for this: the kernel has started
}
"""


_SPIN_C = r"""
#include <stdint.h>
#include <time.h>
static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
/* CLOCK_MONOTONIC when *p == v, or 0 after limit_ns. */
uint64_t p2h_spin_until(volatile uint32_t *p, uint32_t v, uint64_t limit_ns) {
    uint64_t start = now_ns();
    for (;;) {
        if (*p == v)
            return now_ns();
        if (now_ns() - start > limit_ns)
            return 0;
    }
}
"""


def _c_spin():
    """A C spin-wait on a host word, built with the machine's C compiler; None without one."""
    import ctypes
    import os
    import shutil
    import subprocess
    import tempfile

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    d = tempfile.mkdtemp(prefix="p2phub-spin-")
    src, lib = os.path.join(d, "spin.c"), os.path.join(d, "spin.so")
    with open(src, "w") as f:
        f.write(_SPIN_C)
    if subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", lib, src],
                      capture_output=True).returncode != 0:
        return None
    fn = ctypes.CDLL(lib).p2h_spin_until
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64]
    fn.restype = ctypes.c_uint64
    return fn


def bench_fence(iters: int, runs: int, hold_us: float) -> dict:
    import ctypes

    import cupy as cp  # the image's CuPy compiles the kernel (NVRTC) and launches it
    import numpy as np

    from ..ordering import HostFence

    sys.setswitchinterval(0.0005)  # let a woken waiter thread get the GIL promptly
    cp.cuda.Device(0).use()
    import p2phub_cuda

    ops = p2phub_cuda.stream_ops()
    words = ops.alloc_completion_words(64, 0)
    data = ctypes.c_uint32.from_address(words.host_ptr)
    flag = ctypes.c_uint32.from_address(words.host_ptr + 64)
    ddata, dflag = np.uint64(words.dev_ptr), np.uint64(words.dev_ptr + 64)
    kern = cp.RawKernel(_KERNEL, "consume")
    stream = cp.cuda.Stream(non_blocking=True)
    out = cp.zeros(iters + 1, dtype=cp.uint32)
    hold_s = hold_us / 1e6

    def launch(i: int) -> None:
        kern((1,), (1,), (ddata, dflag, out, np.uint32(i)), stream=stream)

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    spin_until = _c_spin()

    def observe(target: int, t0: int) -> int:
        """Nanoseconds from t0 (CLOCK_MONOTONIC) until the kernel's flag reads `target`.
        The C spin releases the GIL (a ctypes call), so a waiter thread runs meanwhile."""
        if spin_until is not None:
            seen = spin_until(words.host_ptr + 64, target, 10_000_000_000)
            if not seen:
                raise TimeoutError(f"the kernel for {target} never started")
            return seen - t0
        while flag.value != target:
            pass
        return time.monotonic_ns() - t0

    # warm up: compile, first launch, word pool
    launch(0)
    stream.synchronize()
    f = HostFence()
    f.on_stream(stream, ops)
    f.set()
    stream.synchronize()

    def run_on_stream(seq0: int) -> tuple[list[float], int]:
        lat, early = [], 0
        for k in range(iters):
            i = seq0 + k
            f = HostFence(f"bench {i}")
            f.on_stream(stream, ops)
            launch(k)
            spin(hold_s)
            if flag.value == k + 1:
                early += 1
            data.value = i
            t0 = time.monotonic_ns()
            f.set()
            lat.append(observe(k + 1, t0) / 1e3)
        stream.synchronize()
        return lat, early

    def run_round_trip(seq0: int) -> tuple[list[float], int]:
        lat: list[float] = []
        q: queue.Queue = queue.Queue()

        def waiter() -> None:
            while True:
                item = q.get()
                if item is None:
                    return
                k, f = item
                f.wait()           # the public API's CPU path: wait for the fence ...
                launch(k)          # ... then launch the consumer

        th = threading.Thread(target=waiter, daemon=True)
        th.start()
        for k in range(iters):
            i = seq0 + k
            f = HostFence(f"bench {i}")
            q.put((k, f))
            spin(hold_s)
            data.value = i
            t0 = time.monotonic_ns()
            f.set()
            lat.append(observe(k + 1, t0) / 1e3)
        q.put(None)
        th.join()
        stream.synchronize()
        return lat, 0

    results: dict[str, list[dict]] = {"on_stream": [], "round_trip": []}
    wrong = 0
    seq = 1 << 20
    for _r in range(runs):
        for mode, fn in (("on_stream", run_on_stream), ("round_trip", run_round_trip)):
            flag.value = 0
            out.fill(0)
            cp.cuda.Device(0).synchronize()
            lat, early = fn(seq)
            got = out[:iters].get()
            bad = int((got != np.arange(seq, seq + iters, dtype=np.uint32)).sum())
            wrong += bad
            results[mode].append({"p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99),
                                  "min_us": min(lat), "mean_us": statistics.fmean(lat),
                                  "early_starts": early, "wrong_values": bad})
            seq += iters

    def summary(rows: list[dict]) -> dict:
        return {k: statistics.median(r[k] for r in rows) for k in ("p50_us", "p99_us", "min_us", "mean_us")}

    on, rt = summary(results["on_stream"]), summary(results["round_trip"])
    words.close()
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"]
    order, opts = ops.rdma_write_ordering(0)
    return {"schema": SCHEMA_FENCE, **_meta(), "gpu": name.decode() if isinstance(name, bytes) else str(name),
            "iters": iters, "runs": runs, "hold_us": hold_us,
            "rdma_writes_ordering": order, "rdma_flush_options": opts,
            "rdma_flush_required": ops.rdma_flush_required(0),
            "on_stream": on, "round_trip": rt,
            "p50_ratio": on["p50_us"] / rt["p50_us"], "p99_ratio": on["p99_us"] / rt["p99_us"],
            "observer": "C spin (ctypes, GIL released)" if spin_until is not None else "Python spin",
            "early_starts": sum(r["early_starts"] for r in results["on_stream"]),
            "wrong_values": wrong, "runs_detail": results}


def _render_fence(rep: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"p2phub bench fence on {rep['gpu']}: fence completed -> consumer kernel started")
    for col in ("path", "p50", "p99", "min", "mean"):
        t.add_column(col, justify="right")
    for name, key in (("fence.on_stream (cuStreamWaitValue32)", "on_stream"),
                      ("fence.wait() then launch", "round_trip")):
        r = rep[key]
        t.add_row(name, f"{r['p50_us']:.1f} us", f"{r['p99_us']:.1f} us", f"{r['min_us']:.1f} us",
                  f"{r['mean_us']:.1f} us")
    Console().print(t)
    Console().print(f"p50 ratio {rep['p50_ratio']:.2f}, p99 ratio {rep['p99_ratio']:.2f}; "
                    f"early starts {rep['early_starts']}, wrong values {rep['wrong_values']}")


def run(args: argparse.Namespace) -> int:
    # errors (and Ctrl-C) are reported by the dispatcher, p2phub/cli.py
    if args.bench == "ordering":
        live = [int(x) for x in args.live.split(",") if x.strip()]
        with steps(args, "bench ordering", len(live) * args.runs) as bar:
            rep = bench_ordering(live, args.ops, args.runs, bar)
    else:
        with steps(args, "bench fence", 1):
            rep = bench_fence(args.iters, args.runs, args.hold_us)
    plot.maybe(args, rep)
    if args.json:
        print(json.dumps(rep, indent=2))
    elif args.bench == "ordering":
        _render_ordering(rep)
    else:
        _render_fence(rep)
    if args.bench == "fence" and (rep["early_starts"] or rep["wrong_values"]):
        return 1
    return 0
