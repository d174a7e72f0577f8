"""Fences for KV transfers: the ordering layer's HostFence where it is installed, else a
minimal future-like fallback with the same calls (set/fail, wait/done/failed/exception,
add_done_callback, await)."""

from __future__ import annotations

try:  # pragma: no cover - depends on the ordering branch being merged
    from ..ordering.errors import FenceError, FenceTimeout
    from ..ordering.fence import HostFence
except ImportError:
    import asyncio
    import threading
    from typing import Any, Callable, Generator

    from ..errors import P2PHubError

    class FenceError(P2PHubError):  # type: ignore[no-redef]
        """A fence failed: its work will never complete as asked. The cause is chained."""

    class FenceTimeout(P2PHubError, TimeoutError):  # type: ignore[no-redef]
        """A fence did not complete within the caller's timeout (it may still complete)."""

    class HostFence:  # type: ignore[no-redef]
        """Completed once by ``set()`` or ``fail(exc)``, from any thread."""

        def __init__(self, what: str = "") -> None:
            self.what = what
            self._lock = threading.Lock()
            self._event = threading.Event()
            self._exc: BaseException | None = None
            self._callbacks: list[Callable[[Any], None]] = []

        def _complete(self, exc: BaseException | None) -> bool:
            with self._lock:
                if self._event.is_set():
                    return False
                self._exc = exc
                cbs, self._callbacks = self._callbacks, []
                self._event.set()
            for cb in cbs:
                try:
                    cb(self)
                except Exception:
                    import traceback
                    traceback.print_exc()
            return True

        def set(self) -> bool:
            return self._complete(None)

        def fail(self, exc: BaseException | str) -> bool:
            if isinstance(exc, str):
                exc = FenceError(f"{self.what or 'fence'}: {exc}")
            return self._complete(exc)

        def done(self) -> bool:
            return self._event.is_set()

        def failed(self) -> bool:
            return self._event.is_set() and self._exc is not None

        def _failure(self) -> BaseException:
            assert self._exc is not None
            if isinstance(self._exc, FenceError):
                return self._exc
            err = FenceError(f"{self} failed: {self._exc}")
            err.__cause__ = self._exc
            return err

        def wait(self, timeout: float | None = None) -> None:
            if not self._event.wait(timeout):
                raise FenceTimeout(f"{self}: not complete after {timeout} s")
            if self._exc is not None:
                raise self._failure()

        def exception(self, timeout: float | None = None) -> BaseException | None:
            if not self._event.wait(timeout):
                raise FenceTimeout(f"{self}: not complete after {timeout} s")
            return self._exc

        def add_done_callback(self, fn: Callable[[Any], None]) -> None:
            with self._lock:
                if not self._event.is_set():
                    self._callbacks.append(fn)
                    return
            fn(self)

        def __await__(self) -> Generator[Any, None, None]:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future = loop.create_future()
            self.add_done_callback(
                lambda _f: loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None)))
            yield from fut.__await__()
            if self._exc is not None:
                raise self._failure()

        def __repr__(self) -> str:
            state = "pending" if not self._event.is_set() else (
                "failed" if self._exc is not None else "done")
            return f"<HostFence {self.what or hex(id(self))} {state}>"

        __str__ = __repr__

__all__ = ["HostFence", "FenceError", "FenceTimeout"]
