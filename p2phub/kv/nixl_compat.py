"""The former home of the NIXL adapter; it lives in :mod:`p2phub.nixl` now.

    from p2phub.nixl._api import nixl_agent, nixl_agent_config
"""

from __future__ import annotations

import time

from ..nixl._api import (  # noqa: F401 - re-exported
    DEFAULT_COMM_PORT, nixl_agent, nixl_agent_config, nixl_prepped_dlist_handle,
    nixl_xfer_handle,
)
from ..nixl._bindings import NIXL_INIT_AGENT  # noqa: F401

__all__ = ["nixl_agent", "nixl_agent_config", "DEFAULT_COMM_PORT", "NIXL_INIT_AGENT"]


def wait_state(agent: nixl_agent, handle: nixl_xfer_handle, timeout: float) -> str:
    """Poll check_xfer_state until it leaves "PROC" or `timeout` passes (a helper for tests)."""
    deadline = time.monotonic() + timeout
    while True:
        st = agent.check_xfer_state(handle)
        if st != "PROC" or time.monotonic() >= deadline:
            return st
        time.sleep(0.0005)
