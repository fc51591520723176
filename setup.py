"""Builds the native extension ``pyloader._C`` from ``csrc/``.

The extension is a plain pybind11 module: it is not built against libtorch, and it
reaches CUDA (when present) at run time, so one build runs with and without a GPU. Where
libjpeg-turbo's headers are installed (Debian: libjpeg62-turbo-dev) it is linked for native
JPEG decoding; without them image fields are decoded by Pillow.
"""

import ctypes.util
import os
from glob import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ParallelCompile("PYLOADER_BUILD_JOBS", default=0).install()  # compile sources in parallel

sources = sorted(glob("csrc/core/*.cpp")) + sorted(glob("csrc/bindings/*.cpp"))


def _libjpeg() -> bool:
    """Whether to decode JPEG natively: libjpeg-turbo's headers and library are on this machine.

    ``PYLOADER_WITH_LIBJPEG=0`` builds without (image fields are then decoded by Pillow).
    """
    if os.environ.get("PYLOADER_WITH_LIBJPEG", "1") == "0":
        return False
    headers = any(os.path.exists(os.path.join(d, "jpeglib.h")) for d in ("/usr/include", "/usr/local/include"))
    if not headers or ctypes.util.find_library("jpeg") is None:
        return False
    # The crop and skip calls native decoding uses are libjpeg-turbo's (1.5 and later).
    for d in ("/usr/include", "/usr/local/include"):
        p = os.path.join(d, "jpeglib.h")
        if os.path.exists(p):
            with open(p, encoding="latin-1") as fh:
                return "jpeg_crop_scanline" in fh.read()
    return False


jpeg = _libjpeg()

ext = Pybind11Extension(
    "pyloader._C",
    sources,
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-unused-parameter"],
    extra_link_args=["-pthread"],
    libraries=["dl"] + (["jpeg"] if jpeg else []),
    define_macros=[("PYLOADER_WITH_LIBJPEG", "1")] if jpeg else [],
)

setup(ext_modules=[ext], cmdclass={"build_ext": build_ext})
