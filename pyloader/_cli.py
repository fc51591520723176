"""The ``pyloader`` command line: dispatch only.

Each command lives with its stage: ``pyloader bench`` in pyloader/bench/cli.py,
``pyloader cache`` in pyloader/remote/cli.py, ``pyloader convert`` in pyloader/write/cli.py.
"""

from __future__ import annotations

import argparse
import sys

from .bench.cli import add_bench_parser, run_bench
from .remote.cli import add_cache_parser, run_cache
from .write.cli import add_convert_parser, run_convert


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pyloader", description="pyloader: a data-loading engine for PyTorch")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_bench_parser(sub)
    add_cache_parser(sub)
    add_convert_parser(sub)
    args = ap.parse_args(argv)
    if args.cmd == "bench":
        return run_bench(args)
    if args.cmd == "cache":
        return run_cache(args)
    if args.cmd == "convert":
        return run_convert(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
