"""pyloader.DataLoader against torch.utils.data.DataLoader, on real shard files.

Native path (a ShardDataset): every batch is compared with what torch's DataLoader reads
from the same dataset with ``num_workers=0`` (torch iterates the dataset's own
``__iter__``, in plan order), for native thread counts, staging (``device="cpu"``,
``pin_memory=True``), shuffle, drop_last, epochs, ``batch_size=None`` and ``collate_fn``.

Generic path (any other dataset): pyloader must behave exactly as torch does -- samplers,
worker processes, ``worker_init_fn``, ``get_worker_info()``, exceptions re-raised with
their type and traceback text, timeouts, persistent workers -- with and without its copy
engine staging the batches.

On a machine without the CUDA driver ``pin_memory=True`` warns once per process
(``pyloader.loader.transfer._warned_pageable``); every test starts in the "already warned"
state so that tests are order-independent, and the tests of the warning reset it.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import pyloader
from pyloader import _C
from pyloader.errors import DeviceError
from pyloader.loader import transfer as _transfer

# Fixed-shape fields, so that torch's default collation can batch them too.
FIELDS: dict[str, Any] = {
    "label": ("int64", ()),
    "img": ("uint8", (3, 4)),
    "vec": ("float32", (2,)),
    "half": ("float16", (2,)),
    "flag": ("bool", ()),
    "small": ("int8", (3,)),
}
N = 45  # a multiple of neither 7 nor 16: the last batch is partial
SHARD_BYTES = 200  # a handful of records per shard: several shards
SEED = 11
PIN_WARNING = "pin_memory needs the CUDA driver"
STAGINGS = [
    pytest.param({}, id="plain"),
    pytest.param({"device": "cpu"}, id="device_cpu"),
    pytest.param({"pin_memory": True}, id="pin_memory"),
]
# For the tests that drop an iterator with batches still in flight to the copy engine: their
# device="cpu" case runs in a child process (test_device_cpu_close_mid_epoch_keeps_memory_intact).
STAGINGS_IN_PROCESS = [p for p in STAGINGS if p.id != "device_cpu"]
NO_DRIVER = _transfer.driver_error() is not None


def sample(i: int) -> dict[str, Any]:
    """Record i: every field is derived from i, so a misplaced row shows."""
    return {
        "label": i,
        "img": (np.arange(12, dtype=np.int64).reshape(3, 4) * 7 + i).astype(np.uint8),
        "vec": np.array([i + 0.25, -i], np.float32),
        "half": np.array([i / 4, 1 - i], np.float16),
        "flag": i % 3 == 0,
        "small": np.array([i % 128, -(i % 100), 3], np.int8),
    }


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("loader") / "fixed")
    with pyloader.ShardWriter(path, FIELDS, shard_bytes=SHARD_BYTES) as w:
        for i in range(N):
            w.write(sample(i))
    return path


@pytest.fixture(autouse=True)
def _pin_warning_already_issued(monkeypatch) -> None:
    """The once-per-process pin_memory warning counts as issued: tests of staging stay
    silent whatever ran before them (monkeypatch restores the flag afterwards)."""
    monkeypatch.setattr(_transfer, "_warned_pageable", True)


@pytest.fixture
def fresh_pin_warning(monkeypatch) -> None:
    """The process has not warned about pin_memory yet."""
    if not NO_DRIVER:
        pytest.skip("the CUDA driver is present: pin_memory pins and does not warn")
    monkeypatch.setattr(_transfer, "_warned_pageable", False)


def shard_ds(path: str, **kw: Any) -> pyloader.ShardDataset:
    kw.setdefault("seed", SEED)
    return pyloader.ShardDataset(path, **kw)


def assert_same(got: Any, want: Any, where: str = "batch") -> None:
    """Same structure (types included), same keys, equal tensors (dtype, shape, values)."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.device == want.device, where
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got, want), f"{where}: values differ\n{got}\n{want}"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=False)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def torch_read(dataset: Any, **kw: Any) -> list[Any]:
    return list(tud.DataLoader(dataset, **kw))


def labels_of(batches: list[dict[str, torch.Tensor]]) -> list[int]:
    return [int(x) for b in batches for x in b["label"].reshape(-1)]


