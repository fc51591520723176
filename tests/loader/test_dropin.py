"""pyloader.DataLoader where torch's DataLoader is expected: patched in, checked with isinstance,
subscripted, frozen attributes, and re-built from its attributes by framework code.

``lightning_rebuild`` and ``accelerate_rebuild`` are written after what Lightning's
``_update_dataloader`` (``_get_dataloader_init_args_and_kwargs``) and Accelerate's
``prepare_data_loader`` do with a loader they are given: inspect ``__init__``'s signature,
read the attributes of the same names, inject a ``DistributedSampler`` (or a sharded batch
sampler) and construct a new loader. Neither package is a dependency; the patterns are
plain code here.

``TORCH_CASES`` runs torch's own DataLoader behaviours (ordering, samplers, batch samplers,
auto-collation off, drop_last, generators, ``len()``, worker processes, exceptions) through
``torch.utils.data.DataLoader`` patched to ``pyloader.DataLoader`` and compares with torch.
"""

from __future__ import annotations

import inspect
import multiprocessing
import typing
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from torch.utils.data.dataloader import DataLoader as TorchDataLoader
from torch.utils.data.dataloader import _InfiniteConstantSampler, _MultiProcessingDataLoaderIter

import pyloader
from pyloader.loader import transfer as _transfer

N = 23
FROZEN = ["batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"]


@pytest.fixture(autouse=True)
def _pin_warning_already_issued(monkeypatch) -> None:
    """The once-per-process pin_memory warning counts as issued (see test_dataloader.py)."""
    monkeypatch.setattr(_transfer, "_warned_pageable", True)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dropin") / "ds")
    with pyloader.ShardWriter(path, {"x": ("int64", ()), "v": ("float32", (2,))}, shard_bytes=128) as w:
        for i in range(N):
            w.write({"x": i, "v": np.array([i, -i], np.float32)})
    return path


@pytest.fixture
def patched(monkeypatch) -> None:
    """The drop-in: ``torch.utils.data.DataLoader`` is pyloader's class (undone after the test)."""
    monkeypatch.setattr(tud, "DataLoader", pyloader.DataLoader)


