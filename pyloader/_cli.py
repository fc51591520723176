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

from .bench.cli import add_bench_parser, run_bench
from .errors import EXIT_HELP, EXIT_USAGE, exit_code
from .remote.cli import add_cache_parser, run_cache
from .write.cli import add_convert_parser, run_convert


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
    add_bench_parser(sub)
    add_cache_parser(sub)
    add_convert_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        ap.print_help(sys.stderr)
        return EXIT_USAGE
    args, extra = ap.parse_known_args(argv)
    if extra:  # the command's parser owns the message, so the user sees that command's usage
        _deepest_parser(ap, args).error(f"unrecognized arguments: {' '.join(extra)}")
    run = {"bench": run_bench, "cache": run_cache, "convert": run_convert}.get(args.cmd)
    if run is None:
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
