"""`p2phub bench load|save`: a multi-GiB file into GPU memory (and back) through p2phub,
side by side in one run with the other ways to do it, and the disk's own ceiling.

load, per run (page cache dropped before every read; all reads O_DIRECT where the
method can):
  ceiling   deep-queue O_DIRECT preads into host memory (4, 8 and 16 threads of
            --chunk bytes); the best of them is the ceiling of that run
  p2phub    hub.load(path, hub.register(tensor)) (staged mode where there is no
            /dev/p2phub: pinned bounce lanes, disk and PCIe overlapped)
  kvikio    kvikio.CuFile(path).read(cupy array) (compat mode unless GDS works)
  torch     single-stream O_DIRECT reads into two pinned buffers, each copied to the GPU
            on a stream while the next is read (double-buffered)
  cufile    cuda.bindings.cufile cuFileRead in compatibility mode

save is the same the other way (D2H, then O_DIRECT writes and an fsync), with
deep-queue O_DIRECT pwrites from host memory as the ceiling. ``p2phub-buffered``
(in --peers) runs p2phub's transfer through the page cache instead of O_DIRECT (a
save then ends with the fsync), as kvikio's compatibility mode does.

Bytes are verified on the GPU (load) and against the source file (save). Medians
over --runs; ratios of p2phub to the ceiling and to each peer of the same run.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from .._resource import Resource
from . import plot
from .argtypes import comma_list, positive, size_text

SCHEMA = "p2phub.bench.load/1"
SEED = 0x5DEECE66D
GiB = 1 << 30
MiB = 1 << 20


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def add_parsers(sub: Any) -> None:
    for name, help_ in (("load", "a multi-GiB file into GPU memory: p2phub vs kvikio, cuFile, "
                                 "torch and the disk's deep-queue ceiling"),
                        ("save", "GPU memory out to a file: p2phub vs kvikio, torch and the "
                                 "disk's deep-queue ceiling")):
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--file", default="/var/tmp/p2phub-bench.bin",
                       help="the file to read (made with a checkable pattern if missing or of "
                            "another size)")
        p.add_argument("--size", type=size_text, default="4G", help="file size (default 4G)")
        p.add_argument("--out", default=None, help="save: the file to write (default FILE.out)")
        p.add_argument("--runs", type=positive, default=3, help="runs; medians are reported")
        p.add_argument("--peers", default="ceiling,p2phub,kvikio,torch,cufile",
                       help="methods to run, in order (default all)")
        p.add_argument("--chunk", type=size_text, default="16M", help="bytes per I/O (default 16M)")
        p.add_argument("--lanes", type=positive, default=16, help="p2phub lanes (I/Os in flight, "
                       "default 16)")
        p.add_argument("--ceiling-threads", type=comma_list(positive), default="4,8,16",
                       help="thread counts of the deep-queue ceiling (best is kept)")
        p.add_argument("--kvikio-threads", type=positive, default=8, help="kvikio's thread pool (default 8)")
        p.add_argument("--mode", choices=("auto", "p2p", "staged"), default="auto",
                       help="Hub mode for p2phub (default auto)")
        p.add_argument("--json", action="store_true", help="print JSON")
        p.set_defaults(bench_io=name, _needs=("torch",))


# ------------------------------------------------------------------ helpers


def drop_caches(path: str) -> str:
    """Drop the file's pages from the page cache: 'dropped' (global drop) or 'fadvise'."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError:
        pass
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped"
    except OSError:
        return "fadvise"


def make_file(path: str, size: int, chunk: int = 64 * MiB) -> None:
    """`size` bytes (a multiple of 8) of int64 words, word i = i ^ SEED: checkable anywhere,
    and not compressible to nothing. Left alone if it already has that size."""
    if os.path.exists(path) and os.path.getsize(path) == size:
        return
    try:
        import numpy as np
    except ImportError:
        np = None
    with open(path, "wb") as f:
        for off in range(0, size, chunk):
            first, n = off // 8, min(chunk, size - off) // 8
            if np is not None:
                f.write((np.arange(first, first + n, dtype=np.int64) ^ SEED).tobytes())
            else:
                import array
                f.write(array.array("q", (i ^ SEED for i in range(first, first + n))).tobytes())
        f.flush()
        os.fsync(f.fileno())


