"""Per-sample random state: what a transform draws from, as a pure function of (seed, epoch, sample).

NOTE [sample seeds]: every sample of an epoch gets a 64-bit seed, ``sample_seeds(seed,
epoch, index)``, where ``seed`` is the loader's order seed (the dataset's ``seed``, or the
``generator``'s), ``epoch`` the epoch read and ``index`` the sample's global record index
(its position in the dataset: the records of all earlier shards plus its record number).
The seed depends on nothing else: not the rank, world size, worker count, executor,
thread timing or how far a resumed epoch had got, so a transform that draws only from its
``SampleContext`` produces bit-identical samples however it is run, and a resumed loader
reproduces the augmented batches exactly. A record read twice in one epoch (the samples
``partition="pad"`` repeats) is transformed identically both times.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser over a uint64 array (wrapping arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def sample_seeds(seed: int, epoch: int, index: Any) -> np.ndarray:
    """The seeds (uint64 array) of the samples with global record indices ``index`` in ``epoch`` (NOTE [sample seeds])."""
    idx = np.asarray(index, dtype=np.uint64)
    with np.errstate(over="ignore"):
        base = _splitmix64(_splitmix64(np.array([seed], dtype=np.uint64)) ^ np.uint64(epoch))
        return _splitmix64(base ^ idx)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample (NOTE [sample seeds])."""
    return int(sample_seeds(seed, epoch, [index])[0])


class SampleContext:
    """Where a sample comes from, and random generators seeded for it alone (NOTE [sample seeds]).

    A transform that takes a second argument receives one: ``transform(sample, ctx)``.

    Attributes:
        seed: the sample's 64-bit seed.
        epoch: the epoch being read.
        index: the sample's global record index.
        shard: the shard (or row group) it was read from, as a name.
        record: its record number within that shard.
        worker: the transform worker handling it (0-based).
    """

    __slots__ = ("seed", "epoch", "index", "shard", "record", "worker", "_rng", "_torch", "_random")

    def __init__(self, seed: int, epoch: int, index: int, shard: str, record: int, worker: int) -> None:
        self.seed, self.epoch, self.index = seed, epoch, index
        self.shard, self.record, self.worker = shard, record, worker
        self._rng: np.random.Generator | None = None
        self._torch: Any = None
        self._random: random.Random | None = None

    @property
    def rng(self) -> np.random.Generator:
        """A numpy ``Generator`` (PCG64) seeded with ``seed``, made on first use."""
        if self._rng is None:
            self._rng = np.random.Generator(np.random.PCG64(self.seed))
        return self._rng

    @property
    def torch_generator(self) -> Any:
        """A CPU ``torch.Generator`` seeded with ``seed``, made on first use (pass it as ``generator=``)."""
        if self._torch is None:
            import torch

            self._torch = torch.Generator().manual_seed(self.seed)
        return self._torch

    @property
    def random(self) -> random.Random:
        """A ``random.Random`` seeded with ``seed``, made on first use."""
        if self._random is None:
            self._random = random.Random(self.seed)
        return self._random

    def __repr__(self) -> str:
        return (f"SampleContext(epoch={self.epoch}, index={self.index}, shard={self.shard!r}, record={self.record}, "
                f"worker={self.worker}, seed={self.seed})")


__all__ = ["sample_seeds", "sample_seed", "SampleContext"]
