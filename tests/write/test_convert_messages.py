"""``pyloader convert``'s messages name the option or column and the one fix (issue 27).

Each test gives the input a user typed and checks the message, the exit status or the figure.
"""

from __future__ import annotations

import datetime
import decimal
import json
import os
import time

import numpy as np
import pytest
from convert_util import pa

import pyloader
from pyloader._cli import main
from pyloader.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from pyloader.write.cli import cli_words
from pyloader.write.convert import Progress

pq = pytest.importorskip("pyarrow.parquet")

N = 12


def _odd_types(tmp_path) -> str:
    """A Parquet file with a timestamp, a decimal and a column with a null at row 3."""
    t = pa.table({
        "a": pa.array(range(N), pa.int64()),
        "ts": pa.array([datetime.datetime(2020, 1, 1) + datetime.timedelta(seconds=i) for i in range(N)],
                       pa.timestamp("us")),
        "d": pa.array([decimal.Decimal(i) / 4 for i in range(N)], pa.decimal128(10, 2)),
        "n": pa.array([None if i == 3 else i for i in range(N)], pa.int64()),
    })
    path = str(tmp_path / "odd.parquet")
    pq.write_table(t, path)
    return path


def _convert(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["convert", *argv, "--quiet"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_timestamp_casts_to_int64_as_the_help_says(tmp_path, capsys) -> None:
    src, dst = _odd_types(tmp_path), str(tmp_path / "o")
    code, _, err = _convert(capsys, src, dst, "--fields", "a,ts")
    assert code == EXIT_FAILED and "ts:int64 in --fields" in err and "cast the column" not in err, err
    code, _, err = _convert(capsys, src, dst, "--fields", "a,ts:int64")
    assert code == EXIT_OK, err
    batch = next(iter(pyloader.ShardDataset(dst).batches(N)))
    start = int(datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc).timestamp()) * 10**6
    assert batch["ts"].tolist() == [start + i * 10**6 for i in range(N)]
    code, _, err = _convert(capsys, src, str(tmp_path / "o2"), "--fields", "a,ts:float64", "--overwrite")
    assert code == EXIT_FAILED and "casts to its integer count, int64, not to float64" in err, err


def test_a_decimal_says_how_to_cast_it(tmp_path, capsys) -> None:
    code, _, err = _convert(capsys, _odd_types(tmp_path), str(tmp_path / "o"), "--fields", "a,d:float64")
    assert code == EXIT_FAILED and "decimal128(10, 2)" in err and "pyarrow.compute.cast(table['d'], 'float64')" in err
    assert "cast the column" not in err


def test_the_nulls_hint_can_be_pasted(tmp_path, capsys) -> None:
    src = _odd_types(tmp_path)
    code, _, err = _convert(capsys, src, str(tmp_path / "o"), "--fields", "n")
    assert code == EXIT_FAILED and "pass --nulls zero to store" in err and "--nulls'" not in err, err
    hint = err.split("pass ")[1].split(" to store")[0]
    code, _, err = _convert(capsys, src, str(tmp_path / "o"), "--fields", "n", *hint.split())
    assert code == EXIT_OK, err
    assert cli_words("pass nulls='zero', kind= or labels=True; jobs=2") == "pass --nulls zero, --kind or --labels; --jobs 2"


@pytest.mark.parametrize("argv,words", [
    (["--storage-options", "{bad json"], "--storage-options '{bad json' is not JSON"),
    (["--storage-options", "[1]"], "--storage-options '[1]' is not a JSON object"),
    (["--shard-size", "100Q"], "--shard-size: invalid size '100Q'"),
    (["--engine", "dask", "--task-size", "lots"], "--task-size: invalid size 'lots'"),
])
def test_a_bad_option_is_named(tmp_path, capsys, argv: list[str], words: str) -> None:
    code, _, err = _convert(capsys, _odd_types(tmp_path), str(tmp_path / "o"), *argv)
    assert code == EXIT_USAGE and words in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("kind", ["numpy", "tar", "arrow"])
def test_the_wrong_kind_names_the_right_one(tmp_path, capsys, kind: str) -> None:
    src = _odd_types(tmp_path)
    code, _, err = _convert(capsys, src, str(tmp_path / "o"), "--kind", kind)
    assert code == EXIT_FAILED and len(err.strip().splitlines()) == 1, err
    assert f"{src}: is a Parquet file" in err and "pass --kind parquet" in err and "allow_pickle" not in err


def test_a_failed_convert_leaves_no_folder_it_made(tmp_path, capsys) -> None:
    src = str(tmp_path / "late.parquet")  # the null is in the last row group: found while writing shards
    pq.write_table(pa.table({"n": pa.array([None if i == 1500 else i for i in range(2000)], pa.int64())}), src,
                   row_group_size=500)
    for jobs in ("1", "2"):
        dst = tmp_path / f"new-{jobs}"
        code, _, err = _convert(capsys, src, str(dst), "--jobs", jobs, "--compression", "none")
        assert code == EXIT_FAILED and "null at row 1500" in err, err
        assert not dst.exists()
    mine = tmp_path / "mine"  # a folder the user made stays
    mine.mkdir()
    assert _convert(capsys, src, str(mine))[0] == EXIT_FAILED
    assert mine.is_dir() and os.listdir(mine) == []


def test_the_summary_line_explains_its_figures(tmp_path, capsys) -> None:
    code, out, err = _convert(capsys, _odd_types(tmp_path), str(tmp_path / "o"), "--fields", "a")
    assert code == EXIT_OK, err
    assert f"wrote {N} records in 1 shard to" in out and "1 shards" not in out and "0.0 MB" not in out, out
    assert "96 B of values ->" in out and "B per record: each shard's header and index" in out, out
    assert "1 job)" in out, out
    code, out, _ = _convert(capsys, _odd_types(tmp_path), str(tmp_path / "o"), "--fields", "a", "--json",
                            "--overwrite")
    assert json.loads(out)["shards"] == 1


def test_the_eta_ignores_the_start_up(capsys) -> None:
    """An ETA from the rate since the first report: a slow start (processes, a cluster) does not stretch it."""
    prog = Progress(100, 100_000, True)
    prog.start -= 60.0  # the first records arrive a minute after the start
    prog.add(10, 10_000)
    time.sleep(0.6)
    prog.add(10, 10_000)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    eta = float(line.split("ETA ")[1].rstrip("s"))
    assert eta < 30, line  # 80 records at about 16/s; the whole-run rate would say 240 s
    assert np.isfinite(eta)
