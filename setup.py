"""Builds the native extension ``pyloader._C`` from ``csrc/``.

The extension is a plain pybind11 module: it is not built against libtorch, and it
reaches CUDA (when present) at run time, so one build runs with and without a GPU.
"""

from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("PYLOADER_BUILD_JOBS", default=0).install()  # compile sources in parallel

sources = sorted(glob("csrc/core/*.cpp")) + sorted(glob("csrc/bindings/*.cpp"))

ext = Pybind11Extension(
    "pyloader._C",
    sources,
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
    libraries=["dl"],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
