"""The NIXL API a subprocess script runs against, by name: ``adapter`` (p2phub.nixl),
``plugin`` (the real NIXL, the pip nixl_cu12 / nixl_cu13, loading libplugin_P2PHUB.so from
`plugin_dir`) or ``posix`` (the real NIXL with its own plugins). Shared by the scripts that
compare the routes (nixl_file_lifetime_script.py, nixl_file_meta_script.py,
nixl_strided_script.py)."""

from __future__ import annotations

import os
import time
from typing import Any


def agent_api(impl: str, plugin_dir: str | None = None) -> tuple[Any, Any]:
    """(nixl_agent, nixl_agent_config) of `impl`."""
    if impl == "adapter":
        from p2phub.nixl._api import nixl_agent, nixl_agent_config
        return nixl_agent, nixl_agent_config
    if impl == "plugin":
        os.environ["NIXL_PLUGIN_DIR"] = str(plugin_dir)
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:  # a CUDA 13 machine carries nixl_cu13
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def finish(agent: Any, h: Any, timeout: float = 60.0) -> str:
    """transfer() then check_xfer_state() every 0.5 ms until it is not "PROC"."""
    st = agent.transfer(h)
    deadline = time.monotonic() + timeout
    while st == "PROC" and time.monotonic() < deadline:
        time.sleep(0.0005)
        st = agent.check_xfer_state(h)
    return st
