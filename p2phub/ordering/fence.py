"""Fences: one completion interface for NVMe commands, RDMA work requests, GPU streams
and remote notifications.

A fence completes once, with success or with an exception. Every fence offers:

    fence.wait(timeout)            block (driving its source); raise its failure
    fence.done()                   non-blocking; drives its source one step
    fence.exception(timeout)       wait, then the failure or None
    fence.add_done_callback(fn)    fn(fence) once complete (at once if it is)
    await fence                    asyncio
    fence.on_stream(stream)        the GPU stream waits for the fence, no CPU round trip

Sources that complete only when someone drives them (an NVMe queue, an RDMA CQ, a host
word written by a GPU) override ``_poll`` and ``_block``; a Progress thread drives the
ones a stream or a callback is waiting on, so ``on_stream`` never needs a CPU waiter.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from typing import Any, Callable, Generator

from ..backend import CompletionWords, StreamOps, find_stream_ops
from .errors import FenceError, FenceTimeout

__all__ = ["Fence", "HostFence", "SourceFence", "completed", "WordPool", "progress"]


class Fence:
    """The base: completed by ``_complete(exc=None)`` from whichever side owns the work."""

    #: True when completion only happens if someone calls _poll (queue/CQ/host word).
    needs_driving = False

    def __init__(self, what: str = "") -> None:
        self.what = what
        self._lock = threading.Lock()
        self._done = False
        self._ev: threading.Event | None = None  # made only when a thread blocks
        self._exc: BaseException | None = None
        self._callbacks: list[Callable[["Fence"], None]] | None = None   # made on first use
        # (pool, slot, value) to store at completion; a list only once a stream waits (most
        # fences never get one: fewer objects for the cycle collector per fence)
        self._words: list[tuple["WordPool", int, int]] | tuple[()] = ()

    # ------------------------------------------------------------------ completion side
    def _complete(self, exc: BaseException | None = None) -> bool:
        """Complete the fence (once); False when it already was."""
        with self._lock:
            if self._done:
                return False
            self._exc = exc
            words, self._words = self._words, ()
            callbacks, self._callbacks = self._callbacks or (), None
            self._done = True
            ev = self._ev
        if ev is not None:
            ev.set()
        # Release GPU streams first: they are the latency-critical waiters. A failed fence
        # releases them too (a stream stuck forever cannot be recovered); the failure is
        # reported to every CPU waiter and by exception().
        for pool, slot, value in words:
            pool.store(slot, value)
        for cb in callbacks:
            try:
                cb(self)
            except Exception:  # a callback's bug must not stop the others
                import traceback
                traceback.print_exc()
        return True

    def _sleep(self, timeout: float | None) -> None:
        """Sleep until complete or `timeout` seconds pass."""
        with self._lock:
            if self._done:
                return
            ev = self._ev
            if ev is None:
                ev = self._ev = threading.Event()
        ev.wait(timeout)

    # ------------------------------------------------------------------ driving hooks
    def _poll(self) -> None:
        """Make progress without blocking (reap a CQ, read a host word)."""

    def _block(self, timeout: float | None) -> None:
        """Block until complete or `timeout` seconds pass (driving the source)."""
        if not self.needs_driving:
            self._sleep(timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        spin = 0
        while not self._done:
            self._poll()
            if self._done:
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return
            spin += 1
            if spin > 200:  # spin briefly for low latency, then back off
                self._sleep(0.0002 if deadline is None else min(0.0002, deadline - now))

    # ------------------------------------------------------------------ user side
    def poll(self) -> bool:
        """Make progress without blocking (reap a queue or CQ, read a host word); True once
        complete."""
        if not self._done and self.needs_driving:
            self._poll()
        return self._done

    def done(self) -> bool:
        if not self._done and self.needs_driving:
            self._poll()
        return self._done

    def failed(self) -> bool:
        """Complete with a failure (non-blocking)."""
        return self.done() and self._exc is not None

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; raise FenceTimeout, or the failure (a FenceError, cause chained)."""
        if not self._done:
            self._block(timeout)
            if not self._done:
                raise FenceTimeout(f"{self}: not complete after {timeout} s")
        if self._exc is not None:
            raise self._failure()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done:
            self._block(timeout)
            if not self._done:
                raise FenceTimeout(f"{self}: not complete after {timeout} s")
        return self._exc

    def _failure(self) -> BaseException:
        exc = self._exc
        assert exc is not None
        if isinstance(exc, FenceError):
            return exc
        err = FenceError(f"{self} failed: {exc}")
        err.__cause__ = exc
        return err

    def _queue_callback(self, fn: Callable[["Fence"], None]) -> bool:
        """Keep `fn` for completion; False when the fence is already complete."""
        with self._lock:
            if self._done:
                return False
            if self._callbacks is None:
                self._callbacks = [fn]
            else:
                self._callbacks.append(fn)
            return True

    def then(self, fn: Callable[["Fence"], None]) -> None:
        """Call ``fn(fence)`` once the fence completes, on the thread that completes it (at
        once when it already has). Unlike add_done_callback, nothing is started to drive a
        fence that only completes when polled."""
        if not self._queue_callback(fn):
            fn(self)

    def add_done_callback(self, fn: Callable[["Fence"], None]) -> None:
        if self._queue_callback(fn):
            if self.needs_driving:
                progress().watch(self)
        else:
            fn(self)

    def __await__(self) -> Generator[Any, None, None]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def wake(_f: "Fence") -> None:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))

        self.add_done_callback(wake)
        yield from fut.__await__()
        if self._exc is not None:
            raise self._failure()

    # ------------------------------------------------------------------ GPU streams
    def on_stream(self, stream: Any, ops: StreamOps | None = None) -> None:
        """Make `stream` wait for this fence: work enqueued after this call starts only
        once the fence has completed. No CPU thread waits: the fence stores a value into a
        pinned host word at completion and the stream waits for it
        (cuStreamWaitValue32 / hipStreamWaitValue32).

        A fence that already failed raises its failure (nothing is enqueued); one that
        fails later still releases the stream, and reports the failure to CPU waiters.
        """
        if self.done():
            if self._exc is not None:
                raise self._failure()
            return
        ops = ops or find_stream_ops(stream)
        pool = WordPool.for_ops(ops, ops.stream_device(stream))
        slot, value = pool.take()
        with self._lock:
            pending = not self._done
            if pending:
                if not self._words:
                    self._words = []
                self._words.append((pool, slot, value))  # type: ignore[union-attr]
        if not pending:
            pool.store(slot, value)  # completed in between: nothing to wait for
            if self._exc is not None:
                raise self._failure()
            return
        ops.stream_wait_value32(stream, pool.dev_addr(slot), value)
        if self.needs_driving:
            progress().watch(self)

    def __repr__(self) -> str:
        if not self._done:
            state = "pending"
        else:
            state = "failed" if self._exc is not None else "done"
        return f"<{type(self).__name__} {self.what or hex(id(self))} {state}>"

    __str__ = __repr__


