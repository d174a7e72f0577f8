"""Progress on stderr for commands that take more than a moment: a spinner (`activity`) or a bar
of steps (`steps`). Shown only when stderr is a terminal (and not with --quiet): a pipe or a
log file gets nothing, and stdout (tables, --json) is never touched."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any, Iterator


def _wanted(args: argparse.Namespace | None) -> bool:
    return sys.stderr.isatty() and not getattr(args, "quiet", False)


def _console() -> Any:
    from rich.console import Console
    return Console(stderr=True)


@contextlib.contextmanager
def activity(args: argparse.Namespace | None, text: str) -> Iterator[None]:
    """A spinner with `text` while the block runs."""
    if not _wanted(args):
        yield
        return
    with _console().status(text):
        yield


class Steps:
    """What `steps` yields: advance(n, description) moves the bar (a no-op when hidden)."""

    def __init__(self, progress: Any = None, task: Any = None) -> None:
        self._p, self._t = progress, task

    def advance(self, n: float = 1, description: str | None = None) -> None:
        if self._p is not None:
            if description is not None:
                self._p.update(self._t, description=description)
            self._p.advance(self._t, n)

    def describe(self, description: str) -> None:
        if self._p is not None:
            self._p.update(self._t, description=description)


@contextlib.contextmanager
def steps(args: argparse.Namespace | None, description: str, total: float) -> Iterator[Steps]:
    """A bar of `total` steps with elapsed and remaining time."""
    if not _wanted(args):
        yield Steps()
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=_console(), transient=True) as p:
        yield Steps(p, p.add_task(description, total=total))
