"""``UnitDataset.samples``: a batch split into the samples a transform worker hands the transform,
field by field, the same values ``sample(batch, i)`` gives row by row."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import pyloader

FIELDS = {"x": ("float32", (3,)), "seq": ("int32", (None,)), "blob": "bytes", "label": "int64"}


@pytest.fixture(scope="module")
def path(tmp_path_factory) -> str:
    p = str(tmp_path_factory.mktemp("split") / "ds")
    with pyloader.ShardWriter(p, FIELDS) as w:
        for i in range(20):
            w.write({"x": np.full(3, i, np.float32), "seq": np.arange(i % 5 + 1, dtype=np.int32),
                     "blob": bytes([i]) * (i % 7), "label": i})
    return p


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert type(a[k]) is type(b[k]), k
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("clone", [False, True])
def test_samples_are_the_rows_sample_gives(path: str, clone: bool) -> None:
    ds = pyloader.ShardDataset(path)
    ds.clone_samples = clone
    for raw in ds.batches(8, drop_last=False):
        rows = int(raw["label"].shape[0])
        split = ds.samples(raw)
        assert len(split) == rows
        for i in range(rows):
            _same(split[i], ds.sample(raw, i))
        shares = split[0]["x"].untyped_storage().data_ptr() == raw["x"].untyped_storage().data_ptr()
        assert shares is not clone  # views of the batch unless clone_samples, as sample()'s


class _Tagged(pyloader.ShardDataset):
    def sample(self, batch: Any, i: int) -> dict[str, Any]:
        return dict(super().sample(batch, i), tag=i)


def test_a_subclass_that_overrides_sample_gets_its_own_rows(path: str) -> None:
    ds = _Tagged(path)
    raw = next(iter(ds.batches(4)))
    assert [s["tag"] for s in ds.samples(raw)] == [0, 1, 2, 3]
    got = [b for b in pyloader.DataLoader(ds, batch_size=4, transform=lambda s: s, num_workers=1,
                                          executor="threads")]
    assert [int(t) for b in got for t in b["tag"]] == [0, 1, 2, 3] * 5
