"""Disaggregated KV-cache transfer: a layout, a pool registered once, and an agent that
moves a request's pages layer by layer to a peer (TCP here; see agent.py)."""

from .agent import Agent, DescList, RemoteAgent
from .errors import KVError, KVPeerError, KVRejected
from .layout import CONTIGUOUS, PER_LAYER, KVLayout
from .pool import KVPool

__all__ = ["Agent", "DescList", "RemoteAgent", "KVError", "KVPeerError", "KVRejected",
           "KVLayout", "KVPool", "PER_LAYER", "CONTIGUOUS"]
