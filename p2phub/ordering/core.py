"""Ordering of one registration: declare accesses, wait for (or refuse) conflicting ones.

    acc = reg.ordering.acquire(offset, length, AccessKind.NVME_READ, "read lba 0")
    try:
        fut = submit(...)                      # the work itself
    except BaseException as exc:
        acc.cancel(exc)                        # nothing was started: withdraw
        raise
    acc.bind(fut)                              # its completion releases the range

An access conflicts with every live access it overlaps unless both are consumers. In
the default (waiting) mode ``acquire`` waits for the fences of the conflicting accesses
(the later access is entered at once, so whoever comes next queues behind it: first
come, first served); in strict mode it raises OrderingError naming both, and enters
nothing. A consumer behind a producer that failed fails too (its bytes are not what
it was promised); a producer behind a failed access goes ahead (it overwrites).
"""

from __future__ import annotations

import errno
import threading
import time
from typing import Any, Callable

from ..errors import P2PHubOSError, UsageError
from .errors import FenceError, FenceTimeout, OrderingError, OrderingTimeout
from .fence import (Fence, SourceFence, WordPool, drive_future, future_failure, progress,
                    wait_future)
from .tracker import Access, AccessKind, AccessRange, RangeTracker, next_seq
from .._resource import Resource

__all__ = ["Ordering", "AccessFence", "FencedAccess", "GpuAccess", "as_fence"]


def as_fence(src: Any) -> Fence:
    """A Fence for anything with the future protocol (NVMe CommandFuture, a Future)."""
    if isinstance(src, Fence):
        return src
    return SourceFence(src)


class AccessFence(Fence):
    """The fence of one access: completes when the work bound to it does, or when the
    access is withdrawn. Until then later conflicting accesses wait for it."""

    needs_driving = True

    def __init__(self, access: Access, ordering: "Ordering") -> None:
        super().__init__("")
        self.access = access
        self._ordering = ordering
        # the work: a Fence, or a future (done, exception(timeout), add_done_callback; an
        # NVMe batch) followed as it is, with no fence of its own between
        self._source: Any = None

    @property  # type: ignore[override]
    def what(self) -> str:
        return str(self.access)

    @what.setter
    def what(self, _value: str) -> None:
        pass

    def _bind(self, src: Any) -> None:
        self._source = src
        if isinstance(src, Fence):
            src.then(self._from_source)
        else:
            src.add_done_callback(self._from_future)

    def _from_source(self, src: Fence) -> None:
        self._end(src._exc)

    def _from_future(self, fut: Any) -> None:
        self._end(future_failure(fut))

    def _end(self, exc: BaseException | None) -> None:
        self._ordering.retire(self.access)
        self._complete(exc)

    def _complete(self, exc: BaseException | None = None) -> bool:
        try:
            return super()._complete(exc)
        finally:
            # The access and this fence refer to each other, a cycle only the collector
            # frees; the work (an NVMe batch and its buffers), finished or withdrawn, must
            # not wait in it for that.
            self._source = None

    def _poll(self) -> None:
        src = self._source
        if src is None or isinstance(src, Fence):
            if src is not None:
                src.poll()
            return
        try:
            drive_future(src)
        except Exception as exc:  # noqa: BLE001 - a dead queue fails the work
            self._end(exc)

    def _block(self, timeout: float | None) -> None:
        # Wait on this fence's own event: it completes from the source (callback) or
        # when the access is withdrawn, whichever comes first. A source that only
        # completes when driven (a queue, a CQ, a host word) is polled meanwhile.
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done:
            src = self._source
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            if src is None:  # not bound yet: the declaring thread is submitting
                self._sleep(0.001 if left is None else min(0.001, left))
            elif not isinstance(src, Fence):
                # A future: wait on it in slices (an NVMe queue drives itself and runs its
                # timeout recovery there), so a withdrawal is seen within 50 ms.
                try:
                    done = wait_future(src, 0.05 if left is None else min(0.05, left))
                except BaseException as exc:  # noqa: BLE001 - waiting failed: so did the work
                    self._end(exc)
                    return
                if done and not self._done:
                    self._from_future(src)
            elif not src.needs_driving:
                self._sleep(left)
            else:
                # Let the source drive itself, in slices, as above.
                src._block(0.05 if left is None else min(0.05, left))
                if src._done and not self._done:
                    self._from_source(src)


