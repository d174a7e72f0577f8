"""Only what pyproject.toml cannot say: the wheel carries the NVMe hot path compiled.

cffi (a build requirement) writes the C source of ``p2phub.nvme._hotlib`` from the definition in
``p2phub/nvme/_hot_build.py``; setuptools compiles it like any extension. The runtime build in
``p2phub/nvme/_build.py`` is only the fallback for a checkout whose C sources changed.
"""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
NVME = os.path.join("p2phub", "nvme")


def _hot_build():
    spec = importlib.util.spec_from_file_location("_hot_build", os.path.join(HERE, NVME, "_hot_build.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildExt(build_ext):
    """Write the cffi C source into the build directory just before compiling it."""

    def build_extension(self, ext):
        if ext.name == "p2phub.nvme._hotlib":
            hb = _hot_build()
            c_file = os.path.join(self.build_temp, "_hotlib.c")
            os.makedirs(self.build_temp, exist_ok=True)
            hb.make_ffi(hb.MODULE).emit_c_code(c_file)
            ext.sources = [c_file]
        super().build_extension(ext)


setup(
    ext_modules=[Extension("p2phub.nvme._hotlib", sources=["(written by BuildExt)"], include_dirs=[NVME],
                           extra_compile_args=["-O2", "-std=gnu11", "-Wall"])],
    cmdclass={"build_ext": BuildExt},
)
