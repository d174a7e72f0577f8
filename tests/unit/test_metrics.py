"""Prometheus metrics (p2phub.metrics): a scrape over HTTP on loopback shows the bytes a KV
transfer and NVMe reads moved, the live registrations, and the no-op fallback without the package."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

prometheus_client = pytest.importorskip("prometheus_client")  # the `metrics` extra (tools/setup installs it)

from p2phub import metrics  # noqa: E402

TOP = Path(__file__).resolve().parents[2]
SMALL = ["--layers", "4", "--blocks", "64", "--block-bytes", "8192"]


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    """The sample of `name` whose labels include `labels` (0.0 when absent)."""
    for line in text.splitlines():
        m = re.match(rf"{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def _p2phub(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TOP), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-m", "p2phub", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def test_kv_serve_metrics_port_shows_the_bytes_a_transfer_moved() -> None:
    srv = _p2phub("kv", "serve", "--name", "decode-m", "--count", "2", "--json", "--metrics-port", "0", *SMALL)
    try:
        first = json.loads(srv.stdout.readline())
        url = first["metrics"]
        assert url.startswith("http://127.0.0.1:")
        before = _scrape(url)
        pool = 4 * 64 * 2 * 8192  # layers x pages x K/V x bytes: the pool the agent registered
        assert _value(before, "p2phub_kv_registered_bytes", agent="decode-m") == pool
        assert _value(before, "p2phub_kv_registered_segments", agent="decode-m") >= 1
        assert _value(before, "p2phub_kv_bytes_total", agent="decode-m", direction="received") == 0
        snd = _p2phub("kv", "send", "--to", f"127.0.0.1:{first['port']}", "--pages", "40", "--json", *SMALL)
        out, err = snd.communicate(timeout=60)
        assert snd.returncode == 0, err
        sent = json.loads(out)["bytes"]
        assert json.loads(srv.stdout.readline())["event"] == "request"   # the server checked it
        after = _scrape(url)
        assert _value(after, "p2phub_kv_bytes_total", agent="decode-m", direction="received") == sent
        assert _value(after, "p2phub_kv_transfers_total", agent="decode-m", direction="received") == 1
        assert _value(after, "p2phub_kv_errors_total", agent="decode-m", direction="received") == 0
    finally:
        srv.kill()
        srv.wait()


def test_library_agents_count_bytes_latency_and_registrations() -> None:
    from p2phub.kv import Agent, KVLayout, KVPool

    lay = KVLayout(num_layers=2, blocks_per_layer=16, block_bytes=4096)
    host, port = metrics.start_http_server(0)
    url = f"http://{host}:{port}/metrics"
    with KVPool.host(lay) as pa, KVPool.host(lay) as pb, Agent("metrics-a", pa) as a, \
            Agent("metrics-b", pb) as b:
        peer = a.handshake(b.host, b.port)
        x = a.send_request(peer, 1, [0, 1, 2], [5, 6, 7])
        x.wait(30)
        b.expect("metrics-a", 1).done.wait(30)
        text = _scrape(url)
        assert _value(text, "p2phub_kv_bytes_total", agent="metrics-a", direction="sent") == x.nbytes
        assert _value(text, "p2phub_kv_bytes_total", agent="metrics-b", direction="received") == x.nbytes
        assert _value(text, "p2phub_kv_transfer_seconds_count", agent="metrics-a") == 1
        assert _value(text, "p2phub_kv_registered_bytes", agent="metrics-a") == pa.nbytes
    # closed agents are no longer reported
    assert 'agent="metrics-a"' not in "\n".join(
        ln for ln in _scrape(url).splitlines() if ln.startswith("p2phub_kv_registered"))


@pytest.fixture()
def nvme_rig():
    """A controller on the fake NVMe device (one 4,096-block namespace), a 1 MiB registration
    it maps, and the fake device (stopped afterwards)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from nvme_fake import FakeControllerFile, FakeHub, FakeNamespace
    from p2phub.nvme import _build
    from p2phub.nvme.controller import Controller

    hot = _build.load()
    dev = FakeControllerFile(hot, namespaces={1: FakeNamespace(blocks=4096)})
    c = Controller(dev, hot=hot, io_queues=1, queue_depth=32)
    c.start()
    try:
        reg = FakeHub(dev.device).register(1 << 20)
        dev.add_registration(reg)
        yield c, dev, reg
    finally:
        c.close()
        dev.stop()


def test_nvme_engine_counts_reads_writes_and_mapped_bytes(nvme_rig) -> None:
    from p2phub.nvme import ReadOp

    c, _dev, reg = nvme_rig
    ns = c.namespace(1)
    bdf = c.bdf

    def count(name: str, **kw: str) -> float:
        return _value(metrics.generate_latest().decode(), name, controller=bdf, **kw)
    r0, b0 = count("p2phub_nvme_bytes_total", op="read"), count("p2phub_nvme_commands_total", op="read")
    for f in ns.submit([ReadOp(reg, 8 * i, 4096, 4096 * i) for i in range(4)]):
        f.result(timeout=10)
    ns.read_batch(reg, [0, 8, 16], [0, 4096, 8192], 4096).result(timeout=10)
    ns.write_batch(reg, [64], [0], 8192).result(timeout=10)
    assert count("p2phub_nvme_bytes_total", op="read") - r0 == 7 * 4096
    assert count("p2phub_nvme_commands_total", op="read") - b0 == 7
    assert count("p2phub_nvme_bytes_total", op="write") >= 8192
    assert count("p2phub_nvme_command_seconds_count", op="read") >= 4
    assert count("p2phub_nvme_mapped_registrations") == 1
    assert count("p2phub_nvme_mapped_bytes") == 1 << 20


