"""``pyloader convert`` on a Hugging Face ``save_to_disk`` folder converts its rows (issue 40 item 19).

The folder is written as ``datasets`` writes it (without needing ``datasets``): Arrow IPC
streams ``data-0000N-of-0000M.arrow`` with the features in the schema's ``huggingface``
metadata, ``dataset_info.json`` and ``state.json`` listing the data files in row order.
"""

from __future__ import annotations

import json
import os

import pytest
from convert_util import pa

import pyloader
from pyloader._cli import main
from pyloader.errors import EXIT_OK

N = 1000
FEATURES = {"label": {"dtype": "int64", "_type": "Value"}, "text": {"dtype": "string", "_type": "Value"},
            "tokens": {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "Sequence"}}


def save_to_disk(folder, n: int = N, files: int = 2) -> str:
    os.makedirs(folder)
    meta = {b"huggingface": json.dumps({"info": {"features": FEATURES}}).encode()}
    schema = pa.schema([("label", pa.int64()), ("text", pa.string()), ("tokens", pa.list_(pa.int32()))],
                       metadata=meta)
    names, per = [], -(-n // files)
    for k in range(files):
        rows = range(k * per, min(n, (k + 1) * per))
        table = pa.table({"label": pa.array(list(rows), pa.int64()),
                          "text": pa.array([f"row {i}" for i in rows]),
                          "tokens": pa.array([list(range(i % 7)) for i in rows], pa.list_(pa.int32()))},
                         schema=schema)
        name = f"data-{k:05d}-of-{files:05d}.arrow"
        with pa.ipc.new_stream(os.path.join(folder, name), schema) as w:  # datasets writes IPC streams
            for batch in table.to_batches(max_chunksize=128):
                w.write_batch(batch)
        names.append(name)
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"citation": "", "description": "", "features": FEATURES, "homepage": "", "license": ""}, f)
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": n} for n in names], "_fingerprint": "0123456789abcdef",
                   "_format_columns": None, "_format_kwargs": {}, "_format_type": None,
                   "_output_all_columns": False, "_split": "train"}, f)
    return str(folder)


def _labels(path: str) -> list[int]:
    ds = pyloader.ShardDataset(path)
    return [int(x) for b in ds.batches(256) for x in b["label"]]


@pytest.mark.timeout(120)
def test_a_save_to_disk_folder_converts_its_rows(tmp_path, capsys) -> None:
    src = save_to_disk(tmp_path / "hf_ds")
    code = main(["convert", src, str(tmp_path / "dst"), "--quiet"])
    err = capsys.readouterr().err
    assert code == EXIT_OK, err
    ds = pyloader.ShardDataset(tmp_path / "dst")
    assert ds.num_records == N and [f.name for f in ds.fields] == ["label", "text", "tokens"]
    assert _labels(str(tmp_path / "dst")) == list(range(N))  # the files in state.json's order
    # The same rows as converting the .arrow files themselves.
    arrows = sorted(str(p) for p in (tmp_path / "hf_ds").glob("*.arrow"))
    pyloader.convert(arrows, tmp_path / "direct")
    assert _labels(str(tmp_path / "direct")) == _labels(str(tmp_path / "dst"))
    first = next(iter(pyloader.ShardDataset(tmp_path / "dst")))
    assert first["text"] == b"row 0" and first["tokens"].tolist() == []
    # kind='files' still takes the folder as files (two .arrow, two .json), when that is what is asked for.
    assert pyloader.convert(src, tmp_path / "blobs", kind="files").records == 4


def test_a_dataset_dict_names_a_split_to_convert(tmp_path, capsys) -> None:
    root = tmp_path / "hf_dict"
    for split in ("train", "test"):
        save_to_disk(root / split, n=10, files=1)
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    code = main(["convert", str(root), str(tmp_path / "dst"), "--quiet"])
    err = capsys.readouterr().err
    assert code != EXIT_OK
    assert "Hugging Face DatasetDict" in err and f"pyloader convert {root / 'train'} DST" in err, err
    assert not (tmp_path / "dst").exists()
    assert main(["convert", str(root / "test"), str(tmp_path / "dst"), "--quiet"]) == EXIT_OK
    assert _labels(str(tmp_path / "dst")) == list(range(10))


def test_a_state_listing_a_missing_or_outside_file_is_refused(tmp_path) -> None:
    src = save_to_disk(tmp_path / "hf_ds", n=20, files=2)
    os.remove(os.path.join(src, "data-00001-of-00002.arrow"))
    with pytest.raises(pyloader.ConvertError, match=r"lists 'data-00001-of-00002.arrow', which is not there"):
        pyloader.convert(src, tmp_path / "dst")
    state = json.loads((tmp_path / "hf_ds" / "state.json").read_text())
    state["_data_files"] = [{"filename": "../elsewhere.arrow"}]
    (tmp_path / "hf_ds" / "state.json").write_text(json.dumps(state))
    with pytest.raises(pyloader.ConvertError, match="which is not a file of the folder"):
        pyloader.convert(src, tmp_path / "dst")
