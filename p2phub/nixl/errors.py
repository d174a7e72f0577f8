"""NIXL's exception classes, by NIXL's names (``nixl._bindings`` raises these).

Each is a :class:`p2phub.errors.P2PHubError` (so ``except P2PHubError`` catches them) and
also the builtin a connector may already catch: an invalid parameter is a ``ValueError``, a
missing agent, descriptor or backend a ``KeyError``, an unsupported request a
``NotImplementedError``. NIXL itself raises them as plain ``Exception`` subclasses, so code
written for NIXL catches them unchanged.
"""

from __future__ import annotations

from ..errors import P2PHubError

__all__ = [
    "nixlError", "nixlNotPostedError", "nixlInvalidParamError", "nixlBackendError",
    "nixlNotFoundError", "nixlMismatchError", "nixlNotAllowedError", "nixlRepostActiveError",
    "nixlUnknownError", "nixlNotSupportedError", "nixlRemoteDisconnectError",
    "nixlCancelledError", "nixlNoTelemetryError", "status_error",
]


class nixlError(P2PHubError):  # noqa: N801 - NIXL's naming
    """Base of the NIXL-named errors. ``status`` is NIXL's nixl_status_t value."""

    status = -8

    def __str__(self) -> str:  # KeyError's str() would quote the message
        return str(self.args[0]) if self.args else self.__class__.__name__


class nixlNotPostedError(nixlError):  # noqa: N801
    status = -1


class nixlInvalidParamError(nixlError, ValueError):  # noqa: N801
    status = -2


class nixlBackendError(nixlError):  # noqa: N801
    status = -3


class nixlNotFoundError(nixlError, KeyError):  # noqa: N801
    status = -4


class nixlMismatchError(nixlError, ValueError):  # noqa: N801
    status = -5


class nixlNotAllowedError(nixlError):  # noqa: N801
    status = -6


class nixlRepostActiveError(nixlError):  # noqa: N801
    status = -7


class nixlUnknownError(nixlError):  # noqa: N801
    status = -8


class nixlNotSupportedError(nixlError, NotImplementedError):  # noqa: N801
    status = -9


class nixlRemoteDisconnectError(nixlError, ConnectionError):  # noqa: N801
    status = -10


class nixlCancelledError(nixlError):  # noqa: N801
    status = -11


class nixlNoTelemetryError(nixlError):  # noqa: N801
    status = -12


_BY_STATUS = {c.status: c for c in (
    nixlNotPostedError, nixlInvalidParamError, nixlBackendError, nixlNotFoundError,
    nixlMismatchError, nixlNotAllowedError, nixlRepostActiveError, nixlUnknownError,
    nixlNotSupportedError, nixlRemoteDisconnectError, nixlCancelledError, nixlNoTelemetryError)}


def status_error(status: int, msg: str) -> nixlError:
    """The exception NIXL raises for a negative nixl_status_t."""
    return _BY_STATUS.get(status, nixlUnknownError)(msg)
