"""The staged I/O engine's CUDA path on the host: a stand-in libcuda.so.1 (fake_libcuda.c)
queues the copies and carries them out only at a later event, as a GPU would, so reusing a
staging slot too early shows as wrong bytes. Loads and saves, with cuMemcpyBatchAsync and
with one copy per run (P2PHUB_NO_BATCH_COPY), loads with the reads on their own thread
(the default) and on the copying thread."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SCRIPT = r"""
import os, sys
import numpy as np
from p2phub import batch, staged
from p2phub.backend import GpuRange
from p2phub.hub import Hub

class FakeCudaOps(staged.HostOps):
    name = "fakecuda"
    def stream_create(self):
        return 1

def fake_gpu(hub, nbytes):
    buf = np.zeros(nbytes, np.uint8)
    ptr = buf.ctypes.data
    rng = GpuRange("fakecuda", 0, ptr, nbytes, ptr, nbytes, keepalive=[buf])
    reg = staged.StagedRegistration(hub, rng, FakeCudaOps(), "fake GPU memory")
    hub._staging.add(reg)
    return buf, reg

path, out = sys.argv[1], sys.argv[2]
data = np.fromfile(path, np.uint8)
hub = Hub(mode="staged")
batch.configure_batch(hub, depth=8, slot=64 << 10, slots=12,   # slots reused many times
                      io_thread=os.environ.get("IO_THREAD") == "1")
mem, reg = fake_gpu(hub, 16 << 20)
rng = np.random.default_rng(3)
n = 600
lens = rng.choice([4096, 5000, 65536, 200000], n)
offs = np.array([rng.integers(0, data.size - l) for l in lens])
dsts = rng.permutation((16 << 20) // 200000)[:n % 80 or 80] * 200000
n = dsts.size
lens, offs = lens[:n], offs[:n]
f = hub.load_batch(storage=path, offsets=offs, lengths=lens, memory=reg, mem_offsets=dsts)
f.wait(60)
for o, l, d in zip(offs, lens, dsts):
    assert np.array_equal(mem[d:d + l], data[o:o + l]), (o, l, d)
st = f.stats
assert st["copies"] >= n - st["merged"] and st["copy_calls"] >= 1, st
# save: fake GPU memory -> scattered places of a file
np.zeros(4 << 20, np.uint8).tofile(out)
woffs = rng.permutation(64)[:40] * 65536
wsrc = rng.integers(0, (16 << 20) // 4096 - 16, 40) * 4096
g = hub.save_batch(storage=out, offsets=woffs, lengths=65536, memory=reg, mem_offsets=wsrc)
g.wait(60)
got = np.fromfile(out, np.uint8)
for o, m in zip(woffs, wsrc):
    assert np.array_equal(got[o:o + 65536], mem[m:m + 65536])
# one batch into the fake GPU and into host memory: only the host engine's ring registers
# the host memory, and the bytes land in both
host = hub.alloc_host(1 << 20)
hview = np.frombuffer(host.mmap(), np.uint8)
mix = hub.load_batch(storage=path, offsets=[0, 8192, 65536], lengths=4096, memory=[reg, host],
                     memory_index=[0, 1, 1], mem_offsets=[0, 0, 4096], direct=True)
mix.wait(60)
assert np.array_equal(mem[:4096], data[:4096])
assert np.array_equal(hview[:4096], data[8192:12288])
assert np.array_equal(hview[4096:8192], data[65536:69632])
cuda_eng = hub.engines.batch_engine(FakeCudaOps(), 0)
host_eng = hub.engines.batch_engine(staged.HostOps(), 0)
assert cuda_eng.mem_table()["live"] == 0, cuda_eng.mem_table()
if host_eng.mem_table()["table"]:
    assert host_eng.mem_table()["live"] == 1, host_eng.mem_table()
# large entries: the staging carved into 512 KiB slots (8 base slots each, 32 of them) for
# that run, the base slots again for the next
batch.configure_batch(hub, depth=8, slot=64 << 10, slots=256,
                      io_thread=os.environ.get("IO_THREAD") == "1")
for ln, carved in ((1 << 20, (512 << 10, 32)), (4096, (64 << 10, 256))):
    boffs = rng.integers(0, (data.size - ln) // 4096, 6) * 4096
    bdst = np.arange(6) * (2 << 20) + 4096
    b = hub.load_batch(storage=path, offsets=boffs, lengths=ln, memory=reg, mem_offsets=bdst)
    b.wait(60)
    assert (b.stats["slot_bytes"], b.stats["slots"]) == carved, b.stats
    for o, d in zip(boffs, bdst):
        assert np.array_equal(mem[d:d + ln], data[o:o + ln]), (ln, o, d)
del hview
print("ok", st["batch_copy_api"], g.stats["batch_copy_api"], st["io_thread"], g.stats["io_thread"])
hub.close()
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("fakecuda")
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"),
                    str(HERE / "fake_libcuda.c")], check=True)
    return d


@pytest.mark.parametrize("batched,io_thread", [(True, True), (False, True), (True, False)])
def test_engine_cuda_path_with_a_stand_in_driver(fake_libcuda, tmp_path, batched,
                                                 io_thread) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(6 << 20))
    env = dict(os.environ, LD_LIBRARY_PATH=str(fake_libcuda))
    env.pop("P2PHUB_NO_BATCH_COPY", None)
    if not batched:
        env["P2PHUB_NO_BATCH_COPY"] = "1"
    env["IO_THREAD"] = "1" if io_thread else "0"
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(src), str(tmp_path / "out.bin")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    # loads read on a second thread while this one issues the copies (unless told not to);
    # saves run on one thread
    assert res.stdout.split() == ["ok", str(batched), str(batched), str(io_thread), "False"]
