"""`p2phub nvme list|bind|unbind|identify`: NVMe controllers and who drives them."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import P2PHubError
from ..pci import normalize

from ..exitcodes import Exit
from .argtypes import nvme_controller

SCHEMA = "p2phub.nvme/1"
CTRL_HELP = "the controller: its PCI address (0000:05:00.0 or 05:00.0) or its node (/dev/nvme0)"

EXIT_OK, EXIT_FAIL, EXIT_BUSY = Exit.OK, Exit.FAIL, Exit.BUSY


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="nvme_cmd", metavar="ACTION", required=True)
    p = sub.add_parser("list", help="NVMe controllers, their driver and namespaces")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("bind", help="hand a controller to p2phub (refused while a namespace is in use)")
    p.add_argument("bdf", type=nvme_controller, help=CTRL_HELP)
    p.add_argument("--allow-shared-subsystem", action="store_true",
                   help="bind although other controllers of its NVMe subsystem may reach the same namespaces "
                        "(still refused while one of them is seen in use)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("unbind", help="give a controller back to the kernel nvme driver")
    p.add_argument("bdf", type=nvme_controller, help=CTRL_HELP)
    p.add_argument("--driver", default="nvme", help="driver to give it to (default nvme; '' for none)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p = sub.add_parser("identify", help="bring the controller up and show Identify data")
    p.add_argument("bdf", type=nvme_controller, help=CTRL_HELP)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--keep-bound", action="store_true",
                   help="leave it on p2phub-nvme (default: back to the driver it had)")


def _emit(args: argparse.Namespace, data: dict, text: str) -> None:
    if args.json:
        print(json.dumps({"schema": SCHEMA, **data}, indent=2))
    else:
        print(text)


def run(args: argparse.Namespace) -> int:
    from ..nvme import bind
    from ..nvme.errors import ControllerBusyError

    try:
        if args.nvme_cmd == "list":
            ctrls = bind.list_controllers()
            rows = [c.as_dict() for c in ctrls]
            text = "\n".join(f"{c.bdf}  {c.driver or '-':12} {c.model or '?':24} {c.serial or '':20} "
                             f"{' '.join(c.namespaces)}" for c in ctrls) or "no NVMe controllers"
            _emit(args, {"controllers": rows}, text)
        elif args.nvme_cmd == "bind":
            before = bind.bind(args.bdf, allow_shared_subsystem=args.allow_shared_subsystem)
            _emit(args, {"bdf": normalize(args.bdf), "driver": bind.DRIVER, "previous": before},
                  f"{args.bdf}: now on {bind.DRIVER} (was {before or 'unbound'})")
        elif args.nvme_cmd == "unbind":
            bind.unbind(args.bdf, driver=args.driver)
            drv = bind.current_driver(normalize(args.bdf))
            _emit(args, {"bdf": normalize(args.bdf), "driver": drv},
                  f"{args.bdf}: now on {drv or 'no driver'}")
        elif args.nvme_cmd == "identify":
            from ..nvme import controller

            bdf = normalize(args.bdf)
            before = bind.current_driver(bdf)
            try:
                with controller.open(bdf) as ctrl:
                    info = ctrl.info()
            finally:
                if not args.keep_bound and before not in (None, bind.DRIVER):
                    bind.unbind(bdf, driver=before)
            c = info["controller"]
            lines = [f"{bdf}: {c['model']} serial {c['serial']} firmware {c['firmware']} NVMe {c['version']}",
                     f"  MQES {info['cap']['mqes']}  DSTRD {info['cap']['dstrd']}  TO {info['cap']['timeout_s']} s"
                     f"  MDTS {c['mdts']} ({info['max_transfer'] // 1024} KiB)  MSI-X {info['msix_vectors']}"
                     f"  I/O queues granted {info['queues_granted']}"]
            lines += [f"  nsid {n['nsid']}: {n['blocks']} blocks of {n['lba_size']} B ({n['bytes'] >> 20} MiB)"
                      for n in info["namespaces"]]
            lines += [f"  nsid {k}: not used: {why}" for k, why in info.get("skipped_namespaces", {}).items()]
            _emit(args, info, "\n".join(lines))
    except ControllerBusyError as exc:
        if args.json:
            print(json.dumps({"schema": SCHEMA, "error": str(exc), "busy": exc.reasons}))
        else:
            print(f"p2phub nvme: {exc.bdf} is in use, not binding:", file=sys.stderr)
            for r in exc.reasons:
                print(f"  - {r}", file=sys.stderr)
        return EXIT_BUSY
    except P2PHubError as exc:
        if args.json:
            print(json.dumps({"schema": SCHEMA, "error": str(exc)}))
        else:
            print(f"p2phub nvme: {exc}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK
