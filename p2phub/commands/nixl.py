"""`p2phub nixl install-plugin [--as NAMES] [--remove] [--json]`: link p2phub's NIXL backend
plugin into the pip nixl's own plugins directory, where NIXL finds it beside UCX, POSIX and
its other plugins with no NIXL_PLUGIN_DIR (p2phub/nixl/plugins.py)."""

from __future__ import annotations

import argparse
import json


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="nixl_cmd", required=True, metavar="install-plugin")
    p = sub.add_parser("install-plugin", help="link libplugin_P2PHUB.so into the pip nixl's "
                       "plugins directory (NIXL's own plugins stay)",
                       description="Link p2phub's NIXL backend plugin into the pip nixl's own "
                       "plugins directory: create_backend('P2PHUB') then works with no "
                       "NIXL_PLUGIN_DIR, and UCX, POSIX and NIXL's other plugins stay usable.")
    p.add_argument("--as", dest="names", default="",
                   help="also under these backend names, comma-separated (names NIXL does not "
                   "ship; its own are never replaced)")
    p.add_argument("--remove", action="store_true", help="take the links out again")
    p.add_argument("--json", action="store_true", help="print what was done as JSON")


def run(args: argparse.Namespace) -> int:
    from ..nixl.plugins import install
    names = tuple(n.strip() for n in args.names.split(",") if n.strip())
    got = install(names, remove=args.remove)
    if args.json:
        print(json.dumps(got))
        return 0
    verb = "removed from" if args.remove else "linked into"
    print(f"{', '.join(got['names'])}: {verb} {got['nixl_plugins']}")
    if not args.remove:
        print(f"  -> {got['p2phub']}")
        print(f"NIXL's own plugins there: {', '.join(got['nixl_own'])}")
    return 0
