"""What p2phub.ko charges a user for: pinned bytes against RLIMIT_MEMLOCK, opens per user.

Each case runs a child process under setpriv (a non-root uid with /dev/p2phub's group, or root
without CAP_IPC_LOCK) that registers through p2phub's Python API and reads its own VmPin from
/proc/self/status, which the kernel keeps and p2phub does not format. The parent checks the
kernel log for the line that names the limit.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

import regutil
from p2phub.hostmem import Udmabuf, VgemBuffer

pytestmark = pytest.mark.lab

KiB = 1 << 10
PARAMS = Path("/sys/module/p2phub/parameters")
NOBODY = 65534

# Registers the dma-buf fds given as "fd:length" in order through one Hub, then closes the
# Hub. Prints, as JSON: VmPin before, then per registration its errno (0: registered), the
# error message and VmPin after it, and VmPin after closing the Hub.
REGISTER_CHILD = r"""
import json, resource, sys
from p2phub.errors import P2PHubOSError
from p2phub.hub import Hub

def vmpin():
    for line in open("/proc/self/status"):
        if line.startswith("VmPin:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmPin in /proc/self/status")

limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
out = {"before": vmpin(), "steps": []}
hub = Hub(mode="p2p")
regs = []
for spec in sys.argv[2:]:
    fd, length = (int(x) for x in spec.split(":"))
    try:
        regs.append(hub.register_dmabuf(fd, 0, length))
        err, msg = 0, ""
    except P2PHubOSError as exc:
        err, msg = exc.errno, str(exc)
    out["steps"].append({"errno": err, "msg": msg, "vmpin": vmpin()})
if regs:
    regs[0].close()
    out["after_first_close"] = vmpin()
hub.close()
out["after"] = vmpin()
print(json.dumps(out))
"""

# Opens /dev/p2phub N times, then once more; closes one and opens again.
OPEN_CHILD = r"""
import errno, json, os, sys
from p2phub.device import Device
from p2phub.errors import P2PHubOSError

n = int(sys.argv[1])
fds = [os.open("/dev/p2phub", os.O_RDWR) for _ in range(n)]
out = {}
try:
    fds.append(os.open("/dev/p2phub", os.O_RDWR))
    out["extra"] = 0
except OSError as exc:
    out["extra"] = exc.errno
try:
    Device().close()
    out["msg"] = ""
except P2PHubOSError as exc:
    out["msg"] = str(exc)
os.close(fds.pop())
fds.append(os.open("/dev/p2phub", os.O_RDWR))
out["after_close"] = 0
print(json.dumps(out))
"""


def _host_buf(size: int) -> Udmabuf | VgemBuffer:
    return Udmabuf(size) if Path("/dev/udmabuf").exists() else VgemBuffer(size)


def _as_user(uid: int) -> list[str]:
    """setpriv for `uid` with /dev/p2phub's group only: a member of the p2phub group, no caps."""
    gid = os.stat("/dev/p2phub").st_gid
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]


NO_IPC_LOCK = ["setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock"]


def _run(prefix: list[str], code: str, args: list[str], fds: tuple[int, ...] = ()) -> dict:
    out = subprocess.run([*prefix, sys.executable, "-c", code, *args], capture_output=True, text=True,
                         timeout=120, pass_fds=fds)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _klog_since(mark: str) -> str:
    log = subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout
    return log[log.rfind(mark):]


def _mark() -> str:
    mark = f"p2phub-lab: accounting mark {time.monotonic_ns()}"
    Path("/dev/kmsg").write_text(mark + "\n")
    return mark


@pytest.fixture
def bufs() -> Iterator[list[Udmabuf | VgemBuffer]]:
    """Two 128 KiB buffers and a 4 KiB one, as dma-bufs."""
    bs = [_host_buf(128 * KiB), _host_buf(128 * KiB), _host_buf(4 * KiB)]
    try:
        yield bs
    finally:
        for b in bs:
            b.close()


def _specs(bs: list[Udmabuf | VgemBuffer]) -> list[str]:
    return [f"{b.fd}:{b.size}" for b in bs]