def verify_gpu(t: Any, nbytes: int) -> bool:
    """The GPU buffer holds the pattern (checked on the GPU)."""
    import torch
    w = t[:nbytes].view(torch.int64)
    step = 1 << 27   # 1 GiB of words at a time
    for i in range(0, w.numel(), step):
        n = min(step, w.numel() - i)
        exp = torch.arange(i, i + n, dtype=torch.int64, device=t.device) ^ SEED
        if not torch.equal(w[i:i + n], exp):
            return False
    return True


def _aligned(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size)


# ------------------------------------------------------------------ load methods


def ceiling_read(path: str, size: int, chunk: int, threads: int) -> float:
    bufs = [_aligned(chunk) for _ in range(threads)]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    nxt = iter(range(0, size, chunk))
    lock = threading.Lock()

    def work(buf: mmap.mmap) -> None:
        mv = memoryview(buf)
        while True:
            with lock:
                off = next(nxt, None)
            if off is None:
                return
            os.preadv(fd, [mv], off)

    try:
        t0 = time.perf_counter()
        ths = [threading.Thread(target=work, args=(b,)) for b in bufs]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def ceiling_write(path: str, size: int, chunk: int, threads: int) -> float:
    bufs = [_aligned(chunk) for _ in range(threads)]
    for b in bufs:
        b.write(b"\xa5" * chunk)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    nxt = iter(range(0, size, chunk))
    lock = threading.Lock()

    def work(buf: mmap.mmap) -> None:
        mv = memoryview(buf)
        while True:
            with lock:
                off = next(nxt, None)
            if off is None:
                return
            os.pwritev(fd, [mv[:min(chunk, size - off)]], off)

    try:
        t0 = time.perf_counter()
        ths = [threading.Thread(target=work, args=(b,)) for b in bufs]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


class P2PHubMethod(Resource):
    def __init__(self, gpu: Any, chunk: int, lanes: int, mode: str, show: Callable | None,
                 direct: bool = True) -> None:
        from p2phub.hub import Hub
        self.direct = direct
        from p2phub import staged
        self.hub = Hub(mode=mode)
        staged.configure(self.hub, chunk=chunk, lanes=lanes)
        self.reg = self.hub.register(gpu)
        self.show = show
        self.lanes, self.chunk = lanes, chunk

    def warm(self, path: str) -> None:
        """The first transfer allocates the lanes' pinned memory: do it before timing."""
        self.hub.load(path, self.reg, 0, self.chunk).wait()

    def info(self) -> dict[str, Any]:
        return {"hub_mode": self.hub.mode, "mode_reason": self.hub.mode_reason,
                "reg_mode": self.reg.mode, "lanes": self.lanes, "chunk": self.chunk}

    def load(self, path: str, size: int) -> float:
        t0 = time.perf_counter()
        fence = self.hub.load(path, self.reg, 0, size, progress=self.show, direct=self.direct)
        fence.wait()
        return time.perf_counter() - t0

    def save(self, path: str, size: int) -> float:
        t0 = time.perf_counter()
        fence = self.hub.save(self.reg, path, 0, size, progress=self.show, direct=self.direct)
        fence.wait()
        return time.perf_counter() - t0

    def _close(self) -> None:
        self.hub.close()


