"""ShardDataset.batches(): batch counts, identical batches for any thread count, argument
checks, held batches surviving slot reuse, and zero padding in reused slots. Shared checks:
tests/roundtrip_util.py.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
import torch
from roundtrip_util import ID_FIELDS, check_batches, check_samples, field_dtypes, id_samples, write

import pyloader
from pyloader import _C

# --- batches(): sizes, threads, lifetime, padding ------------------------------------------------


@pytest.fixture
def ds23(tmp_path) -> tuple[pyloader.ShardDataset, list[dict[str, Any]]]:
    samples = id_samples(23)
    return pyloader.ShardDataset(write(str(tmp_path / "ds"), ID_FIELDS, samples, shard_bytes=150)), samples


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [1, 5, 22, 23, 24, 100])
def test_batch_counts(ds23, batch_size, drop_last):
    ds, samples = ds23
    it = ds.batches(batch_size, drop_last=drop_last)
    want = 23 // batch_size if drop_last else -(-23 // batch_size)
    assert len(it) == want
    sizes = [int(b["id"].shape[0]) for b in it]
    full = [batch_size] * (23 // batch_size)
    assert sizes == (full if drop_last else full + ([23 % batch_size] if 23 % batch_size else []))
    check_batches(ds, samples, batch_size, drop_last=drop_last)


def test_num_threads_give_identical_batches(ds23):
    ds, _ = ds23

    def snap(nt: int, bs: int, prefetch: int | None = None) -> list[dict[str, Any]]:
        return [{k: (tuple(t.shape), t.numpy().tobytes()) for k, t in b.items()}
                for b in ds.batches(bs, num_threads=nt, prefetch=prefetch)]
    for bs in (1, 4, 7):
        ref = snap(1, bs)
        assert len(ref) == -(-23 // bs)
        for nt in (2, 3, 4):
            for prefetch in (None, 1):
                assert snap(nt, bs, prefetch) == ref, (nt, bs, prefetch)


@pytest.mark.parametrize("bad", [0, -1, 1.0, None])
def test_batches_rejects_bad_arguments(ds23, bad):
    ds, _ = ds23
    with pytest.raises(ValueError):
        ds.batches(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ds.batches(4, num_threads=bad)  # type: ignore[arg-type]


def test_batches_rejects_a_pool_of_other_fields(ds23):
    ds, _ = ds23
    n = len(ds.fields)
    for wrong in (n - 1, n + 1):
        with pytest.raises(ValueError, match=f"slot pool has {wrong} fields but the dataset has {n}"):
            ds.batches(4, pool=_C.SlotPool(num_fields=wrong))
    assert len(list(ds.batches(4, pool=_C.SlotPool(num_fields=n)))) == 6


@pytest.mark.timeout(60)
def test_held_batches_survive_iteration_and_slot_reuse(tmp_path):
    """Keep every batch of an epoch: none may be overwritten while Python holds it, not
    by later batches, not after the iterator is gone, not by later epochs on the same pool."""
    samples = id_samples(200)
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), ID_FIELDS, samples, shard_bytes=400))
    pool = _C.SlotPool(num_fields=len(ds.fields))
    it = ds.batches(8, num_threads=3, prefetch=2, pool=pool)
    held = list(it)
    copies = [{k: t.clone() for k, t in b.items()} for b in held]
    assert len(held) == 25
    assert pool.created >= 25  # each held batch owns its slot
    del it
    gc.collect()
    # Later epochs through the same pool, dropping their batches: they may reuse only free slots.
    for nt in (1, 4):
        for b in ds.batches(8, num_threads=nt, prefetch=3, pool=pool):
            b["v"].fill_(-1)  # scribble on whatever slot we got
            b["img"].fill_(7)
    samples_held = list(ds)  # per-sample views into batch slots
    for _ in ds.batches(3, num_threads=2, pool=pool):
        pass
    for k, (b, c) in enumerate(zip(held, copies, strict=True)):
        for name in c:
            assert torch.equal(b[name], c[name]), f"held batch {k} field {name} changed"
    check_samples(samples_held, samples, field_dtypes(ds))
    # And each held batch still holds the right records.
    for k, b in enumerate(held):
        assert b["id"].tolist() == list(range(8 * k, 8 * k + 8))


def test_slots_are_reused_when_batches_are_dropped(tmp_path):
    samples = id_samples(200)
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), ID_FIELDS, samples, shard_bytes=400))
    pool = _C.SlotPool(num_fields=len(ds.fields))
    n = sum(1 for _ in ds.batches(4, num_threads=2, prefetch=2, pool=pool))
    assert n == 50 and pool.created <= 6


@pytest.mark.parametrize("num_threads", [1, 3])
def test_padding_is_zero_after_longer_rows_in_the_same_slot(tmp_path, num_threads):
    """Batches alternate long rows of 0x7F.. with short rows: every padding byte of a short
    batch must be zero even though its (reused) slot held long rows just before."""
    bs = 4
    samples = []
    # Long and short batches in an irregular order, so that whichever slot rotation the
    # pool settles into, short batches land in slots that held long rows.
    long_batch = np.random.default_rng(0).random(60) < 0.5
    for k in range(60):
        for j in range(bs):
            if long_batch[k]:
                samples.append({"v": np.full((60, 3), 0x7F7F, np.int16), "b": b"\xff" * 200,
                                "f": np.full(5, -1.0, np.float32)})
            else:
                n = [1, 9, 2, 0][j]
                samples.append({"v": np.full((max(n, 1), 3), k, np.int16), "b": b"\x01" * n,
                                "f": np.full(n, k, np.float32)})
    fields = {"v": ("int16", (None, 3)), "b": ("bytes", ()), "f": ("float32", (None,))}
    ds = pyloader.ShardDataset(write(str(tmp_path / "ds"), fields, samples, compression="none", shard_bytes=4096))
    pool = _C.SlotPool(num_fields=3)
    for k, b in enumerate(ds.batches(bs, num_threads=num_threads, prefetch=2, pool=pool)):
        for name in fields:
            t, lens = b[name], b[f"{name}_lengths"]
            for i in range(bs):
                ln = int(lens[i])
                assert ln == len(samples[k * bs + i][name])
                pad = t[i, ln:]
                assert pad.numel() == 0 or not pad.view(torch.uint8).any(), f"batch {k} row {i} {name}: stale bytes"
        del b, t, lens, pad
    assert pool.created <= 5, "slots were not reused: the test did not exercise reuse"
    check_batches(ds, samples, bs, num_threads=num_threads)