class HostFence(Fence):
    """A fence the program completes itself: ``set()`` or ``fail(exc)`` (thread-safe)."""

    def set(self) -> bool:
        return self._complete(None)

    def fail(self, exc: BaseException | str) -> bool:
        if isinstance(exc, str):
            exc = FenceError(f"{self.what or 'fence'}: {exc}")
        return self._complete(exc)


def completed(what: str = "") -> Fence:
    f = HostFence(what)
    f.set()
    return f


# The future protocol (done, exception(timeout), add_done_callback; poll where the future
# is driven): what SourceFence and an access's fence (ordering.core.AccessFence) follow.

def future_failure(fut: Any) -> BaseException | None:
    """The failure of a done future (None: it succeeded), or what asking for it raised."""
    try:
        return fut.exception(0)
    except BaseException as exc:  # noqa: BLE001 - the future's failure is the follower's
        return exc


def drive_future(fut: Any) -> None:
    """Make progress without blocking: poll() drives a Fence or an NVMe queue (raising what
    a dead queue raises); a concurrent.futures.Future needs no driving."""
    poll = getattr(fut, "poll", None)
    if poll is None:
        fut.done()
    else:
        poll()


def wait_future(fut: Any, timeout: float | None) -> bool:
    """Wait up to `timeout` seconds (driving the future as its exception() does); True once
    it is done. Raises what waiting raises, other than the timeout."""
    try:
        fut.exception(timeout)
    except TimeoutError:
        return False
    return bool(fut.done())


