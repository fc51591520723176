"""See NOTE [ragged batches]: variable fields collated back to back, without padding.

The packer's input: each variable field of a ragged batch is [sum of lengths, ...], row i
starting at the sum of the lengths before it. Checked against the padded batches of the
same plan, over raw and LZ4 values, several shards, shuffled, with fixed fields alongside.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import pyloader

VARIABLE = ("tokens", "blob")  # the variable fields of conftest's MIXED_FIELDS (the default dataset)


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_ragged_rows_equal_the_padded_rows(write_dataset: Callable[..., str], compression: str | None) -> None:
    path = write_dataset(300, compression=compression)
    ds = pyloader.ShardDataset(path, shuffle=True, seed=4)
    plan = ds.plan()
    padded = list(ds.batches(37, plan=plan, num_threads=2))
    ragged = list(ds.batches(37, plan=plan, num_threads=2, ragged=True))
    assert len(padded) == len(ragged) == 9
    for p, r in zip(padded, ragged, strict=True):
        assert set(p) == set(r)
        for name in (k for k in p if not k.endswith("_lengths")):
            if name not in VARIABLE:
                assert torch.equal(p[name], r[name]), name
                continue
            lengths = r[f"{name}_lengths"]
            assert torch.equal(lengths, p[f"{name}_lengths"])
            assert r[name].shape[0] == int(lengths.sum())  # no padding at all
            off = np.concatenate([[0], np.cumsum(lengths.numpy())])
            for i in range(len(lengths)):
                n = int(lengths[i])
                assert torch.equal(r[name][off[i]:off[i] + n], p[name][i, :n]), (name, i)


def test_ragged_batch_of_empty_values(write_dataset: Callable[..., str]) -> None:
    # Every record's tokens are empty: a ragged field of 0 values, lengths all 0.
    path = write_dataset(20, {"tokens": ("int32", (None,))}, lambda i: {"tokens": np.zeros(0, np.int32)})
    ds = pyloader.ShardDataset(path)
    (b,) = list(ds.batches(20, ragged=True))
    assert b["tokens"].shape == (0,) and int(b["tokens_lengths"].sum()) == 0