# --- native path: batches identical to torch's DataLoader on the same ShardDataset ------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("batch_size", [1, 7, 16])
def test_native_batches_match_torch(shards, batch_size: int, drop_last: bool, shuffle: bool) -> None:
    want = torch_read(shard_ds(shards, shuffle=shuffle), batch_size=batch_size, drop_last=drop_last)
    assert len(want) == (N // batch_size if drop_last else -(-N // batch_size))
    order = labels_of(want)
    if shuffle:
        assert order != sorted(order), "the reference is shuffled"
    else:
        assert order == list(range(len(order)))
    for workers in (0, 2, 3):
        for staging in ({}, {"device": "cpu"}, {"pin_memory": True}):
            loader = pyloader.DataLoader(shard_ds(shards, shuffle=shuffle), batch_size=batch_size,
                                         drop_last=drop_last, num_workers=workers, **staging)
            got = list(loader)
            assert len(loader) == len(want)
            assert_same(got, want, f"num_workers={workers} {staging}")


@pytest.mark.timeout(60)
def test_native_prefetch_depth_does_not_change_the_batches(shards) -> None:
    want = torch_read(shard_ds(shards, shuffle=True), batch_size=7)
    for kw in ({"prefetch": 1}, {"prefetch": 9, "num_workers": 3}, {"num_workers": 2, "prefetch_factor": 1},
               {"num_workers": 3, "prefetch_factor": 4, "device": "cpu", "device_prefetch": 1}):
        got = list(pyloader.DataLoader(shard_ds(shards, shuffle=True), batch_size=7, **kw))
        assert_same(got, want, str(kw))


@pytest.mark.timeout(60)
def test_native_shuffle_argument_overrides_the_dataset(shards) -> None:
    shuffled = labels_of(torch_read(shard_ds(shards, shuffle=True), batch_size=8))
    assert shuffled != list(range(N))
    for ds_shuffle in (False, True):
        for arg, want in ((None, shuffled if ds_shuffle else list(range(N))), (True, shuffled),
                          (False, list(range(N)))):
            loader = pyloader.DataLoader(shard_ds(shards, shuffle=ds_shuffle), batch_size=8, shuffle=arg)
            assert labels_of(list(loader)) == want, f"dataset shuffle={ds_shuffle}, loader shuffle={arg}"


@pytest.mark.timeout(60)
def test_native_generator_seed_replaces_the_dataset_seed(shards) -> None:
    def read(seed: int, **kw: Any) -> list[Any]:
        g = torch.Generator().manual_seed(seed)
        return list(pyloader.DataLoader(shard_ds(shards, shuffle=True, seed=0), batch_size=6, generator=g, **kw))

    first = read(1234)
    assert_same(first, torch_read(shard_ds(shards, shuffle=True, seed=1234), batch_size=6))
    assert_same(read(1234, num_workers=2), first)
    assert_same(read(1234, device="cpu"), first)
    other = labels_of(read(1235))
    assert sorted(other) == list(range(N))
    assert other != labels_of(first), "another generator seed gives another order"
    assert labels_of(first) != labels_of(torch_read(shard_ds(shards, shuffle=True, seed=0), batch_size=6))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_native_each_iteration_is_the_next_epoch(shards, staging: dict[str, Any]) -> None:
    loader = pyloader.DataLoader(shard_ds(shards, shuffle=True), batch_size=8, num_workers=2, **staging)
    epochs = [list(loader) for _ in range(3)]
    ref = shard_ds(shards, shuffle=True)
    for k, got in enumerate(epochs):
        ref.set_epoch(k)
        assert_same(got, torch_read(ref, batch_size=8), f"epoch {k}")
        assert sorted(labels_of(got)) == list(range(N))
    assert len({tuple(labels_of(e)) for e in epochs}) == 3, "the order changes between epochs"
    # Without shuffling every epoch reads the same order.
    plain = pyloader.DataLoader(shard_ds(shards), batch_size=8, **staging)
    assert [labels_of(list(plain)) for _ in range(2)] == [list(range(N))] * 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS_IN_PROCESS)