class Squares(tud.Dataset):
    """An ordinary map-style dataset (not a pyloader one): the generic path."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"x": torch.tensor(i), "sq": torch.tensor([i * i, -i])}


class Counting(tud.IterableDataset):
    """An ordinary iterable dataset, split across worker processes by get_worker_info()."""

    def __init__(self, n: int = N, length: int | None = None) -> None:
        self.n = n
        self.length = length

    def __iter__(self):
        info = tud.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.n, step))

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("no len")
        return self.length


class FailsAt(tud.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            raise KeyError(f"record {i}")
        return i


def flat(batches: list[Any], key: str | None = None) -> list[int]:
    out: list[int] = []
    for b in batches:
        t = b[key] if key is not None else b
        out.extend(int(v) for v in torch.as_tensor(t).reshape(-1))
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


# --- the class itself ---------------------------------------------------------------------


def test_subclass_of_torch_dataloader(shards):
    assert issubclass(pyloader.DataLoader, tud.DataLoader)
    for ds in (Squares(), pyloader.ShardDataset(shards)):
        loader = pyloader.DataLoader(ds, batch_size=4)
        assert isinstance(loader, tud.DataLoader)
        assert isinstance(loader, TorchDataLoader)


def test_generic_like_torch(shards):
    alias = pyloader.DataLoader[int]
    assert typing.get_origin(alias) is pyloader.DataLoader
    assert typing.get_args(alias) == (int,)
    loader = pyloader.DataLoader[dict](Squares(), batch_size=5)
    assert isinstance(loader, pyloader.DataLoader)
    assert flat(list(loader), "x") == list(range(N))
    assert flat(list(pyloader.DataLoader[dict](pyloader.ShardDataset(shards), batch_size=5)), "x") == list(range(N))


def test_signature_is_torchs_plus_keyword_extras():
    ours = inspect.signature(pyloader.DataLoader.__init__).parameters
    theirs = inspect.signature(TorchDataLoader.__init__).parameters
    assert list(ours)[:len(theirs)] == list(theirs)
    for name, p in theirs.items():
        assert ours[name].kind == p.kind, name
        assert ours[name].default == p.default, name
    extras = list(ours)[len(theirs):]
    assert extras == ["device", "device_prefetch", "prefetch", "transform", "executor", "batch_transform",
                      "memory_budget", "pack"]
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in extras)


# --- the drop-in patch ----------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_patched_torch_loads_ordinary_datasets(patched, shards):
    assert tud.DataLoader is pyloader.DataLoader
    loader = tud.DataLoader(Squares(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    assert isinstance(loader, pyloader.DataLoader)
    assert sorted(flat(list(loader), "x")) == list(range(N))
    assert flat(list(tud.DataLoader(Counting(), batch_size=None)), None) == list(range(N))
    assert flat(list(tud.DataLoader(list(range(10)), batch_size=3)), None) == list(range(10))
    native = tud.DataLoader(pyloader.ShardDataset(shards), batch_size=4)
    assert flat(list(native), "x") == list(range(N))


@pytest.mark.timeout(60)
def test_patched_torch_with_worker_processes(patched):
    loader = tud.DataLoader(Counting(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    assert sorted(flat(list(loader), None)) == list(range(N))
    assert isinstance(loader.multiprocessing_context, multiprocessing.context.BaseContext)


# --- attributes, as torch has them ------------------------------------------------------------


def _loaders(shards: str) -> list[Any]:
    return [pyloader.DataLoader(Squares(), batch_size=4),
            pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=4)]


@pytest.mark.parametrize("attr", FROZEN)
@pytest.mark.parametrize("path", ["generic", "native"])
def test_frozen_attributes_raise_like_torch(attr, path, shards):
    loader = _loaders(shards)[path == "native"]
    before = getattr(loader, attr)
    with pytest.raises(ValueError, match=f"{attr} attribute should not be set after DataLoader is initialized"):
        setattr(loader, attr, before)
    torch_loader = TorchDataLoader(Squares(), batch_size=4)
    with pytest.raises(ValueError, match=f"{attr} attribute should not be set after DataLoader is initialized"):
        setattr(torch_loader, attr, getattr(torch_loader, attr))
    assert getattr(loader, attr) is before


def test_assigned_attributes_take_effect_at_the_next_iter(shards):
    generic = pyloader.DataLoader(Squares(), batch_size=4)
    generic.collate_fn = lambda samples: [int(s["x"]) for s in samples]
    assert list(generic)[0] == [0, 1, 2, 3]
    native = pyloader.DataLoader(pyloader.ShardDataset(shards), batch_size=4)
    native.collate_fn = lambda samples: [int(s["x"]) for s in samples]
    assert list(native)[0] == [0, 1, 2, 3]
    native.collate_fn = None
    native.num_workers = 3  # native collation threads
    assert flat(list(native), "x") == list(range(N))
    assert native.stats()["threads"] == 3


def test_torch_private_attributes_on_the_generic_path():
    ds = Squares()
    ours = pyloader.DataLoader(ds, batch_size=4, drop_last=True, shuffle=True)
    theirs = TorchDataLoader(ds, batch_size=4, drop_last=True, shuffle=True)
    for name in ("batch_size", "drop_last", "num_workers", "pin_memory", "timeout", "worker_init_fn", "generator",
                 "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order", "multiprocessing_context",
                 "collate_fn", "_dataset_kind", "_auto_collation", "_iterator", "_IterableDataset_len_called"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert type(ours.sampler) is type(theirs.sampler) is tud.RandomSampler
    assert type(ours.batch_sampler) is type(theirs.batch_sampler) is tud.BatchSampler
    assert ours._index_sampler is ours.batch_sampler
    assert len(ours) == len(theirs) == N // 4


def test_torch_private_attributes_on_the_native_path(shards):
    ds = pyloader.ShardDataset(shards)
    ours = pyloader.DataLoader(ds, batch_size=4)
    theirs = TorchDataLoader(ds, batch_size=4)
    for name in ("batch_size", "drop_last", "num_workers", "pin_memory", "timeout", "worker_init_fn", "generator",
                 "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order", "multiprocessing_context",
                 "_dataset_kind", "_auto_collation", "_iterator", "_IterableDataset_len_called"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert isinstance(ours.sampler, _InfiniteConstantSampler)
    assert isinstance(ours.batch_sampler, tud.BatchSampler) and ours.batch_sampler.batch_size == 4
    assert ours._index_sampler is ours.batch_sampler
    assert len(ours) == len(theirs) == -(-N // 4)
    assert ours._IterableDataset_len_called == theirs._IterableDataset_len_called == N
    # collate_fn stays None on the native path (native collation); torch fills in its default.
    assert ours.collate_fn is None
    unbatched = pyloader.DataLoader(ds, batch_size=None)
    assert unbatched.batch_sampler is None and not unbatched._auto_collation


def test_multiprocessing_context_like_torch(shards):
    loader = pyloader.DataLoader(Squares(), num_workers=1, multiprocessing_context="spawn")
    assert loader.multiprocessing_context is torch.multiprocessing.get_context("spawn")
    loader.multiprocessing_context = "fork"
    assert loader.multiprocessing_context is torch.multiprocessing.get_context("fork")
    with pytest.raises(ValueError, match="multiprocessing_context can only be used with multi-process loading"):
        pyloader.DataLoader(Squares(), multiprocessing_context="fork")
    native = pyloader.DataLoader(pyloader.ShardDataset(shards), num_workers=2)
    assert native.multiprocessing_context is None
    native.multiprocessing_context = None
    with pytest.raises(ValueError, match="multiprocessing_context is not supported"):
        native.multiprocessing_context = "fork"


@pytest.mark.timeout(60)
def test_persistent_workers_iterator_reset_like_lightning():
    """Lightning's ``_shutdown_workers_and_reset_iterator``: ``_iterator`` is torch's persistent iterator."""
    loader = pyloader.DataLoader(Squares(), batch_size=4, num_workers=1, persistent_workers=True,
                                 multiprocessing_context="fork")
    assert loader._iterator is None
    assert flat(list(loader), "x") == list(range(N))
    it = loader._iterator
    assert isinstance(it, _MultiProcessingDataLoaderIter)
    assert flat(list(loader), "x") == list(range(N))
    assert loader._iterator is it  # the workers persisted
    it._shutdown_workers()
    loader._iterator = None
    assert flat(list(loader), "x") == list(range(N))
    assert loader._iterator is not it
    loader._iterator._shutdown_workers()


# --- frameworks re-building a loader ----------------------------------------------------------


def lightning_rebuild(dataloader: Any, sampler: Any) -> Any:
    """What Lightning's ``_update_dataloader`` does to a loader it did not wrap."""
    if not isinstance(dataloader, tud.DataLoader):
        raise ValueError("needs to subclass torch.utils.data.DataLoader")
    attrs = {k: v for k, v in vars(dataloader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = dataloader.multiprocessing_context  # a property, not in vars()
    params = dict(inspect.signature(dataloader.__init__).parameters)
    assert not any(p.kind is p.VAR_KEYWORD for p in params.values())
    non_defaults = {name for name, p in params.items() if name in attrs and p.default is not attrs[name]}
    non_defaults.add("dataset")
    kwargs = {k: v for k, v in attrs.items() if k in non_defaults}
    if isinstance(kwargs["dataset"], tud.IterableDataset):
        kwargs["batch_sampler"] = None
        kwargs["sampler"] = None
    else:
        batch_sampler = dataloader.batch_sampler
        assert batch_sampler is None or type(batch_sampler) is tud.BatchSampler
        kwargs.update(sampler=sampler, shuffle=False, batch_sampler=None)
    required = {p.name for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.default is p.empty and p.name not in kwargs}
    assert not required, required
    missing = set(kwargs) - params.keys()
    assert not missing, missing
    return type(dataloader)(**kwargs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_lightning_injects_distributed_sampler(workers):
    ds = Squares()
    kw: dict[str, Any] = {"multiprocessing_context": "fork", "persistent_workers": True} if workers else {}
    loader = pyloader.DataLoader(ds, batch_size=3, shuffle=True, num_workers=workers, drop_last=False, **kw)
    seen: list[int] = []
    for rank in range(2):
        sampler = tud.DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=5)
        sampler.set_epoch(1)
        new = lightning_rebuild(loader, sampler)
        assert type(new) is pyloader.DataLoader
        assert new.sampler is sampler and new.batch_size == 3 and new.num_workers == workers
        got = flat(list(new), "x")
        assert got == list(sampler)  # the order is the sampler's, passed through to torch
        seen += got
        new._iterator is not None and new._iterator._shutdown_workers()
    assert set(seen) == set(range(N)) and len(seen) == 2 * -(-N // 2)  # DistributedSampler pads


def test_lightning_rebuilds_a_native_loader(shards):
    ds = pyloader.ShardDataset(shards, shuffle=True, seed=4)
    loader = pyloader.DataLoader(ds, batch_size=5, drop_last=True, num_workers=2, device="cpu")
    new = lightning_rebuild(loader, sampler=None)
    assert type(new) is pyloader.DataLoader and new.device == loader.device and new.num_workers == 2
    assert all(same(a, b) for a, b in zip(list(new), list(pyloader.DataLoader(ds, batch_size=5, drop_last=True)),
                                          strict=True))


# Accelerate's _PYTORCH_DATALOADER_KWARGS: the constructor arguments it copies, with defaults.
ACCELERATE_KWARGS: dict[str, Any] = {
    "batch_size": 1, "shuffle": False, "sampler": None, "batch_sampler": None, "num_workers": 0,
    "collate_fn": None, "pin_memory": False, "drop_last": False, "timeout": 0, "worker_init_fn": None,
    "multiprocessing_context": None, "generator": None, "prefetch_factor": 2, "persistent_workers": False,
    "pin_memory_device": "", "in_order": True,
}


class ShardedBatchSampler(tud.Sampler):
    """Every ``num_processes``-th batch of a batch sampler (Accelerate's BatchSamplerShard, simplified)."""

    def __init__(self, batch_sampler: Any, num_processes: int, process_index: int) -> None:
        self.batch_sampler, self.num_processes, self.process_index = batch_sampler, num_processes, process_index

    def __iter__(self):
        for i, batch in enumerate(self.batch_sampler):
            if i % self.num_processes == self.process_index:
                yield batch

    def __len__(self) -> int:
        return len(range(self.process_index, len(self.batch_sampler), self.num_processes))


def accelerate_rebuild(dataloader: Any, num_processes: int, process_index: int) -> Any:
    """What Accelerate's ``prepare_data_loader`` reads from a loader and builds from it."""
    if not isinstance(dataloader, tud.DataLoader):  # Accelerator.prepare passes anything else through
        raise TypeError("not prepared as a DataLoader")
    dataset = dataloader.dataset
    new_batch_sampler = dataloader.batch_sampler if not isinstance(dataset, tud.IterableDataset) else None
    sampler_is_batch_sampler = isinstance(dataloader.sampler, tud.BatchSampler)
    sampler = getattr(dataloader.sampler if sampler_is_batch_sampler else dataloader.batch_sampler, "sampler", None)
    if isinstance(dataset, tud.IterableDataset):
        raise NotImplementedError  # IterableDatasetShard: not exercised here
    if hasattr(sampler, "generator") and sampler.generator is None:
        sampler.generator = torch.Generator()
    new_batch_sampler = ShardedBatchSampler(dataloader.batch_sampler, num_processes, process_index)
    ignore = {"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"}
    kwargs = {k: getattr(dataloader, k, d) for k, d in ACCELERATE_KWARGS.items() if k not in ignore}
    # DataLoaderShard is a subclass of torch's DataLoader (the class bound when it was imported).
    return TorchDataLoader(dataset, batch_sampler=new_batch_sampler, **kwargs)


@pytest.mark.timeout(60)
def test_accelerate_shards_a_generic_loader():
    ds = Squares()
    loader = pyloader.DataLoader(ds, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(9),
                                 pin_memory=True, num_workers=1, prefetch_factor=3, multiprocessing_context="fork")
    reference = flat(list(TorchDataLoader(ds, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(9))),
                     "x")
    parts = []
    for rank in range(2):
        new = accelerate_rebuild(loader, 2, rank)
        assert new.pin_memory is True and new.num_workers == 1 and new.prefetch_factor == 3
        assert new.collate_fn is loader.collate_fn is tud.default_collate
        new.pin_memory = False  # no accelerator on a CPU test machine: torch would warn
        loader.generator.manual_seed(9)
        parts.append([flat([b], "x") for b in new])
    merged = [x for pair in zip(*parts, strict=False) for b in pair for x in b]
    assert sorted(merged + [x for b in parts[0][len(parts[1]):] for x in b]) == sorted(reference)


# --- torch's behaviours, through the patched name -------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


TORCH_CASES: list[Any] = [
    pytest.param(lambda: Squares(), lambda: {"batch_size": 4}, id="sequential"),
    pytest.param(lambda: Squares(), lambda: {"batch_size": 4, "drop_last": True}, id="drop_last"),
    pytest.param(lambda: Squares(), lambda: {"batch_size": 4, "shuffle": True, "generator": _gen(1)}, id="shuffle"),
    pytest.param(lambda: Squares(), lambda: {"batch_size": None}, id="no_auto_collation"),
    pytest.param(lambda: Squares(), lambda: {"sampler": tud.SubsetRandomSampler(range(0, N, 2), generator=_gen(2)),
                                             "batch_size": 3}, id="sampler"),
    pytest.param(lambda: Squares(), lambda: {"batch_sampler": [[3, 1], [0], [5, 6, 7]]}, id="batch_sampler_list"),
    pytest.param(lambda: Squares(), lambda: {"batch_size": 4, "collate_fn": lambda b: len(b)}, id="collate_fn"),
    pytest.param(lambda: list(range(7)), lambda: {"batch_size": 2}, id="list"),
    pytest.param(lambda: Counting(), lambda: {"batch_size": 5}, id="iterable"),
    pytest.param(lambda: Counting(), lambda: {"batch_size": 5, "drop_last": True}, id="iterable_drop_last"),
    pytest.param(lambda: Counting(), lambda: {"batch_size": 3, "num_workers": 2, "multiprocessing_context": "fork"},
                 id="iterable_workers"),
    pytest.param(lambda: Squares(), lambda: {"batch_size": 4, "num_workers": 2, "multiprocessing_context": "fork",
                                             "in_order": True}, id="map_workers"),
    pytest.param(lambda: tud.TensorDataset(torch.arange(10), torch.arange(10) * 2), lambda: {"batch_size": 4},
                 id="tensor_dataset"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("make", "kw"), TORCH_CASES)
def test_patched_behaves_as_torch(patched, make, kw):
    """Each side gets its own dataset, sampler and generator, made alike."""
    ours = tud.DataLoader(make(), **kw())
    assert type(ours) is pyloader.DataLoader
    theirs = TorchDataLoader(make(), **kw())
    assert _has_len(ours) == _has_len(theirs)
    if _has_len(theirs):
        assert len(ours) == len(theirs)
    got, want = list(ours), list(theirs)
    assert same(got, want), (got, want)


def _has_len(loader: Any) -> bool:
    try:
        len(loader)
    except TypeError:
        return False
    return True


@pytest.mark.parametrize("kw", [
    {"batch_size": 2, "shuffle": True, "sampler": tud.SequentialSampler(range(3))},
    {"batch_sampler": [[0]], "batch_size": 2},
    {"batch_sampler": [[0]], "drop_last": True},
    {"batch_size": None, "drop_last": True},
    {"num_workers": -1},
    {"timeout": -1},
    {"prefetch_factor": 2},
    {"persistent_workers": True},
    # torch checks shuffle by its truth value, with the samplers, before any type: so do we.
    {"sampler": tud.SequentialSampler(range(3)), "shuffle": 3},
    {"batch_sampler": [[0]], "sampler": tud.SequentialSampler(range(3)), "shuffle": 3},
    {"batch_sampler": [[0]], "shuffle": "yes"},
    {"batch_sampler": [[0]], "drop_last": 3},
    # torch's order: timeout, prefetch_factor and persistent_workers before batch_size.
    {"batch_size": 0, "timeout": -1},
    {"batch_size": 0, "prefetch_factor": 2},
    {"batch_size": 0, "persistent_workers": True},
])
def test_patched_rejects_what_torch_rejects(patched, kw):
    with pytest.raises(ValueError) as theirs:
        TorchDataLoader(Squares(), **kw)
    with pytest.raises(ValueError) as ours:
        tud.DataLoader(Squares(), **kw)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kw", [
    {"shuffle": 3},
    {"shuffle": True},
    {"sampler": 3},
    {"batch_sampler": 3},
])
def test_patched_iterable_dataset_rejects_what_torch_rejects(patched, kw):
    """torch's messages name the value as the caller gave it ("but got shuffle=3")."""
    with pytest.raises(ValueError) as theirs:
        TorchDataLoader(Counting(), **kw)
    with pytest.raises(ValueError) as ours:
        tud.DataLoader(Counting(), **kw)
    assert str(ours.value) == str(theirs.value)
    assert str(ours.value).startswith("DataLoader with IterableDataset: expected unspecified ")


@pytest.mark.parametrize("shuffle", [1, "yes", np.bool_(True), 0, ""])
def test_patched_takes_any_truth_value_for_shuffle_as_torch(patched, shuffle):
    """torch shuffles a map-style dataset when ``bool(shuffle)``: a flag read as an int
    (``--shuffle 1``) or a numpy bool shuffles the same order with the same generator."""
    loader = tud.DataLoader(Squares(), batch_size=4, shuffle=shuffle, generator=_gen(5))
    want = TorchDataLoader(Squares(), batch_size=4, shuffle=shuffle, generator=_gen(5))
    assert loader.shuffle is bool(shuffle)
    assert flat(list(loader), "x") == flat(list(want), "x")


def test_patched_keeps_an_int_timeout_an_int(patched):
    """torch prints the timeout as given ("DataLoader timed out after 2 seconds"; its test
    matches an integer): an int stays an int, through the generic path's torch loader and
    an assignment."""
    loader = tud.DataLoader(Squares(), num_workers=1, timeout=2)
    assert loader.timeout == 2 and type(loader.timeout) is int and type(loader._inner.timeout) is int
    loader.timeout = np.int64(3)
    assert type(loader.timeout) is int and loader._inner.timeout == 3 and type(loader._inner.timeout) is int
    loader.timeout = 0.5
    assert loader.timeout == 0.5 and loader._inner.timeout == 0.5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_patched_exceptions_as_torch(patched, workers):
    kw: dict[str, Any] = {"num_workers": workers, "multiprocessing_context": "fork"} if workers else {}
    it = iter(tud.DataLoader(FailsAt(), batch_size=2, **kw))
    assert flat([next(it), next(it)], None) == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="record 5"):
        next(it)


def test_patched_iterable_len_warning_as_torch(patched):
    """torch warns when an iterable dataset yields more than its len() said; so does the drop-in."""
    loader = tud.DataLoader(Counting(n=6, length=4), batch_size=None)
    assert len(loader) == 4
    with pytest.warns(UserWarning, match="Length of IterableDataset"):
        assert flat(list(loader), None) == list(range(6))


def _subclasses(cls: type) -> set[type]:
    out = set(cls.__subclasses__())
    for c in list(out):
        out |= _subclasses(c)
    return out


def _wrap_init(init: Any) -> Any:
    def wrapper(obj: Any, *args: Any, **kwargs: Any) -> None:
        old_inside = getattr(obj, "__pl_inside_init", False)
        object.__setattr__(obj, "__pl_inside_init", True)
        params = inspect.signature(init).parameters
        names = [n for n, p in params.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not hasattr(obj, "__pl_saved_args"):
            object.__setattr__(obj, "__pl_saved_args", args)
            object.__setattr__(obj, "__pl_saved_kwargs", kwargs)
            object.__setattr__(obj, "__pl_saved_arg_names", tuple(names[:len(args)]))
            object.__setattr__(obj, "__dataset", args[0] if args else kwargs.get("dataset"))
        init(obj, *args, **kwargs)
        object.__setattr__(obj, "__pl_inside_init", old_inside)
    return wrapper


def _wrap_setattr(method: Any) -> Any:
    def wrapper(obj: Any, name: str, value: Any) -> None:
        prev = getattr(obj, "__pl_current_call", (None, "abc"))
        first_call = prev != (name, "__setattr__")
        object.__setattr__(obj, "__pl_current_call", (name, "__setattr__"))
        method(obj, name, value)
        if first_call and not getattr(obj, "__pl_inside_init", True):
            record = getattr(obj, "__pl_attrs_record", [])
            record.append(((name, value), "__setattr__"))
            object.__setattr__(obj, "__pl_attrs_record", record)
        object.__setattr__(obj, "__pl_current_call", prev)
    return wrapper


@pytest.fixture
def lightning_hooks() -> Any:
    """Lightning's ``_replace_dunder_methods(DataLoader, "dataset")``: while a user's
    ``*_dataloader()`` hook runs, ``__init__`` and ``__setattr__`` of torch's DataLoader and
    of every subclass record how the loader was built and changed."""
    assert issubclass(pyloader.DataLoader, TorchDataLoader)  # imported, as the user's module would have it
    saved = []
    for cls in _subclasses(TorchDataLoader) | {TorchDataLoader}:
        for name, wrap in (("__init__", _wrap_init), ("__setattr__", _wrap_setattr)):
            if name in cls.__dict__:
                saved.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, wrap(cls.__dict__[name]))
    yield
    for cls, name, original in saved:
        setattr(cls, name, original)


def test_lightning_rebuilds_from_recorded_init_args(lightning_hooks):
    """The wrapped path of ``_get_dataloader_init_args_and_kwargs`` and ``_reinstantiate_wrapped_cls``."""
    ds = Squares()
    loader = pyloader.DataLoader(ds, 3, shuffle=True, generator=torch.Generator().manual_seed(1))
    loader.in_order = False  # after __init__: recorded, replayed on the copy
    with pytest.raises(ValueError, match="batch_size attribute should not be set"):
        loader.batch_size = 4
    args, kwargs = getattr(loader, "__pl_saved_args"), dict(getattr(loader, "__pl_saved_kwargs"))
    assert getattr(loader, "__pl_saved_arg_names") == ("dataset", "batch_size")
    assert getattr(loader, "__dataset") is ds
    sampler = tud.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False)
    kwargs.update(sampler=sampler, shuffle=False, batch_sampler=None)
    new = type(loader)(*args, **kwargs)
    for (name, value), _ in getattr(loader, "__pl_attrs_record", []):
        setattr(new, name, value)
    assert type(new) is pyloader.DataLoader and new.in_order is False and new.sampler is sampler
    assert flat(list(new), "x") == list(sampler)