def test_without_prometheus_client_hooks_are_no_ops_and_serving_names_the_package() -> None:
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "from p2phub import metrics\n"
            "assert not metrics.ENABLED\n"
            "metrics.kv_landed('x', b''); metrics.kv_received('x'); metrics.track_agent(object())\n"
            "try:\n    metrics.start_http_server(0)\n"
            "except ImportError as e:\n    print(e)\n")
    env = dict(os.environ, PYTHONPATH=str(TOP))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "needs prometheus_client: pip install 'p2phub[metrics]'"


def test_top_once_shows_an_agents_bytes_and_registrations(capsys) -> None:
    from p2phub import cli
    from p2phub.kv import Agent, KVLayout, KVPool

    lay = KVLayout(num_layers=2, blocks_per_layer=16, block_bytes=4096)
    host, port = metrics.start_http_server(0)
    with KVPool.host(lay) as pa, KVPool.host(lay) as pb, Agent("top-a", pa) as a, Agent("top-b", pb) as b:
        x = a.send_request(a.handshake(b.host, b.port), 1, [0, 1], [2, 3])
        x.wait(30)
        b.expect("top-a", 1).done.wait(30)
        assert cli.main(["top", f"{host}:{port}", "--once", "--json"]) == 0
        snap = json.loads(capsys.readouterr().out)
        assert snap["schema"] == "p2phub.top/1"
        assert snap["series"]["kv top-a"]["bytes_total.sent"] == x.nbytes
        assert snap["series"]["kv top-b"]["bytes_total.received"] == x.nbytes
        assert snap["series"]["kv top-b"]["registered_bytes"] == pb.nbytes
        assert cli.main(["top", f"{host}:{port}", "--once"]) == 0
        text = capsys.readouterr().out
        assert "kv top-a" in text and "sent" in text


def test_top_names_an_endpoint_that_does_not_answer(capsys) -> None:
    import socket

    from p2phub import cli
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    assert cli.main(["top", f"127.0.0.1:{port}", "--once"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused" in err[0].lower()


def test_nvme_batches_count_requests_bytes_errors_and_batch_time_on_the_wire(nvme_rig) -> None:
    """A read_batch that succeeds counts its requests and bytes and one batch time; one the
    device fails counts what completed and the failures; a scrape shows them under the
    Prometheus names (counters end in _total, the batch time is a histogram)."""
    from p2phub.nvme.errors import NvmeStatusError

    c, dev, reg = nvme_rig
    ns = c.namespace(1)
    kw = {"controller": c.bdf, "op": "read"}

    names = ["p2phub_nvme_commands_total", "p2phub_nvme_bytes_total", "p2phub_nvme_errors_total",
             "p2phub_nvme_batch_seconds_count", "p2phub_nvme_command_seconds_count"]

    def counts() -> list[float]:   # the fake controller's address is every test's: deltas
        text = metrics.generate_latest().decode()
        return [_value(text, n, **kw) for n in names]
    before = counts()
    t0 = _value(metrics.generate_latest().decode(), "p2phub_nvme_batch_seconds_sum", **kw)
    ns.read_batch(reg, [0, 8, 16, 24], [0, 4096, 8192, 12288], 4096, latencies=True).result(timeout=10)
    text = metrics.generate_latest().decode()
    assert [a - b for a, b in zip(counts(), before)] == [4, 4 * 4096, 0, 1, 4]
    assert _value(text, "p2phub_nvme_batch_seconds_bucket", le="+Inf", **kw) == before[3] + 1
    assert _value(text, "p2phub_nvme_batch_seconds_bucket", le="30.0", **kw) == before[3] + 1
    assert 0 < _value(text, "p2phub_nvme_batch_seconds_sum", **kw) - t0 < 10
    dev.ns[1].blocks = 100      # the device now fails reads past LBA 100
    with pytest.raises(NvmeStatusError):
        ns.read_batch(reg, [0, 200, 8], [0, 4096, 8192], 4096).result(timeout=10)
    # (its requests' latencies were not asked for: none observed)
    assert [a - b for a, b in zip(counts(), before)] == [6, 6 * 4096, 1, 2, 4]


def test_nvme_latency_histogram_takes_a_batch_at_once() -> None:
    labels = ("0000:99:00.0", "read")
    # 3 us, 5 us (on a bound: counted there), 7 us, 150 us, 2 s
    metrics.NVME_SECONDS.observe_ns(labels, [7_000, 3_000, 150_000, 5_000, 2_000_000_000])
    metrics.NVME_SECONDS.observe(labels, 40e-6)
    text = metrics.generate_latest().decode()
    kw = {"controller": labels[0], "op": "read"}
    assert _value(text, "p2phub_nvme_command_seconds_bucket", le="5e-06", **kw) == 2
    assert _value(text, "p2phub_nvme_command_seconds_bucket", le="1e-05", **kw) == 3
    assert _value(text, "p2phub_nvme_command_seconds_bucket", le="5e-05", **kw) == 4
    assert _value(text, "p2phub_nvme_command_seconds_bucket", le="0.0002", **kw) == 5
    assert _value(text, "p2phub_nvme_command_seconds_bucket", le="1.0", **kw) == 5
    assert _value(text, "p2phub_nvme_command_seconds_bucket", le="+Inf", **kw) == 6
    assert _value(text, "p2phub_nvme_command_seconds_count", **kw) == 6
    assert _value(text, "p2phub_nvme_command_seconds_sum", **kw) == pytest.approx(2.000205)
