"""Kernel log reports that mean something went wrong in the kernel.

Used by the lab runner (a whole run) and by lab tests (one test's share of the log).
"""

from __future__ import annotations

import re
import subprocess

BAD = re.compile(
    r"WARNING:|BUG:|Oops|KASAN|kmemleak|UBSAN|general protection fault|Kernel panic"
    r"|refcount_t:|list_add corruption|list_del corruption|INFO: task .* blocked"
    r"|p2phub: leak|unreferenced object|Call Trace:"
)


def bad_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if BAD.search(line)]


def read() -> list[str]:
    """The kernel ring buffer, one line per message (needs root)."""
    out = subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout
    return out.splitlines()
