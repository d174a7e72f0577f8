"""One base for everything p2phub hands out that must be released: close(), closed, with-blocks.

``close(force=False, timeout=None, **how)`` is a template; a subclass fills in hooks, never
close() itself:

- ``_release(force, timeout, **how)``: release what the object holds. close() passes its
  arguments through: `force` (release even what is still in use, failing its users),
  `timeout` (seconds to wait for them; None: the class's default) and any keyword of the
  class's own (the ordering's `reason`). Raise to refuse (EBUSY): nothing is marked closed, so
  the close can be retried. The default calls ``_close()``.
- ``_close()``: the simple form of ``_release`` for objects that take no parameters.
- ``_abandon()``: called instead of ``_release`` in a forked child of the process that made
  the object (``foreign``): let go of this process's copies, release nothing the parent
  still uses. The default calls ``_close()`` (objects that own nothing shared).
- ``_detach() -> bool``: True when other handles keep what this one refers to alive: this
  handle just goes (marked closed, nothing released). Default False.
- ``_reattach()``: undo ``_detach``'s preparations after a refused release. Default nothing.
- ``_close_again``: a class attribute. False (the default) makes close() return at once once
  the object closed. True runs the release again: for objects that refuse new work once
  closed but may still hold work in flight that a later close waits for or fails.
- ``closed``: a property; a class may widen it (closed also when what it wraps is gone).
  close() itself tests only the object's own close.

Every subclass may call ``_check_open()`` before each use. Objects made in one process and
reached from a forked child refuse every use there (``_check_owner()``): the child shares the
parent's files, and a release issued from it would pull memory out from under the parent.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

from .errors import UsageError

T = TypeVar("T", bound="Resource")

# This process's pid, kept current across fork() (asked on every use of every resource:
# os.getpid() is a system call each time)
this_pid = os.getpid()


def _forked() -> None:
    global this_pid
    this_pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


class Resource:
    _closed: bool = False
    _pid: int = 0
    _close_again: bool = False

    # ------------------------------------------------------------------ hooks
    def _close(self) -> None:
        """Release what this object holds (called once, by close() through _release)."""

    def _release(self, force: bool, timeout: float | None, **how: Any) -> None:
        """Release what this object holds; raise to refuse (the object stays open)."""
        self._close()

    def _abandon(self) -> None:
        """In a forked child of the owner: let go of this process's copies only."""
        self._close()

    def _detach(self) -> bool:
        """True when other handles keep the object alive: this one just goes."""
        return False

    def _reattach(self) -> None:
        """A refused release: undo what _detach prepared."""

    # ------------------------------------------------------------------ the template
    def close(self, force: bool = False, timeout: float | None = None, **how: Any) -> None:
        """Release what this object holds, once (again only where the class says so);
        raises, leaving it open, when its release is refused."""
        if self._closed and not self._close_again:
            return
        if self._detach():
            self._closed = True
            return
        try:
            if self.foreign:
                self._abandon()
            else:
                self._release(force, timeout, **how)
        except BaseException:
            self._reattach()
            raise
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    # ------------------------------------------------------------------ ownership
    def _mark_owner(self) -> None:
        self._pid = this_pid

    @property
    def foreign(self) -> bool:
        """True in a forked child of the process that made this object."""
        return self._pid != 0 and self._pid != this_pid

    def _check_owner(self) -> None:
        if self._pid != 0 and self._pid != this_pid:
            raise UsageError(f"{self!r} belongs to process {self._pid}; a forked child "
                             f"({this_pid}) cannot use it: open its own Hub")

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"{self!r} is closed")
        self._check_owner()

    def __enter__(self: T) -> T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
