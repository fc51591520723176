"""ShardWriter's first mistakes: a bad compression names the option; a first write that fails leaves no folder."""

from __future__ import annotations

import os

import pytest

import pyloader

FIELDS = {"image": ("uint8", (4,)), "label": ("int64", ())}


def test_an_unknown_compression_names_the_option_not_a_field(tmp_path) -> None:
    d = tmp_path / "out"
    with pytest.raises(ValueError) as e:
        pyloader.ShardWriter(d, FIELDS, compression="lz5")
    assert str(e.value) == "compression must be one of ('lz4', 'none') or None (or a dict of them per field), got 'lz5'"
    assert "field" not in str(e.value).split("(or")[0]
    assert not d.exists()
    with pytest.raises(ValueError, match=r"compression for field 'label' must be one of \('lz4', 'none'\), got 'lz5'"):
        pyloader.ShardWriter(d, FIELDS, compression={"image": "lz4", "label": "lz5"})  # a dict names its field


def test_a_schema_error_at_the_first_write_leaves_no_folder(tmp_path) -> None:
    d = tmp_path / "new" / "images"
    with pytest.raises(pyloader.SchemaError, match="sample 0 field 'image'"):
        with pyloader.ShardWriter(d, FIELDS) as w:
            w.write({"image": "not an image", "label": 1})
    assert not (tmp_path / "new").exists()  # both folders the writer made are gone
    # Not with, then abort(): the same.
    w = pyloader.ShardWriter(d, FIELDS)
    with pytest.raises(pyloader.SchemaError):
        w.write({"image": [1, 2, 3], "label": 1})
    w.abort()
    assert not (tmp_path / "new").exists()


def test_folders_it_did_not_make_or_that_hold_other_files_stay(tmp_path) -> None:
    mine = tmp_path / "existing"
    mine.mkdir()
    with pytest.raises(pyloader.SchemaError):
        with pyloader.ShardWriter(mine / "ds", FIELDS) as w:
            w.write({"image": "x", "label": 1})
    assert mine.is_dir() and not (mine / "ds").exists()  # the folder it made is gone, its parent stays
    with pytest.raises(pyloader.SchemaError):
        with pyloader.ShardWriter(mine, FIELDS) as w:
            w.write({"image": "x", "label": 1})
    assert mine.is_dir()  # existed before: kept, empty as it was
    d = tmp_path / "shared"
    with pytest.raises(pyloader.SchemaError):
        with pyloader.ShardWriter(d, FIELDS) as w:
            (d / "notes.txt").write_text("someone else's")
            w.write({"image": "x", "label": 1})
    assert (d / "notes.txt").read_text() == "someone else's"
    # After shards were written, a failure removes them and the folder too.
    d2 = tmp_path / "later"
    with pytest.raises(pyloader.SchemaError):
        with pyloader.ShardWriter(d2, FIELDS, shard_bytes=16) as w:
            for i in range(10):
                w.write({"image": [i] * 4, "label": i})
            w.write({"image": "x", "label": 1})
    assert not d2.exists()
    # A good dataset still writes and reads.
    with pyloader.ShardWriter(d2, FIELDS) as w:
        w.write({"image": [1, 2, 3, 4], "label": 7})
    assert [int(s["label"]) for s in pyloader.ShardDataset(d2)] == [7]
    assert os.path.isfile(d2 / "manifest.json")
