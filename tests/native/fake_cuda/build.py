"""Builds the stand-in CUDA driver (fake_cuda.c) into ``<dest>/libcuda.so.1``.

Used by tests/native/test_fake_driver.py: a process started with ``LD_LIBRARY_PATH=<dest>``
then finds it where pyloader's ``dlopen("libcuda.so.1")`` looks. See fake_cuda.c for what
the stand-in models and checks.
"""

from __future__ import annotations

import os
import shutil
import subprocess

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_cuda.c")


def compiler() -> str | None:
    """The C compiler to use ($CC, cc or gcc), or None when there is none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build(dest: str) -> str:
    """Compiles the stand-in into ``dest/libcuda.so.1`` and returns that path.

    Raises RuntimeError (with the compiler's output) when compilation fails and
    FileNotFoundError when there is no C compiler."""
    cc = compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler (cc, gcc or clang) on PATH")
    os.makedirs(dest, exist_ok=True)
    out = os.path.join(dest, "libcuda.so.1")
    cmd = [cc, "-shared", "-fPIC", "-O1", "-pthread", "-Wall", "-Wextra", "-Werror", "-std=gnu11",
           "-fvisibility=hidden", "-Wl,-soname,libcuda.so.1", "-o", out, SOURCE]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"building the fake CUDA driver failed ({' '.join(cmd)}):\n{res.stdout}{res.stderr}")
    return out
