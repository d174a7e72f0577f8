"""The fences of KV transfers are the ordering layer's (p2phub.ordering): a request's layer
fences complete the producer accesses the receiver declares on exactly the pages each layer
fills, so consumers of those bytes wait for them, or fail with them."""

from __future__ import annotations

from ..ordering.errors import FenceError, FenceTimeout
from ..ordering.fence import HostFence

__all__ = ["HostFence", "FenceError", "FenceTimeout"]
