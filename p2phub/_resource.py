"""One base for everything p2phub hands out that must be released: close(), closed, with-blocks.

A subclass implements ``_close()`` (release what it holds, once) and may call
``_check_open()`` before every use. ``close()`` is idempotent; the object is
marked closed only when ``_close()`` returned, so a refused close (EBUSY) can
be retried. Objects made in one process and reached from a forked child refuse
every use there (``_check_owner()``): the child shares the parent's files, and
a release issued from it would pull memory out from under the parent.
"""

from __future__ import annotations

import os
from typing import TypeVar

from .errors import UsageError

T = TypeVar("T", bound="Resource")


class Resource:
    _closed: bool = False
    _pid: int = 0

    def _close(self) -> None:
        """Release what this object holds (called once by close())."""

    def close(self) -> None:
        if self._closed:
            return
        self._close()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

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