def test_registrations_are_charged_against_memlock(bufs: list) -> None:
    """Non-root, no CAP_IPC_LOCK, RLIMIT_MEMLOCK 256 KiB: 128 + 128 KiB register, 4 KiB more is
    refused naming RLIMIT_MEMLOCK; VmPin follows every registration and its release."""
    mark = _mark()
    r = _run(_as_user(NOBODY), REGISTER_CHILD, [str(256 * KiB), *_specs(bufs)],
             tuple(b.fd for b in bufs))
    s = r["steps"]
    assert [x["errno"] for x in s] == [0, 0, errno.ENOMEM], r
    assert [x["vmpin"] - r["before"] for x in s] == [128 * KiB, 256 * KiB, 256 * KiB], r
    assert "RLIMIT_MEMLOCK" in s[2]["msg"] and "ulimit -l" in s[2]["msg"], s[2]["msg"]
    assert r["after_first_close"] - r["before"] == 128 * KiB, r
    assert r["after"] == r["before"], r
    log = _klog_since(mark)
    assert "RLIMIT_MEMLOCK" in log and "REGISTER of 4096 bytes refused" in log, log
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


def test_cap_ipc_lock_lifts_the_limit_not_the_charge(bufs: list) -> None:
    """Root with CAP_IPC_LOCK registers 260 KiB under a 64 KiB limit (VmPin still counts it);
    root without CAP_IPC_LOCK is refused at the first registration."""
    r = _run([], REGISTER_CHILD, [str(64 * KiB), *_specs(bufs)], tuple(b.fd for b in bufs))
    assert [x["errno"] for x in r["steps"]] == [0, 0, 0], r
    assert r["steps"][-1]["vmpin"] - r["before"] == 260 * KiB, r
    assert r["after"] == r["before"], r

    r = _run(NO_IPC_LOCK, REGISTER_CHILD, [str(64 * KiB), *_specs(bufs)], tuple(b.fd for b in bufs))
    assert [x["errno"] for x in r["steps"]] == [errno.ENOMEM, errno.ENOMEM, 0], r  # 4 KiB fits
    assert r["steps"][-1]["vmpin"] - r["before"] == 4 * KiB, r
    assert r["after"] == r["before"], r
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


def test_opens_per_user_are_capped() -> None:
    """max_files_per_user=3: a user's 4th open of /dev/p2phub fails with EMFILE naming the
    parameter; closing one lets the next open through."""
    param = PARAMS / "max_files_per_user"
    old = param.read_text().strip()
    mark = _mark()
    try:
        param.write_text("3")
        r = _run(_as_user(NOBODY), OPEN_CHILD, ["3"])
    finally:
        param.write_text(old)
    assert r["extra"] == errno.EMFILE, r
    assert "max_files_per_user" in r["msg"], r["msg"]
    assert r["after_close"] == 0
    assert "max_files_per_user" in _klog_since(mark)


# Opens /dev/p2phub once, then forks one child per "fd:length": each REGISTERs on the inherited
# fd (a fresh mm, VmPin 0) and exits, its registration staying in the file. Then a Hub of its
# own registers the last one. Prints each child's errno and the Hub's error.
FORK_CHILD = r"""
import errno, json, os, resource, sys
from p2phub import uapi
from p2phub.device import Device
from p2phub.errors import P2PHubOSError
from p2phub.hub import Hub

limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
specs = [tuple(int(x) for x in s.split(":")) for s in sys.argv[2:]]
dev = Device()
out = {"children": []}
for fd, length in specs[:-1]:
    pid = os.fork()
    if pid == 0:
        arg = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF, fd=fd, length=length)
        try:
            dev.ioctl(uapi.REGISTER, arg, "REGISTER")
            os._exit(0)
        except P2PHubOSError as exc:
            os._exit(exc.errno)
    out["children"].append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
fd, length = specs[-1]
try:
    with Hub(mode="p2p") as hub, hub.register_dmabuf(fd, 0, length):
        out["hub"] = [0, ""]
except P2PHubOSError as exc:
    out["hub"] = [exc.errno, str(exc)]
dev.close()
print(json.dumps(out))
"""


def test_pins_are_capped_per_user_across_forked_children() -> None:
    """Non-root, RLIMIT_MEMLOCK 256 KiB: two forked children register 128 KiB each on one
    inherited fd (each child's own VmPin starts at 0), a third is refused with EDQUOT: the user's
    pins are summed over its processes. A new Hub of the same user is refused too, its error
    naming the limit; everything goes with the file."""
    bs = [_host_buf(128 * KiB) for _ in range(4)]
    mark = _mark()
    try:
        r = _run(_as_user(NOBODY), FORK_CHILD, [str(256 * KiB), *_specs(bs)],
                 tuple(b.fd for b in bs))
    finally:
        for b in bs:
            b.close()
    assert r["children"] == [0, 0, errno.EDQUOT], r
    assert r["hub"][0] == errno.EDQUOT, r
    assert "per-user limit on pinned memory" in r["hub"][1] and "RLIMIT_MEMLOCK" in r["hub"][1], r
    log = _klog_since(mark)
    assert "pinned through p2phub in all its processes" in log, log
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}


