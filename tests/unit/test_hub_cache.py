"""Hub's registration cache, reference counts, draining and fork rules, over an emulated /dev/p2phub.

The kernel side is a dictionary here (REGISTER adds a handle, UNREGISTER removes it, REG_INFO
reports it); what is checked is that p2phub makes exactly the kernel calls it should.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from p2phub import hub as hubmod
from p2phub import uapi
from p2phub.errors import P2PHubOSError, UsageError

pytestmark = pytest.mark.unit


class FakeKernel:
    def __init__(self) -> None:
        self.live: dict[int, str] = {}   # handle -> state
        self.calls: list[str] = []
        self._next = itertools.count(1)
        self.lock = threading.Lock()

    def ioctl(self, fd: int, req: int, arg: Any, mutate: bool = True) -> int:
        with self.lock:
            if req == uapi.REGISTER:
                self.calls.append("REGISTER")
                h = next(self._next)
                self.live[h] = "live"
                arg.out_handle, arg.out_page_size, arg.out_provider = h, 4096, uapi.PROVIDER_DMABUF
                return 0
            if req == uapi.UNREGISTER:
                self.calls.append("UNREGISTER")
                if self.live.pop(arg.handle, None) is None:
                    raise OSError(errno.ENOENT, "no such handle")
                return 0
            if req == uapi.REG_INFO:
                self.calls.append("REG_INFO")
                if not isinstance(arg, uapi.RegInfo):
                    arg = uapi.RegInfo.from_buffer(arg)
                if any(getattr(arg, f) for f, *_ in arg._fields_ if f.startswith("out_")):
                    raise OSError(errno.EINVAL, "outputs must come in as 0")  # the UAPI's rule
                st = self.live.get(arg.handle)
                if st is None:
                    raise OSError(errno.ENOENT, "no such handle")
                arg.out_state = uapi.REG_STATE_LIVE if st == "live" else uapi.REG_STATE_REVOKED
                arg.out_provider = uapi.PROVIDER_DMABUF
                return 0
            if req == uapi.GET_INFO:
                return 0
            raise OSError(errno.ENOTTY, "unexpected ioctl")


class FakeDevice:
    def __init__(self, path: str) -> None:
        self.fd, self.path, self.closed = 1000, path, False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    k = FakeKernel()
    monkeypatch.setattr(hubmod.fcntl, "ioctl", k.ioctl)
    monkeypatch.setattr(hubmod, "Device", FakeDevice)
    return k


@pytest.fixture
def buf(tmp_path: Path) -> Iterator[int]:
    p = tmp_path / "buf"
    p.write_bytes(b"\0" * 65536)
    fd = os.open(p, os.O_RDONLY)
    yield fd
    os.close(fd)


def test_a_second_registration_of_the_same_range_makes_no_kernel_call(kernel: FakeKernel, buf: int) -> None:
    with hubmod.Hub(mode="p2p") as hub:
        a = hub.register_dmabuf(buf)
        b = hub.register_dmabuf(buf, 0, 65536)
        assert a.handle == b.handle and a.shared == 2
        assert kernel.calls == ["REGISTER", "REG_INFO"]  # the hit checks for revocation only
        a.close()
        assert a.closed and not b.closed and kernel.live
        b.close()
        assert kernel.calls[-1] == "UNREGISTER" and not kernel.live
        c = hub.register_dmabuf(buf, 4096, 4096)
        assert c.handle != a.handle
    assert hub.registrations == 0 and c.closed  # closing /dev/p2phub released c in the kernel


def test_closing_a_handle_twice_drops_one_reference(kernel: FakeKernel, buf: int) -> None:
    with hubmod.Hub(mode="p2p") as hub:
        a = hub.register_dmabuf(buf)
        b = hub.register_dmabuf(buf)
        a.close()
        a.close()
        assert b.shared == 1 and kernel.live
        with pytest.raises(UsageError, match="closed"):
            a.dma_pages("0000:00:04.0")


def test_a_revoked_registration_is_not_handed_out(kernel: FakeKernel, buf: int) -> None:
    with hubmod.Hub(mode="p2p") as hub:
        a = hub.register_dmabuf(buf)
        kernel.live[a.handle] = "revoked"
        b = hub.register_dmabuf(buf)
        assert b.handle != a.handle and kernel.calls.count("REGISTER") == 2
        a.close()
        b.close()
    assert not kernel.live


class User:
    def __init__(self, answer: Any) -> None:
        self.answer, self.calls = answer, 0

    def quiesce_registration(self, reg: Any, timeout: float) -> Any:
        self.calls += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("busy", [False, P2PHubOSError(errno.EBUSY, "quiesce")])
def test_a_busy_user_keeps_the_registration(kernel: FakeKernel, buf: int, busy: Any) -> None:
    with hubmod.Hub(mode="p2p") as hub:
        reg = hub.register_dmabuf(buf)
        user = User(busy)
        reg.add_user(user)
        with pytest.raises(P2PHubOSError) as ei:
            reg.close(timeout=0.01)
        assert ei.value.errno == errno.EBUSY and not reg.closed and kernel.live
        # still findable: a new handle gets the same pin
        again = hub.register_dmabuf(buf)
        assert again.handle == reg.handle
        again.close()
        with pytest.raises(P2PHubOSError):
            hub.close(timeout=0.01)
        assert not hub.closed
        user.answer = True
        reg.close()
        assert not kernel.live and user.calls == 3


def test_the_hub_drains_then_releases_everything(kernel: FakeKernel, buf: int) -> None:
    hub = hubmod.Hub(mode="p2p")
    regs = [hub.register_dmabuf(buf, i * 4096, 4096) for i in range(4)]
    users = [User(None) for _ in regs]
    for r, u in zip(regs, users):
        r.add_user(u)

    class Ctrl:
        closed = False

        def close(self) -> None:
            assert all(u.calls == 1 for u in users), "a controller closed before the drain"
            self.closed = True

    ctrl = Ctrl()
    hub._ctrls.append(ctrl)
    hub.close()
    assert ctrl.closed and all(r.closed for r in regs) and all(u.calls == 1 for u in users)
    assert "UNREGISTER" not in kernel.calls  # closing /dev/p2phub releases them in the kernel


def test_a_forked_child_neither_uses_nor_releases(kernel: FakeKernel, buf: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    hub = hubmod.Hub(mode="p2p")
    reg = hub.register_dmabuf(buf)
    from p2phub import _resource
    monkeypatch.setattr(_resource, "this_pid", os.getpid() + 1)   # as in a forked child
    with pytest.raises(UsageError, match="forked child"):
        reg.dma_pages("0000:00:04.0")
    with pytest.raises(UsageError, match="forked child"):
        hub.register_dmabuf(buf)
    reg.close()
    hub.close()
    assert "UNREGISTER" not in kernel.calls and reg.closed


def test_threads_registering_the_same_memory_leave_nothing(kernel: FakeKernel, buf: int) -> None:
    with hubmod.Hub(mode="p2p") as hub:
        held = hub.register_dmabuf(buf, 0, 4096)

        def worker() -> None:
            for _ in range(300):
                hub.register_dmabuf(buf, 0, 4096).close()
                hub.register_dmabuf(buf, 4096, 4096).close()

        ts = [threading.Thread(target=worker) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert held.shared == 1 and list(kernel.live) == [held.handle]
        held.close()
        assert hub.registrations == 0 and not hub._cache
    assert not kernel.live
