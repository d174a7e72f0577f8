"""`p2phub top URL`: a live view of a metrics endpoint (`kv serve --metrics-port`, or a program
that called ``p2phub.metrics.start_http_server``): per KV agent and NVMe controller, the bytes
and operations, their rates, errors, mean latency, live registrations and pinned bytes."""

from __future__ import annotations

import argparse
import json
import re
import time
import urllib.request
from collections import defaultdict
from typing import Any

from .argtypes import Bad, seconds

SCHEMA = "p2phub.top/1"
_SAMPLE = re.compile(r"^(p2phub_[a-z_]+)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def endpoint(text: str) -> str:
    """http://HOST:PORT/metrics from a URL or HOST:PORT."""
    if text.startswith(("http://", "https://")):
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise Bad(f"{text!r}: want http://HOST:PORT/metrics or HOST:PORT")
    return f"http://{host or '127.0.0.1'}:{port}/metrics"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", type=endpoint, metavar="URL",
                        help="the metrics endpoint: http://HOST:PORT/metrics or HOST:PORT")
    parser.add_argument("--interval", type=seconds, default=1.0, help="seconds between scrapes (default 1)")
    parser.add_argument("--once", action="store_true", help="scrape once, print the table and exit")
    parser.add_argument("--json", action="store_true", help="with --once: print the snapshot as JSON")
    parser.set_defaults(_check=_check)


def _check(args: argparse.Namespace) -> None:
    from ..errors import UsageError
    if args.json and not args.once:
        raise UsageError("--json needs --once (the live view is a table)")


def scrape(url: str, timeout: float = 5.0) -> dict[tuple[str, str], dict[str, float]]:
    """{(kind, name): {series: value}} of p2phub's series at `url` (kind: kv or nvme)."""
    import urllib.error

    from ..errors import P2PHubError
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            text = r.read().decode()
    except urllib.error.URLError as exc:
        raise P2PHubError(f"{url}: {getattr(exc, 'reason', exc)}") from None
    rows: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))
        if name.endswith("_bucket") or name.endswith("_created"):
            continue
        if "agent" in labels:
            key = ("kv", labels["agent"])
        elif "controller" in labels:
            key = ("nvme", labels["controller"])
        else:
            continue
        sub = labels.get("direction") or labels.get("op") or ""
        series = name.removeprefix(f"p2phub_{key[0]}_") + (f".{sub}" if sub else "")
        rows[key][series] = rows[key].get(series, 0.0) + value
    return dict(rows)


def _fmt_bytes(n: float) -> str:
    for unit, sh in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << sh:
            return f"{n / (1 << sh):.1f} {unit}"
    return f"{n:.0f} B"


def _rows(now: dict, before: dict | None, dt: float) -> list[list[str]]:
    out = []
    for (kind, name), s in sorted(now.items()):
        prev = (before or {}).get((kind, name), {})
        if kind == "kv":
            moved = [("sent", "bytes_total.sent", "transfers_total.sent"),
                     ("received", "bytes_total.received", "transfers_total.received")]
            lat_sum, lat_n = s.get("transfer_seconds_sum", 0.0), s.get("transfer_seconds_count", 0.0)
            regs, pinned = s.get("registered_segments", 0), s.get("registered_bytes", 0)
        else:
            moved = [("read", "bytes_total.read", "commands_total.read"),
                     ("write", "bytes_total.write", "commands_total.write")]
            lat_sum = s.get("command_seconds_sum.read", 0.0) + s.get("command_seconds_sum.write", 0.0)
            lat_n = s.get("command_seconds_count.read", 0.0) + s.get("command_seconds_count.write", 0.0)
            regs, pinned = s.get("mapped_registrations", 0), s.get("mapped_bytes", 0)
        errors = sum(v for k, v in s.items() if k.startswith("errors_total"))
        for i, (what, b, ops) in enumerate(moved):
            rate = (s.get(b, 0.0) - prev.get(b, 0.0)) / dt if before is not None and dt > 0 else None
            out.append([f"{kind} {name}" if i == 0 else "", what, _fmt_bytes(s.get(b, 0.0)),
                        "-" if rate is None else f"{_fmt_bytes(rate)}/s", f"{s.get(ops, 0.0):.0f}",
                        f"{errors:.0f}" if i == 0 else "",
                        (f"{lat_sum / lat_n * 1e6:.0f} us" if lat_n else "-") if i == 0 else "",
                        f"{regs:.0f} / {_fmt_bytes(pinned)}" if i == 0 else ""])
    return out


def _table(url: str, now: dict, before: dict | None, dt: float) -> Any:
    from rich.table import Table
    t = Table(title=f"p2phub top: {url}", title_justify="left")
    for col in ("agent / controller", "", "bytes", "rate", "ops", "errors", "mean latency", "regs / pinned"):
        t.add_column(col, justify="left" if col in ("agent / controller", "") else "right")
    for r in _rows(now, before, dt):
        t.add_row(*r)
    if not now:
        t.add_row("(no KV agent or NVMe controller reported yet)", *[""] * 7)
    return t


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    first = scrape(args.url)
    if args.once:
        if args.json:
            print(json.dumps({"schema": SCHEMA, "url": args.url,
                              "series": {f"{k} {n}": v for (k, n), v in first.items()}}, indent=2))
        else:
            Console().print(_table(args.url, first, None, 0.0))
        return 0
    from rich.live import Live
    before, t_before = first, time.monotonic()
    with Live(_table(args.url, first, None, 0.0), console=Console(), auto_refresh=False) as live:
        while True:   # until Ctrl-C (exit 130, as every command)
            time.sleep(args.interval)
            now, t_now = scrape(args.url), time.monotonic()
            live.update(_table(args.url, now, before, t_now - t_before), refresh=True)
            before, t_before = now, t_now
