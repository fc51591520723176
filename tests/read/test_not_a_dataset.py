"""What ShardDataset says when its path holds data but no pyloader dataset, and the type of a missing shard."""

from __future__ import annotations

import errno
import os

import pytest

import pyloader


def _parquet(path: str) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"a": [1, 2, 3]}), path)


def test_a_parquet_file_names_parquetdataset_and_convert(tmp_path) -> None:
    p = str(tmp_path / "x.parquet")
    _parquet(p)
    with pytest.raises(pyloader.NotADatasetError, match="Parquet file") as ei:
        pyloader.ShardDataset(p)
    msg = str(ei.value)
    assert "pyloader.ParquetDataset" in msg and "pyloader convert" in msg and p in msg
    # The kind raised before (NotADirectoryError) still catches it, and so does "no manifest".
    assert isinstance(ei.value, NotADirectoryError) and ei.value.errno == errno.ENOTDIR
    assert isinstance(ei.value, pyloader.ManifestNotFoundError)


def test_a_folder_of_parquet_files(tmp_path) -> None:
    _parquet(str(tmp_path / "part-0.parquet"))
    with pytest.raises(pyloader.ManifestNotFoundError, match="holds Parquet files") as ei:
        pyloader.ShardDataset(str(tmp_path))
    assert "pyloader.ParquetDataset" in str(ei.value) and "pyloader convert" in str(ei.value)
    assert isinstance(ei.value, FileNotFoundError) and ei.value.errno == errno.ENOENT
    assert isinstance(ei.value, pyloader.NotADatasetError)


def test_a_folder_of_tars_and_a_tar_file(tmp_path) -> None:
    (tmp_path / "wds-000.tar").write_bytes(b"")
    with pytest.raises(pyloader.NotADatasetError, match="tar files") as ei:
        pyloader.ShardDataset(str(tmp_path))
    assert "pyloader convert" in str(ei.value)
    with pytest.raises(pyloader.NotADatasetError, match="tar file"):
        pyloader.ShardDataset(str(tmp_path / "wds-000.tar"))


def test_another_file_and_an_empty_folder(tmp_path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("x")
    with pytest.raises(pyloader.NotADatasetError, match="is a file, not a pyloader dataset"):
        pyloader.ShardDataset(str(f))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(pyloader.ManifestNotFoundError) as ei:
        pyloader.ShardDataset(str(empty))
    assert not isinstance(ei.value, pyloader.NotADatasetError)


def test_a_missing_shard_is_a_public_exported_error(tmp_path) -> None:
    with pyloader.ShardWriter(str(tmp_path), {"x": ("int64", ())}, shard_bytes=64) as w:
        for i in range(40):
            w.write({"x": i})
    shards = sorted(p for p in os.listdir(tmp_path) if p.endswith(".pyl"))
    os.unlink(tmp_path / shards[0])
    with pytest.raises(pyloader.ShardNotFoundError) as ei:  # found when the dataset is opened (issue 40 item 14)
        pyloader.ShardDataset(str(tmp_path))
    e = ei.value
    assert type(e) is pyloader.ShardNotFoundError and type(e).__module__ == "pyloader.errors"
    assert isinstance(e, pyloader.ShardIOError) and isinstance(e, FileNotFoundError)
    assert "ShardNotFoundError" in pyloader.__all__ and "ShardPermissionError" in pyloader.__all__
    assert issubclass(pyloader.ShardPermissionError, PermissionError)
    assert issubclass(pyloader.ShardPermissionError, pyloader.ShardIOError)