class TorchMethod:
    """Single-stream O_DIRECT reads into two pinned buffers, copies overlapped (the usual
    hand-written loader)."""

    def __init__(self, gpu: Any, chunk: int) -> None:
        import torch
        self.torch = torch
        self.gpu = gpu
        self.chunk = chunk
        self.pinned = [torch.empty(chunk, dtype=torch.uint8).pin_memory() for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)]
        self.stream = torch.cuda.Stream()

    def load(self, path: str, size: int) -> float:
        return self.read_into(path, ((off, off, min(self.chunk, size - off))
                                     for off in range(0, size, self.chunk)))

    def read_into(self, path: str, pieces: Any) -> float:
        """(file offset, GPU offset, bytes) pieces of at most `chunk` bytes, in order: each
        O_DIRECT read into one pinned buffer while the other's copy runs. Seconds taken."""
        torch = self.torch
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        views = [memoryview(p.numpy()) for p in self.pinned]
        used = [False, False]
        try:
            t0 = time.perf_counter()
            for i, (off, dst, n) in enumerate(pieces):
                k = i & 1
                if used[k]:
                    self.events[k].synchronize()
                if os.preadv(fd, [views[k][:-(-n // 4096) * 4096]], off) < n:
                    raise RuntimeError(f"torch: a short read at {off}")
                with torch.cuda.stream(self.stream):
                    self.gpu[dst:dst + n].copy_(self.pinned[k][:n], non_blocking=True)
                    self.events[k].record(self.stream)
                used[k] = True
            self.stream.synchronize()
            return time.perf_counter() - t0
        finally:
            os.close(fd)

    def save(self, path: str, size: int) -> float:
        torch = self.torch
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
        views = [memoryview(p.numpy()) for p in self.pinned]
        try:
            t0 = time.perf_counter()
            offs = list(range(0, size, self.chunk))
            with torch.cuda.stream(self.stream):
                n0 = min(self.chunk, size)
                self.pinned[0][:n0].copy_(self.gpu[:n0], non_blocking=True)
                self.events[0].record(self.stream)
            for i, off in enumerate(offs):
                k = i & 1
                n = min(self.chunk, size - off)
                self.events[k].synchronize()
                if i + 1 < len(offs):      # the next D2H runs while this chunk is written
                    o2 = offs[i + 1]
                    n2 = min(self.chunk, size - o2)
                    with torch.cuda.stream(self.stream):
                        self.pinned[k ^ 1][:n2].copy_(self.gpu[o2:o2 + n2], non_blocking=True)
                        self.events[k ^ 1].record(self.stream)
                os.pwritev(fd, [views[k][:n]], off)
            os.fsync(fd)
            return time.perf_counter() - t0
        finally:
            os.close(fd)


class KvikioMethod:
    def __init__(self, gpu: Any, threads: int, chunk: int) -> None:
        import cupy
        import kvikio
        import kvikio.defaults as kd
        self.kvikio = kvikio
        self.arr = cupy.asarray(gpu)   # the same GPU memory, through __cuda_array_interface__
        for setter in (lambda: kd.set({"num_threads": threads, "task_size": chunk}),
                       lambda: (kd.num_threads_reset(threads), kd.task_size_reset(chunk))):
            try:
                setter()
                break
            except Exception:  # noqa: BLE001 - the API moved between kvikio releases
                continue
        self.info = {"version": getattr(kvikio, "__version__", "?"), "threads": threads}
        self.chunk = chunk
        try:
            self.info["compat_mode"] = str(kd.get("compat_mode"))
        except Exception:  # noqa: BLE001
            try:
                self.info["compat_mode"] = str(kd.compat_mode())
            except Exception:  # noqa: BLE001
                pass

    def warm(self, path: str) -> None:
        with self.kvikio.CuFile(path, "r") as f:
            f.read(self.arr[:self.chunk])

    def load(self, path: str, size: int) -> float:
        t0 = time.perf_counter()
        with self.kvikio.CuFile(path, "r") as f:
            n = f.read(self.arr[:size])
        dt = time.perf_counter() - t0
        if n != size:
            raise RuntimeError(f"kvikio read {n} of {size} bytes")
        return dt

    def save(self, path: str, size: int) -> float:
        t0 = time.perf_counter()
        with self.kvikio.CuFile(path, "w") as f:
            n = f.write(self.arr[:size])
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        dt = time.perf_counter() - t0
        if n != size:
            raise RuntimeError(f"kvikio wrote {n} of {size} bytes")
        return dt


CUFILE_CHILD = r"""
import json, os, sys, time
os.environ.setdefault("CUFILE_FORCE_COMPAT_MODE", "true")
path, size = sys.argv[1], int(sys.argv[2])
import torch
from cuda.bindings import cufile
t = torch.empty(size, dtype=torch.uint8, device="cuda")
cufile.driver_open()
fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
d = cufile.Descr()
d.type = cufile.FileHandleType.OPAQUE_FD
d.handle.fd = fd
fh = cufile.handle_register(d.ptr)
t0 = time.perf_counter()
step = 1 << 30
for off in range(0, size, step):
    n = min(step, size - off)
    got = cufile.read(fh, t.data_ptr(), n, off, off)
    if got != n:
        raise SystemExit(f"cuFileRead returned {got} of {n}")
torch.cuda.synchronize()
dt = time.perf_counter() - t0
w = t.view(torch.int64)
ok = bool(torch.equal(w, torch.arange(w.numel(), dtype=torch.int64, device="cuda") ^ int(sys.argv[3])))
cufile.handle_deregister(fh)
print(json.dumps({"seconds": dt, "verified": ok}))
"""


class CufileMethod:
    """cuFileRead through cuda.bindings.cufile, compatibility mode forced, in a child
    process each time: cuFile has crashed (SIGSEGV) inside cuFileHandleRegister on a VM
    without a udev database, and that must not take the bench down."""

    def __init__(self, gpu: Any, path: str) -> None:
        self.path = path

    def load(self, path: str, size: int) -> float:
        res = subprocess.run([sys.executable, "-c", CUFILE_CHILD, path, str(size), str(SEED)],
                             capture_output=True, text=True, timeout=600, cwd="/tmp")
        if res.returncode != 0:
            why = f"signal {-res.returncode}" if res.returncode < 0 else f"exit {res.returncode}"
            last = (res.stderr.strip().splitlines() or [""])[-1]
            raise RuntimeError(f"cuFile child failed ({why}): {last}")
        out = json.loads(res.stdout.strip().splitlines()[-1])
        if not out["verified"]:
            raise RuntimeError("cuFile read the wrong bytes")
        return float(out["seconds"])


# ------------------------------------------------------------------ the bench


def _machine() -> dict[str, Any]:
    out: dict[str, Any] = {"kernel": platform.release(), "cpus": os.cpu_count()}
    try:
        out["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True,
                                    timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def run_bench(args: argparse.Namespace, show: Callable[[str, int], Any] | None = None) -> dict:
    import torch
    direction = args.bench_io
    size = _parse_size(args.size)
    chunk = _parse_size(args.chunk)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    path = args.file
    make_file(path, size)
    out_path = args.out or path + ".out"
    gpu = torch.empty(size, dtype=torch.uint8, device="cuda")
    report: dict[str, Any] = {
        "schema": SCHEMA, "bench": direction,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": _machine(),
        "file": path, "bytes": size, "chunk": chunk, "runs": args.runs, "methods": {},
        "errors": {},
    }
    methods: dict[str, Any] = {}
    prog = show("p2phub", size) if show else None
    for name in peers:
        try:
            if name == "p2phub":
                methods[name] = P2PHubMethod(gpu, chunk, args.lanes, args.mode, prog)
                report["p2phub"] = methods[name].info()
            elif name == "p2phub-buffered":   # page cache instead of O_DIRECT, then fsync
                methods[name] = P2PHubMethod(gpu, chunk, args.lanes, args.mode, None, direct=False)
            elif name == "torch":
                methods[name] = TorchMethod(gpu, chunk)
            elif name == "kvikio":
                methods[name] = KvikioMethod(gpu, args.kvikio_threads, chunk)
                report["kvikio"] = methods[name].info
            elif name == "cufile":
                if direction == "save":
                    continue
                methods[name] = CufileMethod(gpu, path)
            elif name == "ceiling":
                methods[name] = None
            else:
                report["errors"][name] = "unknown method"
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported, not fatal
            report["errors"][name] = f"{type(exc).__name__}: {exc}"
    if direction == "save":   # the GPU buffer holds the file's pattern
        w = gpu.view(torch.int64)
        w.copy_(torch.arange(w.numel(), dtype=torch.int64, device=gpu.device) ^ SEED)
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    cache = "?"
    cthreads = [int(x) for x in args.ceiling_threads.split(",")]
    for name, m in methods.items():
        if hasattr(m, "warm"):
            try:
                m.warm(path)
            except Exception as exc:  # noqa: BLE001
                report["errors"][name] = f"warm-up: {type(exc).__name__}: {exc}"
    for run in range(args.runs):
        # The VM's disk is a file on its host, whose page cache warms up as a run goes on:
        # each run starts with another method.
        order = peers[run % len(peers):] + peers[:run % len(peers)]
        for name in order:
            if name not in methods:
                continue
            m = methods[name]
            try:
                if name == "ceiling":
                    for th in cthreads:
                        cache = drop_caches(path)
                        if direction == "save" and os.path.exists(out_path):
                            os.unlink(out_path)
                        fn = ceiling_read if direction == "load" else ceiling_write
                        dt = fn(path if direction == "load" else out_path, size, chunk, th)
                        times.setdefault(f"ceiling_{th}t", []).append(dt)
                    continue
                if direction == "load":
                    cache = drop_caches(path)
                    gpu.zero_()
                    torch.cuda.synchronize()
                    if prog and name == "p2phub":
                        prog(None)
                    dt = m.load(path, size)
                    torch.cuda.synchronize()
                    if name != "cufile" and not verify_gpu(gpu, size):
                        raise RuntimeError("the GPU buffer does not hold the file's bytes")
                else:
                    if os.path.exists(out_path):
                        os.unlink(out_path)
                    drop_caches(path)
                    if prog and name == "p2phub":
                        prog(None)
                    dt = m.save(out_path, size)
                    if run == 0 and not _same_file(path, out_path, size):
                        raise RuntimeError(f"{out_path} does not hold the GPU's bytes")
                times.setdefault(name, []).append(dt)
            except Exception as exc:  # noqa: BLE001
                report["errors"][name] = f"{type(exc).__name__}: {exc}"
                methods.pop(name, None)
    for m in methods.values():
        if hasattr(m, "close"):
            m.close()
    report["cache"] = cache
    for name, ts in times.items():
        rates = [size / t / 1e9 for t in ts]
        report["methods"][name] = {"gbps": [round(r, 3) for r in rates],
                                   "median_gbps": round(statistics.median(rates), 3)}
    ceil = [v["median_gbps"] for k, v in report["methods"].items() if k.startswith("ceiling_")]
    # the ceiling of the run: the best host-memory rate of any configuration, per run, median
    per_run = [max(report["methods"][k]["gbps"][i] for k in report["methods"] if k.startswith("ceiling_"))
               for i in range(args.runs)] if ceil else []
    if per_run:
        report["ceiling_gbps"] = round(statistics.median(per_run), 3)
    report["ratios"] = {}
    for mine in ("p2phub", "p2phub-buffered"):
        p = report["methods"].get(mine, {}).get("median_gbps")
        if not p:
            continue
        if per_run:
            report["ratios"][f"{mine}_vs_ceiling"] = round(p / report["ceiling_gbps"], 3)
        for name in ("kvikio", "torch", "cufile"):
            if name in report["methods"]:
                report["ratios"][f"{mine}_vs_{name}"] = round(p / report["methods"][name]["median_gbps"], 3)
    return report


def _same_file(a: str, b: str, size: int) -> bool:
    step = 64 * MiB
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for _ in range(0, size, step):
            if fa.read(step) != fb.read(step):
                return False
    return True


def render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"p2phub bench {report['bench']}: {report['bytes'] / GiB:.1f} GiB, "
                    f"{report['runs']} runs, page cache {report.get('cache')}")
    for col in ("method", "median GB/s", "runs (GB/s)", "p2phub / this"):
        t.add_column(col)
    p = report["methods"].get("p2phub", {}).get("median_gbps")
    for name, v in report["methods"].items():
        ratio = f"{p / v['median_gbps']:.2f}x" if p and name != "p2phub" else ""
        t.add_row(name, f"{v['median_gbps']:.2f}", ", ".join(f"{r:.2f}" for r in v["gbps"]), ratio)
    Console().print(t)
    if report.get("ceiling_gbps"):
        Console().print(f"ceiling (best host-memory rate per run, median): {report['ceiling_gbps']:.2f} GB/s")
    for name, err in report["errors"].items():
        Console().print(f"[yellow]{name}[/]: {err}")
    if "p2phub" in report:
        Console().print(f"hub mode: {report['p2phub']['hub_mode']} ({report['p2phub']['mode_reason']})")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
    progress = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), console=Console(stderr=True), transient=True)
    lock = threading.Lock()

    def show(name: str, total: int) -> Callable[[int | None], None]:
        task = progress.add_task(f"{name} {args.bench_io}", total=total)

        def step(n: int | None) -> None:
            with lock:
                if n is None:
                    progress.reset(task, total=total)
                else:
                    progress.advance(task, n)
        return step

    def produce() -> dict:
        with progress:
            return run_bench(args, show if sys.stderr.isatty() or not args.json else None)
    return emit(args, SCHEMA, f"p2phub bench {args.bench_io}", produce, render,
                lambda r: "p2phub" in r["methods"])


def emit(args: argparse.Namespace, schema: str, what: str, produce: Callable[[], dict],
         render_: Callable[[dict], None], ok: Callable[[dict], bool]) -> int:
    """Run a bench and print its report (JSON with --json, else rich tables); a failure is
    reported with the schema. 0 when `ok(report)`."""
    try:
        report = produce()
    except Exception as exc:  # noqa: BLE001 - reported, with the schema, as a failed run
        if args.json:
            print(json.dumps({"schema": schema, "error": f"{type(exc).__name__}: {exc}"}))
        else:
            print(f"{what}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    plot.maybe(args, report)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        render_(report)
    return 0 if ok(report) else 1
