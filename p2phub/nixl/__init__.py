"""NIXL's Python API over p2phub's KV transfer agent.

A connector written for NIXL (vLLM's NixlConnector, Dynamo, LMCache) runs on p2phub with its
import changed from ``nixl`` to ``p2phub.nixl``:

    from p2phub.nixl._api import nixl_agent, nixl_agent_config
    from p2phub.nixl._bindings import nixlXferTelemetry, nixlNotFoundError

``p2phub.nixl.errors`` holds NIXL's exception classes; ``alias()`` makes ``import nixl``
resolve here in this process (for a connector whose source is not to be edited).
"""

from __future__ import annotations

import sys

from ._api import (
    DEFAULT_COMM_PORT, nixl_agent, nixl_agent_config, nixl_backend_handle,
    nixl_prepped_dlist_handle, nixl_thread_sync_t, nixl_xfer_handle,
)

__all__ = [
    "DEFAULT_COMM_PORT", "nixl_agent", "nixl_agent_config", "nixl_backend_handle",
    "nixl_prepped_dlist_handle", "nixl_thread_sync_t", "nixl_xfer_handle", "alias",
]


def alias() -> None:
    """Make ``import nixl`` (and nixl._api, nixl._bindings, nixl._utils, nixl.logging) give
    this package, for code that imports NIXL by name. Call it before that code imports
    nixl; refused when a real nixl is already imported in this process."""
    from . import _api, _bindings, _utils, errors, logging
    have = sys.modules.get("nixl")
    if have is not None and have is not sys.modules[__name__]:
        raise RuntimeError("a real nixl package is already imported in this process")
    sys.modules["nixl"] = sys.modules[__name__]
    for sub, mod in (("_api", _api), ("_bindings", _bindings), ("_utils", _utils),
                     ("errors", errors), ("logging", logging)):
        sys.modules[f"nixl.{sub}"] = mod
