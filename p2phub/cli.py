"""The `p2phub` command. Each subcommand lives in its own module and is imported lazily.

One contract for every subcommand, enforced here (docs/cli.md):
- arguments are checked while they are parsed (p2phub/commands/argtypes.py) and by the
  subcommand's ``_check(args)`` default before any work: a bad one is refused in one line on
  stderr, exit 4 (USAGE);
- a package or the hardware the command needs (its ``_needs(args)`` default) that is not here
  is named with the line that installs it, exit 7 (NEEDS);
- no traceback reaches a user: Ctrl-C is one line and exit 130, a reader that closes stdout
  early (``| head``) ends the command silently with 141, any error is one line
  (``P2PHUB_LOG=debug`` adds the traceback);
- with ``--json`` every error is also a JSON document on stdout (schema ``p2phub.error/1``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import select
import sys
from typing import Any, NoReturn

from . import __version__
from .errors import MissingDependencyError, ModuleNotLoadedError, P2PHubError, UsageError
from .exitcodes import Exit

log = logging.getLogger(__name__)

# name -> (module, help). Each module has register(parser) and run(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "info": ("p2phub.commands.info", "show p2phub.ko's version and capabilities"),
    "doctor": ("p2phub.doctor.command", "can GPU<->NVMe and GPU<->NIC P2P work here, and why not"),
    "nvme": ("p2phub.commands.nvme", "hand an NVMe controller to p2phub and back (bind, unbind, list, identify)"),
    "kv": ("p2phub.commands.kv", "move KV-cache pages between two agents (serve, send)"),
    "bench": ("p2phub.commands.bench", "measure p2phub against its baselines (register: vs ibv_reg_mr)"),
    "top": ("p2phub.commands.top", "a live view of a metrics endpoint: KV agents and NVMe engines"),
    "nixl": ("p2phub.commands.nixl", "put p2phub's NIXL plugin where the pip nixl finds it (install-plugin)"),
}

ERROR_SCHEMA = "p2phub.error/1"

# every subcommand returns codes from p2phub/exitcodes.py (docs/cli.md)
EXIT_OK, EXIT_FAIL, EXIT_USAGE = Exit.OK, Exit.FAIL, Exit.USAGE


class _Usage(Exception):
    """A usage error found by argparse (raised instead of its print-usage-and-exit-2)."""


class Parser(argparse.ArgumentParser):
    """argparse with the contract's usage errors: one line, raised rather than printed."""

    def error(self, message: str) -> NoReturn:
        raise _Usage(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="p2phub",
        description="GPU peer-to-peer registration hub: GPU memory for NVMe SSDs and RDMA NICs.",
        epilog="P2PHUB_LOG=debug prints the package's log (and a traceback with any error) on stderr.",
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


def leaf_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                 ) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every runnable (sub)command: (words after `p2phub`, its parser), depth first."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, parser)]
    out = []
    seen: set[int] = set()
    for name, p in subs[0].choices.items():
        if id(p) in seen:  # an alias
            continue
        seen.add(id(p))
        out += leaf_parsers(p, path + (name,))
    return out


def _command_words(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The subcommand words of argv (`bench kv` of `bench kv --iters 0`), as far as they go."""
    words: list[str] = []
    for tok in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or tok not in subs[0].choices:
            if tok.startswith("-"):
                continue
            break
        words.append(tok)
        parser = subs[0].choices[tok]
    return words


def _stdout_gone() -> bool:
    """True when stdout is a pipe or socket whose reader has gone away."""
    try:
        fd = sys.stdout.fileno()
        p = select.poll()
        p.register(fd, select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _fd, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):   # not a real file (captured): it is there
        return False


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


def _fail(prog: str, code: Exit, message: str, as_json: bool) -> int:
    """The one error line on stderr (and, with --json, the error document on stdout)."""
    line = message if message.startswith(prog) else f"{prog}: {message}"
    print(line.replace("\n", " "), file=sys.stderr, flush=True)
    if as_json:
        try:
            print(json.dumps({"schema": ERROR_SCHEMA, "command": prog, "error": line,
                              "exit": int(code), "exit_name": code.name}), flush=True)
        except BrokenPipeError:
            _silence_stdout()
            return Exit.CLOSED_PIPE
    return code


def _classify(exc: BaseException) -> tuple[Exit, str]:
    """(exit code, one-line message) for an error a command let through."""
    if isinstance(exc, UsageError):
        return Exit.USAGE, str(exc)
    if isinstance(exc, MissingDependencyError):
        return Exit.NEEDS, str(exc)
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        from .deps import error_for
        return Exit.NEEDS, str(error_for(exc.name))
    if isinstance(exc, ModuleNotLoadedError):
        return Exit.NOT_LOADED, str(exc)
    if isinstance(exc, (P2PHubError, OSError, TimeoutError)):
        return Exit.FAIL, str(exc) or type(exc).__name__
    return Exit.FAIL, (f"internal error: {type(exc).__name__}: {exc} "
                       "(P2PHUB_LOG=debug shows the traceback)")


def _configure_logging() -> None:
    from .log import configure
    configure()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    prog = "p2phub"
    try:
        _configure_logging()
        parser = build_parser()   # imports every command: Ctrl-C may come here already
        prog = " ".join(["p2phub", *_command_words(parser, argv)])
        try:
            args = parser.parse_args(argv)
        except _Usage as exc:
            return _fail(prog, Exit.USAGE, str(exc), as_json)
        except SystemExit as exc:  # --help, --version
            return exc.code if isinstance(exc.code, int) else EXIT_USAGE
        if getattr(args, "_broken", None):
            return _fail(prog, Exit.FAIL, f"cannot load {args._broken}", as_json)
        if not getattr(args, "_run", None):
            parser.print_help()
            return EXIT_USAGE
        as_json = bool(getattr(args, "json", False))
        try:
            needs = getattr(args, "_needs", None)
            needs = list((needs(args) if callable(needs) else needs) or ())
            if getattr(args, "plot", None):
                needs.append("matplotlib")
            if needs:
                from .deps import check
                check(needs)
            check_args = getattr(args, "_check", None)
            if check_args is not None:
                check_args(args)
            log.debug("%s: running", prog)
            code = int(args._run(args) or Exit.OK)
            sys.stdout.flush()
            return code
        except (KeyboardInterrupt, BrokenPipeError):
            raise
        except Exception as exc:  # noqa: BLE001 - the contract: one line, never a traceback
            if isinstance(exc, OSError) and _stdout_gone():
                _silence_stdout()
                return Exit.CLOSED_PIPE
            code, message = _classify(exc)
            log.debug("%s failed", prog, exc_info=exc)
            return _fail(prog, code, message, as_json)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return Exit.INTERRUPTED
    except BrokenPipeError:
        if _stdout_gone():
            _silence_stdout()
            return Exit.CLOSED_PIPE
        return _fail(prog, Exit.FAIL, "broken pipe", as_json)


if __name__ == "__main__":
    sys.exit(main())
