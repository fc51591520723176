"""The top-level ``pyloader`` command: bare, --version, and usage errors inside a command."""

from __future__ import annotations

import subprocess
import sys

import pytest

import pyloader
from pyloader._cli import main


def test_bare_pyloader_lists_the_commands_and_exits_2(capsys) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "required" not in err
    for cmd in ("bench", "cache", "convert"):
        assert cmd in err


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0
    assert capsys.readouterr().out.strip() == f"pyloader {pyloader.__version__}"


def test_an_unknown_flag_of_a_subcommand_shows_that_usage(capsys) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["cache", "ls", "--bogus"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pyloader cache ls" in err and "unrecognized arguments: --bogus" in err


@pytest.mark.timeout(120)
def test_python_dash_m_pyloader_bare() -> None:
    r = subprocess.run([sys.executable, "-m", "pyloader"], capture_output=True, text=True, timeout=100)
    assert r.returncode == 2 and "convert" in r.stderr and "Traceback" not in r.stderr


def test_the_help_gives_the_one_table_of_exit_codes(capsys) -> None:
    """See NOTE [exit codes] in pyloader/errors.py: the same condition exits with the same code from every command."""
    with pytest.raises(SystemExit) as ei:
        main(["--help"])
    assert ei.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for words in ("2 bad usage", "3 the cache cannot take the data", "4 cannot reach the data",
                  "5 verification found a difference", "130 interrupted"):
        assert words in out, words
