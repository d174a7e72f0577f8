"""Errors of KV transfers."""

from __future__ import annotations

from ..errors import P2PHubError

__all__ = ["KVError", "KVPeerError", "KVRejected"]


class KVError(P2PHubError):
    """A KV transfer could not be done as asked."""


class KVPeerError(KVError):
    """The peer died, stalled past the deadline, or closed the connection mid-transfer.
    ``peer`` names it, ``reason`` says what was seen ("closed", "stalled", "reset")."""

    def __init__(self, peer: str, reason: str, detail: str) -> None:
        super().__init__(f"KV peer {peer!r} {reason}: {detail}")
        self.peer = peer
        self.reason = reason


class KVRejected(KVError):
    """The receiving peer refused a transfer (pages outside its pool, unknown region)."""

    def __init__(self, peer: str, detail: str) -> None:
        super().__init__(f"KV peer {peer!r} rejected the transfer: {detail}")
        self.peer = peer