class FencedAccess(Fence, AccessRange):
    """A fence that is also the record of the access its work makes: one object where an
    Access, its AccessFence and the work's own fence would be three. For work made by the
    thousand (single loads and saves): fewer objects per request for the cycle collector and
    no callback between them. ``acquire`` declares it on an Ordering; its completion releases
    the range before its waiters wake. It serves wherever an Access does (``fence`` is
    itself)."""

    _source = None                  # the work is this fence's own
    _ordering: "Ordering | None" = None     # the ordering it was declared on
    deps: "list[Access] | tuple[()]" = ()   # a list once it has any
    kind: AccessKind
    start = end = seq = 0

    @property
    def owner(self) -> str:
        """The memory, in words."""
        o = self._ordering
        return o.owner if o is not None else ""

    @property
    def fence(self) -> "FencedAccess":
        return self

    def acquire(self, ordering: "Ordering", offset: int, length: int, kind: AccessKind, *,
                timeout: float | None = None) -> None:
        """Declare this fence's work as an access of `ordering` (``Ordering.acquire``'s rules,
        waits and errors); on return the range is held until the fence completes."""
        self.kind, self.start, self.end = kind, offset, offset + length
        self.seq, self._ordering = next_seq(), ordering
        ordering.admit(self, timeout)

    def cancel(self, exc: BaseException | None = None) -> None:
        """Withdraw the access: its work never started."""
        o = self._ordering
        if o is not None:
            o.withdraw(self, exc)   # type: ignore[arg-type]
        else:
            self._complete(exc or FenceError(f"{self} was withdrawn"))

    def __repr__(self) -> str:
        if not self.seq:            # not declared yet
            return super().__repr__()
        return self.describe()

    __str__ = __repr__

    def _complete(self, exc: BaseException | None = None) -> bool:
        o = self._ordering
        if o is not None and not self._done:
            o.retire(self)           # type: ignore[arg-type]  (a second retire finds nothing)
        return super()._complete(exc)


