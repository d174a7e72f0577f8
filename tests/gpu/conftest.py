"""GPU-tier fixtures: skip cleanly, with the reason, where there is no CUDA device."""

from __future__ import annotations

import pytest


def _cuda_reason() -> str | None:
    try:
        from cuda.bindings import driver as cu  # type: ignore[import-not-found]
    except ImportError:
        try:
            from cuda import cuda as cu  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return "cuda-python is not installed"
    err, = cu.cuInit(0)
    if int(err) != 0:
        return f"cuInit failed ({err})"
    err, count = cu.cuDeviceGetCount()
    if int(err) != 0 or count == 0:
        return "no CUDA device"
    return None


@pytest.fixture(scope="session")
def cuda_reason() -> str | None:
    return _cuda_reason()


@pytest.fixture(scope="session", autouse=True)
def _needs_cuda(cuda_reason: str | None) -> None:
    if cuda_reason:
        pytest.skip(f"gpu tier: {cuda_reason}")
