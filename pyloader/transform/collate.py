"""The default collation of a transform's samples into a batch, as torch's ``default_collate`` builds it.

``collate_samples`` is what both executors call on a batch of transformed samples when the
user gives no ``collate_fn``; the process executor passes ``alloc`` so that stacked fields
are written straight into its shared-memory slot (NOTE [collate into the slot] in pool.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import CollateError

# Where a collated field is written: (shape, dtype) -> an uninitialised contiguous tensor, or None for a new one.
_Alloc = Callable[[tuple[int, ...], torch.dtype], "torch.Tensor | None"]


def collate_samples(samples: Sequence[Any], alloc: _Alloc | None = None) -> Any:
    """Collates transformed samples into one batch, as torch's ``default_collate`` does.

    Tensors and numpy arrays of one shape and dtype are stacked into a new ``[B, ...]``
    tensor; those of a dict key that differ only in their leading dimension (sequences) are
    zero-padded to the longest, with ``<key>_lengths``, as pyloader's variable fields are; numbers become a 1-D
    tensor of torch's dtype for them (Python floats float64, ints int64); strings, bytes and other objects a
    list; dicts, tuples and lists are collated per key or position (a tuple or list gives a list, a namedtuple
    its own type, as torch's). Raises ``CollateError`` naming the
    field whose shapes, dtypes or types differ.

    ``alloc(shape, dtype)``, if given, returns the (uninitialised, contiguous) tensor a
    stacked or padded field is written into, or None for a new one: the process executor
    collates straight into its shared-memory slot (NOTE [collate into the slot] in
    pool.py).
    """
    return _collate("sample", list(samples), alloc)


def _collate(name: str, values: list[Any], alloc: _Alloc | None = None) -> Any:
    v0 = values[0]
    if isinstance(v0, (torch.Tensor, np.ndarray)):
        return _stack(name, values, alloc)
    if isinstance(v0, Mapping):
        keys = list(v0)
        for i, v in enumerate(values):  # (a dict is told without the Mapping ABC's check)
            if not (type(v) is dict or isinstance(v, Mapping)) or list(v) != keys:
                got = list(v) if isinstance(v, Mapping) else type(v).__name__
                raise CollateError(f"cannot collate {name!r}: sample {i} has keys {got}, sample 0 has {keys}")
        prefix = "" if name == "sample" else f"{name}."
        out: dict[Any, Any] = {}
        for k in keys:
            col = [v[k] for v in values]
            c0 = col[0]
            if isinstance(c0, (torch.Tensor, np.ndarray)) and _uniform(col):
                out[k] = _stack(f"{prefix}{k}", col, alloc, checked=True)  # (one shape: not ragged)
                continue
            ragged = _ragged(col, alloc)
            if ragged is not None and f"{k}_lengths" not in keys:
                # Variable-length sequences: padded, with their lengths, as the native batches are.
                out[k], out[f"{k}_lengths"] = ragged
            else:
                out[k] = _collate(f"{prefix}{k}", col, alloc)
        return out
    if isinstance(v0, (tuple, list)):
        n = len(v0)
        for i, v in enumerate(values):
            if not isinstance(v, (tuple, list)) or len(v) != n:
                raise CollateError(f"cannot collate {name!r}: sample {i} is not a sequence of {n} items like sample 0")
        cols = [_collate(f"{name}[{j}]", [v[j] for v in values], alloc) for j in range(n)]
        # As torch's: a namedtuple stays one, a tuple or list becomes a list.
        return type(v0)(*cols) if isinstance(v0, tuple) and hasattr(v0, "_fields") else cols
    if type(v0) is int and all(type(v) is int for v in values):
        # Python ints (labels, indices): int64, as torch.tensor makes them, through numpy (4-5x faster
        # for a batch of 64); one out of int64's range goes to torch.tensor for its own error.
        try:
            return torch.from_numpy(np.array(values, dtype=np.int64))
        except OverflowError:
            return torch.tensor(values)
    if isinstance(v0, (bool, int, float, np.number, np.bool_)):
        kinds = {type(v) for v in values}
        if not all(isinstance(v, (bool, int, float, np.number, np.bool_)) for v in values):
            raise CollateError(f"cannot collate field {name!r}: mixed types {sorted(k.__name__ for k in kinds)}")
        # The dtype torch's default_collate gives, chosen as it chooses it, by the first sample's
        # type: numpy scalars as numpy types them, Python floats float64, ints and bools as torch.tensor.
        if isinstance(v0, (np.number, np.bool_)):
            return torch.as_tensor(values)
        if isinstance(v0, float):
            return torch.tensor(values, dtype=torch.float64)
        return torch.tensor(values)
    return values  # strings, bytes, None, objects: a list, as torch's default_collate keeps them


def _uniform(values: list[Any]) -> bool:
    """Whether ``values`` are all tensors, or all numpy arrays, of one type, shape and dtype (C-level compares)."""
    t = type(values[0])
    if not all(type(v) is t for v in values):
        return False
    shapes = [v.shape for v in values]
    if shapes.count(shapes[0]) != len(shapes):
        return False
    dtypes = [v.dtype for v in values]
    return dtypes.count(dtypes[0]) == len(dtypes)


def _ragged(values: list[Any], alloc: _Alloc | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(zero-padded ``[B, L_max, ...]``, lengths int64) for tensors that differ in their leading dim alone; else None."""
    v0 = values[0]
    if not isinstance(v0, (torch.Tensor, np.ndarray)) or v0.ndim == 0:
        return None
    ts = [torch.from_numpy(v) if isinstance(v, np.ndarray) else v for v in values]
    if not all(isinstance(t, torch.Tensor) for t in ts):
        return None
    t0 = ts[0]
    lead = {int(t.shape[0]) for t in ts}
    if len(lead) == 1 or any(t.ndim != t0.ndim or t.shape[1:] != t0.shape[1:] or t.dtype != t0.dtype for t in ts):
        return None
    lengths = torch.tensor([int(t.shape[0]) for t in ts], dtype=torch.int64)
    shape = (len(ts), max(lead), *t0.shape[1:])
    out = alloc(shape, t0.dtype) if alloc is not None else None
    zeroed = out is None
    if out is None:
        out = torch.zeros(shape, dtype=t0.dtype)
    for i, t in enumerate(ts):
        out[i, : t.shape[0]] = t
        if not zeroed:
            out[i, t.shape[0]:] = 0  # an allocated tensor holds whatever was there before
    return out, lengths


def _stack(name: str, values: list[Any], alloc: _Alloc | None = None, checked: bool = False) -> torch.Tensor:
    """``values`` stacked into one ``[B, ...]`` tensor (into ``alloc``'s where it gives one).

    ``checked``: ``_uniform(values)`` held (one type, shape and dtype), so no sample is looked at again.
    """
    if checked:
        ts: list[torch.Tensor] = values if type(values[0]) is torch.Tensor else [torch.from_numpy(v) for v in values]
    else:
        ts = []
        for v in values:
            if isinstance(v, np.ndarray):
                v = torch.from_numpy(v)
            elif not isinstance(v, torch.Tensor):
                raise CollateError(f"cannot collate field {name!r}: sample 0 is a tensor, another is a "
                                   f"{type(v).__name__}")
            ts.append(v)
        t0 = ts[0]
        for i, t in enumerate(ts):
            if t.shape != t0.shape or t.dtype != t0.dtype:
                raise CollateError(
                    f"cannot collate field {name!r}: sample {i} is {t.dtype} {tuple(t.shape)}, sample 0 is "
                    f"{t0.dtype} {tuple(t0.shape)}; every sample of a batch needs one shape and dtype: make the "
                    f"transform return one shape (for images, ImageDecode(size=...); for sequences, pad or cut to a "
                    f"fixed length), or pass a collate_fn")
    t0 = ts[0]
    out = alloc((len(ts), *t0.shape), t0.dtype) if alloc is not None else None
    if out is None:
        return torch.stack(ts)
    return torch.stack(ts, out=out)


__all__ = ["collate_samples"]
