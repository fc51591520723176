"""The package's version, in one module that imports nothing (``pyloader.__version__``, ``pyloader --version``).

It must match ``version`` in pyproject.toml.
"""

__version__ = "0.1.0"
