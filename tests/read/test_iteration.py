"""A pyloader dataset read as torch reads an ``IterableDataset``: iterated, never indexed."""

from __future__ import annotations

import pytest

import pyloader


@pytest.mark.timeout(60)
def test_indexing_says_to_iterate(write_dataset, tmp_path) -> None:
    from convert_util import mixed_table, write_parquet

    shards = write_dataset(8)
    parquet = write_parquet(tmp_path / "a.parquet", mixed_table(8))
    for ds in (pyloader.ShardDataset(shards), pyloader.ParquetDataset(parquet),
               pyloader.Mixture([pyloader.ShardDataset(shards)])):
        name = type(ds).__name__
        with pytest.raises(NotImplementedError) as e:
            ds[3]
        msg = str(e.value)
        assert msg.startswith(f"{name}[3]: a {name} is an iterable-style dataset"), msg
        assert "next(iter(ds))" in msg and "pyloader.DataLoader(ds" in msg, msg
        assert "Subclasses of Dataset" not in msg
        assert next(iter(ds)) is not None  # what the message says works
