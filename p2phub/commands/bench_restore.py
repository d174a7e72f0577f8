"""`p2phub bench restore`: the KV-cache restore pattern. Thousands of random aligned reads
of one big file land in scattered places of one buffer (GPU memory, or host memory with
--device host), at several read sizes, p2phub's batch beside the other ways to do it and the
disk's own ceiling, in one run.

Per read size and run (page cache dropped before every method; each run starts with another
method; with --prime, the default, the run's reads are made once before its methods, so that a
cache below this kernel, such as a virtual disk's backing on its host, which the drop does not
reach, is as warm for the first method as for the last):
  p2phub:...   the same with other settings: dN queue depth, sSIZE staging slot (larger
               reads go in slot-sized or split pieces), buf through the page cache, dio
               all O_DIRECT, nofixed staging not registered with io_uring, onethread one
               thread reads and copies (the default), iothread a second thread reads,
               splitSIZE/nosplit the pieces large reads through the staging go in,
               inflightSIZE the bytes of them in flight (p2phub:d256:s256K,
               p2phub:nosplit:inflight0);
               plain p2phub uses the API's defaults
  ceiling      C io_uring, O_DIRECT, one read per request into host memory, queue depth 64,
               128 and 256 (p2phub.staged_io.sio_ceiling); the best depth is the run's
               ceiling. Its timed span opens the file, as every other method's does
               (ceiling_open_ms: what the open took; ceiling_without_open: the best rate
               with the open left out)
  p2phub       hub.load_batch(storage=file, offsets=..., lengths=size, memory=reg,
               mem_offsets=...): one call, one fence
  p2phub:perrequest
               hub.load(file, reg, offset, size, dest_offset) per request, all issued, then
               the fences awaited together (p2phub-load is the same method)
  p2phub:perrequest:file
               the same on a file opened once, as kvikio's CuFile is (hub.open(file) inside
               the timed span; each request then makes no open or stat of its own)
  kvikioN      kvikio.CuFile(file).pread(view, size, offset) futures, its thread pool at N
               threads (kvikio8, kvikio16, kvikio64), awaited together
  nixl-posix   host memory only: the pip nixl package's POSIX plugin (DRAM <- FILE, one READ
               of every request, the file O_DIRECT and registered inside the timed span),
               libaio (its default); nixl-posix:uring its io_uring mode
  torch        O_DIRECT preads into two pinned buffers, each copied to the GPU on a stream while
               the next is read (double-buffered)

Per method and run the report also keeps the process's CPU per read (cpu_us_per_read) and
the cycle collector's time in the timed span with its full collections (gc_ms: [ms, full]);
a full collection runs before every timed span, so that none owed by what ran before (the
setup, the previous method) lands in the next method's time. For the batch it keeps the share
of each call its own engine run took (p2phub_run_share; the rest is planning and hand-overs).

Every byte of a sample of requests is checked on the destination (on the GPU for GPU
memory) against the file's pattern. Figures are requests per second; medians over --runs.
Large reads keep the batch's bytes under --max-bytes: a size gets min(--count, max-bytes /
size) requests (the report's `count` per size).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from typing import Any, Callable

from .._resource import Resource
from ..errors import UsageError
from .argtypes import comma_list, positive, size_bytes, size_text
from .bench_load import (GiB, SEED, TorchMethod, _machine, _parse_size, drop_caches, emit,
                         make_file)
from .gc_clock import GcClock

SCHEMA = "p2phub.bench.restore/1"
METHODS = ("ceiling,p2phub,p2phub:perrequest,p2phub:perrequest:file,kvikio8,kvikio16,kvikio64,"
           "torch")
PER_REQUEST = ("p2phub-load", "p2phub:perrequest", "p2phub:perrequest:file")
KVIKIO = ("kvikio8", "kvikio16", "kvikio64")
NIXL = ("nixl-posix", "nixl-posix:uring")



def _prime(path: str, offs: Any, size: int) -> None:
    """Read every request once, untimed (the page cache is dropped before each method)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in offs.tolist():
            os.pread(fd, size, off)
    finally:
        os.close(fd)


