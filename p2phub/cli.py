"""The `p2phub` command. Each subcommand lives in its own module and is imported lazily."""

from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .exitcodes import Exit

# name -> (module, help). Each module has register(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("p2phub.commands.info", "show p2phub.ko's version and capabilities"),
    "doctor": ("p2phub.doctor.command", "can GPU<->NVMe and GPU<->NIC P2P work here, and why not"),
    "nvme": ("p2phub.commands.nvme", "hand an NVMe controller to p2phub and back (bind, unbind, list, identify)"),
    "kv": ("p2phub.commands.kv", "move KV-cache pages between two agents (serve, send)"),
    "bench": ("p2phub.commands.bench", "measure p2phub against its baselines (register: vs ibv_reg_mr)"),
}

# every subcommand returns codes from p2phub/exitcodes.py (docs/cli.md)
EXIT_OK, EXIT_FAIL, EXIT_USAGE = Exit.OK, Exit.FAIL, Exit.USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2phub",
        description="GPU peer-to-peer registration hub: GPU memory for NVMe SSDs and RDMA NICs.",
    )
    parser.add_argument("--version", action="version", version=f"p2phub {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (modname, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        try:
            mod = importlib.import_module(modname)
        except ImportError as exc:  # keep the other commands usable
            p.set_defaults(_broken=f"{name}: {exc}")
            continue
        mod.register(p)
        p.set_defaults(_run=mod.run)
    return parser



def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors; ours is 4
        code = exc.code if isinstance(exc.code, int) else EXIT_USAGE
        return EXIT_USAGE if code == 2 else code
    if getattr(args, "_broken", None):
        print(f"p2phub: cannot load {args._broken}", file=sys.stderr)
        return EXIT_FAIL
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USAGE
    return int(args._run(args) or Exit.OK)


if __name__ == "__main__":
    sys.exit(main())
