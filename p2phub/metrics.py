"""Prometheus metrics of KV agents and NVMe engines (the optional ``prometheus_client``).

    pip install 'p2phub[metrics]'
    import p2phub.metrics
    p2phub.metrics.start_http_server(9400)          # http://127.0.0.1:9400/metrics

or scrape ``prometheus_client.REGISTRY`` (the default registry: the metrics are there as soon as
this module is imported, next to an application's own). ``p2phub kv serve --metrics-port N``
serves them from the command line. Without prometheus_client every hook is a no-op costing one
test, and ``start_http_server`` raises MissingDependencyError naming the package.

Series (counters end in ``_total`` on the wire):

    p2phub_kv_bytes_total{agent,direction}           bytes sent (acknowledged) / received (landed)
    p2phub_kv_transfers_total{agent,direction}       transfers sent (acknowledged) / received
    p2phub_kv_errors_total{agent,direction}          failed transfers / refused data
    p2phub_kv_transfer_seconds{agent}                post -> acknowledgement, histogram
    p2phub_kv_auth_failures_total{agent,reason}      connections refused before or at the
                                                     proof of the KV secret (bad_proof,
                                                     no_proof, timeout, malformed, too_many)
    p2phub_kv_registered_segments{agent}             live memory registrations of the agent
    p2phub_kv_registered_bytes{agent}                bytes they cover (pinned for transfers)
    p2phub_nvme_bytes_total{controller,op}           bytes read / written by completed commands
    p2phub_nvme_commands_total{controller,op}        requests completed
    p2phub_nvme_errors_total{controller,op}          requests that failed
    p2phub_nvme_command_seconds{controller,op}       per-request latency (submission -> CQE)
    p2phub_nvme_batch_seconds{controller,op}         read_batch/write_batch submission -> last CQE
    p2phub_nvme_mapped_registrations{controller}     registrations mapped for the controller
    p2phub_nvme_mapped_bytes{controller}             bytes they pin
"""

from __future__ import annotations

import array
import bisect
import itertools
import logging
import operator
import struct
import threading
import time
import weakref
from typing import Any, Iterable

log = logging.getLogger(__name__)

try:
    import prometheus_client as _pc
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    from prometheus_client.utils import floatToGoString
except ImportError:  # the hooks below become no-ops
    _pc = None

ENABLED = _pc is not None

_LAT_BUCKETS = (5e-6, 10e-6, 20e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3,
                50e-3, 0.1, 0.5, 1.0, 5.0)
