"""The cffi definition of the NVMe hot path (``_hot.h`` + ``_hot.c``), in API mode.

Two users, one definition:

- the wheel build: ``setup.py`` has cffi write the C source of ``p2phub.nvme._hotlib`` from it
  and setuptools compiles that into the wheel (setup.py loads this file by path, so it imports
  nothing from the package);
- ``_build.py``'s developer fallback, which compiles the same definition at first use when no
  compiled module matches the sources (a checkout where ``_hot.c`` was just edited).

The compiled module answers ``p2phub_hot_tag()``: a hash of the two sources it was built from, so a
stale build is never loaded.
"""

from __future__ import annotations

import hashlib
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
MODULE = "p2phub.nvme._hotlib"
SOURCES = ("_hot.h", "_hot.c")


def sources_tag() -> str:
    h = hashlib.sha256()
    for name in SOURCES:
        with open(os.path.join(HERE, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def cdef() -> str:
    """The declarations of _hot.h, stripped to what cffi's parser takes."""
    with open(os.path.join(HERE, "_hot.h")) as f:
        text = f.read()
    return re.sub(r"/\*.*?\*/", "", text, flags=re.S)


def make_ffi(module_name: str):  # -> cffi.FFI
    import cffi  # a build-time (and developer-fallback) dependency only

    ffi = cffi.FFI()
    ffi.cdef(cdef() + "\nconst char *p2phub_hot_tag(void);\n")
    # _hot.c includes _hot.h and the system headers it needs.
    ffi.set_source(
        module_name,
        '#include "_hot.c"\n'
        f'const char *p2phub_hot_tag(void) {{ return "{sources_tag()}"; }}\n',
        include_dirs=[HERE],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    )
    return ffi
