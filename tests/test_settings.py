"""Each public setting is checked once, by one rule (NOTE [one rule per setting] in pyloader.contract).

Every setting is given its boundary values -- ``True`` for an int, ``2**64``, a negative
number, a float, a string -- through every class that receives it, and each must raise the
same ``ValueError`` with the same message, at construction (not at the first epoch). numpy
integers are ints: they are accepted and kept as Python ints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import pyloader
from pyloader.contract import INT_SETTINGS, OrderSpec, check_int, check_size

BAD_INTS = [True, np.bool_(True), 2**64, -1, 1.5, "3", None]
SIZE_SETTINGS = {"memory_budget"}  # settings of bytes: a size string ("3", "8G") is a value, see test_sizes_*


class _Squares(torch.utils.data.Dataset):  # the generic path (torch's DataLoader does the loading)
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i * i


@pytest.fixture()
def sources(write_dataset, tmp_path) -> dict[str, Any]:
    from convert_util import mixed_table, write_parquet

    shards = write_dataset(16)
    return {"shards": shards, "parquet": write_parquet(tmp_path / "a.parquet", mixed_table(16))}


def _error(fn: Callable[[], Any]) -> str:
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


def _receivers(src: dict[str, Any], name: str) -> dict[str, Callable[[Any], Any]]:
    """Every public way to give setting ``name`` a value: constructor keywords, setters, method arguments."""
    shards, parquet = src["shards"], src["parquet"]

    def ds() -> pyloader.ShardDataset:
        return pyloader.ShardDataset(shards)

    table: dict[str, dict[str, Callable[[Any], Any]]] = {
        "seed": {
            "ShardDataset": lambda v: pyloader.ShardDataset(shards, seed=v),
            "ParquetDataset": lambda v: pyloader.ParquetDataset(parquet, seed=v),
            "Mixture": lambda v: pyloader.Mixture([ds()], seed=v),
            "OrderSpec": lambda v: OrderSpec(seed=v),
            "dataset.seed =": lambda v: setattr(ds(), "seed", v),
        },
        "window": {
            "ShardDataset": lambda v: pyloader.ShardDataset(shards, window=v),
            "ParquetDataset": lambda v: pyloader.ParquetDataset(parquet, window=v),
            "OrderSpec": lambda v: OrderSpec(window=v),
        },
        "rank": {
            "ShardDataset": lambda v: pyloader.ShardDataset(shards, rank=v, world_size=2),
            "ParquetDataset": lambda v: pyloader.ParquetDataset(parquet, rank=v, world_size=2),
            "Mixture": lambda v: pyloader.Mixture([ds()], rank=v, world_size=2),
        },
        "world_size": {
            "ShardDataset": lambda v: pyloader.ShardDataset(shards, rank=0, world_size=v),
            "ParquetDataset": lambda v: pyloader.ParquetDataset(parquet, rank=0, world_size=v),
            "Mixture": lambda v: pyloader.Mixture([ds()], rank=0, world_size=v),
        },
        "fetch_jobs": {
            "ShardDataset": lambda v: pyloader.ShardDataset(shards, fetch_jobs=v),
            "ParquetDataset": lambda v: pyloader.ParquetDataset(parquet, fetch_jobs=v),
        },
        "epoch": {
            "ShardDataset.set_epoch": lambda v: ds().set_epoch(v),
            "ParquetDataset.set_epoch": lambda v: pyloader.ParquetDataset(parquet).set_epoch(v),
            "Mixture.set_epoch": lambda v: pyloader.Mixture([ds()]).set_epoch(v),
            "DataLoader.set_epoch": lambda v: pyloader.DataLoader(ds(), batch_size=4).set_epoch(v),
        },
        "batch_size": {
            "DataLoader(ShardDataset)": lambda v: pyloader.DataLoader(ds(), batch_size=v),
            "DataLoader(torch dataset)": lambda v: pyloader.DataLoader(_Squares(), batch_size=v),
            "ShardDataset.batches": lambda v: ds().batches(v),
            "ParquetDataset.batches": lambda v: pyloader.ParquetDataset(parquet).batches(v),
            "Mixture.batches": lambda v: pyloader.Mixture([ds()]).batches(v),
        },
        "num_threads": {
            "ShardDataset.batches": lambda v: ds().batches(4, num_threads=v),
            "ParquetDataset.batches": lambda v: pyloader.ParquetDataset(parquet).batches(4, num_threads=v),
            "Mixture.batches": lambda v: pyloader.Mixture([ds()]).batches(4, num_threads=v),
        },
        "prefetch": {
            "DataLoader": lambda v: pyloader.DataLoader(ds(), batch_size=4, prefetch=v),
            "ShardDataset.batches": lambda v: ds().batches(4, prefetch=v),
            "ParquetDataset.batches": lambda v: pyloader.ParquetDataset(parquet).batches(4, prefetch=v),
        },
        "num_workers": {
            "DataLoader(ShardDataset)": lambda v: pyloader.DataLoader(ds(), batch_size=4, num_workers=v),
            "DataLoader(torch dataset)": lambda v: pyloader.DataLoader(_Squares(), num_workers=v),
            "loader.num_workers =": lambda v: setattr(pyloader.DataLoader(ds(), batch_size=4), "num_workers", v),
        },
        "device_prefetch": {
            "DataLoader(ShardDataset)": lambda v: pyloader.DataLoader(ds(), device_prefetch=v),
            "DataLoader(torch dataset)": lambda v: pyloader.DataLoader(_Squares(), device_prefetch=v),
        },
        "prefetch_factor": {
            "DataLoader(ShardDataset)": lambda v: pyloader.DataLoader(ds(), num_workers=2, prefetch_factor=v),
            "DataLoader(torch dataset)": lambda v: pyloader.DataLoader(_Squares(), num_workers=2, prefetch_factor=v),
            "loader.prefetch_factor =": lambda v: setattr(pyloader.DataLoader(ds(), num_workers=2),
                                                          "prefetch_factor", v),
        },
        "memory_budget": {
            "DataLoader": lambda v: pyloader.DataLoader(ds(), batch_size=4, num_workers="auto", memory_budget=v),
        },
        "samples_per_epoch": {"Mixture": lambda v: pyloader.Mixture([ds()], samples_per_epoch=v)},
        "samples_per_step": {"Mixture": lambda v: pyloader.Mixture([ds()], samples_per_step=v)},
        "seq_len": {"PackSpec": lambda v: pyloader.PackSpec(seq_len=v)},
        "doc_batch": {"PackSpec": lambda v: pyloader.PackSpec(seq_len=8, doc_batch=v)},
    }
    return table[name]


# The settings whose receivers are listed; None is the rule's default where it is optional.
SETTINGS = ["seed", "window", "rank", "world_size", "fetch_jobs", "epoch", "batch_size", "num_threads", "prefetch",
            "num_workers", "device_prefetch", "prefetch_factor", "memory_budget", "samples_per_epoch",
            "samples_per_step", "seq_len", "doc_batch"]


@pytest.mark.parametrize("name", SETTINGS)
def test_a_bad_value_gets_the_same_error_from_every_receiver(sources, name: str) -> None:
    rule = INT_SETTINGS[name]
    for bad in BAD_INTS:
        if bad is None and (rule.optional or name == "batch_size"):
            continue  # None is allowed (batch_size=None: per-sample iteration)
        if bad == -1 and rule.lo < 0:
            continue
        if isinstance(bad, str) and name in SIZE_SETTINGS:
            continue
        expected = _error(lambda: check_int(name, bad))  # noqa: B023 - called at once
        for who, give in _receivers(sources, name).items():
            got = _error(lambda: give(bad))  # noqa: B023 - called at once
            if who.startswith("PackSpec"):
                expected_here = f"PackSpec {expected}"
            else:
                expected_here = expected
            assert got == expected_here, f"{name}={bad!r} through {who}: {got!r}, expected {expected_here!r}"


@pytest.mark.parametrize("name", SETTINGS)
def test_numpy_integers_are_ints(sources, name: str) -> None:
    """A numpy integer of a valid value is accepted by every receiver (and kept as a Python int)."""
    good = {"seed": 3, "window": 8, "rank": 1, "world_size": 2, "fetch_jobs": 2, "epoch": 2, "batch_size": 4,
            "num_threads": 1, "prefetch": 2, "num_workers": 2, "device_prefetch": 3, "prefetch_factor": 2,
            "memory_budget": 1 << 26, "samples_per_epoch": 10, "samples_per_step": 4, "seq_len": 8,
            "doc_batch": 16}[name]
    for who, give in _receivers(sources, name).items():
        out = give(np.int64(good))
        if hasattr(out, "close"):
            out.close()
        assert check_int(name, np.int64(good)) == good and type(check_int(name, np.int64(good))) is int, who


def test_numpy_values_land_as_python_ints(write_dataset) -> None:
    ds = pyloader.ShardDataset(write_dataset(16), seed=np.int64(5), window=np.int32(8), rank=np.int64(0),
                               world_size=np.int64(2), shuffle=np.bool_(True))
    assert (ds.order.seed, ds.order.window, ds.rank, ds.world_size, ds.order.shuffle) == (5, 8, 0, 2, True)
    assert all(type(v) is int for v in (ds.order.seed, ds.order.window, ds.rank, ds.world_size))
    loader = pyloader.DataLoader(ds, batch_size=np.int64(4), num_workers=np.int64(1))
    assert type(loader.batch_size) is int and type(loader.num_workers) is int
    assert [len(b["label"]) for b in loader] == [4, 4]


def test_a_seed_past_64_bits_fails_when_the_dataset_is_built(write_dataset) -> None:
    path = write_dataset(4)
    with pytest.raises(ValueError, match=r"seed must be at most 2\*\*64 - 1, got 18446744073709551616"):
        pyloader.ShardDataset(path, seed=2**64)
    assert pyloader.ShardDataset(path, seed=2**64 - 1, shuffle=True).plan()[0].size == 4  # the largest seed plans


@pytest.mark.parametrize("name,value,message", [
    ("shuffle", "yes", "shuffle must be True or False, got 'yes'"),
    ("shuffle", 1, "shuffle must be True or False, got 1"),
    ("partition", "wrap", "partition must be one of ('pad', 'drop'), got 'wrap'"),
    ("transform", 3, "transform must be callable, got 3"),
])
def test_dataset_settings_get_one_message(sources, name: str, value: Any, message: str) -> None:
    ds = pyloader.ShardDataset(sources["shards"])
    givers = [lambda: pyloader.ShardDataset(sources["shards"], **{name: value}),
              lambda: pyloader.ParquetDataset(sources["parquet"], **{name: value}),
              lambda: pyloader.Mixture([ds], **{name: value}),
              lambda: setattr(pyloader.ShardDataset(sources["shards"]), name, value)]
    for give in givers:
        assert _error(give) == message


@pytest.mark.parametrize("kwargs,message", [
    ({"timeout": -1}, "timeout option should be non-negative"),
    ({"timeout": float("nan")}, "timeout option should be non-negative"),
    ({"timeout": True}, "timeout option should be non-negative"),
    ({"transform": 3}, "transform must be callable, got 3"),
    ({"batch_transform": 3}, "batch_transform must be callable, got 3"),
    ({"executor": "fibres"}, "executor must be one of ('auto', 'threads', 'processes'), got 'fibres'"),
    ({"pin_memory_device": 0}, "pin_memory_device must be a str, got 0"),
    ({"pin_memory_device": "cpu"}, "pin_memory_device='cpu': pyloader pins memory for 'cuda[:N]' only"),
    ({"generator": 3}, "generator must be a torch.Generator, got int"),
])
def test_loader_options_are_checked_whichever_path(write_dataset, kwargs: dict[str, Any], message: str) -> None:
    """The native and the generic path check the loader's own options by the same rules (NOTE [loader options])."""
    ds = pyloader.ShardDataset(write_dataset(8))
    assert _error(lambda: pyloader.DataLoader(ds, **kwargs)) == message
    assert _error(lambda: pyloader.DataLoader(_Squares(), **kwargs)) == message


