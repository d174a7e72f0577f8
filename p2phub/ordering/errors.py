"""Errors of p2phub.ordering."""

from __future__ import annotations

from typing import Any

from ..errors import P2PHubError


class OrderingError(P2PHubError):
    """An access conflicts with a live one (strict mode), or cannot be ordered at all (two
    conflicting accesses in one batch). ``access`` and ``conflict`` name both."""

    def __init__(self, msg: str, access: Any = None,
                 conflict: Any = None) -> None:
        super().__init__(msg)
        self.access = access
        self.conflict = conflict


class FenceError(P2PHubError):
    """A fence failed: its work will never complete as asked (a command error, a dead
    controller, a destroyed queue pair, a closed registration). The cause is chained."""


class FenceTimeout(P2PHubError, TimeoutError):
    """A fence did not complete within the caller's timeout (it may still complete)."""


class OrderingTimeout(FenceTimeout):
    """An access waited longer than its timeout for the earlier accesses it conflicts with;
    ``access`` and ``conflict`` name both. The access was withdrawn."""

    def __init__(self, msg: str, access: Any = None,
                 conflict: Any = None) -> None:
        super().__init__(msg)
        self.access = access
        self.conflict = conflict