class Ordering(Resource):
    """The live accesses of one registration and the rules between them."""

    def __init__(self, owner: str, length: int, *, strict: bool = False,
                 timeout: float | None = None) -> None:
        self.owner = owner
        self.length = length
        self.strict = strict
        self.timeout = timeout           # default wait for conflicting accesses (None: forever)
        self._lock = threading.Lock()
        self._tracker = RangeTracker()
        self._closed = False
        self._closed_reason = ""
        self.gpu_device: tuple[Any, int] | None = None  # (StreamOps, device) of GPU memory

    # ------------------------------------------------------------------ declare
    def _check(self, offset: int, length: int, kind: AccessKind) -> None:
        if not isinstance(kind, AccessKind):
            raise UsageError(f"kind must be a p2phub.ordering.AccessKind, not {kind!r}")
        if offset < 0 or length <= 0 or offset + length > self.length:
            raise UsageError(f"{kind.label} [{offset:#x}, +{length:#x}) is not inside "
                             f"{self.owner} ({self.length} bytes)")

    def enter(self, offset: int, length: int, kind: AccessKind, what: str = "") -> Access:
        """Enter an access now, without waiting: ``access.deps`` lists the earlier accesses
        it must come after. Strict mode raises OrderingError when there are any."""
        self._check(offset, length, kind)
        a = Access(kind, offset, offset + length, what, self.owner)
        a.fence = AccessFence(a, self)
        self.admit(a, wait=False)
        return a

    def admit(self, a: Any, timeout: float | None = None, *, wait: bool = True) -> None:
        """Enter `a`, an access whose fields are set (a FencedAccess), and wait for the earlier
        accesses it conflicts with, as ``acquire`` does; withdrawn if that fails. `wait`
        False: enter it only (``a.deps`` lists what it must come after). One frame: single
        requests enter here by the thousand."""
        if a.start < 0 or a.end <= a.start or a.end > self.length:
            self._check(a.start, a.end - a.start, a.kind)
        with self._lock:
            if self._closed:
                raise UsageError(f"{self.owner} is closed{self._closed_reason}")
            deps = self._tracker.enter(a, self.strict)
            if deps:
                if self.strict:
                    raise OrderingError(f"{a} conflicts with the live {deps[0]} (strict "
                                        "ordering)", a, deps[0])
                a.deps = deps
        if deps and wait:
            try:
                self.wait_deps(a, self.timeout if timeout is None else timeout)
            except BaseException as exc:
                self.withdraw(a, exc)
                raise

    def acquire(self, offset: int, length: int, kind: AccessKind, what: str = "", *,
                timeout: float | None = None) -> Access:
        """Enter an access and wait until every earlier conflicting access is complete.

        Raises OrderingError (strict mode), OrderingTimeout after `timeout` seconds
        (default: this ordering's timeout), or FenceError when a producer it would consume
        failed; in every case the access is withdrawn."""
        a = self.enter(offset, length, kind, what)
        if not a.deps:
            return a
        try:
            self.wait_deps(a, self.timeout if timeout is None else timeout)
        except BaseException as exc:
            self.withdraw(a, exc)
            raise
        return a

    def wait_deps(self, a: Access, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for dep in a.deps:
            f = dep.fence
            assert f is not None
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                exc = f.exception(left)
            except FenceTimeout:
                raise OrderingTimeout(f"{a} waited {timeout} s for the earlier {dep}; "
                                      "withdrawn", a, dep) from None
            self._check_dep(a, dep, exc)

    @staticmethod
    def _check_dep(a: Access, dep: Access, exc: BaseException | None) -> None:
        if exc is not None and dep.producer and not a.producer:
            err = FenceError(f"{a} cannot go ahead: the earlier {dep} that fills its bytes "
                             f"failed: {exc}")
            err.__cause__ = exc
            raise err

    def stream_deps(self, a: Access, stream: Any, ops: Any = None) -> None:
        """Make `stream` wait for every earlier conflicting access (no CPU wait)."""
        for dep in a.deps:
            f = dep.fence
            assert f is not None
            if f.done():
                self._check_dep(a, dep, f._exc)
                continue
            src = f._source
            slot = src._slot if isinstance(src, GpuAccess) else None
            if slot is not None and ops is not None and src.ops is ops:
                # GPU after GPU: wait on the word the earlier stream writes, no host hop.
                pool, index, value = slot
                ops.stream_wait_value32(stream, pool.dev_addr(index), value)
                continue
            f.on_stream(stream, ops)

    def withdraw(self, a: Access, exc: BaseException | None = None) -> None:
        """Take back an access whose work never started (or will never complete)."""
        f = a.fence
        assert f is not None
        if f._done:
            return
        self.retire(a)
        if exc is None:
            exc = FenceError(f"{a} was withdrawn")
        src = f._source
        f._complete(exc)            # (an AccessFence lets go of its work here)
        if isinstance(src, Fence) and not src._done and not isinstance(src, GpuAccess):
            # The work's own fence (an RDMA request, a notification) can never count now:
            # fail it too, so whoever holds it wakes with the reason.
            src._complete(exc)

    def retire_all(self, accesses: list[Any]) -> None:
        """``retire`` for many, under one hold of the lock (a batch of completed requests)."""
        with self._lock:
            self._tracker.remove_all(accesses)     # those withdrawn meanwhile are skipped

    def retire(self, a: Access) -> None:
        """The access's work is over (or never started): its range is released (the
        access's fence completes separately)."""
        with self._lock:
            try:
                self._tracker.remove(a)
            except KeyError:
                pass

    # ------------------------------------------------------------------ queries
    def live(self) -> list[Access]:
        with self._lock:
            return self._tracker.accesses()

    def __len__(self) -> int:
        return len(self._tracker)

    def overlapping(self, offset: int, length: int) -> list[Access]:
        with self._lock:
            return self._tracker.overlapping(offset, offset + length)

    # ------------------------------------------------------------------ GPU
    def gpu_access(self, offset: int, length: int, kind: AccessKind, stream: Any,
                   what: str = "", ops: Any = None) -> "GpuAccess":
        if kind not in (AccessKind.GPU_READ, AccessKind.GPU_WRITE):
            raise UsageError(f"gpu_access needs AccessKind.GPU_READ or GPU_WRITE, not {kind}")
        from ..backend import find_stream_ops
        ops = ops or find_stream_ops(stream)
        a = self.enter(offset, length, kind, what or "gpu stream work")
        try:
            self.stream_deps(a, stream, ops)
        except BaseException as exc:
            self.withdraw(a, exc)
            raise
        return GpuAccess(self, a, stream, ops)

    # ------------------------------------------------------------------ RDMA visibility
    def make_visible(self) -> None:
        """Make completed NIC writes into this memory visible to its GPU's kernels (the
        third step of RDMA write visibility); nothing for host memory or GPUs that order
        them themselves."""
        if self.gpu_device is None:
            return
        ops, device = self.gpu_device
        if ops.rdma_flush_required(device):
            ops.flush_rdma_writes(device)

    # ------------------------------------------------------------------ lifetime
    _close_again = True   # a closed ordering refuses new accesses; a later close still
                          # waits for (or fails) the ones it refused to drop the first time

    def _release(self, force: bool, timeout: float | None, *,  # type: ignore[override]
                 reason: str = "the registration was closed") -> None:
        """close(force=False, timeout=None, reason=...): refuse new accesses; wait up to
        `timeout` seconds for the live ones (None: do not wait). It may be called again (a
        registration's users quiesce it).

        Raises P2PHubOSError(EBUSY) naming them when some are still live, unless `force`:
        then each fails with `reason` and its waiters wake."""
        deadline = time.monotonic() + (timeout or 0.0)
        for a in self.live():
            f = a.fence
            assert f is not None
            try:
                f.exception(max(0.0, deadline - time.monotonic()))
            except FenceTimeout:
                break
        live = self.live()
        if live and not force:
            names = "; ".join(str(a) for a in live[:3])
            more = f" and {len(live) - 3} more" if len(live) > 3 else ""
            raise P2PHubOSError(errno.EBUSY, f"close {self.owner}",
                                f"{len(live)} access(es) still in flight: {names}{more}; wait "
                                "for their fences or close(force=True)")
        with self._lock:
            self._closed = True
            self._closed_reason = f" ({reason})"
        for a in live:
            self.withdraw(a, FenceError(f"{a} can never complete: {reason}"))

    def quiesce_registration(self, reg: Any, timeout: float) -> bool:
        """As a user of its registration (p2phub.hub.RegistrationUser): wait up to `timeout`
        seconds for the accesses in flight; False (nothing released) when some remain."""
        try:
            self.close(timeout=timeout)
        except P2PHubOSError:
            return False
        return True

    def abandon_registration(self, reg: Any, reason: str = "the registration was closed") -> None:
        """Closed with force: every access still in flight fails with `reason`, and its
        waiters wake (the kernel still keeps device DMA off released memory)."""
        self.close(timeout=0.0, force=True, reason=reason)

    def __repr__(self) -> str:
        live = self.live()
        names = "; ".join(str(a) for a in live[:3])
        more = f" and {len(live) - 3} more" if len(live) > 3 else ""
        return (f"<ordering of {self.owner}: {len(live)} access(es) in flight"
                f"{': ' + names + more if live else ''}>")

    def fail_all(self, reason: str, match: Callable[[Access], bool] | None = None) -> int:
        """Fail every live access (or those `match` picks) with `reason`: a source that can
        never complete them (a dead controller, a destroyed QP). Returns how many."""
        n = 0
        for a in self.live():
            if match is None or match(a):
                self.withdraw(a, FenceError(f"{a} can never complete: {reason}"))
                n += 1
        return n


class GpuAccess(Fence):
    """GPU work on a range, ordered on its stream. Use as a context manager around the
    enqueue of the work (or call ``record()`` right after it):

        with reg.gpu_access(0, n, AccessKind.GPU_READ, stream) as acc:
            kernel[grid, block, stream](...)        # waits on the stream for earlier fences
        ssd.write(reg, ...)                          # waits for acc: the kernel's end

    On entry the stream was made to wait for every earlier conflicting access; ``record()``
    enqueues a store of a host word on the stream, which completes this fence and the
    access. The fence itself is ``access.fence`` and this object (same completion)."""

    needs_driving = True

    def __init__(self, ordering: Ordering, access: Access, stream: Any, ops: Any) -> None:
        super().__init__(str(access))
        self.ordering = ordering
        self.access = access
        self.stream = stream
        self.ops = ops
        self._slot: tuple[WordPool, int, int] | None = None
        assert access.fence is not None
        access.fence._bind(self)

    def record(self) -> "GpuAccess":
        if self._slot is not None:
            raise UsageError(f"{self.access}: already recorded")
        pool = WordPool.for_ops(self.ops, self.ops.stream_device(self.stream))
        slot, value = pool.hold()
        self._slot = (pool, slot, value)
        try:
            self.ops.stream_write_value32(self.stream, pool.dev_addr(slot), value)
        except BaseException as exc:
            pool.release(slot)
            self._slot = None
            self._complete(exc)
            raise
        progress().watch(self)  # completes (and releases the range) with nobody waiting
        return self

    def _poll(self) -> None:
        s = self._slot
        if s is not None and not self._done:
            pool, slot, value = s
            if pool.reached(slot, value):
                pool.release(slot)
                self._complete(None)

    def cancel(self, exc: BaseException | None = None) -> None:
        """Withdraw before any work was enqueued."""
        if self._slot is not None:
            raise UsageError(f"{self.access}: recorded on the stream; it completes there")
        self._complete(exc or FenceError(f"{self.access} was withdrawn"))

    def __enter__(self) -> "GpuAccess":
        return self

    def __exit__(self, et: object, exc: BaseException | None, tb: object) -> None:
        if self._slot is not None or self._done:
            return
        if exc is not None:
            # The work may or may not be on the stream: record anyway, so the range is
            # released only after whatever was enqueued has run.
            try:
                self.record()
            except BaseException:  # noqa: BLE001 - the caller's exception wins
                pass
            return
        self.record()


# Binding helpers used by the I/O paths -------------------------------------------


def bind(access: Access, source: Any) -> Fence:
    """Tie `access` to the completion of `source` (a Fence or an NVMe future)."""
    assert access.fence is not None
    access.fence._bind(source)
    return access.fence

