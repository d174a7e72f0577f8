"""`p2phub info`: what p2phub.ko reports about itself."""

from __future__ import annotations

import argparse
import json
import sys

from .. import backend, uapi
from ..device import get_info
from ..errors import ModuleNotLoadedError, P2PHubOSError

from ..exitcodes import Exit

EXIT_OK, EXIT_FAIL, EXIT_NOT_LOADED = Exit.OK, Exit.FAIL, Exit.NOT_LOADED


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--device", default=uapi.DEVICE_PATH,
                        help=f"the p2phub device node (default {uapi.DEVICE_PATH})")


def run(args: argparse.Namespace) -> int:
    try:
        info = get_info(args.device)
    except ModuleNotLoadedError as exc:
        if args.json:
            print(json.dumps({"schema": "p2phub.info/1", "loaded": False, "error": str(exc)}))
        else:
            print(f"p2phub info: {exc}", file=sys.stderr)
        return EXIT_NOT_LOADED
    except P2PHubOSError as exc:
        if args.json:
            print(json.dumps({"schema": "p2phub.info/1", "loaded": True, "error": str(exc),
                              "errno": exc.errno}))
        else:
            print(f"p2phub info: {exc}", file=sys.stderr)
        return EXIT_FAIL
    plugins = {"backends": backend.backend_names(), "backends_unavailable": backend.unavailable()}
    if args.json:
        print(json.dumps({"schema": "p2phub.info/1", "loaded": True, **info.as_dict(), **plugins},
                         indent=2))
        return EXIT_OK

    from rich.console import Console
    from rich.table import Table

    table = Table(title="p2phub.ko", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    table.add_row("version", info.version)
    table.add_row("ABI", str(info.abi_version))
    table.add_row("capabilities", ", ".join(info.cap_names) or "(none)")
    table.add_row("caps mask", f"0x{int(info.caps):x}")
    table.add_row("registrations per open", str(info.max_regs_per_file))
    table.add_row("backend plugins", ", ".join(plugins["backends"]) or "(none)")
    for name, why in plugins["backends_unavailable"].items():
        table.add_row(f"  {name} (not loaded)", why)
    Console().print(table)
    return EXIT_OK
