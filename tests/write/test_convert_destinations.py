"""``pyloader convert``'s destination: one it cannot reach exits 4 with the fix, one already there names the flag once.

Issue 40 items 9 and 10. The S3 destination is moto's server on 127.0.0.1 (started here);
the command runs as the user ran it, in a child process, with no AWS credentials anywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import pyloader
from pyloader._cli import main
from pyloader.errors import EXIT_FAILED, EXIT_UNREACHABLE

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, os.path.join(TESTS, "remote"))
from remote_servers import S3Server  # noqa: E402
from remote_util import closed_port  # noqa: E402


def _parquet(tmp_path) -> str:
    d = tmp_path / "data"
    d.mkdir()
    for k in range(2):
        pq.write_table(pa.table({"a": list(range(10 * k, 10 * k + 10))}), str(d / f"part-{k}.parquet"))
    return str(d)


def _no_credentials_env(tmp_path, endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), AWS_ENDPOINT_URL=endpoint,
               AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true", HOME=str(tmp_path))
    return env


def _convert(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pyloader", "convert", *argv, "--quiet"], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_convert_to_s3_without_credentials_exits_4_naming_the_fix(tmp_path):
    """Item 9: no credentials: exit 4 as docs/convert.md says (as `cache warm` does), no traceback."""
    data = _parquet(tmp_path)
    srv = S3Server(max_life=120).start()
    try:
        r = _convert(_no_credentials_env(tmp_path, srv.endpoint), f"{data}/*.parquet", "s3://bucket/tables")
    finally:
        srv.stop()
    assert r.returncode == EXIT_UNREACHABLE, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("pyloader convert: ") and "s3://bucket/tables" in r.stderr, r.stderr
    assert "no credentials" in r.stderr and "AWS_ACCESS_KEY_ID" in r.stderr and "--storage-options" in r.stderr
    assert "already holds" not in r.stderr


@pytest.mark.timeout(150)
def test_convert_to_an_endpoint_nothing_listens_on_exits_4(tmp_path):
    """Item 9's sibling: credentials given, no server at the endpoint: exit 4, the endpoint named as the fix."""
    data = _parquet(tmp_path)
    env = _no_credentials_env(tmp_path, f"http://127.0.0.1:{closed_port()}")
    env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_MAX_ATTEMPTS="1",
               AWS_RETRY_MODE="standard")
    r = _convert(env, f"{data}/*.parquet", "s3://bucket/tables")
    assert r.returncode == EXIT_UNREACHABLE, r.stderr
    assert "Traceback" not in r.stderr and "cannot reach" in r.stderr and "AWS_ENDPOINT_URL" in r.stderr, r.stderr


def test_a_dataset_already_there_names_the_flag_once(tmp_path, capsys):
    """Item 10: "(pass --overwrite / --overwrite)" on the command line; the keyword in Python."""
    data, dst = _parquet(tmp_path), str(tmp_path / "out")
    assert main(["convert", data, dst, "--quiet"]) == 0
    capsys.readouterr()
    assert main(["convert", data, dst, "--quiet"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "already holds a dataset (pass --overwrite to replace it)" in err and err.count("--overwrite") == 1, err
    with pytest.raises(FileExistsError, match=r"\(pass overwrite=True to replace it\)"):
        pyloader.convert(data, dst)
