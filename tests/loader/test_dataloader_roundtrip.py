"""A written dataset read back through torch's DataLoader (per sample with 0 and 2 worker
processes, and collated) and through pyloader.DataLoader, every value exact. Shared checks:
tests/roundtrip_util.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from roundtrip_util import ID_FIELDS, check_batches, check_samples, field_dtypes, id_samples, write

import pyloader

# --- torch DataLoader and pyloader.DataLoader -----------------------------------------------------


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # few-CPU CI machines
@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_dataloader_per_sample(tmp_path, num_workers):
    samples = id_samples(150)
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), ID_FIELDS, samples, shard_bytes=300))
    got = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=num_workers))
    # Each record exactly once (workers split the plan), every value exact.
    check_samples(got, samples, field_dtypes(ds), key="id")
    if num_workers == 0:
        assert [int(s["id"]) for s in got] == list(range(150))


@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # few-CPU CI machines
@pytest.mark.timeout(120)
def test_torch_dataloader_collates_fixed_fields(tmp_path):
    samples = [{"x": np.arange(6, dtype=np.float64).reshape(2, 3) * i, "id": i} for i in range(50)]
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), {"x": ("float64", (2, 3)), "id": ("int32", ())}, samples))
    batches = list(torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2))
    ids = torch.cat([b["id"] for b in batches])
    xs = torch.cat([b["x"] for b in batches])
    order = torch.argsort(ids)
    assert ids[order].tolist() == list(range(50))
    assert torch.equal(xs[order], torch.from_numpy(np.stack([s["x"] for s in samples])))


@pytest.mark.parametrize("num_workers", [0, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_pyloader_dataloader(tmp_path, num_workers, drop_last):
    samples = id_samples(47)
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), ID_FIELDS, samples, shard_bytes=200))
    loader = pyloader.DataLoader(ds, batch_size=6, num_workers=num_workers, drop_last=drop_last)
    assert len(loader) == (47 // 6 if drop_last else 8)
    epochs = [list(loader) for _ in range(3)]
    for ep in epochs:
        assert len(ep) == len(loader)
        ids = [int(i) for b in ep for i in b["id"]]
        assert ids == list(range(len(ids)))
    # Batches of all three epochs were held: all still exact.
    for ep in epochs:
        n = 0
        for b in ep:
            for i in range(b["id"].shape[0]):
                s = samples[n]
                assert int(b["id"][i]) == n
                assert torch.equal(b["v"][i, : int(b["v_lengths"][i])], torch.from_numpy(s["v"]))
                assert not b["v"][i, int(b["v_lengths"][i]):].any()
                assert bytes(b["b"][i, : int(b["b_lengths"][i])].numpy()) == s["b"]
                assert torch.equal(b["img"][i], torch.from_numpy(s["img"]))
                n += 1
    check_batches(ds, samples, 6, drop_last=drop_last)

