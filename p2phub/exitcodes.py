"""One table of exit codes for every `p2phub` command (documented in docs/cli.md).

A code means the same thing whichever subcommand returns it; a command uses the subset that applies
to it (``USED_BY``). Scripts may test for any of them.
"""

from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    OK = 0           # done; doctor: no FAIL (and, with --strict, no WARN)
    FAIL = 1         # the command failed, or the doctor found something that blocks P2P
    WARN = 2         # doctor --strict: warnings, nothing blocking
    UNKNOWN = 3      # doctor: no FAIL, but a key check could not be decided
    USAGE = 4        # bad command line or arguments (argparse's own 2 is mapped here)
    NOT_LOADED = 5   # p2phub.ko is not loaded (/dev/p2phub absent)
    BUSY = 6         # nvme bind: the controller is in use by the kernel (mounted, swap, held)
    NEEDS = 7        # an optional package, or the hardware asked for, is not on this host
    INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT), the code shells give such a process
    CLOSED_PIPE = 141  # the reader of stdout went away (`| head`): SIGPIPE's code, 128 + 13


MEANING = {
    Exit.OK: "success; doctor: no FAIL (with --strict: no WARN either)",
    Exit.FAIL: "the command failed; doctor: at least one FAIL (something blocks P2P)",
    Exit.WARN: "doctor --strict: warnings, no FAIL",
    Exit.UNKNOWN: "doctor: no FAIL, but a key check is UNKNOWN (run as root, or see the report)",
    Exit.USAGE: "usage error: unknown command, bad option or argument",
    Exit.NOT_LOADED: "p2phub.ko is not loaded (/dev/p2phub absent)",
    Exit.BUSY: "nvme bind: the controller is in use (a namespace is mounted, swap or held)",
    Exit.NEEDS: "needs a package or hardware this host lacks (named, with the line that installs it)",
    Exit.INTERRUPTED: "stopped by Ctrl-C (SIGINT): one line on stderr, no traceback",
    Exit.CLOSED_PIPE: "stdout was closed early by its reader (e.g. `| head`): silent, SIGPIPE's 128 + 13",
}

# codes every command may return: the dispatcher (p2phub/cli.py) gives them
COMMON = (Exit.USAGE, Exit.NOT_LOADED, Exit.NEEDS, Exit.INTERRUPTED, Exit.CLOSED_PIPE)

# which command returns which codes (every command may also return those of COMMON)
USED_BY = {
    "p2phub": (Exit.OK, Exit.FAIL, Exit.USAGE),
    "info": (Exit.OK, Exit.FAIL, Exit.NOT_LOADED),
    "doctor": (Exit.OK, Exit.FAIL, Exit.WARN, Exit.UNKNOWN),
    "nvme": (Exit.OK, Exit.FAIL, Exit.BUSY),
    "kv": (Exit.OK, Exit.FAIL),
    "bench": (Exit.OK, Exit.FAIL),
    "top": (Exit.OK, Exit.FAIL),
    "nixl": (Exit.OK, Exit.FAIL, Exit.NEEDS),
}
