"""`pyloader bench` on a user's own data: every kind of dataset `pyloader convert` writes.

A folder of images with `--labels`, WebDataset tars, Parquet with lists and bytes, and
numpy arrays are converted with the command, then benched in a subprocess, local and over
a loopback HTTP server, with and without `--image-size`, `--transform` and `--pack`
(docs/bench.md: the I/O stages read encoded fields as bytes). The JSON's figures must hold
together: payload is what the records hold, padding is not data.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import pyloader
from pyloader.bench.measure import batch_payload, epoch_samples

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
Image = pytest.importorskip("PIL.Image")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "remote"))
from remote_servers import FaultServer  # noqa: E402

# Small runs: one short timed round per loader, no AU search, torch without worker processes.
FAST = ["--epochs", "1", "--min-seconds", "0.05", "--batch-size", "16", "--threads", "2", "--torch-workers", "0",
        "--workload", "none", "--json", "--quiet"]
TRANSFORM = "usertr:identity"
# One tiny AU trial on the dataset's own records (what a bench without --workload none runs).
AU = ["--workload", "custom", "--au-batch-size", "8", "--compute-time", "0.001", "--max-accelerators", "1",
      "--au-seconds", "0.05", "--au-budget", "1", "--au-torch-workers", "0"]


def _jpeg(rng: np.random.Generator) -> bytes:
    h, w = (int(v) for v in rng.integers(24, 72, 2))  # every image its own size, as a user's photos
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _sources(root: str) -> dict[str, Any]:
    """The four sources in ``root``; returns each one's path, convert options and value bytes per record."""
    rng = np.random.default_rng(0)
    images = os.path.join(root, "images")
    image_bytes = 0
    for cls in ("cat", "dog"):
        os.makedirs(os.path.join(images, cls))
        for i in range(24):
            data = _jpeg(rng)
            with open(os.path.join(images, cls, f"{i}.jpg"), "wb") as f:
                f.write(data)
            image_bytes += len(data) + len(f"{cls}/{i}.jpg") + 8  # data, path, label
    wds = os.path.join(root, "wds")
    os.makedirs(wds)
    with tarfile.open(os.path.join(wds, "train-000.tar"), "w") as tf:
        for i in range(32):
            for ext, data in (("jpg", _jpeg(rng)), ("cls", str(i % 3).encode())):
                ti = tarfile.TarInfo(f"s{i:04d}.{ext}")
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))
    # Parquet: a token list of very uneven lengths (padding would dwarf the data), bytes and strings.
    n = 300
    lengths = np.where(rng.random(n) < 0.05, 400, rng.integers(1, 40, n))
    tokens = [rng.integers(0, 50_000, int(k)).astype(np.int32) for k in lengths]
    blobs = [bytes(rng.integers(0, 256, int(k) % 17, dtype=np.uint8)) for k in lengths]
    texts = [f"document {i}" for i in range(n)]
    os.makedirs(os.path.join(root, "parquet"))
    pq.write_table(pa.table({"tokens": pa.array([t.tolist() for t in tokens], pa.list_(pa.int32())),
                             "blob": pa.array(blobs, pa.binary()), "text": pa.array(texts),
                             "label": pa.array(np.arange(n) % 5)}),
                   os.path.join(root, "parquet", "part-0.parquet"), row_group_size=100)
    parquet_bytes = sum(4 * len(t) + len(b) + len(s.encode()) + 8 for t, b, s in zip(tokens, blobs, texts))
    os.makedirs(os.path.join(root, "numpy"))
    np.save(os.path.join(root, "numpy", "x.npy"), rng.standard_normal((400, 12)).astype(np.float32))
    np.save(os.path.join(root, "numpy", "y.npy"), np.arange(400, dtype=np.int64))
    return {"images": (images, ["--labels"], image_bytes / 48), "wds": (wds, [], None),
            "parquet": (os.path.join(root, "parquet"), ["--compression", "none"], parquet_bytes / n),
            "numpy": (os.path.join(root, "numpy"), [], (12 * 4 + 8))}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Each source converted with `pyloader convert` into ``<root>/shards/<kind>`` (served over HTTP too)."""
    root = str(tmp_path_factory.mktemp("userdata"))
    sources = _sources(root)
    runs = {kind: subprocess.Popen([sys.executable, "-m", "pyloader", "convert", src,
                                    os.path.join(root, "shards", kind), *opts, "--quiet"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for kind, (src, opts, _) in sources.items()}
    for kind, p in runs.items():
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, (kind, out, err)
    with open(os.path.join(root, "usertr.py"), "w") as f:
        f.write("def identity(sample):\n    return sample\n")
    with FaultServer(os.path.join(root, "shards"), max_life=600) as server:
        yield {"root": root, "url": server.url, "mean_bytes": {k: v[2] for k, v in sources.items()}}


def bench(converted: dict[str, Any], kind: str, *opts: str, remote: bool = False,
          expect_rc: int = 0) -> subprocess.CompletedProcess[str]:
    root = converted["root"]
    where = f"{converted['url']}/{kind}" if remote else os.path.join(root, "shards", kind)
    cache = ["--cache-dir", tempfile.mkdtemp(prefix="cache-", dir=root)] if remote else []  # a cold cache
    res = subprocess.run([sys.executable, "-m", "pyloader", "bench", where, *cache, *FAST, *opts],
                         capture_output=True, text=True, timeout=240, cwd=root)
    assert res.returncode == expect_rc, res.stderr[-3000:]
    return res


CASES = [
    ("images", False, AU),
    ("images", False, ["--image-size", "32"]),
    ("images", True, ["--image-size", "32"]),
    ("wds", False, ["--image-size", "32", "--transform", TRANSFORM]),
    ("wds", True, []),
    ("parquet", False, ["--transform", TRANSFORM, "--pack", "64"]),
    ("parquet", True, ["--pack", "64"]),
    ("numpy", False, []),
    ("numpy", True, ["--transform", TRANSFORM]),
]

NAMED = ("--image-size", "--transform", "--pack", "--workload")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,remote,opts", CASES,
                         ids=[f"{k}-{'http' if r else 'local'}{''.join(x for x in o if x in NAMED)}" for k, r, o in CASES])
def test_bench_runs_on_what_convert_writes(converted, kind: str, remote: bool, opts: list[str]) -> None:
    r = json.loads(bench(converted, kind, *opts, remote=remote).stdout)
    n = r["dataset"]["records"]
    st = r["stages"]
    py, tc = st["pyloader"], st["torch_dataloader"]
    assert py["samples"] == tc["samples"] == n
    # The I/O stages read encoded fields as the bytes they are: every record's values once, no padding.
    assert py["bytes"] == py["decoded_bytes"] == tc["bytes"], (py, tc)
    if kind in ("images", "wds"):
        assert all(f["dtype"] == "bytes" for f in r["dataset"]["fields"] if f.get("encoding"))
    if not remote:
        assert st["cold_read"]["samples"] == n
    else:
        assert st["remote_fetch"]["bytes"] == r["dataset"]["bytes"]
    if "--image-size" in opts or "--transform" in opts:
        t = r["transform"]
        assert t["with_transform"]["samples"] == t["without_transform"]["samples"] == n
        assert t["torch_dataloader"]["samples"] == n
        assert t["without_transform"]["bytes"] == py["bytes"]  # the same records, as bytes
    if "--image-size" in opts and "--transform" not in opts:
        image = [f["name"] for f in r["dataset"]["fields"] if f.get("encoding")]
        assert len(image) == 1
        # Decoded to 32 x 32 x 3; the other fields as they are stored.
        assert r["transform"]["with_transform"]["bytes"] > n * 32 * 32 * 3
    mean = converted["mean_bytes"][kind]
    if mean is not None:
        assert py["bytes"] / n == pytest.approx(mean)  # the mean record: padding is not data
    if "--workload" in opts:
        assert r["accelerator_utilization"]["workload"]["record_bytes"] == round(py["bytes"] / n)
        assert r["accelerator_utilization"]["pyloader"]["trials"]
    if "--pack" in opts:
        p = r["packing"]
        assert p["field"] == "tokens" and p["tokens_per_s"] > 0 and 0 <= p["padding_fraction"] < 1


@pytest.mark.timeout(300)
def test_a_collation_error_names_the_commands_options(converted) -> None:
    # Images of many sizes, decoded at their own size for a transform that keeps them: the
    # fix is --image-size (or a transform returning one shape), not a Python argument.
    res = bench(converted, "images", "--transform", TRANSFORM, expect_rc=1)
    err = res.stderr.strip().splitlines()[-1]
    assert err.startswith("pyloader bench: error: cannot collate field 'data'"), err
    assert "--image-size N" in err and f"--transform {TRANSFORM}" in err, err
    assert "ImageDecode" not in err and "collate_fn" not in err, err


@pytest.mark.timeout(300)
def test_padding_is_not_data(converted) -> None:
    """Uneven token lists, padded to the longest in each batch: delivered and record size count values only."""
    plot = os.path.join(converted["root"], "parquet.png")
    res = bench(converted, "parquet", "--plot", plot, *AU)
    r = json.loads(res.stdout)
    st, dg = r["stages"], r["diagnosis"]
    py = st["pyloader"]
    mean = converted["mean_bytes"]["parquet"]
    assert py["lz4_stored_bytes"] == 0 and py["stored_bytes"] == py["decoded_bytes"]  # undecoded: read as stored
    # Delivered never exceeds what was read, per epoch and as a rate.
    assert py["bytes"] <= py["stored_bytes"]
    assert dg["loader_gbps"] <= dg["stages"]["storage"]["demand_gbps"] * (1 + 1e-9)
    assert py["bytes"] / py["samples"] == pytest.approx(mean)
    assert st["torch_dataloader"]["bytes"] == py["bytes"]
    assert r["accelerator_utilization"]["workload"]["record_bytes"] == round(mean)
    # The plot draws pyloader no higher than the storage it read from.
    from pyloader.bench.cli import _plot_bars

    assert os.path.getsize(plot) > 0
    bars = dict(_plot_bars(r))
    assert bars["pyloader"] <= bars["storage read"]


def _sample(i: int) -> dict[str, Any]:
    return {"image": np.full((3, 4, 4), i % 251, np.uint8), "label": i, "tokens": np.arange(i % 9, dtype=np.int32),
            "blob": bytes([i % 256]) * (i % 5), "half": np.array([i, -i], np.float16)}


def test_batch_payload_counts_each_field_kind(write_dataset) -> None:
    """Every field kind a batch holds, counted as the records hold it: padding and lengths are not payload."""
    fields = {"image": ("uint8", (3, 4, 4)), "label": ("int64", ()), "tokens": ("int32", (None,)),
              "blob": ("bytes", ()), "half": ("float16", (2,))}
    path = write_dataset(50, fields, _sample)  # fixed, scalar, variable, bytes and float16 fields
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=16, num_workers=2)
    want = sum(48 + 8 + 4 * (i % 9) + i % 5 + 4 for i in range(50))
    assert epoch_samples(loader) == (50, want)
    # What torch's default_collate and pyloader's transform stage make of bytes and strings: lists.
    assert batch_payload({"path": [b"ab", b"c", b""], "x": torch.zeros(3, 2), "name": ["é", "a", "b"]}) == (3, 31)
    assert batch_payload({"label": torch.arange(4), "data": [b"xy"] * 4}) == (4, 40)
    # A tuple batch (torch's per-sample baseline), and a padded field with all lengths 0.
    assert batch_payload((torch.zeros(4, 2, dtype=torch.int16), torch.arange(4))) == (4, 48)
    assert batch_payload({"t": torch.zeros(2, 0, 3), "t_lengths": torch.zeros(2, dtype=torch.int64)}) == (2, 0)
