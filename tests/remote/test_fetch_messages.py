"""What a user sees when a remote dataset's server is wrong, absent, or the warm is stopped (issue 40).

Each test starts its own loopback server on 127.0.0.1 (or none, for a refused connection)
and runs what the user ran: a ``ShardDataset`` read or ``pyloader cache warm``, on both
transports (NOTE [transport choice]) where the transport moves the bytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from remote_servers import Fault
from remote_util import child_env, closed_port, temp_files

import pyloader
import pyloader._C as _C
from pyloader.errors import EXIT_INTERRUPTED, EXIT_UNREACHABLE
from pyloader.remote.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARD1 = "ds/shard-000001.pyl"


@pytest.fixture(params=["native", "fsspec"])
def transport(request, monkeypatch) -> str:
    if request.param == "native" and not _C.http_available()[0]:
        pytest.skip("no libcurl.so.4 here")
    monkeypatch.setenv("PYLOADER_TRANSPORT", request.param)
    return request.param


def _read_all(url: str, cache_dir: str) -> None:
    ds = pyloader.ShardDataset(url, cache_dir=cache_dir)
    for _ in ds.batches(32):
        pass


@pytest.mark.timeout(60)
def test_a_shard_short_on_the_server_fails_at_once_naming_both_sizes(server, srv_root, cache_dir, transport):
    """Item 13: the server's Content-Length is below the manifest's size: the object is wrong, which no
    retry changes; the message names the URL and both sizes, no internal class, no "host is up"."""
    size = os.path.getsize(os.path.join(srv_root, SHARD1))
    server.inject(SHARD1, Fault("truncate", times=None))  # a consistent answer of half the bytes
    t0 = time.monotonic()
    with pytest.raises(pyloader.ShardIOError) as ei:
        _read_all(server.url + "/ds", cache_dir)
    msg = str(ei.value)
    assert server.count(SHARD1) == 1, msg  # not retried
    assert f"{server.url}/{SHARD1}" in msg and f"is {size // 2} bytes, not the manifest's {size}" in msg, msg
    assert "_ShortBody" not in msg and "host is up" not in msg and "not retried" in msg, msg
    assert time.monotonic() - t0 < 15


@pytest.mark.timeout(60)
def test_a_server_gone_mid_read_is_refused_a_few_times_on_both_transports(server, cache_dir, transport):
    """Item 15: a refused connection is retried at most 3 times (not PYLOADER_FETCH_ATTEMPTS=4 of the
    fixture), in the same words on both transports."""
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir)  # the manifest is read now
    server.stop()
    with pytest.raises(pyloader.ShardIOError) as ei:
        for _ in ds.batches(32):
            pass
    msg = str(ei.value)
    assert "the connection was refused or the host is unreachable" in msg, msg
    assert "gave up after 3 attempts" in msg and "at most 3 attempts at a refused connection" in msg, msg
    assert "check that the server is running and that the URL's host and port are right" in msg, msg
    assert "ClientConnectorError" not in msg and "libcurl" not in msg, msg


@pytest.mark.timeout(60)
def test_nothing_listening_gives_one_prefix_and_few_attempts(cache_dir, capsys) -> None:
    """Item 15, as the user ran it: `pyloader cache warm` at a port nothing listens on."""
    url = f"http://127.0.0.1:{closed_port()}/ds"
    assert main(["cache", "warm", url, "--cache-dir", cache_dir]) == EXIT_UNREACHABLE
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("pyloader cache warm: ") for ln in lines), err
    assert f"{url}/manifest.json" in err and "refused" in err and "gave up after 3 attempts" in err, err
    assert "no data for" not in err  # a refused connection is not a silent one


@pytest.mark.timeout(60)
def test_the_waiting_line_has_the_commands_prefix(cache_dir, capsys, monkeypatch) -> None:
    """Item 15: the line printed while a server sends nothing has the same prefix as the error after it."""
    import socket

    from pyloader.remote import cli as cache_cli

    monkeypatch.setattr(cache_cli, "QUIET_S", 0.3)
    monkeypatch.setenv("PYLOADER_FETCH_ATTEMPTS", "1")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        code = main(["cache", "warm", f"http://127.0.0.1:{silent.getsockname()[1]}/ds", "--cache-dir", cache_dir])
    err = capsys.readouterr().err
    assert code == EXIT_UNREACHABLE and "no data for" in err, err
    assert all(ln.startswith("pyloader cache warm: ") for ln in err.splitlines() if ln.strip()), err


@pytest.mark.timeout(120)
def test_sigterm_to_cache_warm_exits_cleanly_and_leaves_no_temp(slow_server, tmp_path):
    """Item 16: SIGTERM (what a scheduler sends) ends `cache warm` as Ctrl-C does: exit 130, no temp file."""
    cache = str(tmp_path / "cache")
    p = subprocess.Popen([sys.executable, "-m", "pyloader", "cache", "warm", slow_server.url + "/ds",
                          "--cache-dir", cache, "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=child_env(ROOT), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not temp_files(cache):
            assert p.poll() is None and time.monotonic() < deadline, "no download started"
            time.sleep(0.02)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == EXIT_INTERRUPTED, err
    assert "pyloader cache warm: error: interrupted by SIGTERM" in err and "Traceback" not in err, err
    assert temp_files(cache) == []


@pytest.mark.timeout(120)
def test_no_credentials_for_s3_names_where_to_give_them(tmp_path, monkeypatch):
    """An s3:// dataset opened without any credentials: one permanent error naming the fix."""
    from remote_servers import S3Server

    for name in [k for k in os.environ if k.startswith("AWS_") and "CA_BUNDLE" not in k]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3 = S3Server(max_life=100).start()
    try:
        opts = {"client_kwargs": {"endpoint_url": s3.endpoint, "region_name": "us-east-1"},
                "skip_instance_cache": True}
        with pytest.raises(pyloader.FetchError) as ei:
            pyloader.ShardDataset("s3://bucket/ds", cache_dir=str(tmp_path / "cache"), storage_options=opts)
    finally:
        s3.stop()
    msg = str(ei.value)
    assert "permanent, not retried" in msg and "give credentials" in msg and "AWS_ACCESS_KEY_ID" in msg, msg
