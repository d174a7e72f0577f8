"""p2phub's ROCm backend (hip-python). Recognises nothing yet: ROCm allocations cannot be registered."""

from __future__ import annotations

from typing import Any


class RocmBackend:
    name = "rocm"

    def claims(self, obj: Any) -> bool:
        return False

    def resolve(self, obj: Any, offset: int = 0, length: int | None = None,
                export_dmabuf: bool = True):
        raise NotImplementedError("the ROCm backend is not written yet")


def backend() -> RocmBackend:
    return RocmBackend()
