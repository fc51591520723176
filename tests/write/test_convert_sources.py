"""pyloader.convert from numpy arrays, folders of files and WebDataset tars; and the CLI."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from convert_util import pa, read_all, write_parquet, write_tar

import pyloader
from pyloader.write import cli as CLI


def test_numpy_arrays_npy_paths_and_strings(tmp_path):
    x = np.arange(600, dtype=np.float32).reshape(200, 3)
    np.save(tmp_path / "x.npy", x)
    src = {"x": str(tmp_path / "x.npy"), "y": np.arange(200, dtype=np.uint16),
           "name": np.array([f"n{i}é" for i in range(200)]), "raw": np.array([b"ab" * (i % 3) for i in range(200)])}
    res = pyloader.convert(src, str(tmp_path / "out"), verify=True)
    assert [(f["name"], f["dtype"]) for f in res.fields] == [("x", "float32"), ("y", "uint16"), ("name", "bytes"),
                                                             ("raw", "bytes")]
    recs = read_all(str(tmp_path / "out"))
    assert np.array_equal(np.stack([r["x"] for r in recs]), x)
    assert [r["name"] for r in recs[:3]] == ["n0é".encode(), "n1é".encode(), "n2é".encode()]
    assert [r["raw"] for r in recs[:3]] == [b"", b"ab", b"abab"]


def test_npy_folder_and_npz(tmp_path):
    (tmp_path / "arrs").mkdir()
    np.save(tmp_path / "arrs" / "a.npy", np.arange(10))
    np.save(tmp_path / "arrs" / "b.npy", np.ones((10, 2, 2), np.int8))
    res = pyloader.convert(str(tmp_path / "arrs"), str(tmp_path / "o1"), verify=True)
    assert [f["name"] for f in res.fields] == ["a", "b"] and res.records == 10
    np.savez(tmp_path / "z.npz", p=np.arange(5.0), q=np.zeros((5, 4), bool))
    res = pyloader.convert(str(tmp_path / "z.npz"), str(tmp_path / "o2"), verify=True)
    assert [(f["name"], f["dtype"], f["shape"]) for f in res.fields] == [("p", "float64", []), ("q", "bool", [4])]


def test_numpy_bad_inputs(tmp_path):
    with pytest.raises(pyloader.ConvertError, match=r"array 'b' has 3 records, others 2"):
        pyloader.convert({"a": np.zeros(2), "b": np.zeros(3)}, str(tmp_path / "o"))
    with pytest.raises(pyloader.ConvertError, match=r"array 'o' has dtype object"):
        pyloader.convert({"o": np.array([1, "x"], dtype=object)}, str(tmp_path / "o"))
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    with pytest.raises(pyloader.ConvertError, match=r"bad.npy: not a readable .npy file"):
        pyloader.convert({"a": str(tmp_path / "bad.npy")}, str(tmp_path / "o"))


def test_folder_of_files_with_labels_and_empty_files(tmp_path):
    root = tmp_path / "imgs"
    for rel, data in {"cat/1.jpg": b"\x01" * 50, "cat/deep/2.jpg": b"", "dog/3.png": b"dog", "ant/4": b"a"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    res = pyloader.convert(str(root), str(tmp_path / "out"), labels=True, verify=True)
    recs = read_all(str(tmp_path / "out"))
    assert [r["path"] for r in recs] == [b"ant/4", b"cat/1.jpg", b"cat/deep/2.jpg", b"dog/3.png"]
    assert [r["data"] for r in recs] == [b"a", b"\x01" * 50, b"", b"dog"]
    assert [int(r["label"]) for r in recs] == [0, 1, 1, 2]
    side = json.loads((tmp_path / "out" / "convert.json").read_text())
    assert side["source"]["classes"] == ["ant", "cat", "dog"]
    assert res.records == 4
    (root / "loose.txt").write_bytes(b"x")
    with pytest.raises(pyloader.ConvertError, match=r"loose.txt: with labels every file must be inside a class"):
        pyloader.convert(str(root), str(tmp_path / "out2"), labels=True)
    res = pyloader.convert(str(root), str(tmp_path / "out3"), fields=["path"], verify=True)
    assert [f["name"] for f in res.fields] == ["path"] and res.records == 5


def test_empty_folder_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(pyloader.ConvertError, match="holds no files"):
        pyloader.convert(str(tmp_path / "empty"), str(tmp_path / "out"), verify=True)


def _samples(n, start=0):
    return [(f"d/s{i:04d}", {"jpg": bytes([i % 256]) * (i % 7), "cls": str(i).encode(), "seg.png": b"S" * i})
            for i in range(start, start + n)]


def test_tar_round_trip_and_parallel(tmp_path):
    (tmp_path / "tars").mkdir()
    for k in range(3):
        write_tar(tmp_path / "tars" / f"shard-{k}.tar", _samples(20, 20 * k))
    res = pyloader.convert(str(tmp_path / "tars"), str(tmp_path / "out"), jobs=2, verify=True)
    assert [f["name"] for f in res.fields] == ["__key__", "cls", "jpg", "seg_png"] and res.records == 60
    recs = read_all(str(tmp_path / "out"))
    assert [r["__key__"] for r in recs] == [f"d/s{i:04d}".encode() for i in range(60)]
    assert [r["cls"] for r in recs] == [str(i).encode() for i in range(60)]
    assert recs[13]["seg_png"] == b"S" * 13 and recs[13]["jpg"] == bytes([13]) * 6


def test_tar_with_a_missing_member(tmp_path):
    s = _samples(5)
    del s[3][1]["jpg"]
    path = write_tar(tmp_path / "m.tar", s)
    with pytest.raises(pyloader.ConvertError, match=r"m.tar: sample 'd/s0003' has no member with extension 'jpg'"):
        pyloader.convert(path, str(tmp_path / "out"))
    pyloader.convert(path, str(tmp_path / "ok"), nulls="zero", verify=True)
    assert read_all(str(tmp_path / "ok"))[3]["jpg"] == b""


def test_damaged_tars(tmp_path):
    path = write_tar(tmp_path / "t.tar", _samples(3) + [("d/s0001", {"txt": b"again"})])
    with pytest.raises(pyloader.ConvertError, match=r"members of sample 'd/s0001' are not consecutive"):
        pyloader.convert(path, str(tmp_path / "o"))
    import io
    import tarfile

    with tarfile.open(tmp_path / "n.tar", "w") as tf:
        tf.addfile(tarfile.TarInfo("noext"), io.BytesIO(b""))
    with pytest.raises(pyloader.ConvertError, match=r"member 'noext' has no extension"):
        pyloader.convert(str(tmp_path / "n.tar"), str(tmp_path / "o"))
    (tmp_path / "junk.tar").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(pyloader.ConvertError, match=r"junk.tar: not a readable tar file"):
        pyloader.convert(str(tmp_path / "junk.tar"), str(tmp_path / "o"))
    good = write_tar(tmp_path / "g.tar", _samples(4))
    data = (tmp_path / "g.tar").read_bytes()
    (tmp_path / "g.tar").write_bytes(data[:1000])  # cut inside a member
    with pytest.raises(pyloader.ConvertError, match=r"g.tar: the tar ends inside a member"):
        pyloader.convert(good, str(tmp_path / "o"))


def test_cli_exit_codes(tmp_path, capsys):
    t = pa.table({"a": pa.array(range(50), pa.int64()), "s": pa.array([str(i) for i in range(50)])})
    src = write_parquet(tmp_path / "c.parquet", t)
    out = str(tmp_path / "out")
    assert CLI.main(["convert", src, out, "--verify", "--json", "--fields", "a,s", "--shard-size", "200"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["records"] == 50 and info["verified"]["records"] == 50 and info["shards"] > 1
    assert CLI.main(["convert", src, out]) == 1  # exists
    assert "already holds a dataset" in capsys.readouterr().err
    assert CLI.main(["convert", src, out, "--fields", "a:notatype"]) == 2
    assert CLI.main(["convert", src, out, "--shard-size", "lots"]) == 2
    write_parquet(src, t.set_column(0, "a", pa.array([0] * 50, pa.int64())))
    assert CLI.main(["convert", "--verify-only", src, out, "--fields", "a,s"]) == 5
    assert "record 1 field 'a' differs" in capsys.readouterr().err
    assert CLI.main(["convert", str(tmp_path / "missing.parquet"), str(tmp_path / "o2")]) == 1
    assert CLI.main(["convert", src, str(tmp_path / "o3"), "--quiet", "--compression", "none"]) == 0
    assert "wrote 50 records" in capsys.readouterr().out
    assert not os.path.exists(tmp_path / "o2" / "manifest.json")
