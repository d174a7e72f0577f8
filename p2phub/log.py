"""The `p2phub` logger: every module logs through ``logging.getLogger(__name__)``.

Nothing is printed unless asked: the package adds only a NullHandler. ``P2PHUB_LOG=debug``
(or info, warning, error) configures a stderr handler for the ``p2phub`` logger, for the
command line and for library users alike; ``configure("debug")`` does the same from code.
The command line shows INFO and above by default (the notice that a Hub chose staged mode).
"""

from __future__ import annotations

import logging
import os
import sys

ENV = "P2PHUB_LOG"
_HANDLER_NAME = "p2phub-stderr"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "warn": logging.WARNING, "error": logging.ERROR, "off": logging.CRITICAL + 10}


def level_from_env(default: int | None = None) -> int | None:
    """The level P2PHUB_LOG names (a name or a number), `default` when it is unset; an
    unknown name is taken as debug rather than silently ignored."""
    text = os.environ.get(ENV, "").strip().lower()
    if not text:
        return default
    if text.isdigit():
        return int(text)
    return _LEVELS.get(text, logging.DEBUG)


class _Stderr(logging.StreamHandler):
    """A handler on whatever sys.stderr is when a record is written (it may be replaced)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


def configure(level: int | str | None = None, stream=None) -> logging.Logger:
    """A stderr handler on the ``p2phub`` logger at `level` (default: P2PHUB_LOG, else INFO).
    Calling it again replaces the handler rather than adding a second one."""
    if isinstance(level, str):
        level = _LEVELS.get(level.lower(), logging.DEBUG)
    if level is None:
        level = level_from_env(logging.INFO)
    log = logging.getLogger("p2phub")
    for h in list(log.handlers):
        if h.get_name() == _HANDLER_NAME:
            log.removeHandler(h)
    h = logging.StreamHandler(stream) if stream is not None else _Stderr()
    h.set_name(_HANDLER_NAME)
    fmt = "%(asctime)s %(name)s %(levelname)s: %(message)s" if level <= logging.DEBUG \
        else "p2phub: %(message)s"
    h.setFormatter(logging.Formatter(fmt))
    log.addHandler(h)
    log.setLevel(level)
    log.propagate = False  # one copy of each record, whatever the root logger has
    return log