class SourceFence(Fence):
    """A fence that follows another completion source with the future protocol (done,
    exception(timeout), add_done_callback): an NVMe CommandFuture, a concurrent.futures
    Future, another Fence. Driving this fence drives the source."""

    needs_driving = True

    def __init__(self, source: Any, what: str = "") -> None:
        super().__init__(what or getattr(source, "what", ""))
        self.source = source
        source.add_done_callback(self._from_source)

    def _from_source(self, src: Any) -> None:
        self._complete(future_failure(src))

    def _poll(self) -> None:
        try:
            drive_future(self.source)
        except Exception as exc:  # noqa: BLE001 - a dead queue fails the fence
            self._complete(exc)

    def _block(self, timeout: float | None) -> None:
        try:
            done = wait_future(self.source, timeout)
        except BaseException as exc:  # noqa: BLE001 - the source's failure is the fence's
            self._complete(exc)
            return
        if done and not self._done:
            self._from_source(self.source)


# ---------------------------------------------------------------------- completion words


class WordPool:
    """Completion words of one backend and device, handed out as (slot, value).

    Each slot's value only grows: a taker waits for ``last + 1`` and the fence stores it,
    so a slot can be handed out again at once without a reset racing a pending stream
    wait (every earlier wait on it asks for a smaller value, wrap-safe)."""

    CHUNK = 1024
    _pools: dict[tuple[str, int], "WordPool"] = {}
    _pools_lock = threading.Lock()

    def __init__(self, ops: StreamOps, device: int) -> None:
        self.ops = ops
        self.device = device
        self._lock = threading.Lock()
        self._chunks: list[CompletionWords] = []
        self._free: list[int] = []
        self._last: list[int] = []

    @classmethod
    def for_ops(cls, ops: StreamOps, device: int) -> "WordPool":
        key = (ops.name, device)
        with cls._pools_lock:
            pool = cls._pools.get(key)
            if pool is None:
                pool = cls._pools[key] = cls(ops, device)
            return pool

    def take(self) -> tuple[int, int]:
        with self._lock:
            if not self._free:
                words = self.ops.alloc_completion_words(self.CHUNK, self.device)
                base = len(self._chunks) * self.CHUNK
                self._chunks.append(words)
                self._last.extend([0] * self.CHUNK)
                self._free.extend(range(base + self.CHUNK - 1, base - 1, -1))
            slot = self._free.pop()
            value = (self._last[slot] + 1) & 0xFFFFFFFF
            self._last[slot] = value
            return slot, value

    def _host_addr(self, slot: int) -> int:
        return self._chunks[slot // self.CHUNK].host_ptr + 4 * (slot % self.CHUNK)

    def dev_addr(self, slot: int) -> int:
        return self._chunks[slot // self.CHUNK].dev_ptr + 4 * (slot % self.CHUNK)

    def store(self, slot: int, value: int) -> None:
        """Release every stream waiting for `value` on `slot`; the slot is free again."""
        ctypes.c_uint32.from_address(self._host_addr(slot)).value = value
        with self._lock:
            self._free.append(slot)

    def load(self, slot: int) -> int:
        return ctypes.c_uint32.from_address(self._host_addr(slot)).value

    def hold(self) -> tuple[int, int]:
        """A slot that a *stream* will store into (stream_write_value32); the caller polls
        ``reached`` and gives it back with ``release``."""
        return self.take()

    def reached(self, slot: int, value: int) -> bool:
        return ((self.load(slot) - value) & 0xFFFFFFFF) < 0x80000000

    def release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


# ---------------------------------------------------------------------- progress


class Progress:
    """One daemon thread that drives fences nobody on the CPU waits for (a stream waits via
    on_stream, or a callback is registered): polls them, spinning briefly, then sleeping."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[int, Fence] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, fence: Fence) -> None:
        with self._lock:
            self._watched[id(fence)] = fence
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="p2phub-fence-progress",
                                                daemon=True)
                self._thread.start()
        self._wake.set()

    def watching(self) -> int:
        with self._lock:
            return len(self._watched)

    def _run(self) -> None:
        idle = 0
        while True:
            with self._lock:
                fences = list(self._watched.values())
            if not fences:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            progressed = False
            for f in fences:
                if f.done():
                    with self._lock:
                        self._watched.pop(id(f), None)
                    progressed = True
            idle = 0 if progressed else idle + 1
            if idle > 1000:
                time.sleep(0.0005)
            elif idle > 100:
                time.sleep(0)


_progress: Progress | None = None
_progress_lock = threading.Lock()


def progress() -> Progress:
    global _progress
    with _progress_lock:
        if _progress is None:
            _progress = Progress()
        return _progress