# --- torch's own test suite (benchmarks/torch_dataloader_suite.py): what it found --------------
# Batches staged by pyloader's copy engine (pin_memory=True with CUDA, or device=) reach the
# loop through a pyloader iterator, not torch's: these keep what torch's tests read there.


@pytest.mark.timeout(60)
def test_staged_iterator_lists_torchs_workers():
    """torch's test_partial_workers: ``iter(loader)._workers`` are the worker processes, and
    dropping a partly read iterator stops them."""
    loader = pyloader.DataLoader(Squares(40), batch_size=2, num_workers=2, device="cpu",
                                 multiprocessing_context="fork")
    it = iter(loader)
    assert isinstance(it, pyloader.loader.iterators.LoaderIterator)  # staged, not torch's iterator
    workers = it._workers
    assert len(workers) == 2 and all(w.is_alive() for w in workers)
    assert flat([next(it) for _ in range(5)], "x") == list(range(10))
    del it
    for w in workers:
        w.join(30)
        assert not w.is_alive(), "worker process not stopped after its iterator was dropped"


class _Nested(tud.Dataset):
    def __init__(self) -> None:
        self.items = [torch.nested.nested_tensor([torch.arange(i + 1.0), torch.ones(2)]) for i in range(4)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.items[i]


def _clone(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in batch]


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_staged_nested_tensors_like_torch():
    """torch's test_nested_tensor_multiprocessing (pin_memory=True): a strided nested tensor
    has no one flat buffer for the engine to copy; torch moves it, as its pin_memory does."""
    ds = _Nested()
    got = list(pyloader.DataLoader(ds, batch_size=1, collate_fn=_clone, device="cpu"))
    assert len(got) == len(ds)
    for batch, want in zip(got, ds.items, strict=True):
        assert batch[0].is_nested
        assert all(torch.equal(a, b) for a, b in zip(batch[0].unbind(), want.unbind(), strict=True))


class PinnableBatch:
    """A custom batch type with its own pin_memory(), as in torch's TestCustomPinFn."""

    def __init__(self, t: torch.Tensor, pinned: bool = False) -> None:
        self.t = t
        self.pinned = pinned

    def pin_memory(self) -> PinnableBatch:
        return PinnableBatch(self.t, pinned=True)


def test_custom_batch_pin_memory_is_called_like_torch():
    """torch's test_custom_batch_pin: pinning calls a batch object's own pin_memory() (inside
    containers too), after mappings and sequences, as torch's pin_memory does."""
    leaves: list[torch.Tensor] = []
    batch = {"custom": PinnableBatch(torch.ones(2)), "plain": [torch.zeros(3)], "n": 3}
    build = _transfer._flatten(batch, leaves, custom=lambda obj: obj.pin_memory())
    assert len(leaves) == 1 and torch.equal(leaves[0], torch.zeros(3))  # only the tensor is copied
    out = build([torch.full((3,), 7.0)])
    assert out["custom"].pinned and out["n"] == 3 and torch.equal(out["plain"][0], torch.full((3,), 7.0))
    # The stage calls it only when it pins (a pin-only stage over page-locked memory); over
    # pageable memory, where torch would not pin either, the object passes through.
    stage = _transfer.DeviceStage(None, pin=True, depth=2)
    try:
        p = stage.submit_tree([PinnableBatch(torch.ones(2)), torch.arange(3)])
        got = stage.take(p)
    finally:
        stage.close()
    assert got[0].pinned is stage.pinned and torch.equal(got[1], torch.arange(3))


def test_torch_refuses_first_whatever_pyloader_would_check_first():
    """An argument combination torch refuses gets torch's own message on the generic path (STYLE 11)."""
    ds = torch.utils.data.TensorDataset(torch.arange(10))
    bs = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), 2, False)
    for kw in (dict(batch_size=0, batch_sampler=bs), dict(batch_size=0, sampler=[0, 1], shuffle=True)):
        with pytest.raises(ValueError) as torch_err:
            tud.dataloader.DataLoader(ds, **kw)
        with pytest.raises(ValueError) as ours:
            pyloader.DataLoader(ds, **kw)
        assert str(ours.value) == str(torch_err.value)