_XFER_BUCKETS = (100e-6, 500e-6, 1e-3, 5e-3, 10e-3, 50e-3, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_agents: "weakref.WeakSet[Any]" = weakref.WeakSet()
_controllers: "weakref.WeakSet[Any]" = weakref.WeakSet()
_OPS = {0x01: "write", 0x02: "read"}
_RUN = struct.Struct("<IIQQ")  # a DATA run on the KV wire: seg, flags, offset, length

if ENABLED:
    KV_BYTES = _pc.Counter("p2phub_kv_bytes", "KV bytes sent (acknowledged) or received (landed)",
                           ["agent", "direction"])
    KV_TRANSFERS = _pc.Counter("p2phub_kv_transfers", "KV transfers sent, requests received",
                               ["agent", "direction"])
    KV_ERRORS = _pc.Counter("p2phub_kv_errors", "KV transfers that failed, data refused",
                            ["agent", "direction"])
    KV_AUTH_FAILURES = _pc.Counter("p2phub_kv_auth_failures",
                                   "KV connections refused before or at the proof of the secret",
                                   ["agent", "reason"])
    KV_SECONDS = _pc.Histogram("p2phub_kv_transfer_seconds", "KV transfer: post to acknowledgement",
                               ["agent"], buckets=_XFER_BUCKETS)
    class _NvmeTotals:
        """The NVMe engines' request, byte and error counters and their batch-time histogram,
        per (controller, op): plain ints under one lock, one hold per completed batch. A
        read_batch completes thousands of times a second; prometheus_client's children take
        a lock for each inc and observe, and a lookup for each labels()."""

        def __init__(self) -> None:
            self._lock = threading.Lock()
            self._done: dict[tuple[str, str], list[int]] = {}   # [requests, bytes]
            self._errors: dict[tuple[str, str], int] = {}
            self._batches: dict[tuple[str, str], list] = {}     # [per-bucket counts, count, sum s]
            self._les = [floatToGoString(b) for b in _XFER_BUCKETS]

        def count(self, key: tuple[str, str], requests: int, nbytes: int) -> None:
            with self._lock:
                self._add(key, requests, nbytes, 0)

        def fail(self, key: tuple[str, str], requests: int) -> None:
            with self._lock:
                self._errors[key] = self._errors.get(key, 0) + requests

        def batch(self, key: tuple[str, str], requests: int, nbytes: int, failed: int,
                  seconds: float) -> None:
            """A batch ended: requests and bytes that completed, requests that failed, and its
            time from submission to its last completion."""
            with self._lock:
                self._add(key, requests, nbytes, failed)
                self._time(key, seconds)

        def batch_time(self, key: tuple[str, str], seconds: float) -> None:
            with self._lock:
                self._time(key, seconds)

        def _add(self, key: tuple[str, str], requests: int, nbytes: int, failed: int) -> None:
            d = self._done.get(key)
            if d is None:
                d = self._done[key] = [0, 0]
            d[0] += requests
            d[1] += nbytes
            if failed:
                self._errors[key] = self._errors.get(key, 0) + failed

        def _time(self, key: tuple[str, str], seconds: float) -> None:
            h = self._batches.get(key)
            if h is None:
                h = self._batches[key] = [[0] * (len(_XFER_BUCKETS) + 1), 0, 0.0]
            h[0][bisect.bisect_left(_XFER_BUCKETS, seconds)] += 1   # le: at most the bound
            h[1] += 1
            h[2] += seconds

        def collect(self) -> Iterable[Any]:
            with self._lock:
                done = [(k, list(v)) for k, v in self._done.items()]
                errors = list(self._errors.items())
                batches = [(k, list(v[0]), v[1], v[2]) for k, v in self._batches.items()]
            commands, moved, failed, seconds = families = self._families()
            for key, (n, nbytes) in done:
                commands.add_metric(list(key), n)
                moved.add_metric(list(key), nbytes)
            for key, n in errors:
                failed.add_metric(list(key), n)
            for key, per, n, total in batches:
                cum = list(itertools.accumulate(per[:-1]))
                seconds.add_metric(list(key), [*zip(self._les, cum), ("+Inf", n)], total)
            return families

        def describe(self) -> Iterable[Any]:
            return self._families()

        @staticmethod
        def _families() -> list[Any]:
            labels = ["controller", "op"]
            return [CounterMetricFamily("p2phub_nvme_commands", "NVMe requests completed", labels=labels),
                    CounterMetricFamily("p2phub_nvme_bytes", "NVMe bytes moved by completed requests",
                                        labels=labels),
                    CounterMetricFamily("p2phub_nvme_errors", "NVMe requests that failed", labels=labels),
                    HistogramMetricFamily("p2phub_nvme_batch_seconds",
                                          "NVMe batch: submission to its last completion", labels=labels)]

    NVME = _NvmeTotals()
    _pc.REGISTRY.register(NVME)

    class _LatencyHistogram:
        """A histogram fed a whole batch of latencies at once. A read_batch of 4,096
        requests adds its latencies in one C pass into the series' own counts (each series
        an array of uint64: the cumulative count per bound, then how many, then their sum in
        ns), where Histogram.observe would take its lock 4,096 times on the thread that
        reaps the queue."""

        def __init__(self, name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> None:
            self.name, self.doc, self.labels = name, doc, labels
            self.buckets = buckets
            self._bounds_ns = tuple(int(round(b * 1e9)) for b in buckets)
            self._les = [floatToGoString(b) for b in buckets]
            self._series: dict[tuple[str, ...], array.array] = {}
            self._lock = threading.Lock()

        def _series_of(self, labels: tuple[str, ...]) -> array.array:
            s = self._series.get(labels)
            if s is None:
                s = self._series[labels] = array.array("Q", bytes(8 * (len(self._bounds_ns) + 2)))
            return s

        def observe_ns(self, labels: tuple[str, ...], lat_ns: Iterable[int]) -> None:
            lat = sorted(lat_ns)
            if lat:
                self.observe_buckets(labels, [bisect.bisect_right(lat, b) for b in self._bounds_ns],
                                     len(lat), sum(lat))

        def observe_buckets(self, labels: tuple[str, ...], below: list[int], n: int, total_ns: int) -> None:
            """n latencies already bucketed: below[i] of them at most bounds_ns[i]; total_ns their sum."""
            if not n:
                return
            nb = len(self._bounds_ns)
            with self._lock:
                s = self._series_of(labels)
                s[:nb] = array.array("Q", map(operator.add, s[:nb], below))
                s[nb] += n
                s[nb + 1] += total_ns

        def observe_batch(self, labels: tuple[str, ...], batch: Any) -> None:
            """Every latency of a done NVMe batch (BatchFuture.add_latencies), counted in C."""
            nb = len(self._bounds_ns)
            with self._lock:
                s = self._series_of(labels)
                s[nb] += batch.add_latencies(self._bounds_ns, s)

        @property
        def bounds_ns(self) -> tuple[int, ...]:
            return self._bounds_ns

        def observe(self, labels: tuple[str, ...], seconds: float) -> None:
            self.observe_ns(labels, (int(seconds * 1e9),))

        def collect(self) -> Iterable[Any]:
            fam = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
            nb = len(self._bounds_ns)
            with self._lock:
                series = [(k, list(v[:nb]), v[nb], v[nb + 1]) for k, v in self._series.items()]
            for labels, counts, n, total_ns in series:
                fam.add_metric(list(labels), [*zip(self._les, counts), ("+Inf", n)], total_ns / 1e9)
            return [fam]

        def describe(self) -> Iterable[Any]:
            return [HistogramMetricFamily(self.name, self.doc, labels=self.labels)]

    NVME_SECONDS = _LatencyHistogram("p2phub_nvme_command_seconds", "NVMe request latency",
                                     ["controller", "op"], _LAT_BUCKETS)
    _pc.REGISTRY.register(NVME_SECONDS)

    class _Live:
        """Gauges read at scrape time from the live agents and controllers (no hot-path cost)."""

        def collect(self) -> Iterable[Any]:
            kv = _pair("kv", "agent", "registered_segments", "live memory registrations of a KV agent",
                       "registered_bytes", "bytes a KV agent's registrations cover",
                       ((a.name, [n for _addr, n in a.segments]) for a in list(_agents)
                        if not a.closed))
            nvme = _pair("nvme", "controller", "mapped_registrations",
                         "registrations mapped for an NVMe controller", "mapped_bytes",
                         "bytes pinned by an NVMe controller's mappings",
                         ((c.bdf, [int(getattr(m.reg, "length", 0)) for m in c.mappings.mapped()])
                          for c in list(_controllers) if not getattr(c, "closed", False)))
            return [*kv, *nvme]

        def describe(self) -> Iterable[Any]:
            return []

    def _pair(kind: str, label: str, count_name: str, count_help: str, bytes_name: str, bytes_help: str,
              owners: Iterable[tuple[str, list[int]]]) -> tuple[Any, Any]:
        """Two gauges, how many registrations and how many bytes, one sample per owner."""
        count = GaugeMetricFamily(f"p2phub_{kind}_{count_name}", count_help, labels=[label])
        total = GaugeMetricFamily(f"p2phub_{kind}_{bytes_name}", bytes_help, labels=[label])
        for name, lengths in owners:
            count.add_metric([name], len(lengths))
            total.add_metric([name], sum(lengths))
        return count, total

    _pc.REGISTRY.register(_Live())


# ------------------------------------------------------------------ hooks (one line each at the call site)


def track_agent(agent: Any) -> None:
    """A KV agent: its registrations become gauges while it lives."""
    if ENABLED:
        _agents.add(agent)


def track_controller(ctrl: Any) -> None:
    """An NVMe controller: its mapped registrations become gauges while it lives."""
    if ENABLED:
        _controllers.add(ctrl)


def kv_sent(agent: str, xfer: Any) -> None:
    """A KV transfer ended (xfer.error set when it failed); xfer.posted: its monotonic post time."""
    if not ENABLED:
        return
    if xfer.error is not None:
        KV_ERRORS.labels(agent, "sent").inc()
        return
    KV_BYTES.labels(agent, "sent").inc(xfer.nbytes)
    KV_TRANSFERS.labels(agent, "sent").inc()
    if xfer.posted:
        KV_SECONDS.labels(agent).observe(time.monotonic() - xfer.posted)


def kv_landed(agent: str, wire: bytes) -> None:
    """DATA landed in an agent's memory: `wire` is its runs (their lengths add up to the bytes)."""
    if ENABLED:
        KV_BYTES.labels(agent, "received").inc(sum(r[3] for r in _RUN.iter_unpack(wire)))


def kv_received(agent: str) -> None:
    """A transfer into an agent ended well (its receiver acknowledged it)."""
    if ENABLED:
        KV_TRANSFERS.labels(agent, "received").inc()


def kv_auth_failed(agent: str, reason: str) -> None:
    """A connection to or from an agent did not prove the KV secret (`reason`: why)."""
    if ENABLED:
        KV_AUTH_FAILURES.labels(agent, reason).inc()


def kv_refused(agent: str) -> None:
    """Data a receiving agent refused (bad runs, unknown request) or a transfer it failed."""
    if ENABLED:
        KV_ERRORS.labels(agent, "received").inc()


def nvme_ops(bdf: str, ops: list[Any], fut: Any, op_futures: list[Any] | None = None) -> None:
    """A batch of requests (Namespace.submit_ops) went to controller `bdf`: when it is done,
    each request counts its bytes, or its error (per-request NVMe status); where the caller
    has one future per request (Namespace.submit), each also observes its latency (from
    submission to its last command's completion)."""
    if not ENABLED:
        return
    t0 = time.monotonic()

    def done(f: Any) -> None:
        for op, status in zip(ops, f.statuses()):
            key = (bdf, getattr(op, "kind", "other"))
            if status:
                NVME.fail(key, 1)
            else:
                NVME.count(key, 1, int(getattr(op, "nbytes", 0) or 0))
        NVME.batch_time((bdf, "requests"), time.monotonic() - t0)
    fut.add_done_callback(done)
    for op, of in zip(ops, op_futures or ()):
        def one(f: Any, kind: str = getattr(op, "kind", "other")) -> None:
            if f.error is None:
                NVME_SECONDS.observe((bdf, kind), time.monotonic() - t0)
        of.add_done_callback(one)


def nvme_batch(bdf: str, kind: str, n: int, nbytes: int, fut: Any) -> None:
    """A read_batch/write_batch of n requests of nbytes each went to controller `bdf`."""
    if not ENABLED:
        return
    t0 = time.monotonic()
    key = (bdf, kind)

    def done(f: Any) -> None:
        if f.error is None:
            NVME.batch(key, n, n * nbytes, 0, time.monotonic() - t0)
            NVME_SECONDS.observe_batch(key, f)   # every request, counted in C
            return
        ok = max(int(f.completed) - int(f.failures), 0)
        NVME.batch(key, ok, ok * nbytes, max(n - ok, 1), time.monotonic() - t0)
        if ok > 0:
            NVME_SECONDS.observe_ns(key, f.latencies_ns()[:ok])
    fut.add_done_callback(done)


# ------------------------------------------------------------------ serving


def _require() -> Any:
    if not ENABLED:
        from .deps import error_for
        raise error_for("prometheus_client")
    return _pc


def start_http_server(port: int, addr: str = "127.0.0.1") -> tuple[str, int]:
    """Serve every metric of the default registry on http://addr:port/metrics (port 0: any free
    one) from a daemon thread; returns the (host, port) it listens on."""
    pc = _require()
    server, _thread = pc.start_http_server(port, addr=addr)
    host, bound = server.server_address[:2]
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return host, bound


def generate_latest() -> bytes:
    """The text exposition of the default registry (what a scrape returns)."""
    return _require().generate_latest()
