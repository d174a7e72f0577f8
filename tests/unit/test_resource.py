"""Resource.close() is one template: close once, arguments passed to the hook, a refused close
left open to retry, close again where the class says so, nothing released from a forked child,
a handle that others keep alive just goes."""

from __future__ import annotations

import errno
import os
from typing import Any

import pytest

from p2phub._resource import Resource
from p2phub.errors import P2PHubOSError, UsageError

pytestmark = pytest.mark.unit


class Simple(Resource):
    def __init__(self) -> None:
        self.released = 0

    def _close(self) -> None:
        self.released += 1


class Busy(Resource):
    """Refuses a close while in use, unless forced; records what close() passed."""

    def __init__(self) -> None:
        self.in_use = True
        self.calls: list[tuple[bool, float | None, dict[str, Any]]] = []
        self.abandoned = False

    def _release(self, force: bool, timeout: float | None, **how: Any) -> None:
        self.calls.append((force, timeout, how))
        if self.in_use and not force:
            raise P2PHubOSError(errno.EBUSY, "close", "still in use")

    def _abandon(self) -> None:
        self.abandoned = True


class Again(Busy):
    _close_again = True


def test_a_simple_resource_releases_once_and_refuses_use_after() -> None:
    r = Simple()
    with r:
        r._check_open()
    r.close()
    assert r.closed and r.released == 1
    with pytest.raises(UsageError, match="closed"):
        r._check_open()


def test_close_passes_its_arguments_and_a_refused_close_can_be_retried() -> None:
    r = Busy()
    with pytest.raises(P2PHubOSError) as ei:
        r.close(timeout=0.5, reason="test")
    assert ei.value.errno == errno.EBUSY and not r.closed
    r.close(force=True)
    assert r.closed
    assert r.calls == [(False, 0.5, {"reason": "test"}), (True, None, {})]
    r.close(force=True)
    assert len(r.calls) == 2     # closed: nothing runs again


def test_a_class_may_close_again() -> None:
    r = Again()
    r.close(force=True)
    r.in_use = False
    r.close(timeout=1.0)
    assert r.closed and [c[:2] for c in r.calls] == [(True, None), (False, 1.0)]


def test_a_forked_child_abandons_instead_of_releasing() -> None:
    r = Busy()
    r._mark_owner()
    r._pid = os.getpid() + 1     # as a forked child sees its parent's object
    assert r.foreign
    r.close()
    assert r.closed and r.abandoned and r.calls == []
    with pytest.raises(UsageError, match="forked child"):
        r._check_owner()


def test_the_ordering_closes_on_the_template() -> None:
    from p2phub.ordering import AccessKind, Ordering

    o = Ordering("reg", 4096)
    a = o.acquire(0, 4096, AccessKind.NVME_READ)
    with pytest.raises(P2PHubOSError, match="in flight"):
        o.close()
    assert not o.closed and o.live() == [a]     # refused: nothing changed
    o.close(force=True, reason="the controller died")
    assert o.closed and o.live() == [] and a.fence is not None and a.fence.done()
    with pytest.raises(Exception, match="the controller died"):
        a.fence.wait(0)
    o.close(timeout=0.01)                       # again: nothing left to wait for


class Handle(Resource):
    """One of several handles of one thing: the last one releases it."""

    def __init__(self, refs: list[int], refuse: bool = False) -> None:
        self.refs, self.refuse, self.events = refs, refuse, []

    def _detach(self) -> bool:
        if self.refs[0] > 1:
            self.refs[0] -= 1
            return True
        self.events.append("last")
        return False

    def _release(self, force: bool, timeout: float | None, **how: Any) -> None:
        if self.refuse:
            raise P2PHubOSError(errno.EBUSY, "close", "in use")
        self.refs[0] -= 1
        self.events.append("released")

    def _reattach(self) -> None:
        self.events.append("reattached")


def test_a_detached_handle_just_goes_and_a_refused_last_one_reattaches() -> None:
    refs = [2]
    a, b = Handle(refs), Handle(refs, refuse=True)
    a.close()
    assert a.closed and refs == [1] and a.events == []
    with pytest.raises(P2PHubOSError):
        b.close()
    assert not b.closed and b.events == ["last", "reattached"] and refs == [1]
    b.refuse = False
    b.close()
    assert b.closed and refs == [0] and b.events[-1] == "released"
