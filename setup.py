"""Only what pyproject.toml cannot say: the wheel carries p2phub's C hot paths compiled, and
p2phub's NIXL backend plugin (``p2phub/nixl/plugin/lib/libplugin_P2PHUB.so``) where it builds.

cffi (a build requirement) writes the C source of each module in ``HOT_PATHS`` of
``p2phub/_cffi_build.py`` (the NVMe engine, ``p2phub.nvme._hotlib``, and the KV transfer path,
``p2phub.kv._kvhotlib``); setuptools compiles them like any extension. The runtime build in
``p2phub/_cffi_build.py`` is only the fallback for a checkout whose C sources changed.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.realpath(__file__))


def _cffi_build():
    """p2phub/_cffi_build.py, loaded by path: it imports nothing from the package."""
    spec = importlib.util.spec_from_file_location("_p2phub_cffi_build", os.path.join(HERE, "p2phub", "_cffi_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CFFI = _cffi_build()
HOT = {hp.module: hp for hp in CFFI.HOT_PATHS}


class BuildExt(build_ext):
    """Write each module's cffi C source into the build directory just before compiling it."""

    def build_extension(self, ext):
        hp = HOT.get(ext.name)
        if hp is not None:
            c_file = os.path.join(self.build_temp, ext.name.rpartition(".")[2] + ".c")
            os.makedirs(self.build_temp, exist_ok=True)
            hp.make_ffi(hp.module).emit_c_code(c_file)
            ext.sources = [c_file]
        super().build_extension(ext)


class BuildPlugin(BuildExt):
    """The hot paths, then the NIXL plugin with its own Makefile (g++ and gcc only) into the
    build's p2phub/nixl/plugin/lib/. A plugin that does not build stops nothing: the rest
    installs, and the build says so (``p2phub nixl plugin-dir`` then names what is missing)."""

    def run(self):
        super().run()
        src = os.path.join(HERE, "p2phub", "nixl", "plugin")
        dest = os.path.join(self.build_lib if not self.inplace else HERE, "p2phub", "nixl",
                            "plugin", "lib")
        with tempfile.TemporaryDirectory() as out:
            p = subprocess.run(["make", "-s", "-C", src, f"OUT={out}"], capture_output=True,
                               text=True)
            lib = os.path.join(out, "libplugin_P2PHUB.so")
            if p.returncode != 0 or not os.path.exists(lib):
                print("p2phub: the NIXL plugin (p2phub/nixl/plugin) did not build; everything "
                      f"else installs:\n{p.stderr.strip()[-2000:]}", file=sys.stderr)
                return
            os.makedirs(dest, exist_ok=True)
            shutil.copy2(lib, os.path.join(dest, "libplugin_P2PHUB.so"))


setup(
    ext_modules=[Extension(hp.module, sources=["(written by BuildExt)"],
                           include_dirs=[os.path.relpath(hp.dir, HERE)],
                           extra_compile_args=CFFI.COMPILE_ARGS, extra_link_args=["-pthread"])
                 for hp in CFFI.HOT_PATHS],
    cmdclass={"build_ext": BuildPlugin},
)
