"""A KV agent in its own process, driven by JSON lines on stdin (one reply line each).

Used by the two-process loopback tests: the test starts two (or three) of these, moves
metadata between them and tells them what to send and what to expect. Every page is
filled with, and checked against, content derived from (seed, layer, kv, block), so the
receiving process checks every byte on its own.

    {"op": "init", "name": "b", "layout": {...}, "stall": 2.0}  -> {"md": "..."}
    {"op": "fill", "seed": 1}
    {"op": "add_remote", "md": "..."}                          -> {"peer": "a"}
    {"op": "send", "peer": "b", "req": 1, "local": [...], "remote": [...],
     "pace": 0.0, "notif": "x"}                                -> {"state": "DONE", ...}
    {"op": "expect", "peer": "a", "req": 1, "timeout": 10}     -> {"layer_t": [...], ...}
    {"op": "verify", "seed": 1, "local": [...], "remote": [...], "layers": [...]}
"""

from __future__ import annotations

import json
import sys
import time
import traceback

from p2phub.kv import Agent, KVLayout, KVPool
from p2phub.kv.rendezvous import open_rendezvous

from p2phub.kv.pattern import page  # noqa: E402 - re-exported for the tests


class Peer:
    def __init__(self) -> None:
        self.agent: Agent | None = None
        self.pool: KVPool | None = None

    def op_init(self, m: dict) -> dict:
        lay = KVLayout.from_dict(m["layout"])
        self.pool = KVPool.host(lay)
        kw = {k: m[k] for k in ("port", "peer_timeout", "xfer_timeout") if k in m}
        self.agent = Agent(m["name"], self.pool, stall_timeout=m.get("stall", 2.0), **kw)
        if m.get("rdv"):
            rdv = open_rendezvous(m["rdv"])
            rdv.publish(self.agent.name, self.agent.metadata())
        return {"md": self.agent.metadata().decode(), "port": self.agent.port}

    def op_lookup(self, m: dict) -> dict:
        rdv = open_rendezvous(m["rdv"])
        return {"peer": self.agent.add_remote(rdv.lookup(m["name"], m.get("timeout", 10)))}

    def op_fill(self, m: dict) -> dict:
        lay = self.pool.layout
        for ly in range(lay.num_layers):
            for kv in range(lay.kv):
                for b in m.get("blocks", range(lay.blocks_per_layer)):
                    self.pool.block(ly, kv, b)[:] = page(m["seed"], ly, kv, b, lay.block_bytes)
        return {}

    def op_add_remote(self, m: dict) -> dict:
        return {"peer": self.agent.add_remote(m["md"])}

    def op_send(self, m: dict) -> dict:
        a = self.agent
        t0 = time.monotonic()
        layers = m.get("layers") or list(range(self.pool.layout.num_layers))
        if m.get("pace"):
            xs = []
            for i, ly in enumerate(layers):
                last = i == len(layers) - 1
                xs.append(a.send_request(m["peer"], m["req"], m["local"], m["remote"], [ly],
                                         notif=m.get("notif", "").encode() if last else b"",
                                         end=last, timeout=m.get("deadline")))
                time.sleep(m["pace"])
        else:
            xs = [a.send_request(m["peer"], m["req"], m["local"], m["remote"], layers,
                                 notif=m.get("notif", "").encode(), timeout=m.get("deadline"))]
        errors = []
        for x in xs:
            try:
                x.wait(m.get("timeout", 30))
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
        return {"state": "ERR" if errors else "DONE", "errors": errors,
                "status": [x.status for x in xs], "seconds": time.monotonic() - t0}

    def op_expect(self, m: dict) -> dict:
        r = self.agent.expect(m["peer"], m["req"], deadline=m.get("deadline"))
        lay = self.pool.layout
        t0 = time.monotonic()
        layer_t: list[float | None] = []
        error = None
        deadline = t0 + m.get("timeout", 30)
        for ly in m.get("layers") or range(lay.num_layers):
            try:
                r.layer(ly).wait(max(0.0, deadline - time.monotonic()))
                layer_t.append(time.monotonic() - t0)
            except Exception as exc:
                layer_t.append(None)
                error = error or f"{type(exc).__name__}: {exc}"
        if error is None:
            try:
                r.done.wait(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
        return {"layer_t": layer_t, "error": error, "failed_at": time.monotonic() - t0,
                "status": r.status,
                "landed": r.landed_layers(), "notifs": {k: [v.decode() for v in vs] for k, vs in
                                                         self.agent.get_new_notifs().items()}}

    def op_verify(self, m: dict) -> dict:
        lay = self.pool.layout
        bad = 0
        checked = 0
        for ly in m.get("layers") or range(lay.num_layers):
            for kv in range(lay.kv):
                for src, dst in zip(m["local"], m["remote"]):
                    checked += 1
                    if bytes(self.pool.block(ly, kv, dst)) != page(m["seed"], ly, kv, src, lay.block_bytes):
                        bad += 1
        return {"bad": bad, "checked": checked}

    def op_zero(self, m: dict) -> dict:
        for s in self.pool.segments:
            s.view[:] = bytes(s.length)
        return {}

    def op_exit(self, m: dict) -> dict:
        self.agent.close()
        return {}


def main() -> None:
    peer = Peer()
    for line in sys.stdin:
        m = json.loads(line)
        try:
            out = getattr(peer, "op_" + m["op"])(m)
            out["ok"] = True
        except Exception as exc:
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                   "trace": traceback.format_exc()}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
        if m["op"] == "exit":
            break


if __name__ == "__main__":
    main()
