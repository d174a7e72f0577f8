"""Storage opened once for many loads and saves: ``hub.open(path)``.

``hub.load(path, ...)`` per request has to ask the file system, every time, whether the path
still names the file it opened before (a ``stat``: a path walk and a system call). A
connector that restores many blocks of one file opens it once instead, as kvikio's ``CuFile``
and NIXL's registered fds do, and passes the open file to each call: the request then makes
no system call before the engine's own read. The file's size is kept and asked again only
when a read reaches past it (the file grew); a read of a file that shrank comes back short
and its fence says so.

An open file belongs to its Hub. ``close()`` (its with-block, or ``hub.close()``) marks it
closing, waits for every load and save queued on it before, then closes the fd: a request never
reads or writes an fd number the process has since reused. A request racing the close either
is queued before the close's mark (and waited for) or is refused: the engine's queue checks
``closing`` under the lock that orders both. Work that runs outside that queue (the staging
lanes, a batch's planning) gets its own duplicate of the fd (``dup()``).
"""

from __future__ import annotations

import os
import stat
import threading
from typing import Protocol

from . import staged
from ._resource import Resource
from .errors import UsageError
from .staged import ALIGN


class Engines(Protocol):
    """What an open file needs of its Hub's engines (p2phub.batch.Engines)."""

    def wait_queued(self) -> None: ...

    def forget(self, f: "StorageFile") -> None: ...

# mode -> (open flags, readable, writable)
_MODES = {
    "r": (os.O_RDONLY, True, False),
    "r+": (os.O_RDWR, True, True),
    "w": (os.O_RDWR | os.O_CREAT | os.O_TRUNC, True, True),
    "a": (os.O_RDWR | os.O_CREAT, True, True),     # created if missing, never truncated
}


class StorageFile(Resource):
    """A file or block device open for ``hub.load``/``hub.save`` (and the batch calls, like
    any open file). ``direct``: opened O_DIRECT (asked for, and the file system has it).
    Saves of a range that O_DIRECT cannot write (not 4 KiB-aligned) go through a second,
    buffered fd of the same open file, opened on first need."""

    def __init__(self, engines: "Engines", path: "str | os.PathLike[str]", mode: str = "r",
                 *, direct: bool = True) -> None:
        if mode not in _MODES:
            raise UsageError(f"mode={mode!r}: want one of {', '.join(map(repr, _MODES))}")
        self.name = os.fspath(path)
        self.mode = mode
        flags, self.readable, self.writable = _MODES[mode]
        self.engines = engines
        self.fd, self.direct = staged.open_path(self.name, flags, direct)
        self._buffered_fd = -1
        # set once close() begins (read by the engine queue under its lock); _lock orders it
        # with the fds made from this one (dup, the buffered fd)
        self.closing = False
        self._lock = threading.Lock()
        try:
            mode_bits = os.fstat(self.fd).st_mode
            if not (stat.S_ISREG(mode_bits) or stat.S_ISBLK(mode_bits) or stat.S_ISDIR(mode_bits)):
                raise UsageError(f"{self.name} is not a regular file or a block device")
            self._size = staged.size_of(self.fd, self.name)    # refuses a directory
        except BaseException:
            os.close(self.fd)
            raise
        self._mark_owner()

    # ------------------------------------------------------------------ sizes and ranges
    @property
    def size(self) -> int:
        """The file's size now (asked of the file system)."""
        self._check_open()
        self._size = staged.size_of(self.fd, self.name)
        return self._size

    def read_range(self, offset: int, nbytes: int | None) -> int:
        """The length of a read of `nbytes` (None: to the end) at `offset`, checked inside the
        file; the size is asked again only when the range reaches past the one last seen."""
        if self.closing:
            self._check_closing()
        if not self.readable:
            raise UsageError(f"{self.name} is open for writing only")
        size = self._size
        if nbytes is None or offset + nbytes > size:
            size = self.size
            if nbytes is None:
                nbytes = size - offset
        if offset < 0 or nbytes <= 0 or offset + nbytes > size:
            raise UsageError(f"{self.name}: range offset={offset} nbytes={nbytes} is not "
                             f"inside its {size} bytes")
        return nbytes

    def write_fd(self, offset: int, nbytes: int) -> tuple[int, bool]:
        """(fd, O_DIRECT) for a save of `nbytes` at `offset`: the O_DIRECT fd when the range is
        aligned, else the buffered one."""
        self._check_closing()
        if not self.writable:
            raise UsageError(f"{self.name} is open for reading only (hub.open(path, 'r+'))")
        if offset < 0:
            raise UsageError(f"offset={offset} is negative")
        if not self.direct or (offset % ALIGN == 0 and nbytes % ALIGN == 0):
            return self.fd, self.direct
        with self._lock:
            self._check_closing()
            return self._buffered_locked(), False

    def dup(self, buffered: bool = False) -> int:
        """A duplicate of the fd (`buffered`: of one without O_DIRECT), the caller's to close:
        for work that runs outside the engine queue that close() waits for."""
        with self._lock:
            self._check_closing()
            return os.dup(self._buffered_locked() if buffered and self.direct else self.fd)

    def _buffered_locked(self) -> int:
        if self._buffered_fd < 0:
            # the same open file without O_DIRECT (the path may name another file by now)
            flags = (os.O_RDWR if self.writable else os.O_RDONLY) | os.O_CLOEXEC
            self._buffered_fd = os.open(f"/proc/self/fd/{self.fd}", flags)
        return self._buffered_fd

    def fileno(self) -> int:
        """The O_DIRECT fd where there is one."""
        self._check_open()
        return self.fd

    def _check_closing(self) -> None:
        if self.closing:
            raise UsageError(f"{self!r} is closed")
        self._check_open()

    # ------------------------------------------------------------------ closing
    def _close(self) -> None:
        with self._lock:
            self.closing = True     # from here the engine queue refuses requests on it
        # every request queued before this point has run: none reads the fds after they go
        self.engines.wait_queued()
        self.engines.forget(self)
        self._abandon()

    def _abandon(self) -> None:
        """Close the fds (alone in a forked child: its copies, nothing queued in it)."""
        for fd in (self.fd, self._buffered_fd):
            if fd >= 0:
                os.close(fd)

    def __repr__(self) -> str:
        state = "closed" if self.closing else f"{self._size} bytes"
        return (f"<StorageFile {self.name} {self.mode}"
                f"{' O_DIRECT' if self.direct else ''} {state}>")
