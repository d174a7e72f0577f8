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


# ---------------------------------------------------------------- shared fixtures

@pytest.fixture(scope="session")
def torch():
    """torch with CUDA initialised (skips, naming why, where torch or its CUDA is missing)."""
    t = pytest.importorskip("torch")
    if not t.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    t.cuda.init()
    return t


@pytest.fixture(scope="session")
def cp():
    return pytest.importorskip("cupy")


@pytest.fixture(scope="session")
def be():
    """The CUDA backend plugin (backends/cuda)."""
    import p2phub_cuda
    return p2phub_cuda.backend()


@pytest.fixture(scope="session")
def cu():
    """The CUDA driver API module the backend uses."""
    from p2phub_cuda.backend import cu as driver
    return driver


@pytest.fixture(scope="session")
def ops():
    """The backend's stream operations (fences on streams)."""
    import p2phub_cuda
    return p2phub_cuda.stream_ops()
