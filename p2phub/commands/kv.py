"""`p2phub kv serve` / `p2phub kv send`: a KV transfer between two terminals or two nodes.

    p2phub kv serve --name decode --listen 127.0.0.1:7000 --count 1
    p2phub kv send  --name prefill --to 127.0.0.1:7000 --pages 512 --seed 7

The sender fills its pool with checkable pages (p2phub.kv.pattern), sends `--pages` random
pages of every layer to random places, and tells the server in the notification which
pages went where; the server checks every byte of them and reports. Both take the same
layout options (they must agree); --rdv tcpstore://H:P or redis://H:P finds the peer
through a store instead of --to. Exit codes: 0 verified, 1 transfer or check failed,
4 usage.

Both prove the deployment's secret to each other first: P2PHUB_KV_SECRET or
P2PHUB_KV_SECRET_FILE in the environment (never an option: a command line is visible to
every user), else the per-user secret, which serves one user on one host; --listen beyond
loopback needs one of the two variables.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from ..errors import P2PHubError
from .argtypes import hostport, int_at_least, non_negative, positive, seconds
from .progress import activity

SCHEMA = "p2phub.kv/1"


def _layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=positive, default=32, help="layers (default 32)")
    p.add_argument("--blocks", type=positive, default=1024, help="pages per layer (default 1024)")
    p.add_argument("--block-bytes", type=positive, default=16384, help="bytes per page (default 16384)")
    p.add_argument("--dtype", default="bfloat16", help="element type of the pages (default bfloat16)")
    p.add_argument("--arrangement", choices=("per_layer", "contiguous"), default="per_layer",
                   help="one region per layer (per_layer, the default) or one for all (contiguous)")
    p.add_argument("--stall-timeout", type=seconds, default=5.0,
                   help="seconds without progress before a peer counts as dead (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON")


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kv", metavar="ACTION", required=True)
    s = sub.add_parser("serve", help="receive KV requests into a pool and check them")
    s.add_argument("--name", default="decode", help="this agent's name (default decode)")
    s.add_argument("--listen", type=hostport(allow_zero=True), default="127.0.0.1:0",
                   help="HOST:PORT to listen on (default 127.0.0.1:0: any free port); beyond "
                        "loopback it needs P2PHUB_KV_SECRET or P2PHUB_KV_SECRET_FILE")
    s.add_argument("--rdv", help="publish the metadata to tcpstore://H:P or redis://H:P[/db]")
    s.add_argument("--count", type=non_negative, default=0, help="exit after this many requests (0: never)")
    s.add_argument("--metrics-port", type=int_at_least(0), default=None, metavar="PORT",
                   help="serve Prometheus metrics on http://127.0.0.1:PORT/metrics (0: any free port; "
                        "needs prometheus_client)")
    s.add_argument("--metrics-host", default="127.0.0.1",
                   help="address the metrics endpoint listens on (default 127.0.0.1)")
    _layout_args(s)
    t = sub.add_parser("send", help="send one KV request to a serving agent")
    t.add_argument("--name", default="prefill", help="this agent's name (default prefill)")
    t.add_argument("--to", type=hostport(allow_zero=False), help="HOST:PORT of the serving agent (direct handshake)")
    t.add_argument("--rdv", help="find --peer in tcpstore://H:P or redis://H:P[/db]")
    t.add_argument("--peer", default="decode", help="the serving agent's name (with --rdv)")
    t.add_argument("--pages", type=positive, default=256, help="pages per layer to send (default 256)")
    t.add_argument("--seed", type=int, default=1, help="seed of the random pages and places (default 1)")
    t.add_argument("--req", type=non_negative, default=1, help="request id (default 1)")
    _layout_args(t)
    s.set_defaults(_needs=lambda a: ["prometheus_client"] if a.metrics_port is not None else [])
    t.set_defaults(_check=_check_send)


def _check_send(args: argparse.Namespace) -> None:
    from ..errors import UsageError
    if args.pages > args.blocks:
        raise UsageError(f"--pages {args.pages} must be in [1, {args.blocks}] (--blocks)")
    if bool(args.to) == bool(args.rdv):
        raise UsageError("give exactly one of --to HOST:PORT and --rdv URL")


def _layout(args: argparse.Namespace):
    from ..kv import KVLayout
    return KVLayout(num_layers=args.layers, blocks_per_layer=args.blocks,
                    block_bytes=args.block_bytes, dtype=args.dtype, arrangement=args.arrangement)


def _hostport(text: str) -> tuple[str, int]:
    from ..errors import UsageError
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise UsageError(f"{text!r}: want HOST:PORT")
    return host or "127.0.0.1", int(port)


def _out(args: argparse.Namespace, d: dict, text: str) -> None:
    if args.json:
        print(json.dumps({"schema": SCHEMA, **d}), flush=True)
    else:
        from rich.console import Console
        Console().print(text)


def _serve(args: argparse.Namespace) -> int:
    from ..kv import Agent, KVPool
    from ..kv.pattern import page
    lay = _layout(args)
    host, port = _hostport(args.listen)
    bad_total = 0
    with KVPool.host(lay) as pool, Agent(args.name, pool, host=host, port=port,
                                        stall_timeout=args.stall_timeout) as agent:
        if args.rdv:
            from ..kv.rendezvous import open_rendezvous
            open_rendezvous(args.rdv).publish(agent.name, agent.metadata())
        extra, note = {}, ""
        if args.metrics_port is not None:
            from .. import metrics
            mh, mp = metrics.start_http_server(args.metrics_port, args.metrics_host)
            extra["metrics"] = f"http://{mh}:{mp}/metrics"
            note = f"; metrics on {extra['metrics']}"
        _out(args, {"event": "listening", "name": agent.name, "host": agent.host, "port": agent.port,
                    **extra},
             f"[bold]{agent.name}[/] listening on {agent.host}:{agent.port} "
             f"({lay.num_layers} layers x {lay.blocks_per_layer} pages x {lay.block_bytes} B){note}")
        served = 0
        while not args.count or served < args.count:
            time.sleep(0.01)
            for peer, msgs in agent.get_new_notifs().items():
                for m in msgs:
                    try:
                        info = json.loads(m)
                        src, dst, seed = info["local"], info["remote"], int(info["seed"])
                    except (ValueError, KeyError, TypeError):
                        continue
                    r = agent.expect(peer, int(info["req"]))
                    ok = r.done.done() and not r.done.failed()
                    bad = 0
                    for ly in range(lay.num_layers):
                        for kv in range(lay.kv):
                            for s, d in zip(src, dst):
                                if bytes(pool.block(ly, kv, d)) != page(seed, ly, kv, s, lay.block_bytes):
                                    bad += 1
                    nbytes = len(src) * lay.kv * lay.num_layers * lay.block_bytes
                    bad_total += bad + (0 if ok else 1)
                    _out(args, {"event": "request", "peer": peer, "req": info["req"], "bytes": nbytes,
                                "pages": len(src) * lay.kv * lay.num_layers, "bad_pages": bad,
                                "complete": ok},
                         f"request {info['req']} from {peer}: {nbytes} bytes, "
                         + ("[green]every byte verified[/]" if ok and not bad else
                            f"[red]{bad} bad pages, complete={ok}[/]"))
                    agent.release(peer, int(info["req"]))
                    served += 1
    return 1 if bad_total else 0


def _send(args: argparse.Namespace) -> int:
    from ..kv import Agent, KVPool
    from ..kv.pattern import page
    lay = _layout(args)
    with KVPool.host(lay) as pool, Agent(args.name, pool, stall_timeout=args.stall_timeout) as agent:
        rnd = random.Random(args.seed)
        src = rnd.sample(range(lay.blocks_per_layer), args.pages)
        dst = rnd.sample(range(lay.blocks_per_layer), args.pages)
        for ly in range(lay.num_layers):
            for kv in range(lay.kv):
                for s in src:
                    pool.block(ly, kv, s)[:] = page(args.seed, ly, kv, s, lay.block_bytes)
        if args.to:
            peer = agent.handshake(*_hostport(args.to))
        else:
            from ..kv.rendezvous import open_rendezvous
            peer = agent.add_remote(open_rendezvous(args.rdv).lookup(args.peer, timeout=30))
        notif = json.dumps({"req": args.req, "seed": args.seed, "local": src, "remote": dst}).encode()
        t0 = time.perf_counter()
        x = agent.send_request(peer, args.req, src, dst, notif=notif)
        with activity(args, f"request {args.req} -> {peer}: {x.nbytes} bytes"):
            x.wait(args.stall_timeout * 4 + 60)
        secs = time.perf_counter() - t0
        nbytes = x.nbytes
        _out(args, {"event": "sent", "peer": peer, "req": args.req, "bytes": nbytes,
                    "seconds": round(secs, 6), "gbps": round(nbytes / secs / 1e9, 3),
                    "state": x.state},
             f"request {args.req} -> {peer}: {nbytes} bytes in {secs * 1e3:.1f} ms "
             f"({nbytes / secs / 1e9:.2f} GB/s), {x.state}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Errors (and Ctrl-C) are reported by the dispatcher (p2phub/cli.py): one line, a JSON
    document with --json."""
    return _serve(args) if args.kv == "serve" else _send(args)
