"""Only what pyproject.toml cannot say: the wheel carries p2phub's C hot paths compiled.

cffi (a build requirement) writes the C source of each module in ``HOT_PATHS`` of
``p2phub/_cffi_build.py`` (the NVMe engine, ``p2phub.nvme._hotlib``, and the KV transfer path,
``p2phub.kv._kvhotlib``); setuptools compiles them like any extension. The runtime build in
``p2phub/_cffi_build.py`` is only the fallback for a checkout whose C sources changed.
"""

import importlib.util
import os

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


setup(
    ext_modules=[Extension(hp.module, sources=["(written by BuildExt)"],
                           include_dirs=[os.path.relpath(hp.dir, HERE)],
                           extra_compile_args=CFFI.COMPILE_ARGS, extra_link_args=["-pthread"])
                 for hp in CFFI.HOT_PATHS],
    cmdclass={"build_ext": BuildExt},
)
