"""Helpers shared by the resume tests of ShardDataset and ParquetDataset loaders."""

from __future__ import annotations

import json
from typing import Any

import pyloader


def lockstep(its: list[Any], steps: int | None, key: str) -> list[list[list[int]]]:
    """Takes ``steps`` batches (None: all) from every rank's iterator; field ``key`` of each batch, per rank."""
    out: list[list[list[int]]] = [[] for _ in its]
    k = 0
    while steps is None or k < steps:
        got = [next(it, None) for it in its]
        if all(g is None for g in got):
            break
        assert all(g is not None for g in got), "ranks ran out of batches at different steps"
        for r, g in enumerate(got):
            out[r].append(g[key].tolist())
        k += 1
    return out


def common_state(ls: list[pyloader.DataLoader]) -> dict[str, Any]:
    """The state every rank in lockstep reports (asserted equal), after a JSON round trip like a checkpoint's."""
    states = [loader.state_dict() for loader in ls]
    assert all(s == states[0] for s in states), "ranks in lockstep must report the same state"
    return json.loads(json.dumps(states[0]))
