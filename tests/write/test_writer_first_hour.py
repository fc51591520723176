"""ShardWriter mistakes a first user makes: no close(), a remote URL, compression=None, a huge int."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import pytest

import pyloader


def test_a_writer_never_closed_warns_naming_the_folder_and_records(tmp_path) -> None:
    d = str(tmp_path / "ds")
    w = pyloader.ShardWriter(d, {"x": ("int64", ())}, shard_bytes=64)
    for i in range(30):
        w.write({"x": i})
    assert any(n.endswith(".pyl") for n in os.listdir(d))  # shards rolled over already
    with pytest.warns(RuntimeWarning, match="never closed") as rec:
        del w
        gc.collect()
    msg = str(rec[0].message)
    assert d in msg and "30 records" in msg
    # Nothing half-written is left to look like data: no manifest, no orphan shards, not the folder it made.
    assert not os.path.exists(d)


def test_a_closed_or_aborted_writer_does_not_warn(tmp_path) -> None:
    w = pyloader.ShardWriter(str(tmp_path / "a"), {"x": ("int64", ())})
    w.write({"x": 1})
    w.close()
    del w
    a = pyloader.ShardWriter(str(tmp_path / "b"), {"x": ("int64", ())})
    a.abort()
    del a
    gc.collect()  # filterwarnings=error: any warning here fails the test
    assert pyloader.ShardDataset(str(tmp_path / "a")).num_records == 1


def test_a_writer_alive_at_interpreter_exit_warns(tmp_path) -> None:
    d = str(tmp_path / "ds")
    code = textwrap.dedent(f"""
        import pyloader
        w = pyloader.ShardWriter({d!r}, {{"x": ("int64", ())}})
        for i in range(7):
            w.write({{"x": i}})
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" in r.stderr and "never closed" in r.stderr and "7 records" in r.stderr, r.stderr
    assert not os.path.exists(os.path.join(d, "manifest.json"))


@pytest.mark.parametrize("url", ["s3://bucket/x", "gs://b/x", "https://host/x"])
def test_a_remote_url_is_refused_and_creates_nothing(tmp_path, monkeypatch, url) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="local folder only") as ei:
        pyloader.ShardWriter(url, {"x": ("int64", ())})
    assert "upload" in str(ei.value)
    assert os.listdir(tmp_path) == []


def test_a_file_url_writes_locally(tmp_path) -> None:
    with pyloader.ShardWriter(f"file://{tmp_path}/ds", {"x": ("int64", ())}) as w:
        w.write({"x": 3})
    assert pyloader.ShardDataset(str(tmp_path / "ds")).num_records == 1


def test_compression_none_means_no_compression(tmp_path) -> None:
    with pyloader.ShardWriter(str(tmp_path / "a"), {"x": ("int64", ())}, compression=None) as w:
        w.write({"x": 1})
    with pyloader.ShardWriter(str(tmp_path / "b"), {"x": ("int64", ()), "y": ("uint8", (8,))},
                              compression={"x": None, "y": "lz4"}) as w:
        w.write({"x": 1, "y": list(range(8))})
    with pytest.raises(ValueError, match="lz4"):
        pyloader.ShardWriter(str(tmp_path / "c"), {"x": ("int64", ())}, compression=5)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [2**70, -(2**70), [1, 2**64]])
def test_an_int_beyond_64_bits_is_out_of_range_naming_field_and_value(tmp_path, value) -> None:
    shape = () if isinstance(value, int) else (2,)
    with pyloader.ShardWriter(str(tmp_path / "ds"), {"label": ("int64", shape)}) as w:
        with pytest.raises(pyloader.SchemaError, match="out of range for int64") as ei:
            w.write({"label": value})
        w.write({"label": 0 if shape == () else [0, 1]})
    big = value if isinstance(value, int) else 2**64
    assert "'label'" in str(ei.value) and str(big) in str(ei.value)
