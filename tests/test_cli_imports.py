"""``pyloader --version`` and ``--help`` import no torch (issue 27, item 15): each command's module
loads only when that command is named, and bench's parser is built without its measuring modules."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pyloader import _cli

# Runs main(argv) as the command line would, then prints whether torch (or a measuring
# module) was imported on the way.
PROBE = r"""
import sys
from pyloader._cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("RESULT", code, "torch" in sys.modules, "pyloader.bench.stages" in sys.modules, file=sys.stderr)
"""


def probe(*argv: str) -> tuple[str, str]:
    r = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    result = [ln for ln in r.stderr.splitlines() if ln.startswith("RESULT ")]
    assert result, r.stderr
    return result[-1], r.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["bench", "--help"], ["convert", "--help"],
                                  ["cache", "--help"], ["cache", "warm", "--help"]])
def test_help_and_version_import_no_torch(argv: list[str]) -> None:
    result, out = probe(*argv)
    assert result == "RESULT 0 False False", (argv, result)
    assert out.strip(), argv


@pytest.mark.timeout(120)
def test_python_dash_m_pyloader_version_imports_no_torch() -> None:
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "pyloader", "--version"], capture_output=True,
                       text=True, timeout=100)
    assert r.returncode == 0 and r.stdout.startswith("pyloader "), r.stderr[-2000:]
    imported = {ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines() if ln.startswith("import time:")}
    assert "pyloader._cli" in imported
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}
    assert not {m for m in imported if m.endswith(".cli") and m.startswith("pyloader.")}  # no command's module


@pytest.mark.timeout(300)
def test_a_bad_bench_option_is_still_checked_before_torch_loads() -> None:
    result, _ = probe("bench", "--records", "0")
    assert result == "RESULT 2 False False", result


def test_each_commands_one_line_help_is_the_one_its_parser_gives() -> None:
    """The top level lists a command from ``_cli._COMMANDS`` without importing it: the line must
    be the one the command's own parser declares."""
    for name, line in _cli._COMMANDS.items():
        ap = argparse.ArgumentParser(prog="pyloader")
        sub = ap.add_subparsers(dest="cmd")
        add_parser, _run = _cli._command(name)
        add_parser(sub)
        helps = {a.dest: a.help for a in sub._choices_actions}
        assert helps == {name: line}, name
