"""``nixl.logging``: NIXL's examples take their logger from here."""

from __future__ import annotations

import logging as _logging


def get_logger(name: str) -> _logging.Logger:
    return _logging.getLogger(name)
