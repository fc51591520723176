"""The ``pyloader`` command line: dispatch only.

Each command lives with its stage: ``pyloader bench`` in pyloader/bench/cli.py,
``pyloader cache`` in pyloader/remote/cli.py, ``pyloader convert`` in pyloader/write/cli.py.
``pyloader`` alone prints the help (the commands) and exits 2; ``--version`` prints the
version. A usage error inside a command prints that command's usage, not the top level's.

Every command exits with the codes of one table, NOTE [exit codes] in pyloader/errors.py
(``exit_code(exc)``): an error a command's ``run_*`` lets through is printed and mapped by
it here, so the same condition exits with the same code whichever command met it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from .errors import EXIT_HELP, EXIT_USAGE, exit_code

# Each command's module is imported only when that command is named: `pyloader --version`
# and `pyloader --help` import none of them (bench's imports torch as it runs, not before).
# The other commands get a parser with only their one-line help, for the top level's help.
_COMMANDS = {
    "bench": "measure the data path, stage by stage (default: a generated dataset)",
    "cache": "the node-local shard cache of remote datasets",
    "convert": "convert Parquet/Arrow, numpy, a folder of files or WebDataset tars to pyloader shards",
}


def _command(name: str) -> tuple[Callable[[Any], object], Callable[[argparse.Namespace], int]]:
    """(add_parser, run) of command ``name``, its module imported now."""
    if name == "bench":
        from .bench.cli import add_bench_parser, run_bench

        return add_bench_parser, run_bench
    if name == "cache":
        from .remote.cli import add_cache_parser, run_cache

        return add_cache_parser, run_cache
    from .write.cli import add_convert_parser, run_convert

    return add_convert_parser, run_convert


def _version() -> str:
    from ._version import __version__

    return __version__


def _deepest_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser that ``args`` reached: the one whose usage fits an error in them."""
    while True:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions:
            return parser
        name = getattr(args, actions[0].dest, None)
        child = actions[0].choices.get(name) if name is not None else None
        if child is None:
            return parser
        parser = child


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default ``sys.argv[1:]``), runs the command and returns its exit code."""
    ap = argparse.ArgumentParser(prog="pyloader", description="pyloader: a data-loading engine for PyTorch",
                                 epilog=EXIT_HELP)
    ap.add_argument("--version", action="version", version=f"pyloader {_version()}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND", title="commands")
    argv = sys.argv[1:] if argv is None else list(argv)
    named = next((a for a in argv if not a.startswith("-")), None)  # the top level's options take no value
    run: Callable[[argparse.Namespace], int] | None = None
    for name, help_line in _COMMANDS.items():
        if name == named:
            add_parser, run = _command(name)
            add_parser(sub)
        else:
            sub.add_parser(name, help=help_line)
    if not argv:
        ap.print_help(sys.stderr)
        return EXIT_USAGE
    args, extra = ap.parse_known_args(argv)
    if extra:  # the command's parser owns the message, so the user sees that command's usage
        _deepest_parser(ap, args).error(f"unrecognized arguments: {' '.join(extra)}")
    if run is None or args.cmd != named:
        ap.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(run(args))
    except BaseException as e:  # See NOTE [exit codes]: what a command let through gets the table's code
        code = exit_code(e)
        if code is None or isinstance(e, SystemExit):
            raise
        print(f"pyloader {args.cmd}: error: {'interrupted' if isinstance(e, KeyboardInterrupt) else e}",
              file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
