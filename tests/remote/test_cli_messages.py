"""``pyloader cache``'s messages name the object and the one fix, and its exit codes follow NOTE [exit codes].

Each test gives the input a user gave (a shard corrupt at the source, a --limit too small, a
--cache-dir typo, bad --storage-options, the command alone, a log that is no terminal) and
checks the message and the exit status.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from remote_util import child_env, closed_port

import pyloader
from pyloader.errors import EXIT_CODES, exit_code
from pyloader.remote.cli import EXIT_CACHE, EXIT_OK, EXIT_PARTIAL, EXIT_UNREACHABLE, EXIT_USAGE, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _flip_source_byte(srv_root: str, k: int) -> str:
    """Flips one byte of the ``k``-th shard file on the server's disk; returns its name."""
    path = sorted(glob.glob(os.path.join(srv_root, "ds", "shard-*.pyl")))[k]
    with open(path, "r+b") as f:
        f.seek(200)
        b = f.read(1)
        f.seek(200)
        f.write(bytes([b[0] ^ 1]))
    return os.path.basename(path)


@pytest.mark.timeout(60)
def test_a_shard_corrupt_at_the_source_says_so_and_is_not_counted(server, srv_root, cache_dir, capsys) -> None:
    name = _flip_source_byte(srv_root, 3)
    url = server.url + "/ds"
    code = main(["cache", "warm", url, "--cache-dir", cache_dir, "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == EXIT_PARTIAL and r["downloaded"] == 15 and len(r["failed"]) == 1
    err = r["failed"][0]["error"]
    assert name in err and r["failed"][0]["url"].endswith(name)
    assert "do not match the manifest's checksum" in err and "corrupt at the source" in err
    assert "re-upload that shard" in err and "will not help" in err and "changed after" not in err
    # The summary counts the 15 shards now cached, not the bytes received for the corrupt one.
    sizes = {os.path.basename(p): os.path.getsize(p) for p in glob.glob(os.path.join(srv_root, "ds", "shard-*"))}
    assert r["bytes_downloaded"] == sum(sizes.values()) - sizes[name]
    assert r["bytes_received"] >= r["bytes_downloaded"] + 2 * sizes[name]  # both attempts arrived
    # The same from the Python API: a RemoteCorruptError (a FetchError), not a RemoteChangedError.
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    with pytest.raises(pyloader.PyloaderError) as ei:
        list(ds.batches(32))
    assert "corrupt at the source" in str(ei.value)
    ds._fetcher.close()


@pytest.mark.timeout(60)
def test_the_text_summary_counts_only_good_downloads(server, srv_root, cache_dir, capsys) -> None:
    _flip_source_byte(srv_root, 0)
    assert main(["cache", "warm", server.url + "/ds", "--cache-dir", cache_dir, "--quiet"]) == EXIT_PARTIAL
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    selected = float(head.split(" shards (")[1].split(" KB")[0])
    downloaded = float(head.split(" downloaded (")[1].split(" KB")[0])
    assert "15 downloaded" in head and "1 failed" in head and downloaded < selected, head


@pytest.mark.timeout(60)
def test_a_limit_too_small_is_said_in_the_units_it_was_given(server, cache_dir, capsys) -> None:
    assert main(["cache", "warm", server.url + "/ds", "--cache-dir", cache_dir, "--limit", "10K"]) == EXIT_CACHE
    err = capsys.readouterr().err
    assert "more than --limit 10 KiB" in err and "give a --limit of at least" in err, err
    assert "10240" not in err


@pytest.mark.timeout(60)
def test_bad_storage_options_name_the_option(server, cache_dir, capsys) -> None:
    for bad, words in (("{bad json", "is not JSON"), ("[1, 2]", "is not a JSON object")):
        code = main(["cache", "warm", server.url + "/ds", "--cache-dir", cache_dir, "--storage-options", bad])
        err = capsys.readouterr().err
        assert code == EXIT_USAGE and f"--storage-options {bad!r} {words}" in err and '{"anon": true}' in err, err


@pytest.mark.timeout(60)
def test_a_missing_dataset_says_what_to_do(server, cache_dir, capsys) -> None:
    assert main(["cache", "warm", server.url + "/nothere", "--cache-dir", cache_dir]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "no manifest at" in err and "check the URL" in err and "pyloader convert SRC" in err, err


def test_a_cache_dir_that_does_not_exist_is_a_usage_error(tmp_path, capsys) -> None:
    typo = str(tmp_path / "typo")
    for cmd in ("ls", "stats", "verify", "evict", "clear"):
        assert main(["cache", cmd, "--cache-dir", typo]) == EXIT_USAGE, cmd
        err = capsys.readouterr().err
        assert f"--cache-dir {typo!r}: no such folder" in err, err
    os.mkdir(typo)  # an empty cache folder is an empty cache
    assert main(["cache", "stats", "--cache-dir", typo]) == EXIT_OK


def test_the_command_alone_lists_the_commands() -> None:
    r = subprocess.run([sys.executable, "-m", "pyloader", "cache"], capture_output=True, text=True, timeout=60,
                       env=child_env(ROOT))
    assert r.returncode == EXIT_USAGE and r.stdout == ""
    assert "name a command: warm, ls, stats, verify, evict, clear" in r.stderr and "cache_cmd" not in r.stderr


def test_warm_options_say_their_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["cache", "warm", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for words in ("(default 0)", "(default global)", "(default 65536)", "(default pad)", "--quiet", "JSON object"):
        assert words in out, words


@pytest.mark.timeout(60)
def test_warm_logs_progress_when_stderr_is_no_terminal(server, cache_dir) -> None:
    """A job's log (stderr a file or pipe) gets progress lines without --progress, as convert's does."""
    cmd = [sys.executable, "-m", "pyloader", "cache", "warm", server.url + "/ds", "--cache-dir", cache_dir]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=child_env(ROOT))
    assert r.returncode == EXIT_OK, r.stderr
    assert "16/16 shards" in r.stderr and "\r" not in r.stderr
    r = subprocess.run([*cmd, "--quiet"], capture_output=True, text=True, timeout=60, env=child_env(ROOT))
    assert r.returncode == EXIT_OK and r.stderr == ""


@pytest.mark.timeout(60)
def test_giving_up_names_the_bound_that_ended_the_retries(cache_dir, capsys, monkeypatch) -> None:
    monkeypatch.setenv("PYLOADER_FETCH_ATTEMPTS", "3")
    url = f"http://127.0.0.1:{closed_port()}/ds"
    assert main(["cache", "warm", url, "--cache-dir", cache_dir]) == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    assert "gave up after 3 attempts" in err and "the limit of 3 attempts, PYLOADER_FETCH_ATTEMPTS" in err, err
    assert "check that the server is running" in err  # nothing listens: refused (issue 40 item 15)


def test_one_table_of_exit_codes() -> None:
    """The same condition, the same code, whichever command met it (NOTE [exit codes])."""
    fetch = pyloader.FetchError(111, "refused")
    missing = pyloader.FetchNotFoundError(2, "404")
    assert exit_code(fetch) == EXIT_UNREACHABLE and exit_code(missing) == EXIT_USAGE
    assert exit_code(pyloader.RemoteCorruptError(5, "bad bytes")) == EXIT_PARTIAL
    assert exit_code(pyloader.RemoteChangedError(5, "changed")) == EXIT_PARTIAL
    assert exit_code(pyloader.CacheLimitError("small")) == EXIT_CACHE
    assert exit_code(pyloader.ManifestNotFoundError(2, "none")) == EXIT_USAGE
    assert exit_code(pyloader.VerifyError("differs")) == 5
    assert exit_code(pyloader.ShardCorruptError("bad")) == 1 and exit_code(ValueError("bad option")) == EXIT_USAGE
    assert exit_code(KeyboardInterrupt()) == 130 and exit_code(RuntimeError("bug")) is None
    assert all(issubclass(cls, BaseException) for cls, _ in EXIT_CODES)