def test_native_new_iter_leaves_the_previous_one_running(shards, staging: dict[str, Any]) -> None:
    """Issue 27 item 9: each iter() has its own epoch (the k-th reads epoch k) and a new one ends no other."""
    loader = pyloader.DataLoader(shard_ds(shards, shuffle=True), batch_size=5, num_workers=2, **staging)
    ref = shard_ds(shards, shuffle=True)
    want = []
    for epoch in range(3):
        ref.set_epoch(epoch)
        want.append(torch_read(ref, batch_size=5))
    it1 = iter(loader)
    got1 = [next(it1)]
    it2 = iter(loader)
    got2 = [next(it2), next(it2)]
    got1.append(next(it1))  # interleaved: each goes on where it was
    it3 = iter(loader)
    got3 = list(it3)
    got1 += list(it1)
    got2 += list(it2)
    assert_same(got1, want[0], "first iter() reads epoch 0 to its end")
    assert_same(got2, want[1], "second iter() reads epoch 1 to its end")
    assert_same(got3, want[2], "third iter() reads epoch 2")
    for k in range(2):
        ref.set_epoch(3 + k)
        assert_same(list(loader), torch_read(ref, batch_size=5), f"epochs go on after them: {3 + k}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS_IN_PROCESS)
@pytest.mark.parametrize("workers", [0, 2])
def test_native_zip_of_a_loader_with_itself_is_torchs(shards, staging: dict[str, Any], workers: int) -> None:
    """``zip(loader, loader)`` yields pairs (torch's does), not nothing: two unshuffled epochs, batch for batch."""
    ds = shard_ds(shards)
    want = list(zip(tud.DataLoader(ds, batch_size=7), tud.DataLoader(ds, batch_size=7)))
    assert len(want) == 7
    loader = pyloader.DataLoader(shard_ds(shards), batch_size=7, num_workers=workers, **staging)
    got = list(zip(loader, loader))
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert_same(list(g), list(w), f"pair {k}")
    again = list(zip(loader, loader))  # and again: epochs 2 and 3, no stale stream adopted
    assert len(again) == len(want) and all(labels_of(list(a)) == labels_of(list(w)) for a, w in zip(again, want))
    # Shuffled, each of the two reads its own epoch.
    shuffled = pyloader.DataLoader(shard_ds(shards, shuffle=True), batch_size=7, num_workers=workers, **staging)
    pairs = list(zip(shuffled, shuffled))
    ref = shard_ds(shards, shuffle=True)
    for epoch, side in ((0, 0), (1, 1)):
        ref.set_epoch(epoch)
        assert_same([p[side] for p in pairs], torch_read(ref, batch_size=7), f"epoch {epoch}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_zip_of_a_transform_loader_with_itself(shards, executor: str) -> None:
    """Two live iterators of a per-sample transform loader: each has its own workers and reads its whole epoch."""
    def bump(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**s, "label": s["label"] + 1000}

    want = labels_of(torch_read(shard_ds(shards), batch_size=7))
    loader = pyloader.DataLoader(shard_ds(shards), batch_size=7, num_workers=2, transform=bump, executor=executor)
    pairs = list(zip(loader, loader))
    assert labels_of([a for a, _ in pairs]) == labels_of([b for _, b in pairs]) == [x + 1000 for x in want]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
@pytest.mark.parametrize("shuffle", [False, True])
def test_native_batch_size_none_yields_samples_like_torch(write_dataset, staging: dict[str, Any],
                                                          shuffle: bool) -> None:
    path = write_dataset(23)  # the mixed schema: variable-length tensors and bytes
    want = torch_read(shard_ds(path, shuffle=shuffle), batch_size=None)
    assert len(want) == 23 and sorted(int(s["label"]) for s in want) == list(range(23))
    by_label = {int(s["label"]): s for s in want}
    assert isinstance(by_label[4]["blob"], bytes) and by_label[4]["blob"] == b"\x04" * 4
    for workers in (0, 2):
        loader = pyloader.DataLoader(shard_ds(path, shuffle=shuffle), batch_size=None, num_workers=workers,
                                     **staging)
        assert len(loader) == 23
        got = list(loader)
        assert_same(got, want, f"num_workers={workers}")


def _recording_collate(calls: list[list[Any]]) -> Any:
    def collate(samples: list[dict[str, Any]]) -> Any:
        calls.append(samples)
        return {"labels": [int(s["label"]) for s in samples], "blobs": tuple(s["blob"] for s in samples),
                "image": torch.stack([s["image"] for s in samples]).transpose(1, 3),
                "tokens": torch.cat([s["tokens"] for s in samples])}
    return collate


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
@pytest.mark.parametrize("drop_last", [False, True])
def test_native_collate_fn_receives_the_samples_torch_passes(write_dataset, staging: dict[str, Any],
                                                             drop_last: bool) -> None:
    path = write_dataset(23)
    want_calls: list[list[Any]] = []
    want = torch_read(shard_ds(path, shuffle=True), batch_size=7, drop_last=drop_last,
                      collate_fn=_recording_collate(want_calls))
    assert len(want_calls) == (3 if drop_last else 4)
    for workers in (0, 3):
        calls: list[list[Any]] = []
        loader = pyloader.DataLoader(shard_ds(path, shuffle=True), batch_size=7, drop_last=drop_last,
                                     num_workers=workers, collate_fn=_recording_collate(calls), **staging)
        got = list(loader)
        assert len(loader) == len(want)
        assert_same(calls, want_calls, "collate_fn input")  # kept alive past their batch
        assert_same(got, want, "collate_fn output")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_native_collate_fn_with_batch_size_none_gets_each_sample(write_dataset, staging: dict[str, Any]) -> None:
    path = write_dataset(12)

    def collate(s: dict[str, Any]) -> Any:
        return (int(s["label"]), s["blob"], s["half"] * 2)

    want = torch_read(shard_ds(path), batch_size=None, collate_fn=collate)
    got = list(pyloader.DataLoader(shard_ds(path), batch_size=None, collate_fn=collate, **staging))
    assert [w[0] for w in want] == list(range(12))
    assert_same(got, want)


class _CollateFailure(Exception):
    pass


def _collate_fails_at_12(samples: list[dict[str, Any]]) -> torch.Tensor:
    labels = [int(s["label"]) for s in samples]
    if 12 in labels:
        raise _CollateFailure(f"cannot collate {labels}")
    return torch.tensor(labels)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_native_collate_error_arrives_after_the_batches_before_it(shards, staging: dict[str, Any]) -> None:
    loader = pyloader.DataLoader(shard_ds(shards), batch_size=4, collate_fn=_collate_fails_at_12, device_prefetch=3,
                                 **staging)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    assert [b.tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(_CollateFailure, match=r"cannot collate \[12, 13, 14, 15\]") as info:
        next(it)
    assert "_collate_fails_at_12" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_native_iteration_goes_on_after_a_failing_collate(shards, staging: dict[str, Any]) -> None:
    """With torch's DataLoader on the same ShardDataset, the batch after a failing
    collate_fn call is the next one returned: pyloader's epoch must not end there."""
    want = _drain(tud.DataLoader(shard_ds(shards), batch_size=4, collate_fn=_collate_fails_at_12))
    assert [type(e).__name__ for e in want] == ["Tensor"] * 3 + ["_Raised"] + ["Tensor"] * 8
    got = _drain(pyloader.DataLoader(shard_ds(shards), batch_size=4, collate_fn=_collate_fails_at_12, **staging))
    assert [type(e).__name__ for e in got] == [type(e).__name__ for e in want]
    assert_same([b for b in got if isinstance(b, torch.Tensor)], [b for b in want if isinstance(b, torch.Tensor)])


def _stalled(path: str, **kw: Any) -> pyloader.ShardDataset:
    """A ShardDataset whose shards are all pending, as behind a server that stalls: its
    native readers wait for shards that never arrive (NOTE [shard readiness])."""
    ds = shard_ds(path, **kw)
    ds._shards = _C.ShardSet(paths=ds.shard_paths, bytes=ds.shard_bytes, records=ds.records_per_shard,
                             schema=ds._schema, pending=True)
    ds._shards_pid = os.getpid()
    return ds


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [
    pytest.param({"batch_size": 4}, id="batched"),
    pytest.param({"batch_size": 4, "num_workers": 2, "device": "cpu"}, id="device_cpu"),
    pytest.param({"batch_size": 4, "pin_memory": True}, id="pin_memory"),
    pytest.param({"batch_size": None}, id="samples"),
    pytest.param({"batch_size": 4, "collate_fn": list}, id="collate_fn"),
])
def test_native_timeout_raises_loader_timeout_error(shards, kwargs: dict[str, Any]) -> None:
    ds = _stalled(shards)
    loader = pyloader.DataLoader(ds, timeout=0.3, **kwargs)
    start = time.monotonic()
    with pytest.raises(pyloader.LoaderTimeoutError) as info:
        next(iter(loader))
    waited = time.monotonic() - start
    assert isinstance(info.value, RuntimeError)
    # torch's words first (See NOTE [timeout message]), then what pyloader waited for.
    assert str(info.value).startswith("DataLoader timed out after 0.3 seconds: no batch arrived"), str(info.value)
    assert 0.25 <= waited < 10, f"raised after {waited:.2f} s for a timeout of 0.3 s"
    # Once the shards arrive, the next epoch reads everything.
    for i, p in enumerate(ds.shard_paths):
        ds._shards.mark_ready(i, p)
    got = list(loader)
    if kwargs["batch_size"] is None:
        assert [int(s["label"]) for s in got] == list(range(N))
    elif kwargs.get("collate_fn") is list:
        assert [int(s["label"]) for b in got for s in b] == list(range(N))
    else:
        assert_same(got, torch_read(shard_ds(shards), batch_size=4))


@pytest.mark.timeout(60)
def test_native_timeout_in_seconds_as_torch_prints_them(shards) -> None:
    """An int timeout is printed as torch prints it ("after 1 seconds", not "1.0" nor
    "1.000000 s"): torch's own test_timeout matches an integer there."""
    loader = pyloader.DataLoader(_stalled(shards), batch_size=4, timeout=1)
    assert loader.timeout == 1 and type(loader.timeout) is int
    with pytest.raises(pyloader.LoaderTimeoutError) as info:
        next(iter(loader))
    assert re.match(r"DataLoader timed out after \d+ seconds", str(info.value)), str(info.value)
    assert str(info.value).startswith("DataLoader timed out after 1 seconds: no batch arrived"), str(info.value)


# --- native path: staging state, pin_memory without a driver, argument checks -----------------


@pytest.mark.timeout(60)
def test_native_device_cpu_stats_count_copy_jobs(shards) -> None:
    loader = pyloader.DataLoader(shard_ds(shards), batch_size=4, device="cpu", device_prefetch=3)
    assert loader.stats() == {}
    it = iter(loader)
    got = []
    for k in range(1, 6):
        got.append(next(it))
        stats = loader.stats()
        assert stats["batches"] >= k
        copy = stats["copy"]
        assert copy["backend"] == "cpu"
        assert copy["depth"] == 3
        assert k <= copy["jobs"] <= k + 3, f"{copy['jobs']} copy jobs after {k} batches"
    got += list(it)
    assert len(got) == len(loader) == 12
    copy = loader.stats()["copy"]
    assert copy["jobs"] == 12
    assert copy["bytes"] == sum(t.nbytes for b in got for t in b.values())
    assert_same(got, torch_read(shard_ds(shards), batch_size=4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep_iterator", [True, False], ids=["iterator_kept", "iterator_dropped"])
@pytest.mark.parametrize("staging", STAGINGS)
def test_native_stats_describe_the_last_epoch(shards, staging: dict[str, Any], keep_iterator: bool) -> None:
    """stats(): "the current (or last) epoch ... with a copy engine, its counters under 'copy'"."""
    loader = pyloader.DataLoader(shard_ds(shards), batch_size=4, **staging)
    it = iter(loader)
    assert len(list(it)) == 12
    if not keep_iterator:
        del it
    stats = loader.stats()
    assert stats.get("batches") == 12 and stats.get("records") == N and stats.get("finished") is True, (
        f"the last epoch's counters are lost: {sorted(stats)}")
    if staging.get("device") == "cpu":
        assert stats["copy"]["backend"] == "cpu" and stats["copy"]["jobs"] == 12
    else:
        assert "copy" not in stats


# Closing an iterator while the copy engine still copies batches ahead: run in a child
# process, since writing into freed memory corrupts the heap (or faults) instead of raising.
_CLOSE_MID_EPOCH = """
import sys, torch, pyloader
kind, path, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])


class Big(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {"big": torch.full((1024, 1024), i, dtype=torch.uint8), "label": torch.tensor(i)}


def check(batch, k):
    labels = list(range(4 * k, 4 * k + 4))
    assert batch["label"].tolist() == labels, batch["label"]
    assert [int(x) for x in batch["big"].amax(dim=(1, 2))] == labels


ds = pyloader.ShardDataset(path) if kind == "native" else Big()
for r in range(rounds):
    loader = pyloader.DataLoader(ds, batch_size=4, device="cpu", device_prefetch=3)
    it = iter(loader)
    check(next(it), 0)
    if r % 2:
        it.close()  # the next batches are being copied right now
    else:
        again = iter(loader)  # a second live iterator with its own copy engine, as torch's has its own workers
        check(next(again), 0)
        check(next(it), 1)  # the first one goes on
        check(next(again), 1)
        if r % 4 == 0:
            del again  # dropped while its next batches are being copied, the first one still live
            check(next(it), 2)
        else:
            it, again = again, None  # the older one dropped mid-copy
            check(next(it), 2)
    del it, loader
print("survived")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["native", "generic"])
def test_device_cpu_close_mid_epoch_keeps_memory_intact(tmp_path, kind: str) -> None:
    """close() or a new iter() mid-epoch must stop the copy engine before the batches in
    flight -- their destination tensors and sources -- are freed. (This is also where the
    new-iter() tests get their device="cpu" case: in the test process a heap corrupted by
    a late copy would abort the whole run.)"""
    path = str(tmp_path / "big")
    if kind == "native":
        with pyloader.ShardWriter(path, {"big": ("uint8", (1024, 1024)), "label": ("int64", ())}) as w:
            for i in range(16):
                w.write({"big": np.full((1024, 1024), i, np.uint8), "label": i})
    root = os.path.dirname(os.path.dirname(os.path.abspath(pyloader.__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _CLOSE_MID_EPOCH, kind, path, "200"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0 and "survived" in proc.stdout, (
        f"exit status {proc.returncode} ({_signal_name(proc.returncode)}): {proc.stderr[-2000:]}")


def _signal_name(returncode: int) -> str:
    if returncode >= 0:
        return "no signal"
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


@pytest.mark.timeout(60)
def test_pin_memory_without_driver_warns_once_per_process(shards, fresh_pin_warning) -> None:
    want = torch_read(shard_ds(shards), batch_size=6)
    with pytest.warns(RuntimeWarning, match=PIN_WARNING) as record:
        loader = pyloader.DataLoader(shard_ds(shards), batch_size=6, pin_memory=True)
        first = list(loader)
        second = list(loader)
    assert len([w for w in record if PIN_WARNING in str(w.message)]) == 1
    assert_same(first, want)
    assert_same(second, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any further warning fails
        again = pyloader.DataLoader(shard_ds(shards), batch_size=6, pin_memory=True, device="cpu")
        assert_same(list(again), want)
        generic = pyloader.DataLoader(_MapDataset(10), batch_size=3, pin_memory=True)
        assert_same(list(generic), torch_read(_MapDataset(10), batch_size=3))


@pytest.mark.timeout(60)
def test_pin_memory_without_driver_warns_once_on_the_generic_path(fresh_pin_warning) -> None:
    want = torch_read(_MapDataset(10), batch_size=3)
    with pytest.warns(RuntimeWarning, match=PIN_WARNING) as record:
        loader = pyloader.DataLoader(_MapDataset(10), batch_size=3, pin_memory=True)
        epochs = [list(loader), list(loader)]
        epochs.append(list(pyloader.DataLoader(_MapDataset(10), batch_size=3, pin_memory=True)))
    assert len([w for w in record if PIN_WARNING in str(w.message)]) == 1
    for got in epochs:
        assert_same(got, want)


@pytest.mark.parametrize("arg,value", [
    ("sampler", [0, 1, 2]),
    ("batch_sampler", [[0, 1], [2]]),
    ("worker_init_fn", lambda worker_id: None),
    ("multiprocessing_context", "fork"),
])
def test_native_rejects_process_and_sampling_arguments(shards, arg: str, value: Any) -> None:
    kwargs: dict[str, Any] = {arg: value}
    if arg == "batch_sampler":
        kwargs["batch_size"] = 1
    with pytest.raises(ValueError, match=arg):
        pyloader.DataLoader(shard_ds(shards), **kwargs)


@pytest.mark.parametrize("kwargs", [
    {"num_workers": -1},
    {"timeout": -1},
    {"prefetch_factor": 2},
    {"persistent_workers": True},
    {"batch_size": None, "drop_last": True},
    {"batch_size": 0},
    {"num_workers": 2, "prefetch_factor": -1},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("kind", ["shards", "map"])
def test_argument_checks_match_torch(shards, kind: str, kwargs: dict[str, Any]) -> None:
    ds = shard_ds(shards) if kind == "shards" else _MapDataset(5)
    with pytest.raises(ValueError) as want:
        tud.DataLoader(ds, **kwargs)
    with pytest.raises(ValueError) as got:
        pyloader.DataLoader(ds, **kwargs)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("kind", ["shards", "map"])
def test_device_argument_checks(shards, kind: str) -> None:
    ds = shard_ds(shards) if kind == "shards" else _MapDataset(5)
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="device_prefetch"):
            pyloader.DataLoader(ds, device="cpu", device_prefetch=bad)
    for bad_device in ("mps", "bogus", "meta"):
        with pytest.raises(ValueError, match=repr(bad_device)):
            pyloader.DataLoader(ds, device=bad_device)
    loader = pyloader.DataLoader(ds, device=torch.device("cpu"), device_prefetch=1)
    assert loader.device == torch.device("cpu")
    if kind == "map":
        with pytest.raises(ValueError, match="prefetch"):
            pyloader.DataLoader(ds, prefetch=2)
    else:
        with pytest.raises(ValueError, match="prefetch"):
            pyloader.DataLoader(ds, prefetch=0)


@pytest.mark.skipif(not NO_DRIVER, reason="the CUDA driver is present")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)], ids=str)
def test_cuda_device_without_driver_raises_device_error(shards, device: Any) -> None:
    for ds in (shard_ds(shards), _MapDataset(5)):
        with pytest.raises(DeviceError, match="needs a CUDA GPU"):
            pyloader.DataLoader(ds, device=device)


def test_device_error_is_public() -> None:
    """The error a caller catches for device="cuda" without a driver is importable from pyloader."""
    assert issubclass(DeviceError, pyloader.PyloaderError) and issubclass(DeviceError, RuntimeError)
    assert "DeviceError" in pyloader.__all__
    assert getattr(pyloader, "DeviceError", None) is DeviceError


# --- generic path: any other dataset behaves exactly as with torch's DataLoader --------------


class Pair(NamedTuple):
    tensor: torch.Tensor
    name: str


class _MapDataset(tud.Dataset):
    """Sample i: a dict with a tensor, an int and a string, all derived from i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"x": torch.tensor([i, 2 * i], dtype=torch.float32), "i": i, "name": f"s{i}"}


class _TupleDataset(tud.Dataset):
    def __len__(self) -> int:
        return 9

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return np.full((2, 3), i, np.int16), i, f"n{i}", [np.float64(i / 2)]


class _EveryOther(tud.Sampler[int]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(list(range(self.n - 1, -1, -2)) + list(range(0, self.n, 2)))

    def __len__(self) -> int:
        return len(range(self.n - 1, -1, -2)) + len(range(0, self.n, 2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_generic_shuffle_with_a_seeded_generator_matches_torch(staging: dict[str, Any]) -> None:
    def read(cls: Any, **kw: Any) -> list[list[Any]]:
        loader = cls(_MapDataset(23), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5), **kw)
        return [list(loader) for _ in range(2)]

    want = read(tud.DataLoader)
    assert [int(v) for b in want[0] for v in b["i"]] != list(range(23)), "the reference is shuffled"
    assert_same(read(pyloader.DataLoader, **staging), want)
    assert len(pyloader.DataLoader(_MapDataset(23), batch_size=4, drop_last=True, **staging)) == 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_generic_sampler_and_batch_sampler_match_torch(staging: dict[str, Any]) -> None:
    for kw in ({"sampler": _EveryOther(11), "batch_size": 3},
               {"sampler": _EveryOther(11), "batch_size": 3, "drop_last": True},
               {"batch_sampler": [[4, 1], [0], [10, 9, 8, 7, 2], [3, 3]]}):
        want = torch_read(_MapDataset(11), **kw)
        loader = pyloader.DataLoader(_MapDataset(11), **kw, **staging)
        assert len(loader) == len(want)
        assert_same(list(loader), want, str(kw))
        assert loader.batch_sampler is not None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_generic_batch_size_none_matches_torch(staging: dict[str, Any]) -> None:
    want = torch_read(_TupleDataset(), batch_size=None)
    assert isinstance(want[3][0], torch.Tensor) and want[3][1] == 3 and want[3][2] == "n3"
    loader = pyloader.DataLoader(_TupleDataset(), batch_size=None, **staging)
    assert len(loader) == 9
    assert_same(list(loader), want)


def _structured_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Nested containers, namedtuples, non-tensor leaves, odd tensors."""
    x = torch.stack([s["x"] for s in samples])  # (B, 2)
    ids = [s["i"] for s in samples]
    first = ids[0]
    return {
        "pair": Pair(x.t(), samples[0]["name"]),  # a non-contiguous view inside a namedtuple
        "ids": ids,
        "names": tuple(s["name"] for s in samples),
        "nested": [{"deep": (x[:, 1], first, None)}, [torch.zeros(0, 3), torch.empty(len(ids), 0, dtype=torch.int8)]],
        "dtypes": (torch.tensor([i % 2 == 0 for i in ids]), x.to(torch.float16),
                   torch.tensor(ids, dtype=torch.int8) - 100, torch.tensor(float(first)).double()),
        "strided": torch.arange(24).reshape(4, 6)[::2, 1::3],  # non-contiguous, storage offset 1
        "scalar": 3.5,
        "flag": True,
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_generic_collate_fn_structures_match_torch(staging: dict[str, Any]) -> None:
    for workers in (0, 2):
        kw = {"batch_size": 4, "collate_fn": _structured_collate, "num_workers": workers}
        want = torch_read(_MapDataset(10), **kw)
        assert not want[0]["pair"].tensor.is_contiguous()
        got = list(pyloader.DataLoader(_MapDataset(10), **kw, **staging))  # all held: no buffer reused
        assert_same(got, want, f"num_workers={workers}")
        for g in got:
            assert type(g["pair"]) is Pair and g["nested"][0]["deep"][2] is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_generic_collate_fn_mapping_and_sequence_types_are_kept(staging: dict[str, Any]) -> None:
    """torch leaves collate_fn's result untouched; pinning (torch's pin_memory too) keeps
    a mutable mapping's or sequence's type by copying it and replacing the items."""

    class Tagged(list):
        tag = "kept"

    def collate(samples: list[dict[str, Any]]) -> Any:
        d = collections.defaultdict(list)
        d["x"] = torch.stack([s["x"] for s in samples])
        od = collections.OrderedDict(b=torch.tensor([s["i"] for s in samples]), a="leaf")
        return {"default": d, "ordered": od, "tagged": Tagged([od["b"] * 2, "t"])}

    want = torch_read(_MapDataset(7), batch_size=3, collate_fn=collate)
    got = list(pyloader.DataLoader(_MapDataset(7), batch_size=3, collate_fn=collate, **staging))
    assert_same(got, want)
    assert all(isinstance(g["default"], collections.defaultdict) and g["default"].default_factory is list
               for g in got)


_INIT_WORKER = -1  # set by _record_worker_init in each worker process


def _record_worker_init(worker_id: int) -> None:
    global _INIT_WORKER
    info = tud.get_worker_info()
    assert info is not None and info.id == worker_id
    _INIT_WORKER = worker_id + 100


class _WorkerSeen(tud.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        info = tud.get_worker_info()
        return torch.tensor([i, _INIT_WORKER, -1 if info is None else info.id])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_generic_worker_init_fn_runs_in_each_worker(staging: dict[str, Any]) -> None:
    kw = {"batch_size": 2, "num_workers": 2, "worker_init_fn": _record_worker_init, "timeout": 30}
    want = torch_read(_WorkerSeen(), **kw)
    got = list(pyloader.DataLoader(_WorkerSeen(), **kw, **staging))
    assert_same(got, want)
    rows = torch.cat(got)
    assert rows[:, 0].tolist() == list(range(12))
    assert (rows[:, 1] == rows[:, 2] + 100).all(), "each sample saw its own worker's init"
    assert set(rows[:, 2].tolist()) == {0, 1}
    assert _INIT_WORKER == -1, "worker_init_fn ran in the workers only"


class _ShardedStream(tud.IterableDataset):
    """Worker w of k yields w, w + k, ... (the whole range without workers)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = tud.get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(w, self.n, k):
            yield {"i": torch.tensor(i), "worker": w, "sq": torch.tensor([i * i], dtype=torch.int32)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_generic_iterable_dataset_sharded_by_worker_matches_torch(staging: dict[str, Any]) -> None:
    for kw in ({"batch_size": 3, "num_workers": 2, "timeout": 30}, {"batch_size": 3}, {"batch_size": None}):
        want = torch_read(_ShardedStream(17), **kw)
        got = list(pyloader.DataLoader(_ShardedStream(17), **kw, **staging))
        assert_same(got, want, str(kw))
        ids = [int(x) for b in got for x in b["i"].reshape(-1)]
        assert sorted(ids) == list(range(17)), "every sample once across the workers"
        if kw.get("num_workers"):
            assert {int(w) for b in got for w in b["worker"]} == {0, 1}


class SampleError(Exception):
    """A dataset's own exception class: must come back with its type."""


class _FailsAt(tud.Dataset):
    def __init__(self, bad: int, exc: type[Exception]) -> None:
        self.bad = bad
        self.exc = exc

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.bad:
            raise self.exc(f"sample {i} is broken")
        return torch.tensor([i, -i])


class _Raised(NamedTuple):
    """An exception seen by a test, without its traceback (which would keep the loader's
    iterator, and so its worker processes, alive in a reference cycle)."""

    type: type
    message: str
    frames: list[str]  # the function names in its traceback


def _raised(e: BaseException) -> _Raised:
    return _Raised(type(e), str(e), [f.name for f in traceback.extract_tb(e.__traceback__)])


def _torch_iterators(it: Any) -> list[Any]:
    """The torch iterators behind ``it`` (itself, or the one under a pyloader iterator):
    taken right after iter(), since a pyloader iterator lets go of its source on close."""
    return [obj for obj in (it, getattr(it, "_source", None)) if hasattr(obj, "_shutdown_workers")]


def _shut_down(iterators: list[Any]) -> None:
    """Test hygiene: stops torch iterators' worker processes now. Left to the cycle
    collector (an exception's traceback keeps an iterator in a reference cycle), torch's
    shutdown runs after the worker queues were finalized and waits 5 s per worker."""
    for obj in iterators:
        obj._shutdown_workers()


def _drain(loader: Any, max_errors: int = 3) -> list[Any]:
    """Every batch of an epoch, and in their place the exceptions raised (as _Raised):
    like torch's loop, iteration goes on after a failing batch."""
    events: list[Any] = []
    it = iter(loader)
    workers = _torch_iterators(it)
    try:
        while sum(isinstance(e, _Raised) for e in events) < max_errors:
            try:
                events.append(next(it))
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001 - the exceptions under test
                events.append(_raised(e))
    finally:
        _shut_down(workers)
    return events


def _until_error(events: list[Any]) -> tuple[list[Any], _Raised]:
    for k, e in enumerate(events):
        if isinstance(e, _Raised):
            return events[:k], e
    raise AssertionError(f"no exception in {len(events)} batches")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
@pytest.mark.parametrize("exc", [SampleError, KeyError], ids=["custom", "KeyError"])
@pytest.mark.parametrize("workers", [0, 2])
def test_generic_dataset_exception_keeps_type_traceback_and_order(staging: dict[str, Any], exc: type[Exception],
                                                                  workers: int) -> None:
    kw = {"batch_size": 2, "num_workers": workers, **({"timeout": 30} if workers else {})}
    want_batches, want_error = _until_error(_drain(tud.DataLoader(_FailsAt(7, exc), **kw)))
    assert len(want_batches) == 3
    got_batches, got_error = _until_error(_drain(pyloader.DataLoader(_FailsAt(7, exc), device_prefetch=4, **kw,
                                                                     **staging)))
    assert_same(got_batches, want_batches, "batches before the failing one")
    assert got_error.type is exc
    assert got_error.message == want_error.message
    assert "sample 7 is broken" in got_error.message
    if workers:
        assert "Original Traceback" in got_error.message and "__getitem__" in got_error.message
    else:
        assert "__getitem__" in got_error.frames, "the original traceback is kept"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
@pytest.mark.parametrize("workers", [0, 2])
def test_generic_iteration_goes_on_after_a_failing_batch(staging: dict[str, Any], workers: int) -> None:
    """torch skips a batch whose sample raised: the next next() returns the batch after it."""
    kw = {"batch_size": 2, "num_workers": workers, **({"timeout": 30} if workers else {})}
    want = _drain(tud.DataLoader(_FailsAt(7, KeyError), **kw))
    assert [type(e).__name__ for e in want] == ["Tensor"] * 3 + ["_Raised"] + ["Tensor"] * 2
    got = _drain(pyloader.DataLoader(_FailsAt(7, KeyError), **kw, **staging))
    assert [type(e).__name__ for e in got] == [type(e).__name__ for e in want]
    assert_same([b for b in got if isinstance(b, torch.Tensor)], [b for b in want if isinstance(b, torch.Tensor)])


class _Stalls(tud.Dataset):
    """Sample ``stall`` waits for ``release`` (shared with the forked workers)."""

    def __init__(self, stall: int, release: Any) -> None:
        self.stall = stall
        self.release = release

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.stall:
            self.release.wait(20)
        return torch.tensor([i])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [0.3, 1])
@pytest.mark.parametrize("staging", STAGINGS)
def test_generic_timeout_matches_torch(staging: dict[str, Any], timeout: float) -> None:
    """torch raises RuntimeError when a worker takes longer than ``timeout``: pyloader's
    generic path must too, after the batches that did arrive, with torch's message (an int
    timeout printed as an int: "after 1 seconds"). (The native path's timeout is tested on a
    stalled ShardDataset above.)"""
    ctx = multiprocessing.get_context("fork")
    outcomes = []
    for cls, extra in ((tud.DataLoader, {}), (pyloader.DataLoader, staging)):
        release = ctx.Event()
        it = iter(cls(_Stalls(2, release), batch_size=2, num_workers=1, timeout=timeout, **extra))
        workers = _torch_iterators(it)
        error: _Raised | None = None
        start = time.monotonic()
        try:
            first = next(it)
            try:
                next(it)
            except Exception as e:  # noqa: BLE001 - the exception under test
                error = _raised(e)
            waited = time.monotonic() - start
        finally:
            release.set()  # the stalled worker finishes, so that shutting it down is quick
            _shut_down(workers)
        outcomes.append((first, error, waited))
    (want, want_error, _), (got, error, waited) = outcomes
    assert want_error is not None and error is not None
    assert_same(got, want)
    assert error.type is want_error.type and issubclass(error.type, RuntimeError)
    assert error.message == want_error.message and f"timed out after {timeout} seconds" in error.message
    assert timeout - 0.05 <= waited < 10


class _Pids(tud.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, os.getpid()])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_generic_persistent_workers_survive_epochs(staging: dict[str, Any]) -> None:
    loader = pyloader.DataLoader(_Pids(), batch_size=3, num_workers=2, persistent_workers=True, timeout=30, **staging)
    pids = []
    try:
        for epoch in range(3):
            batches = list(loader)
            rows = torch.cat(batches)
            assert rows[:, 0].tolist() == list(range(10)), f"epoch {epoch}"
            assert [len(b) for b in batches] == [3, 3, 3, 1]
            pids.append(set(rows[:, 1].tolist()))
    finally:
        _shut_down(_torch_iterators(getattr(getattr(loader, "_inner", None), "_iterator", None)))
    assert len(pids[0]) == 2 and os.getpid() not in pids[0]
    assert pids[1] == pids[0] and pids[2] == pids[0], "the same worker processes serve every epoch"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS_IN_PROCESS)
@pytest.mark.parametrize("workers", [0, 2])
def test_generic_new_iter_while_the_previous_is_alive(staging: dict[str, Any], workers: int) -> None:
    """torch lets a second iter() start while the first iterator is still referenced."""
    want = torch_read(_MapDataset(9), batch_size=4)
    loader = pyloader.DataLoader(_MapDataset(9), batch_size=4, num_workers=workers,
                                 **({"timeout": 30} if workers else {}), **staging)
    first = iter(loader)
    workers = _torch_iterators(first)
    try:
        assert_same(next(first), want[0])
        second = iter(loader)
        assert_same(list(second), want)
    finally:
        _shut_down(workers)


class _SlowFirst(tud.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        if i < 2:
            time.sleep(0.3)  # worker 0's first batch is late
        return torch.tensor([i])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staging", STAGINGS)
def test_generic_in_order_false_still_yields_every_batch(staging: dict[str, Any]) -> None:
    kw = {"batch_size": 2, "num_workers": 2, "in_order": False, "timeout": 30}
    want = torch_read(_SlowFirst(), **kw)
    got = list(pyloader.DataLoader(_SlowFirst(), **kw, **staging))
    assert len(got) == len(want) == 6
    assert sorted(b.flatten().tolist() for b in got) == sorted(b.flatten().tolist() for b in want)
    assert sorted(int(x) for b in got for x in b) == list(range(12))


@pytest.mark.timeout(60)
def test_generic_device_cpu_stats_count_copy_jobs() -> None:
    loader = pyloader.DataLoader(_MapDataset(20), batch_size=3, device="cpu", device_prefetch=2)
    it = iter(loader)
    for k in range(1, 4):
        next(it)
        copy = loader.stats()["copy"]
        assert copy["backend"] == "cpu"
        assert k <= copy["jobs"] <= k + 2
    rest = list(it)
    assert len(rest) == 4
    assert loader.stats()["copy"]["jobs"] == 7
    plain = pyloader.DataLoader(_MapDataset(20), batch_size=3)
    list(plain)
    assert "copy" not in plain.stats()
