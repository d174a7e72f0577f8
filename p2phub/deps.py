"""Optional dependencies: which package provides a module, and how to install it.

``require("torch")`` imports and returns the module, or raises MissingDependencyError whose
message is the one line a user needs: ``needs torch: pip install torch``.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from .errors import MissingDependencyError

# top-level module -> (what to call it, how to install it)
INSTALL: dict[str, tuple[str, str]] = {
    "torch": ("torch", "pip install torch"),
    "cupy": ("cupy", "pip install cupy-cuda12x"),
    "numpy": ("numpy", "pip install numpy"),
    "pyverbs": ("pyverbs", "apt-get install python3-pyverbs (Debian/Ubuntu) or dnf install "
                           "python3-pyverbs (RHEL)"),
    "matplotlib": ("matplotlib", "pip install 'p2phub[plot]'"),
    "prometheus_client": ("prometheus_client", "pip install 'p2phub[metrics]'"),
    "nixl_cu12": ("nixl", "pip install nixl-cu12"),
    "mooncake": ("mooncake", "pip install mooncake-transfer-engine"),
    "kvikio": ("kvikio", "pip install kvikio-cu12"),
    "p2phub_cuda": ("the p2phub CUDA backend", "pip install ./backends/cuda"),
    "p2phub_rocm": ("the p2phub ROCm backend", "pip install ./backends/rocm"),
    "redis": ("redis", "pip install redis"),
}


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def error_for(module: str) -> MissingDependencyError:
    what, how = INSTALL.get(_top(module), (_top(module), f"pip install {_top(module)}"))
    return MissingDependencyError(what, how)


def available(module: str) -> bool:
    """True when `module` can be imported (found on the path; not imported)."""
    try:
        return importlib.util.find_spec(_top(module)) is not None
    except (ImportError, ValueError):
        return False


def require(module: str) -> ModuleType:
    """Import `module`; MissingDependencyError naming the package when it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and _top(exc.name) == _top(module):
            raise error_for(module) from None
        raise


def check(modules: list[str] | tuple[str, ...]) -> None:
    """MissingDependencyError for the first of `modules` that is not installed."""
    for m in modules:
        if not available(m):
            raise error_for(m)
