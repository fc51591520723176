"""pyloader convert as a first user types it: several sources, globs, empty folders, unknown files."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pytest
from convert_util import mixed_table, pa, write_parquet

import pyloader
from pyloader._cli import main


def _parts(tmp_path, n: int = 3) -> list[str]:
    d = tmp_path / "data"
    d.mkdir()
    return [write_parquet(d / f"part-{k}.parquet", mixed_table(20, start=20 * k)) for k in range(n)]


def _ids(path: str) -> list[int]:
    ds = pyloader.ShardDataset(path)
    return [int(b["id"][i]) for b in ds.batches(7) for i in range(len(b["id"]))]


def _tars(tmp_path, n: int = 2) -> str:
    d = tmp_path / "wds"
    d.mkdir()
    for k in range(n):
        with tarfile.open(d / f"shard-{k}.tar", "w") as tf:
            for i in range(3):
                for ext, data in (("txt", f"{k}-{i}".encode()), ("cls", str(i).encode())):
                    info = tarfile.TarInfo(f"s{k}{i}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
    return str(d)


def test_several_sources_as_a_shell_glob_gives_them(tmp_path, capsys) -> None:
    parts = _parts(tmp_path)
    dst = str(tmp_path / "out")
    code = main(["convert", *parts, dst, "--compression", "auto", "--jobs", "2", "--verify", "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert _ids(dst) == list(range(60))
    assert "verified: 60 records" in capsys.readouterr().out


def test_a_quoted_glob_is_expanded(tmp_path, capsys) -> None:
    wds = _tars(tmp_path)
    dst = str(tmp_path / "out")
    assert main(["convert", os.path.join(wds, "*.tar"), dst, "--quiet"]) == 0, capsys.readouterr().err
    assert pyloader.ShardDataset(dst).num_records == 6


def test_a_glob_that_matches_nothing_says_so(tmp_path, capsys) -> None:
    pattern = str(tmp_path / "nothing" / "*.tar")
    assert main(["convert", pattern, str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "matches no file" in err and pattern in err
    with pytest.raises(pyloader.ConvertError, match="matches no file"):
        pyloader.convert(pattern, str(tmp_path / "out2"))


def test_the_python_api_takes_a_glob_and_a_list(tmp_path) -> None:
    parts = _parts(tmp_path)
    pattern = os.path.join(os.path.dirname(parts[0]), "part-*.parquet")
    r = pyloader.convert(pattern, str(tmp_path / "a"), verify=True)
    assert r.records == 60 and _ids(str(tmp_path / "a")) == list(range(60))
    r = pyloader.convert([parts[2], parts[0]], str(tmp_path / "b"))
    assert _ids(str(tmp_path / "b")) == [*range(40, 60), *range(20)]  # a list keeps its order


def test_a_usage_error_prints_the_commands_usage(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as ei:
        main(["convert", "a", "b", "--no-such-flag"])
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pyloader convert" in err and "SRC [SRC ...] DST" in err
    assert "unrecognized arguments: --no-such-flag" in err


def test_an_empty_folder_is_refused_not_written(tmp_path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    dst = tmp_path / "out"
    assert main(["convert", str(empty), str(dst)]) == 1
    assert "holds no files" in capsys.readouterr().err
    assert not (dst / "manifest.json").exists()
    with pytest.raises(pyloader.ConvertError, match="holds no files"):
        pyloader.convert(str(empty), str(dst))


def test_a_source_of_no_records_is_refused(tmp_path) -> None:
    p = write_parquet(tmp_path / "zero.parquet", pa.table({"a": pa.array([], pa.int64())}))
    with pytest.raises(pyloader.ConvertError, match="no records"):
        pyloader.convert(p, str(tmp_path / "out"))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_csv_names_what_to_do_and_the_cli_names_its_flag(tmp_path, capsys) -> None:
    csv = tmp_path / "data.csv"
    csv.write_text("a,b\n1,2\n")
    with pytest.raises(pyloader.ConvertError, match="Parquet first"):
        pyloader.convert(str(csv), str(tmp_path / "out"))
    odd = tmp_path / "data.bin"
    odd.write_bytes(b"x")
    with pytest.raises(pyloader.ConvertError, match="pass kind="):
        pyloader.convert(str(odd), str(tmp_path / "out"))
    assert main(["convert", str(odd), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "--kind" in err and "kind=" not in err
    np.save(tmp_path / "a.npy", np.arange(3))
    assert main(["convert", str(tmp_path / "a.npy"), str(tmp_path / "o2"), "--labels"]) == 2
    err = capsys.readouterr().err
    assert "--labels applies" in err and "labels=" not in err
