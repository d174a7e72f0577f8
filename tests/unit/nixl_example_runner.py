"""Run one of NIXL's Python examples unchanged against the installed nixl_cu12 wheel:

    python nixl_example_runner.py EXAMPLE.py ARGS...

The examples import ``nixl`` (the name of NIXL's meta package, which picks nixl_cu12 or
nixl_cu13); this maps that name and its submodules onto whichever wheel is installed, then
runs the example as __main__."""

from __future__ import annotations

import importlib
import runpy
import sys


def main() -> None:
    for wheel in ("nixl_cu12", "nixl_cu13"):
        try:
            pkg = importlib.import_module(wheel)
            break
        except ImportError:
            continue
    else:
        raise SystemExit("neither nixl_cu12 nor nixl_cu13 is installed")
    sys.modules["nixl"] = pkg
    for sub in ("_api", "_utils", "_bindings", "logging"):
        sys.modules[f"nixl.{sub}"] = importlib.import_module(f"{pkg.__name__}.{sub}")
    example = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(example, run_name="__main__")


if __name__ == "__main__":
    main()
