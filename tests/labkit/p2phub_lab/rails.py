"""A second RDMA rail for the lab: another veth pair with an rxe device on each end,
addressed and routed the way guest.sh sets up the first (rxe-a/rxe-b): rxe-c on
169.254.78.1, rxe-d on 169.254.78.2. Made on demand by the tests and benchmarks that
need two NICs per node, removed when they are done."""

from __future__ import annotations

import contextlib
import subprocess
import time
from pathlib import Path
from typing import Iterator

NODES = (("c", "169.254.78.1", "169.254.78.2", "12"), ("d", "169.254.78.2", "169.254.78.1", "13"))


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")


def _gid_ready(dev: str, tail: str) -> bool:
    p = Path(f"/sys/class/infiniband/{dev}/ports/1/gids/1")
    try:
        return p.read_text().strip().endswith(tail)
    except OSError:
        return False


@contextlib.contextmanager
def second_rail(timeout: float = 20.0) -> Iterator[tuple[str, str]]:
    """Yields ("rxe-c", "rxe-d"): node A's and node B's second NIC."""
    _sh("ip", "link", "add", "veth-c", "type", "veth", "peer", "name", "veth-d")
    try:
        for n, me, other, table in NODES:
            for k in ("accept_local=1", "rp_filter=0", "arp_ignore=1", "arp_announce=2",
                      "arp_filter=1"):
                _sh("sysctl", "-qw", f"net.ipv4.conf.veth-{n}.{k}")
            _sh("ip", "addr", "add", f"{me}/32", "dev", f"veth-{n}")
            _sh("ip", "link", "set", f"veth-{n}", "up")
            _sh("ip", "rule", "add", "pref", table, "to", other, "iif", "lo", "lookup", table)
            _sh("ip", "route", "add", other, "dev", f"veth-{n}", "src", me, "table", table)
        for n, *_ in NODES:
            _sh("rdma", "link", "add", f"rxe-{n}", "type", "rxe", "netdev", f"veth-{n}")
        deadline = time.monotonic() + timeout    # the IPv4 GIDs follow the addresses
        while not (_gid_ready("rxe-c", "a9fe:4e01") and _gid_ready("rxe-d", "a9fe:4e02")):
            if time.monotonic() > deadline:
                raise RuntimeError("rxe-c/rxe-d: no IPv4 GID at index 1")
            time.sleep(0.2)
        yield "rxe-c", "rxe-d"
    finally:
        for n, *_ in NODES:
            subprocess.run(["rdma", "link", "delete", f"rxe-{n}"], capture_output=True)
        for *_, table in NODES:
            subprocess.run(["ip", "rule", "del", "pref", table], capture_output=True)
        subprocess.run(["ip", "link", "del", "veth-c"], capture_output=True)


def sent_packets(dev: str) -> int:
    """The NIC's own count of packets it sent (rxe's hw_counters)."""
    return int(Path(f"/sys/class/infiniband/{dev}/ports/1/hw_counters/sent_pkts").read_text())
