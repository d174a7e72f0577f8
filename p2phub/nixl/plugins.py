"""Where the pip ``nixl`` finds p2phub's NIXL backend plugin.

NIXL loads every backend plugin from one directory: its wheel's own ``plugins/``, or
``NIXL_PLUGIN_DIR``, which replaces it (and NIXL's own plugins cannot be linked elsewhere:
they find their libraries relative to where they lie). `install` therefore links
``libplugin_P2PHUB.so`` into the wheel's own directory: ``create_backend("P2PHUB")`` then works
with no environment, beside UCX, POSIX and the rest (``p2phub nixl install-plugin``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..errors import MissingDependencyError, UsageError

PLUGIN = "libplugin_P2PHUB.so"
_PKG = Path(__file__).resolve().parent / "plugin"


def plugin_library() -> Path | None:
    """libplugin_P2PHUB.so: the one the install built (``lib/``) or a checkout's own build
    (``make -C p2phub/nixl/plugin``: ``build/``), the newer where both exist."""
    found = [p for p in (_PKG / "lib" / PLUGIN, _PKG / "build" / PLUGIN) if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def nixl_plugins() -> Path | None:
    """The pip nixl's own plugins directory (<site-packages>/.nixl_<flavour>.mesonpy.libs/
    plugins), or None where no nixl wheel is installed."""
    for name in ("nixl_cu13", "nixl_cu12", "nixl"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        pkg = Path(list(spec.submodule_search_locations)[0])
        d = pkg.parent / f".{pkg.name}.mesonpy.libs" / "plugins"
        if d.is_dir():
            return d
    return None


def install(names: tuple[str, ...] = (), remove: bool = False) -> dict[str, object]:
    """Link libplugin_P2PHUB.so into the pip nixl's own plugins directory (as P2PHUB, and as
    each of `names` that NIXL does not ship itself), so that NIXL finds it with no
    NIXL_PLUGIN_DIR and every plugin of its own stays. `remove`: take those links out again.
    A name that would replace one of NIXL's own plugins is refused (a directory of aliases
    that hides them is `make -C p2phub/nixl/plugin aliases`, for NIXL_PLUGIN_DIR)."""
    own = nixl_plugins()
    if own is None:
        raise MissingDependencyError("the pip nixl", "pip install nixl-cu12 (or nixl-cu13)")
    for n in names:
        if not n or not n.replace("_", "").isalnum() or n != n.upper():
            raise UsageError(f"--as {n!r}: want a backend name such as MY_STORE")
    lib = plugin_library()
    if lib is None and not remove:
        raise MissingDependencyError("libplugin_P2PHUB.so", "reinstall p2phub where g++ and make "
                                     "are installed, or run `make -C p2phub/nixl/plugin` in a checkout")
    links = [own / f"libplugin_{n}.so" for n in ("P2PHUB", *names)]
    for link in links:
        if link.exists() and not link.is_symlink():
            raise UsageError(f"{link} is NIXL's own plugin: p2phub's will not replace it")
        if link.is_symlink():
            link.unlink()
        if not remove:
            link.symlink_to(lib)    # (NIXL's own plugins find their libraries by $ORIGIN:
                                    # they stay where they are)
    return {"nixl_plugins": str(own), "p2phub": str(lib) if lib else None,
            "names": ["P2PHUB", *names], "removed": remove,
            "nixl_own": sorted(p.name[len("libplugin_"):-3] for p in own.glob("libplugin_*.so")
                               if not p.is_symlink())}
