"""pyloader cache warm when the data cannot be reached: its own exit code, and never silent."""

from __future__ import annotations

import socket

import pytest
from remote_util import closed_port

from pyloader.remote import cli as cache_cli
from pyloader.remote.cli import EXIT_OK, EXIT_UNREACHABLE, main


@pytest.mark.timeout(60)
def test_a_refused_connection_is_exit_4_not_done_in_part(cache_dir, capsys) -> None:
    url = f"http://127.0.0.1:{closed_port()}/ds"
    assert main(["cache", "warm", url, "--cache-dir", cache_dir]) == EXIT_UNREACHABLE
    assert url in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_server_that_never_answers_is_named_while_waiting(cache_dir, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cache_cli, "QUIET_S", 0.3)
    monkeypatch.setenv("PYLOADER_FETCH_ATTEMPTS", "2")
    monkeypatch.setenv("PYLOADER_FETCH_STALL_TIMEOUT", "1.5")
    with socket.socket() as silent:  # the kernel completes the handshake; nobody ever reads or answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/ds"
        code = main(["cache", "warm", url, "--cache-dir", cache_dir])
    err = capsys.readouterr().err
    assert code == EXIT_UNREACHABLE, err
    assert "no data for" in err and f"{url}/manifest.json" in err and "PYLOADER_FETCH_STALL_TIMEOUT" in err
    # What the waiting line promises is what the retries do: at most 2 attempts, and the last line says so.
    assert "up to 2 attempts and at most" in err and "retried until" not in err, err
    assert "gave up after 2 attempts" in err and "the limit of 2 attempts, PYLOADER_FETCH_ATTEMPTS" in err, err


def test_the_help_documents_exit_4(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["cache", "--help"])
    out = capsys.readouterr().out
    assert "4 cannot reach the data" in " ".join(out.split())


def test_a_reachable_dataset_prints_no_waiting_line(server, cache_dir, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cache_cli, "QUIET_S", 5.0)
    assert main(["cache", "warm", server.url + "/ds", "--cache-dir", cache_dir]) == EXIT_OK
    assert "no data for" not in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_bench_exits_as_cache_warm_does_for_the_same_refused_url(cache_dir, capsys) -> None:
    """See NOTE [exit codes]: the same condition, the same code, whichever command met it."""
    url = f"http://127.0.0.1:{closed_port()}/ds"
    from pyloader._cli import main as pyloader_main

    warm = pyloader_main(["cache", "warm", url, "--cache-dir", cache_dir])
    bench = pyloader_main(["bench", url, "--cache-dir", cache_dir, "--quiet", "--workload", "none"])
    err = capsys.readouterr().err
    assert warm == bench == EXIT_UNREACHABLE, err
    assert "pyloader bench: error:" in err and url in err
