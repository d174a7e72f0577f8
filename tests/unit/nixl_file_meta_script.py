"""One table of FILE registration metas through one NIXL API:

    python nixl_file_meta_script.py --impl adapter|plugin|posix --dir TMP [--plugin-dir DIR]

adapter: p2phub.nixl; plugin: the real NIXL (pip nixl_cu12) loading libplugin_P2PHUB.so from
DIR as POSIX; posix: the real NIXL with its own POSIX plugin. Each meta is registered with
devId = an open fd of file X, and its path (where it has one) names file Y; a 4 KiB READ then
shows which file the registration reads: "path" (Y), "fd" (X), or the exception class of
the registration. Prints one JSON line {meta: outcome}; the test compares the three.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import stat
from pathlib import Path

from nixl_impls import agent_api, finish

BLK = 4096


def metas(d: Path) -> list[str]:
    y = d / "Y.bin"
    return [
        f"rw:{y}", f"ro:{y}", f"ro,direct:{y}", f"rw,sync,noatime:{y}", f"direct,rw:{y}",
        f"rw:{y.relative_to(Path.cwd())}" if y.is_relative_to(Path.cwd()) else f"rw:{y}",
        f"ro,rw:{y}", f"rw,fast:{y}", f"rw,direct,direct:{y}",
        "ro:", "", str(y), "rw", f"rwx:{y}", f"ro:{d / 'missing.bin'}", f"ro:{d / 'link.bin'}",
        f"rw,create:{d / 'new.bin'}",
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", choices=("adapter", "plugin", "posix"), required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--plugin-dir")
    args = ap.parse_args()
    d = Path(args.dir)
    nixl_agent, nixl_agent_config = agent_api(args.impl, args.plugin_dir)  # noqa: N806
    (d / "X.bin").write_bytes(b"X" * BLK)
    (d / "Y.bin").write_bytes(b"Y" * BLK)
    link = d / "link.bin"
    if not link.exists():
        link.symlink_to(d / "Y.bin")
    fd_x = os.open(d / "X.bin", os.O_RDWR)
    agent = nixl_agent("meta", nixl_agent_config(backends=[]))
    agent.create_backend("POSIX")
    m = mmap.mmap(-1, BLK)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    agent.register_memory([(base, BLK, 0, "")], "DRAM")
    out: dict[str, str] = {}
    for meta in metas(d):
        try:
            reg = agent.register_memory([(0, BLK, fd_x, meta)], "FILE")
        except Exception as exc:  # noqa: BLE001 - the class is the outcome
            out[meta] = type(exc).__name__
            continue
        m[:] = b"\0" * BLK
        try:
            h = agent.initialize_xfer("READ", agent.get_xfer_descs([(base, BLK, 0)], "DRAM"),
                                      agent.get_xfer_descs([(0, BLK, fd_x)], "FILE"), "meta")
            st = finish(agent, h)
            agent.release_xfer_handle(h)
            got = m[:1]
            out[meta] = "read-failed" if st != "DONE" else \
                {b"X": "fd", b"Y": "path"}.get(got, repr(got))
        except Exception as exc:  # noqa: BLE001
            out[meta] = "read-failed"
        agent.deregister_memory(reg)
    new = d / "new.bin"
    out["new.mode"] = oct(stat.S_IMODE(new.stat().st_mode)) if new.exists() else "absent"
    print(json.dumps(out), flush=True)
    os.close(fd_x)
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
