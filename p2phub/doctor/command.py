"""`p2phub doctor`: the command-line entry point (registered by p2phub/cli.py)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tarfile
import tempfile

from .. import __version__
from .core import EXIT_FAIL, EXIT_OK, diagnose
from ..commands.argtypes import non_negative, positive
from ..commands.progress import activity
from ..errors import UsageError
from .sysroot import SysRoot


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the versioned JSON report on stdout")
    parser.add_argument("--root", metavar="DIR",
                        help="read a captured sysfs/procfs tree (a directory or a .tar.gz made by --capture) "
                             "instead of the live system")
    parser.add_argument("--capture", metavar="DIR",
                        help="copy what the doctor reads on this machine into DIR (new or empty), for --root "
                             "elsewhere; run as root for full PCI config space (ACS/ATS)")
    parser.add_argument("--tar", action="store_true", help="with --capture: also write DIR.tar.gz")
    parser.add_argument("--strict", action="store_true", help="exit 2 when there are warnings")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every check and its evidence")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing; the exit code is the answer")
    parser.add_argument("--active", action="store_true",
                        help="confirm a GPU<->NVMe pair with a small real DMA and a checksum (needs p2phub.ko, "
                             "root and --active-nvme)")
    parser.add_argument("--active-nvme", metavar="BDF",
                        help="the NVMe controller --active may take from the kernel nvme driver for the test "
                             "(refused when a namespace is mounted, swapped on or held)")
    parser.add_argument("--active-gpu", metavar="ID|BDF", help="the GPU to test with (default: the first that pairs)")
    parser.add_argument("--active-lba", metavar="LBA", type=non_negative,
                        help="first LBA of namespace 1 to use (default 0; required with --active-write)")
    parser.add_argument("--active-bytes", metavar="N", type=positive, default=64 << 10,
                        help="bytes to move (default 65536, at most 4 MiB)")
    parser.add_argument("--active-write", action="store_true",
                        help="also write: GPU -> SSD over the --active-lba range (declared scratch; its contents "
                             "are restored afterwards), then read it back")
    parser.add_argument("--explain", metavar="CHECK_ID", help="print what a check means and exit")
    parser.add_argument("--no-color", action="store_true", help="no colours (NO_COLOR is honoured too)")


# what a captured tree (or a live /) has, at least one of
CAPTURE_MARKS = ("p2phub-capture.json", "proc/cpuinfo", "sys/bus/pci")


def _open_root(path: str) -> tuple[str, str | None]:
    """(root dir, temp dir to remove) for --root, extracting a tarball when given one."""
    if os.path.isdir(path):
        return path, None
    if os.path.isfile(path) and tarfile.is_tarfile(path):
        tmp = tempfile.mkdtemp(prefix="p2phub-doctor-")
        with tarfile.open(path) as tf:
            members = [m for m in tf.getmembers() if not (m.name.startswith("/") or ".." in m.name.split("/"))
                       and (m.isfile() or m.isdir() or m.issym())]
            if sys.version_info >= (3, 12):
                tf.extractall(tmp, members=members, filter="tar")
            else:
                tf.extractall(tmp, members=members)
        entries = os.listdir(tmp)
        root = os.path.join(tmp, entries[0]) if len(entries) == 1 and os.path.isdir(os.path.join(tmp, entries[0])) \
            and not os.path.exists(os.path.join(tmp, "proc")) else tmp
        return root, tmp
    raise FileNotFoundError(path)


def _capture(args: argparse.Namespace) -> int:
    from .capture import capture, write_tarball

    try:
        meta = capture(args.capture)
    except FileExistsError as exc:
        raise UsageError(f"--capture: {exc}")
    except OSError as exc:
        print(f"p2phub doctor: --capture {args.capture}: {exc}", file=sys.stderr)
        return EXIT_FAIL
    out = write_tarball(args.capture) if args.tar else args.capture
    if not args.quiet:
        print(out)
    if os.geteuid() != 0:
        print("p2phub doctor: not root: PCI config space is limited to 64 bytes (ACS/ATS unknown)", file=sys.stderr)
    if meta["unreadable"]:
        print(f"p2phub doctor: {len(meta['unreadable'])} file(s) unreadable (listed in p2phub-capture.json)",
              file=sys.stderr)
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    from .report import explain, render_json, render_rich

    if args.explain:
        text = explain(args.explain)
        if text is None:
            raise UsageError(f"unknown check id {args.explain!r}")
        print(text)
        return EXIT_OK
    if args.tar and not args.capture:
        raise UsageError("--tar needs --capture")
    if args.capture:
        if args.root or args.active:
            raise UsageError("--capture reads the live system; it takes neither --root nor --active")
        return _capture(args)
    opts = None
    if args.active_nvme or args.active_write or args.active_lba is not None or args.active_gpu:
        if not args.active:
            raise UsageError("--active-* options need --active")
    if args.active:
        from .active import ActiveOptions, ActiveUsageError
        opts = ActiveOptions(nvme=args.active_nvme, gpu=args.active_gpu, lba=args.active_lba,
                             nbytes=args.active_bytes, write=args.active_write)
        try:
            opts.validate()
        except ActiveUsageError as exc:
            raise UsageError(str(exc)) from None
    tmp = None
    try:
        root = "/"
        if args.root:
            try:
                root, tmp = _open_root(args.root)
            except (FileNotFoundError, tarfile.TarError, OSError) as exc:
                raise UsageError(f"--root {args.root}: not a directory or tarball ({exc})")
            if not any(os.path.exists(os.path.join(root, p)) for p in CAPTURE_MARKS):
                raise UsageError(f"--root {args.root}: not a capture (it has none of "
                                 f"{', '.join(CAPTURE_MARKS)}; make one with `p2phub doctor --capture DIR`)")
        sr = SysRoot(root)
        with activity(args, "p2phub doctor --active: a real DMA between GPU and SSD" if args.active
                      else "p2phub doctor"):
            rep = diagnose(sr, active=args.active, active_opts=opts)
        code = rep.exit_code(strict=args.strict)
        if args.quiet:
            return code
        if args.json:
            render_json(rep, __version__)
        else:
            color = False if (args.no_color or os.environ.get("NO_COLOR")) else None
            render_rich(rep, verbose=args.verbose, color=color)
        return code
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
