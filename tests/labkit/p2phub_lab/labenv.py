"""The lab's description (tools/lab writes it; $P2PHUB_LAB_ENV names it inside the VM)."""

from __future__ import annotations

import os
from pathlib import Path


def read(path: str | None = None) -> dict[str, str]:
    """KEY=VALUE pairs of the lab env file; empty outside the lab or when unreadable to this user."""
    path = path or os.environ.get("P2PHUB_LAB_ENV")
    if not path:
        return {}
    try:
        text = Path(path).read_text()
    except OSError:
        return {}
    env: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            env[key.strip()] = value.strip()
    return env