def add_parser(sub: Any) -> None:
    help_ = ("the KV-cache restore pattern: thousands of random aligned reads into scattered "
             "places of one buffer; p2phub's batch vs kvikio, torch, per-request hub.load and "
             "the C io_uring ceiling")
    p = sub.add_parser("restore", help=help_, description=help_)
    p.add_argument("--file", default="/var/tmp/p2phub-bench.bin",
                   help="the file to read (made with a checkable pattern if missing or of "
                        "another size)")
    p.add_argument("--size", type=size_text, default="4G", help="file size (default 4G)")
    p.add_argument("--count", type=positive, default=4096, help="reads per batch (default 4096)")
    p.add_argument("--sizes", type=comma_list(size_bytes), default="4K,64K,256K,1M",
                   help="read sizes, up to 16M (default 4K,64K,256K,1M)")
    p.add_argument("--runs", type=positive, default=3, help="runs; medians are reported (default 3)")
    p.add_argument("--methods", default=METHODS, help=f"methods, in order (default {METHODS})")
    p.add_argument("--depths", type=comma_list(positive), default="64,128,256", help="queue depths of the ceiling")
    p.add_argument("--memory", "--device", dest="device", choices=("auto", "cuda", "host"),
                   default="auto",
                   help="destination memory (default: cuda where torch sees a GPU, else host)")
    p.add_argument("--max-bytes", type=size_text, default="2G",
                   help="bytes per batch at most: larger reads get fewer requests (default 2G)")
    p.add_argument("--sample", type=positive, default=64, help="requests checked per method and run")
    p.add_argument("--depth", type=positive, default=128, help="p2phub batch queue depth")
    p.add_argument("--slot", type=size_text, default="1M", help="p2phub batch staging slot size")
    p.add_argument("--mode", choices=("auto", "p2p", "staged"), default="auto",
                   help="Hub mode for p2phub (default auto)")
    p.add_argument("--seed", type=int, default=21,
                   help="seed of the random offsets and places (default 21)")
    p.add_argument("--prime", action=argparse.BooleanOptionalAction, default=True,
                   help="make each run's reads once, untimed, before its methods (default on)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(bench_restore=True)


# ------------------------------------------------------------------ destinations


class Dest:
    """The destination buffer: a torch CUDA tensor or a numpy host array."""

    def __init__(self, kind: str, nbytes: int) -> None:
        import numpy as np
        self.kind = kind
        self.nbytes = nbytes
        if kind == "cuda":
            import torch
            self.torch = torch
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        else:
            import mmap
            # page-aligned, as GPU memory and pinned host buffers are
            self.buf = np.frombuffer(mmap.mmap(-1, nbytes), np.uint8)

    def clear(self) -> None:
        if self.kind == "cuda":
            self.buf.zero_()
            self.torch.cuda.synchronize()
        else:
            self.buf[:] = 0

    def sync(self) -> None:
        if self.kind == "cuda":
            self.torch.cuda.synchronize()

    def check(self, offs: Any, dsts: Any, size: int, sample: Any) -> bool:
        """Every byte of the sampled requests is the file's pattern (checked where it lives)."""
        for i in sample:
            off, dst = int(offs[i]), int(dsts[i])
            if self.kind == "cuda":
                torch = self.torch
                got = self.buf[dst:dst + size].view(torch.int64)
                exp = torch.arange(off // 8, (off + size) // 8, dtype=torch.int64,
                                   device=got.device) ^ SEED
                if not torch.equal(got, exp):
                    return False
            else:
                import numpy as np
                got = self.buf[dst:dst + size].view(np.int64)
                exp = np.arange(off // 8, (off + size) // 8, dtype=np.int64) ^ SEED
                if not np.array_equal(got, exp):
                    return False
        return True


# ------------------------------------------------------------------ methods


class Ceiling:
    """C io_uring, O_DIRECT, into host memory: the disk's ceiling for this pattern."""

    def __init__(self, path: str, depths: list[int], max_size: int) -> None:
        import mmap

        from ..staged_io import load
        self.mod = load()
        self.path = path
        self.depths = depths
        self.bufs = {d: mmap.mmap(-1, d * max_size) for d in depths}

    def run(self, offs: Any, size: int, depth: int) -> tuple[float, float]:
        """(seconds, of which opening the file): like every other method, the ceiling opens
        the file inside its timed span (after the page cache was dropped the open reads the
        path's directories and the inode from the disk)."""
        import numpy as np
        ffi, lib = self.mod.ffi, self.mod.lib
        o = np.ascontiguousarray(offs.astype(np.uint64))
        ln = np.full(offs.size, size, np.uint64)
        err = ffi.new("char[]", 256)
        buf = ffi.from_buffer(self.bufs[depth])
        t0 = time.perf_counter()
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        try:
            t1 = time.perf_counter()
            rc = lib.sio_ceiling(fd, offs.size, ffi.from_buffer("unsigned long long[]", o),
                                 ffi.from_buffer("unsigned long long[]", ln), depth, buf, size,
                                 err, 256)
            dt = time.perf_counter() - t0
        finally:
            os.close(fd)
        if rc:
            raise OSError(-rc, f"ceiling: {ffi.string(err).decode()}")
        return dt, t1 - t0


def _variant(name: str, depth: int, slot: int) -> tuple[int, int, bool | str, dict[str, Any]]:
    """p2phub's batch with other settings: "p2phub:d256:s256K:buf" (queue depth 256, 256 KiB
    staging slots, reads through the page cache; "dio": every read O_DIRECT; "nofixed": the
    staging memory not registered with io_uring; "onethread" (the default): one thread reads
    and issues the GPU copies; "iothread": a second thread reads while the first copies;
    "split1M": O_DIRECT reads through the staging of 2 MiB and up in 1 MiB pieces (the
    default 128 KiB), "nosplit": slot-sized pieces; "inflight32M": at most 32 MiB of such
    reads in flight (the default 8 MiB; "inflight0": only the depth bounds them);
    "poll": the engine polls for completions instead of sleeping)."""
    direct: bool | str = "auto"
    engine: dict[str, Any] = {"fixed_buffers": True, "io_thread": False}

    def size(tok: str, key: str, least: int, align: int) -> int:
        try:
            v = _parse_size(tok[len(key):])
        except ValueError:
            v = -1
        if v < least or v % align:
            raise ValueError(f"{name}: {tok!r}: want {key}SIZE, SIZE at least {least} and a "
                             f"multiple of {align} (such as {key}128K)")
        return v

    for tok in name.split(":")[1:]:
        if tok in ("buf", "dio"):
            direct = tok == "dio"
        elif tok == "nofixed":
            engine["fixed_buffers"] = False
        elif tok in ("onethread", "iothread"):
            engine["io_thread"] = tok == "iothread"
        elif tok == "poll":
            engine["poll"] = True
        elif tok == "nosplit":
            engine["split"] = 0
        elif tok.startswith("split"):
            engine["split"] = size(tok, "split", 0, 4096)
        elif tok.startswith("inflight"):
            engine["inflight"] = size(tok, "inflight", 0, 1)
        elif tok[:1] == "d" and tok[1:].isdigit():
            depth = int(tok[1:])
        elif tok[:1] == "s":
            slot = size(tok, "s", 4096, 4096)
        else:
            raise ValueError(f"{name}: unknown setting {tok!r} (want dN, sSIZE, buf, dio, "
                             "nofixed, onethread, iothread, splitSIZE, nosplit, inflightSIZE or "
                             "poll)")
    return depth, slot, direct, engine


class P2PHubBatch(Resource):
    def __init__(self, dest: Dest, mode: str, depth: int, slot: int,
                 direct: bool | str = "auto", engine: dict[str, Any] | None = None) -> None:
        from .. import batch
        from ..hub import Hub
        self.hub = Hub(mode=mode)
        batch.configure_batch(self.hub, depth=depth, slot=slot, slots=max(2 * depth, 64),
                              **(engine or {}))
        self.reg = self.hub.register(dest.buf)
        self.direct = direct
        self.settings = {"depth": depth, "slot": slot, "direct": direct, **(engine or {})}
        self.stats: dict[str, Any] = {}

    def warm(self, path: str, size: int) -> None:
        self.hub.load_batch([(path, 0, size, self.reg, 0)]).wait()

    def run(self, path: str, offs: Any, dsts: Any, size: int) -> float:
        t0 = time.perf_counter()
        f = self.hub.load_batch(storage=path, offsets=offs, lengths=size, memory=self.reg,
                                mem_offsets=dsts, direct=self.direct)
        f.wait()
        dt = time.perf_counter() - t0
        # the batch's own run (its fence's seconds) against the whole call: what p2phub's
        # planning and hand-overs add around the disk's time
        self.stats = {k: v for k, v in f.stats.items() if k not in ("seconds", "gbps", "per_s")}
        self.stats.update(run_seconds=round(f.stats["seconds"], 6), call_seconds=round(dt, 6))
        return dt

    def info(self) -> dict[str, Any]:
        return {"hub_mode": self.hub.mode, "mode_reason": self.hub.mode_reason,
                "reg_mode": self.reg.mode, "last_batch": self.stats, **self.settings}

    def _close(self) -> None:
        self.hub.close()


class P2PHubLoad(P2PHubBatch):
    def warm(self, path: str, size: int) -> None:
        self.hub.load(path, self.reg, 0, size).wait()

    def run(self, path: str, offs: Any, dsts: Any, size: int) -> float:
        t0 = time.perf_counter()
        fences = [self.hub.load(path, self.reg, int(o), size, int(d)) for o, d in zip(offs, dsts)]
        for f in fences:
            f.wait()
        return time.perf_counter() - t0


class P2PHubLoadFile(P2PHubLoad):
    def run(self, path: str, offs: Any, dsts: Any, size: int) -> float:
        t0 = time.perf_counter()
        with self.hub.open(path) as f:
            fences = [self.hub.load(f, self.reg, int(o), size, int(d))
                      for o, d in zip(offs, dsts)]
            for fe in fences:
                fe.wait()
        return time.perf_counter() - t0


class Kvikio:
    def __init__(self, dest: Dest, threads: int) -> None:
        try:
            import kvikio
        except ImportError:
            raise RuntimeError("needs kvikio") from None
        self.kvikio = kvikio
        self.threads = threads
        self._set_threads()
        if dest.kind == "cuda":
            import cupy
            self.arr = cupy.asarray(dest.buf)
        else:
            self.arr = dest.buf

    def _set_threads(self) -> None:
        import kvikio.defaults as kd
        for setter in (lambda: kd.set({"num_threads": self.threads}),
                       lambda: kd.num_threads_reset(self.threads)):
            try:
                setter()
                return
            except Exception:  # noqa: BLE001
                continue

    def warm(self, path: str, size: int) -> None:
        self._set_threads()
        with self.kvikio.CuFile(path, "r") as f:
            f.pread(self.arr[:size], size, 0).get()

    def run(self, path: str, offs: Any, dsts: Any, size: int) -> float:
        self._set_threads()
        arr = self.arr
        t0 = time.perf_counter()
        with self.kvikio.CuFile(path, "r") as f:
            futs = [f.pread(arr[int(d):int(d) + size], size, int(o)) for o, d in zip(offs, dsts)]
            for fut in futs:
                if fut.get() != size:
                    raise RuntimeError("kvikio: a short read")
        return time.perf_counter() - t0

    def info(self) -> dict[str, Any]:
        return {"version": getattr(self.kvikio, "__version__", "?"), "threads": self.threads}


def _nixl_api() -> Any:
    """nixl's Python API: the `nixl` meta package, else the CUDA build installed."""
    import importlib
    for mod in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(mod)
        except ImportError:
            continue
    raise RuntimeError("needs nixl (pip nixl / nixl-cu12)")


class NixlPosix(Resource):
    """The pip nixl package's POSIX plugin: DRAM <- FILE, every request in one READ transfer,
    libaio (its default) or io_uring ("nixl-posix:uring"). Like every other method it opens
    (O_DIRECT) and registers the file inside its timed span."""

    def __init__(self, dest: Dest, mode: str) -> None:
        if dest.kind != "host":
            raise RuntimeError("needs host memory (--memory host): NIXL POSIX moves DRAM <-> FILE")
        import logging
        api = _nixl_api()
        logging.getLogger("nixl").setLevel(logging.WARNING)
        self.name = f"p2phub-bench-nixl-{mode}"
        self.agent = api.nixl_agent(self.name, api.nixl_agent_config(backends=[]))
        self.mode = mode
        params = {"use_uring": "true"} if mode == "uring" else {}
        self.agent.create_backend("POSIX", params)
        self.params = dict(self.agent.get_backend_params("POSIX") or {})
        self.dest = dest
        self.addr = dest.buf.ctypes.data
        self.dram = self.agent.register_memory([(self.addr, dest.nbytes, 0, "")], "DRAM")

    def run(self, path: str, offs: Any, dsts: Any, size: int) -> float:
        import numpy as np
        n = offs.size
        a = self.agent
        t0 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            freg = a.register_memory([(0, os.fstat(fd).st_size, fd, "")], "FILE")
            loc = a.get_xfer_descs(np.stack([self.addr + dsts, np.full(n, size, np.int64),
                                             np.zeros(n, np.int64)], 1), "DRAM")
            rem = a.get_xfer_descs(np.stack([offs, np.full(n, size, np.int64),
                                             np.full(n, fd, np.int64)], 1), "FILE")
            h = a.initialize_xfer("READ", loc, rem, self.name)
            state = a.transfer(h)
            while state == "PROC":
                state = a.check_xfer_state(h)
            dt = time.perf_counter() - t0
            a.release_xfer_handle(h)
            a.deregister_memory(freg)
        finally:
            os.close(fd)
        if state != "DONE":
            raise RuntimeError(f"nixl POSIX transfer ended {state}")
        return dt

    def info(self) -> dict[str, Any]:
        return {"mode": self.mode, "backend_params": self.params}

    def _close(self) -> None:
        self.agent.deregister_memory(self.dram)


class TorchDouble:
    """O_DIRECT preads into two pinned buffers, each copied on a stream while the next is read
    (bench load's torch method, one piece per request)."""

    def __init__(self, dest: Dest, max_size: int) -> None:
        if dest.kind != "cuda":
            raise RuntimeError("needs a CUDA destination (torch copies to the GPU)")
        self.method = TorchMethod(dest.buf, max_size)

    def run(self, path: str, offs: Any, dsts: Any, size: int) -> float:
        return self.method.read_into(path, ((int(o), int(d), size) for o, d in zip(offs, dsts)))


# ------------------------------------------------------------------ the bench


def _requests(seed: int, file_size: int, count: int, size: int) -> tuple[Any, Any]:
    """count random 4 KiB-aligned offsets in the file, and a permutation of count slots of
    `size` bytes in the destination."""
    import numpy as np
    rng = np.random.default_rng(seed)
    offs = rng.integers(0, (file_size - size) // 4096 + 1, count, dtype=np.int64) * 4096
    dsts = rng.permutation(count).astype(np.int64) * size
    return offs, dsts


def run_bench(args: argparse.Namespace, step: Callable[[str], None] | None = None) -> dict:
    import numpy as np
    file_size = _parse_size(args.size)
    sizes = [_parse_size(s) for s in args.sizes.split(",") if s.strip()]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    depths = [int(d) for d in args.depths.split(",")]
    kind = args.device
    if kind == "auto":
        try:
            import torch
            kind = "cuda" if torch.cuda.is_available() else "host"
        except ImportError:
            kind = "host"
    if max(sizes) > 16 << 20:
        raise ValueError(f"--sizes: {max(sizes)} bytes is over 16M")
    if max(sizes) > file_size:
        raise ValueError(f"--sizes: {max(sizes)} bytes is larger than the file ({file_size})")
    max_bytes = _parse_size(args.max_bytes)
    counts = {size: max(1, min(args.count, max_bytes // size)) for size in sizes}
    make_file(args.file, file_size)
    max_size = max(sizes)
    dest = Dest(kind, max(counts[s] * s for s in sizes))
    report: dict[str, Any] = {
        "schema": SCHEMA, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": _machine(), "file": args.file, "file_bytes": file_size, "count": args.count,
        "runs": args.runs, "primed": args.prime, "collected_before_each": True,
        "device": kind, "methods": methods,
        "sizes": {}, "errors": {}, "info": {},
    }
    impl: dict[str, Any] = {}
    for name in methods:
        try:
            if name == "ceiling":
                impl[name] = Ceiling(args.file, depths, max_size)
            elif name in PER_REQUEST:
                cls = P2PHubLoadFile if name.endswith(":file") else P2PHubLoad
                impl[name] = cls(dest, args.mode, args.depth, _parse_size(args.slot))
            elif name == "p2phub" or name.startswith("p2phub:"):
                depth, slot, direct, engine = _variant(name, args.depth, _parse_size(args.slot))
                impl[name] = P2PHubBatch(dest, args.mode, depth, slot, direct, engine)
            elif name in NIXL:
                impl[name] = NixlPosix(dest, "uring" if name.endswith(":uring") else "aio")
            elif name.startswith("kvikio") and (name[6:] or "8").isdigit():
                impl[name] = Kvikio(dest, int(name[6:] or 8))
            elif name == "torch":
                impl[name] = TorchDouble(dest, max_size)
            else:
                report["errors"][name] = "unknown method"
        except Exception as exc:  # noqa: BLE001 - a method that cannot run is reported
            msg = str(exc) if str(exc).startswith("needs ") else f"{type(exc).__name__}: {exc}"
            report["errors"][name] = msg
    cache = "?"
    for size in sizes:
        count = counts[size]
        row: dict[str, Any] = {"count": count, "per_s": {}, "verified": {}}
        report["sizes"][str(size)] = row
        for name, m in impl.items():
            if hasattr(m, "warm"):
                try:
                    m.warm(args.file, size)
                except Exception as exc:  # noqa: BLE001
                    report["errors"][name] = f"warm-up: {type(exc).__name__}: {exc}"
        live = [n for n in methods if n in impl]
        for run in range(args.runs):
            offs, dsts = _requests(args.seed * 1000 + run, file_size, count, size)
            rng = np.random.default_rng(run)
            sample = np.unique(np.concatenate([[0, count - 1],
                                               rng.integers(0, count, args.sample)]))
            order = live[run % len(live):] + live[:run % len(live)] if live else []
            if args.prime:
                _prime(args.file, offs, size)
            for name in order:
                m = impl.get(name)
                if m is None:
                    continue
                if step:
                    step(f"{size >> 10} KiB run {run + 1} {name}")
                try:
                    if name == "ceiling":
                        best = best_noopen = 0.0
                        for d in depths:
                            cache = drop_caches(args.file)
                            dt, t_open = m.run(offs, size, d)
                            rate = count / dt
                            row["per_s"].setdefault(f"ceiling_qd{d}", []).append(rate)
                            row.setdefault("ceiling_open_ms", []).append(round(t_open * 1e3, 3))
                            best = max(best, rate)
                            best_noopen = max(best_noopen, count / (dt - t_open))
                        row["per_s"].setdefault("ceiling", []).append(best)
                        row["per_s"].setdefault("ceiling_without_open", []).append(best_noopen)
                        continue
                    dest.clear()
                    cache = drop_caches(args.file)
                    # every method starts with the collector's slate clean: a full collection
                    # owed by what ran before (the setup, another method) is not its to pay
                    gc.collect()
                    cpu0 = time.process_time()
                    with GcClock() as gcc:
                        dt = m.run(args.file, offs, dsts, size)
                    dest.sync()
                    row.setdefault("gc_ms", {}).setdefault(name, []).append(
                        [round(gcc.seconds * 1e3, 2), gcc.full])
                    # CPU of the whole process (every thread a method started) per read: on
                    # a host shared with other work, steadier than the wall clock
                    row.setdefault("cpu_us_per_read", {}).setdefault(name, []).append(
                        round((time.process_time() - cpu0) / count * 1e6, 2))
                    ok = dest.check(offs, dsts, size, sample)
                    row["verified"][name] = row["verified"].get(name, True) and ok
                    if not ok:
                        raise RuntimeError("the destination does not hold the file's bytes")
                    row["per_s"].setdefault(name, []).append(count / dt)
                    if name == "p2phub":
                        # the share of the call the batch's own run took (the rest: planning
                        # and hand-overs)
                        row.setdefault("p2phub_run_share", []).append(
                            round(m.stats["run_seconds"] / dt, 4))
                except Exception as exc:  # noqa: BLE001
                    report["errors"][name] = f"{size} B: {type(exc).__name__}: {exc}"
                    impl.pop(name, None)
                    if hasattr(m, "close"):
                        m.close()
        row["median_per_s"] = {k: round(statistics.median(v), 1) for k, v in row["per_s"].items()}
        row["median_cpu_us_per_read"] = {k: round(statistics.median(v), 2)
                                         for k, v in row.get("cpu_us_per_read", {}).items()}
        # each run's p2phub against each run's best NIXL mode: the two ran minutes apart at
        # most, so a host whose speed drifts moves both
        nx = [row["per_s"].get(k) for k in NIXL if row["per_s"].get(k)]
        if row["per_s"].get("p2phub") and nx:
            paired = [p / max(x) for p, *x in zip(row["per_s"]["p2phub"], *nx)]
            row["p2phub_vs_best_nixl_per_run"] = [round(r, 3) for r in paired]
            row["p2phub_vs_best_nixl_per_run_median"] = round(statistics.median(paired), 3)
        if row.get("ceiling_open_ms"):
            row["ceiling_open_ms_median"] = round(statistics.median(row["ceiling_open_ms"]), 3)
        row["per_s"] = {k: [round(x, 1) for x in v] for k, v in row["per_s"].items()}
        med = row["median_per_s"]
        ratios: dict[str, float] = {}
        if "p2phub" in med:
            for other in ("ceiling", "ceiling_without_open", *KVIKIO, "torch", *PER_REQUEST,
                          *NIXL):
                if med.get(other):
                    ratios[f"p2phub_vs_{other}"] = round(med["p2phub"] / med[other], 3)
            for group, names in (("kvikio", KVIKIO), ("nixl", NIXL)):
                best = [med[k] for k in names if med.get(k)]
                if best:
                    ratios[f"p2phub_vs_best_{group}"] = round(med["p2phub"] / max(best), 3)
        kv = [med[k] for k in KVIKIO if med.get(k)]
        for tag, per in (("perrequest", med.get("p2phub:perrequest") or med.get("p2phub-load")),
                         ("perrequest_file", med.get("p2phub:perrequest:file"))):
            if not per:
                continue
            if med.get("p2phub"):
                ratios[f"{tag}_vs_p2phub"] = round(per / med["p2phub"], 3)
            if kv:
                ratios[f"{tag}_vs_best_kvikio"] = round(per / max(kv), 3)
        row["ratios"] = ratios
        if "p2phub" in impl:
            row["p2phub_batch"] = impl["p2phub"].info()["last_batch"]
    for name, m in impl.items():
        if hasattr(m, "info"):
            report["info"][name] = m.info()
        if hasattr(m, "close"):
            m.close()
    report["cache"] = cache
    return report


def render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console()
    t = Table(title=f"p2phub bench restore: up to {report['count']} random reads of "
                    f"{report['file_bytes'] / GiB:.1f} GiB into {report['device']} memory, "
                    f"{report['runs']} runs, page cache {report.get('cache')} (reads/s, median)")
    names: list[str] = []
    for row in report["sizes"].values():
        for k in row["median_per_s"]:
            if k not in names:
                names.append(k)
    t.add_column("method")
    for s, row in report["sizes"].items():
        t.add_column(f"{int(s) >> 10} KiB ({row.get('count', report['count'])})", justify="right")
    for n in names:
        t.add_row(n, *[f"{row['median_per_s'][n]:,.0f}" if n in row["median_per_s"] else ""
                       for row in report["sizes"].values()])
    keys: list[str] = []
    for row in report["sizes"].values():
        keys += [k for k in row["ratios"] if k not in keys]
    for key in keys:
        t.add_row(key.replace("_vs_", " / "),
                  *[f"{row['ratios'][key]:.2f}x" if key in row["ratios"] else ""
                    for row in report["sizes"].values()])
    con.print(t)
    for name, err in report["errors"].items():
        con.print(f"[yellow]{name}[/]: {err}")
    if report.get("cache") != "dropped":
        con.print(f"[yellow]page cache[/]: not dropped globally ({report.get('cache')}: "
                  "/proc/sys/vm/drop_caches is not writable here)")


def _check_methods(names: list[str]) -> None:
    """A method name the bench does not know is a usage error (exit 4), before anything runs."""
    for name in names:
        known = (name in ("ceiling", "torch", "p2phub", *PER_REQUEST)
                 or name in NIXL or (name.startswith("kvikio") and (name[6:] or "8").isdigit()))
        if name.startswith("p2phub:") and not known:
            try:
                _variant(name, 128, 1 << 20)
                known = True
            except ValueError as exc:
                raise UsageError(f"--methods: {exc}") from None
        if not known:
            raise UsageError(f"--methods: unknown method {name!r} (known: {METHODS}, "
                             f"{', '.join(NIXL)}, kvikioN, p2phub:SETTINGS)")


def run(args: argparse.Namespace) -> int:
    _check_methods([m.strip() for m in args.methods.split(",") if m.strip()])
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress
    sizes = [s for s in args.sizes.split(",") if s.strip()]
    total = len(sizes) * args.runs * len([m for m in args.methods.split(",") if m.strip()])
    progress = Progress("[progress.description]{task.description}", BarColumn(),
                        MofNCompleteColumn(), console=Console(stderr=True), transient=True)
    def produce() -> dict:
        with progress:
            task = progress.add_task("restore", total=total)

            def step(what: str) -> None:
                progress.update(task, advance=1, description=what)
            return run_bench(args, step)
    return emit(args, SCHEMA, "p2phub bench restore", produce, render,
                lambda r: any("p2phub" in row["median_per_s"] for row in r["sizes"].values()))
