"""One base for everything p2phub hands out that must be released: close(), closed, with-blocks.

``close()`` is a template; a subclass fills in hooks, never close() itself:

- ``_teardown(force, timeout, **how)``: release what the object holds. ``close(force=...,
  timeout=..., **how)`` passes its arguments through: `force` (release even what is still in
  use, failing its users), `timeout` (seconds to wait for them; None: the object's default),
  and any keyword of the subclass's own (the ordering's `reason`). Raise to refuse (EBUSY):
  nothing is marked closed, so the close can be retried. The default calls ``_close()``.
- ``_close()``: the simple form of ``_teardown`` for objects that take no parameters.
- ``_abandon()``: called instead of ``_teardown`` in a forked child of the process that made
  the object (``foreign``): drop this process's copies, release nothing the parent still
  uses. The default releases as usual (objects that own nothing shared with the parent).
- ``_close_again``: a class attribute; False (the default) makes close() return at once on a
  closed object. True runs ``_teardown`` again: for objects that refuse new work once closed
  but may still hold work in flight that a later close waits for or fails (the ordering).
- ``closed``: a property; a subclass may widen it (closed also when what it wraps is gone).

Every subclass may call ``_check_open()`` before each use. The object is marked closed only
when the hook returned. Objects made in one process and reached from a forked child refuse
every use there (``_check_owner()``): the child shares the parent's files, and a release
issued from it would pull memory out from under the parent.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from .errors import UsageError

T = TypeVar("T", bound="Resource")


class Resource:
    _closed: bool = False
    _pid: int = 0
    _close_again: bool = False

    # ------------------------------------------------------------------ hooks
    def _close(self) -> None:
        """Release what this object holds (called once by close(), through _teardown)."""

    def _teardown(self, force: bool, timeout: float | None, **how: Any) -> None:
        """Release what this object holds; raise to refuse (the object stays open)."""
        self._close()

    def _abandon(self) -> None:
        """In a forked child of the owner: drop this process's copies only."""
        self._teardown(False, 0.0)

    # ------------------------------------------------------------------ the template
    def close(self, force: bool = False, timeout: float | None = None, **how: Any) -> None:
        """Release what this object holds, once (again only where the class says so);
        raises, leaving it open, when its release is refused."""
        if self._closed and not self._close_again:
            return
        if self.foreign:
            self._abandon()
        else:
            self._teardown(force, timeout, **how)
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ ownership
    def _mark_owner(self) -> None:
        self._pid = os.getpid()

    @property
    def foreign(self) -> bool:
        """True in a forked child of the process that made this object."""
        return self._pid != 0 and self._pid != os.getpid()

    def _check_owner(self) -> None:
        if self._pid != 0 and self._pid != os.getpid():
            raise UsageError(f"{self!r} belongs to process {self._pid}; a forked child "
                             f"({os.getpid()}) cannot use it: open its own Hub")

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"{self!r} is closed")
        self._check_owner()

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
