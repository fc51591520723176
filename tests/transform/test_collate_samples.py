"""The default collation of transformed samples: torch's ``default_collate`` results, pyloader's errors.

``collate_samples`` checks the common batch (dicts of one key order, tensors or arrays of
one shape and dtype, Python ints) in one pass per field; every other batch takes the
sample-by-sample path. Both must give what ``torch.utils.data.default_collate`` gives.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import pyloader
from pyloader.transform.stage import collate_samples


class Pair(NamedTuple):
    image: Any
    label: Any


def same(a: Any, b: Any, where: str = "batch") -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} against {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype} {tuple(a.shape)} / {b.dtype} {tuple(b.shape)}"
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


BATCHES = {
    "ints": [{"x": torch.full((3, 4), float(i)), "label": i} for i in range(8)],
    "large ints": [{"label": (1 << 62) + i, "neg": -(1 << 62) - i} for i in range(5)],
    "bools": [{"flag": i % 2 == 0} for i in range(6)],
    "ints and bools": [{"v": True}, {"v": 3}, {"v": False}],
    "floats": [{"v": 0.1 * i} for i in range(6)],
    "numpy scalars": [{"v": np.int32(i), "w": np.float32(i / 3)} for i in range(6)],
    "arrays": [{"a": np.full((2, 3), i, np.int16), "b": np.arange(4, dtype=np.float64) * i} for i in range(5)],
    "nested": [{"p": (torch.tensor(float(i)), i), "q": {"r": torch.arange(3) + i, "s": [i, i + 1]}} for i in range(4)],
    "strings": [{"name": f"s{i}", "label": i} for i in range(3)],
    "tuples": [(torch.zeros(2) + i, i) for i in range(4)],
    "lists": [[torch.zeros(2) + i, 0.5 * i] for i in range(4)],
    "namedtuples": [Pair(torch.full((2, 2), i), i) for i in range(4)],
    "mixed numbers, a float first": [{"v": 0.5}, {"v": 2}, {"v": True}],
    "mixed numbers, an int first": [{"v": 2}, {"v": 0.5}],
}


@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_collated_batches_equal_torchs_default_collate(kind: str) -> None:
    samples = BATCHES[kind]
    same(collate_samples(samples), default_collate(samples), kind)


def test_into_allocated_memory_the_batch_is_the_same() -> None:
    """Stacked fields written into the tensors ``alloc`` gives (the process executor's slots) hold the same values."""
    samples = BATCHES["ints"] + BATCHES["ints"]
    given: list[torch.Tensor] = []

    def alloc(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.full(shape, -7, dtype=dtype)  # (whatever was there before)
        given.append(t)
        return t

    got = collate_samples(samples, alloc)
    same(got, default_collate(samples))
    assert len(given) == 1 and got["x"].data_ptr() == given[0].data_ptr()


def test_an_int_out_of_int64s_range_is_refused_as_torch_refuses_it() -> None:
    samples = [{"label": 1}, {"label": 1 << 64}]
    with pytest.raises(Exception) as ours:
        collate_samples(samples)
    with pytest.raises(Exception) as torchs:
        default_collate(samples)
    assert type(ours.value) is type(torchs.value)


@pytest.mark.parametrize("samples, match", [
    ([{"a": 1, "b": 2}, {"b": 2, "a": 1}], r"sample 1 has keys \['b', 'a'\], sample 0 has \['a', 'b'\]"),
    ([{"a": 1, "b": 2}, {"a": 1}], r"sample 1 has keys \['a'\]"),
    ([{"a": 1}, [1]], r"sample 1 has keys list"),
    ([{"x": torch.zeros(2, 3)}, {"x": torch.zeros(3, 2)}], r"field 'x'.*sample 1 is torch.float32 \(3, 2\)"),
    ([{"x": torch.zeros(3)}, {"x": torch.zeros(3, dtype=torch.int64)}], r"field 'x'.*sample 1 is torch.int64"),
    ([{"x": torch.zeros(3)}, {"x": 3}], r"field 'x'.*another is a int"),
    ([{"v": 1}, {"v": "one"}], r"field 'v'.*mixed types"),
])
def test_samples_that_do_not_collate_are_named(samples: list[Any], match: str) -> None:
    with pytest.raises(pyloader.CollateError, match=match):
        collate_samples(samples)


def test_sequences_of_one_shape_but_their_length_are_padded_with_lengths() -> None:
    samples = [{"seq": torch.arange(n) + 1} for n in (3, 1, 4)]
    got = collate_samples(samples)
    assert got["seq"].tolist() == [[1, 2, 3, 0], [1, 0, 0, 0], [1, 2, 3, 4]]
    assert got["seq_lengths"].tolist() == [3, 1, 4]


def pair_transform(s: dict[str, Any]) -> Pair:
    return Pair(s["x"] * 2, float(s["label"]) / 2)


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_a_loaders_transformed_batches_have_torchs_types(tmp_path, executor: str) -> None:
    """Through the loader (the process executor sends the batch's structure, its tensors in a slot) as torch builds them."""
    path = str(tmp_path / "ds")
    with pyloader.ShardWriter(path, {"x": ("float32", (3,)), "label": "int64"}) as w:
        for i in range(20):
            w.write({"x": np.full(3, i, np.float32), "label": i})
    loader = pyloader.DataLoader(pyloader.ShardDataset(path), batch_size=8, transform=pair_transform,
                                 num_workers=2, executor=executor)
    got = list(loader)
    assert [len(b.label) for b in got] == [8, 8, 4]
    for k, b in enumerate(got):
        ids = range(8 * k, min(20, 8 * k + 8))
        want = default_collate([Pair(torch.full((3,), 2.0 * i), i / 2) for i in ids])
        same(b, want, f"batch {k}")