# Run as root. A child opens /dev/p2phub as `uid` (the device's group, RLIMIT_MEMLOCK `limit`),
# then forks one grandchild per "fd:length", one at a time: each enters a user namespace of its
# own, is mapped there (by this root process, as newuidmap would) to a distinct uid outside,
# setuid()s to it and REGISTERs on the inherited fd. Prints each grandchild's errno (0:
# registered) and the uids outside, or {"skip": why} when user namespaces cannot be made here.
USERNS_CHILD = r"""
import ctypes, json, os, resource, sys, time
from p2phub import uapi
from p2phub.device import Device
from p2phub.errors import P2PHubOSError

CLONE_NEWUSER = 0x10000000
libc = ctypes.CDLL(None, use_errno=True)
uid, gid, limit, base = (int(x) for x in sys.argv[1:5])
specs = [tuple(int(x) for x in s.split(":")) for s in sys.argv[5:]]
rd, wr = os.pipe()

opener = os.fork()
if opener == 0:
    os.close(rd)
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (limit, limit))
    os.setresuid(uid, uid, uid)
    dev = Device()
    codes = []
    for i, (fd, length) in enumerate(specs):
        pid = os.fork()
        if pid == 0:
            if libc.unshare(CLONE_NEWUSER) != 0:
                os.write(wr, f"skip unshare(CLONE_NEWUSER): {os.strerror(ctypes.get_errno())}\n".encode())
                os._exit(200)
            os.write(wr, f"map {os.getpid()} {base + i}\n".encode())
            deadline = time.monotonic() + 30
            while not open("/proc/self/uid_map").read().strip():
                if time.monotonic() > deadline:
                    os._exit(202)
                time.sleep(0.01)
            os.setresuid(0, 0, 0)               # uid 0 inside: base + i outside
            arg = uapi.Register.new(flags=uapi.REGISTER_F_DMABUF, fd=fd, length=length)
            try:
                dev.ioctl(uapi.REGISTER, arg, "REGISTER")
                os._exit(0)
            except P2PHubOSError as exc:
                os._exit(exc.errno)
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        if codes[-1] == 200:
            break
    os.write(wr, ("done " + json.dumps(codes) + "\n").encode())
    dev.close()
    os._exit(0)

os.close(wr)
out = {"children": [], "uids": []}
for line in os.fdopen(rd):
    word, _, rest = line.strip().partition(" ")
    if word == "skip":
        out["skip"] = rest
    elif word == "map":
        pid, outside = (int(x) for x in rest.split())
        with open(f"/proc/{pid}/uid_map", "w") as f:
            f.write(f"0 {outside} 1\n")
        out["uids"].append(outside)
    elif word == "done":
        out["children"] = json.loads(rest)
os.waitpid(opener, 0)
print(json.dumps(out))
"""


def test_pins_are_charged_to_the_opener_across_uids_in_a_user_namespace() -> None:
    """A non-root user opens /dev/p2phub (RLIMIT_MEMLOCK 256 KiB); children on the inherited fd
    each enter a user namespace and setuid() to a distinct uid: two register 128 KiB each, the
    third is refused with EDQUOT. The pins are the opener's, whatever uid the caller has now."""
    bs = [_host_buf(128 * KiB) for _ in range(3)]
    gid = os.stat("/dev/p2phub").st_gid
    try:
        r = _run([], USERNS_CHILD, [str(NOBODY), str(gid), str(256 * KiB), "200000", *_specs(bs)],
                 tuple(b.fd for b in bs))
    finally:
        for b in bs:
            b.close()
    if "skip" in r:
        pytest.skip(f"no user namespaces in this kernel: {r['skip']}")
    assert len(set(r["uids"])) == 3, r
    assert r["children"] == [0, 0, errno.EDQUOT], r
    assert regutil.wait_no_leaks() == {k: 0 for k in regutil.LEAK_COUNTERS}