def test_an_option_assigned_later_is_checked_by_its_rule(write_dataset) -> None:
    loader = pyloader.DataLoader(pyloader.ShardDataset(write_dataset(8)), batch_size=4)
    with pytest.raises(ValueError, match="timeout option should be non-negative"):
        loader.timeout = -3
    assert loader.timeout == 0
    loader.num_workers = np.int64(2)
    assert loader.num_workers == 2 and type(loader.num_workers) is int
    with pytest.raises(ValueError, match="batch_size attribute should not be set after"):
        loader.batch_size = 8  # torch's frozen attribute


def test_the_contract_imports_no_torch() -> None:
    """The write stage checks its settings by the contract's rules too, and its workers run without torch."""
    import subprocess
    import sys

    code = ("import sys, pyloader.contract, pyloader.write.verify, pyloader.write.convert; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("given,expected", [("1G", 1 << 30), ("512MiB", 512 << 20), ("3", 3), (1 << 26, 1 << 26)])
def test_sizes_are_taken_where_a_setting_is_bytes(sources, given: Any, expected: int) -> None:
    """``memory_budget="1G"`` as ``cache_limit="500G"``: one size parser (pyloader.format.sizes.parse_size)."""
    ds = pyloader.ShardDataset(sources["shards"])
    loader = pyloader.DataLoader(ds, batch_size=4, num_workers="auto", memory_budget=given)
    assert loader.memory_budget == expected and type(loader.memory_budget) is int
    assert check_size("memory_budget", given) == expected


@pytest.mark.parametrize("bad", ["lots", "0", "-1G", "1Q", "", 1.5, True])
def test_a_bad_size_gets_the_rule_message(sources, bad: Any) -> None:
    ds = pyloader.ShardDataset(sources["shards"])
    got = _error(lambda: pyloader.DataLoader(ds, batch_size=4, num_workers="auto", memory_budget=bad))
    assert got == f"memory_budget must be a positive number of bytes (an int, or a size such as '8G') or None, " \
                  f"got {bad!r}"
    assert _error(lambda: check_size("memory_budget", bad)) == got


@pytest.mark.parametrize("bad", ["2", 2.0, True, None])
def test_num_workers_of_another_type_is_told_to_be_an_int(sources, bad: Any) -> None:
    """torch words a negative num_workers (its message stays); a value of another type gets no
    words of torch's (a TypeError from a comparison), so it gets the rule's: an int, or 'auto'."""
    shards = sources["shards"]
    want = f"num_workers must be a non-negative int or 'auto', got {bad!r}"
    assert _error(lambda: pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=4, num_workers=bad)) == want
    assert _error(lambda: pyloader.DataLoader(_Squares(), num_workers=bad)) == want
    with pytest.raises(ValueError) as torch_says:
        torch.utils.data.DataLoader(_Squares(), num_workers=-1)
    assert _error(lambda: pyloader.DataLoader(_Squares(), num_workers=-1)) == str(torch_says.value)
    assert "should be non-negative" not in _error(
        lambda: pyloader.DataLoader(_Squares(), num_workers=2, prefetch_factor="2"))
