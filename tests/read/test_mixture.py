"""pyloader.Mixture: proportions over windows, determinism across ranks and threads, schedules,
exhaustion policies, field mapping, resume (exact and elastic), remote sources through the
node cache and a failing one. Real shards, real loaders, a loopback HTTP server.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter
from typing import Any

import numpy as np
import pytest

import pyloader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "remote"))

FIELDS = {"src": ("int64", ()), "idx": ("int64", ()), "tokens": ("int32", (None,))}
SIZES = (300, 200, 100)


def write_source(d: str, src: int, n: int, fields: dict[str, Any] = FIELDS) -> str:
    names = list(fields)
    with pyloader.ShardWriter(d, fields, shard_bytes=2048) as w:
        for i in range(n):
            w.write({names[0]: src, names[1]: i, names[2]: np.arange(i % 7, dtype=np.int32)})
    return d


@pytest.fixture(scope="module")
def source_dirs(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("mix")
    return [write_source(str(root / f"s{k}"), k, n) for k, n in enumerate(SIZES)]


def sources(dirs: list[str], **kw: Any) -> list[pyloader.ShardDataset]:
    return [pyloader.ShardDataset(d, **kw) for d in dirs]


def pairs(batches: Any) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for b in batches:
        out += list(zip(b["src"].tolist(), b["idx"].tolist(), strict=True))
    return out


def read(mix: pyloader.Mixture, **kw: Any) -> list[tuple[int, int]]:
    kw.setdefault("batch_size", 16)
    return pairs(pyloader.DataLoader(mix, **kw))


# -- proportions ----------------------------------------------------------------------------------


def tolerance(window: int) -> float:
    """The bound docs/mixtures.md states: |count - L * w| <= 2 + log2(L) / 2 in every window of L."""
    return 2 + math.log2(window) / 2


@pytest.mark.parametrize("weights", [(0.5, 0.3, 0.2), (0.9, 0.07, 0.03), (1 / 3, 1 / 3, 1 / 3), (0.01, 0.01, 0.98)])
def test_proportions_in_every_window(source_dirs, weights):
    mix = pyloader.Mixture(sources(source_dirs), weights, samples_per_epoch=20000, shuffle=True, seed=3)
    for epoch in (0, 1):
        ch = mix.epoch_sources(epoch)
        assert ch.size == 20000
        for L in (10, 64, 500, 4096):
            for k, w in enumerate(weights):
                c = np.concatenate([[0], np.cumsum(ch == k)])
                counts = c[L:] - c[:-L]  # every window of L consecutive positions
                worst = float(np.abs(counts - L * w).max())
                assert worst <= tolerance(L), (L, k, worst)


def test_proportions_of_every_rank(source_dirs):
    weights = (0.5, 0.3, 0.2)
    mix = pyloader.Mixture(sources(source_dirs), weights, samples_per_epoch=12000, shuffle=True, seed=1)
    for world in (2, 3, 4):
        for rank in range(world):
            got = mix.realised(rank=rank, world_size=world)
            n = sum(got.values())
            for (name, c), w in zip(got.items(), weights, strict=True):
                assert abs(c - n * w) <= tolerance(n), (world, rank, name, c, n * w)


# -- determinism, ranks and threads ----------------------------------------------------------------


def test_deterministic_and_same_union_across_world_sizes_and_threads(source_dirs):
    def mix(**kw: Any) -> pyloader.Mixture:
        return pyloader.Mixture(sources(source_dirs), (0.5, 0.25, 0.25), samples_per_epoch=800, shuffle=True,
                                seed=11, **kw)
    one = read(mix(), num_workers=1)
    assert one == read(mix(), num_workers=3)  # threads never change the order
    assert one == read(mix(), num_workers=2, batch_size=7)
    assert len(one) == 800
    for world in (2, 4):
        per_rank = [read(mix(rank=r, world_size=world), num_workers=2) for r in range(world)]
        assert {len(p) for p in per_rank} == {800 // world}
        assert Counter(sum(per_rank, [])) == Counter(one)
        # Stride partition: at every step the world reads one contiguous run of the sequence.
        assert [p[i] for i in range(800 // world) for p in per_rank] == one
    other = pyloader.Mixture(sources(source_dirs), (0.5, 0.25, 0.25), samples_per_epoch=800, shuffle=True, seed=12)
    assert read(other) != one
    m = mix()
    m.set_epoch(1)
    assert read(m) != one


def test_each_source_is_read_in_its_own_order(source_dirs):
    mix = pyloader.Mixture(sources(source_dirs), samples_per_epoch=600, shuffle=True, seed=5)
    got = read(mix)
    for k, n in enumerate(SIZES):
        idx = [i for s, i in got if s == k]
        assert sorted(idx) == list(range(n))  # proportional weights, cycle: each record once here
        assert idx != sorted(idx)


# -- schedules -----------------------------------------------------------------------------------


def test_list_schedule_changes_weights_at_a_step(source_dirs):
    mix = pyloader.Mixture(sources(source_dirs), (1, 0, 0), schedule=[(50, (0, 1, 0)), (80, (0, 0, 1))],
                           samples_per_step=10, samples_per_epoch=1000)
    ch = mix.epoch_sources(0)
    assert set(ch[:500].tolist()) == {0} and set(ch[500:800].tolist()) == {1} and set(ch[800:].tolist()) == {2}
    # Steps count across epochs: epoch 1 starts at step 100, after the last change.
    assert set(mix.epoch_sources(1).tolist()) == {2}


def test_callable_schedule(source_dirs):
    def ramp(step: int) -> list[float]:
        return [1.0, step / 100, 0.0]

    mix = pyloader.Mixture(sources(source_dirs), schedule=ramp, samples_per_step=16, samples_per_epoch=1600,
                           shuffle=True)
    ch = mix.epoch_sources(0)
    first, last = ch[:160], ch[-160:]
    assert (first == 1).mean() < 0.1 and 0.4 < (last == 1).mean() < 0.6 and not (ch == 2).any()
    with pytest.raises(ValueError, match=r"schedule\(0\)"):
        pyloader.Mixture(sources(source_dirs), schedule=lambda s: [0, 0, 0]).epoch_sources(0)


# -- policies ------------------------------------------------------------------------------------


def test_cycle_repeats_an_exhausted_source_in_fresh_orders(source_dirs):
    mix = pyloader.Mixture(sources(source_dirs), (0.2, 0.2, 0.6), samples_per_epoch=1000, shuffle=True, seed=2)
    small = [i for s, i in read(mix) if s == 2]
    assert abs(len(small) - 600) <= tolerance(1000)
    first, second = small[:100], small[100:200]
    assert sorted(first) == sorted(second) == list(range(100)) and first != second


def test_stop_ends_the_epoch_when_a_source_runs_out(source_dirs):
    mix = pyloader.Mixture(sources(source_dirs), (0.2, 0.2, 0.6), policy="stop", shuffle=True, seed=2)
    got = read(mix)
    n = len(got)
    assert n == mix.epoch_length(0) < 600
    small = sorted(i for s, i in got if s == 2)
    assert small == list(range(100))  # the exhausted source was read exactly once
    assert len(mix) == n


def test_renormalise_reads_every_record_once(source_dirs):
    mix = pyloader.Mixture(sources(source_dirs), (0.2, 0.2, 0.6), policy="renormalise", shuffle=True, seed=2)
    got = read(mix)
    assert Counter(got) == Counter((k, i) for k, n in enumerate(SIZES) for i in range(n))
    ch = mix.epoch_sources(0)
    last2 = int(np.flatnonzero(ch == 2).max())
    assert last2 < 300  # source 2 ran out early; the rest renormalised over sources 0 and 1
    with pytest.raises(ValueError, match="renormalise"):
        pyloader.Mixture(sources(source_dirs), policy="renormalise", samples_per_epoch=10)


def test_weight_zero_source_under_renormalise_is_an_error_when_it_is_all_that_is_left(source_dirs):
    mix = pyloader.Mixture(sources(source_dirs[:2]), (1, 0), policy="renormalise")
    with pytest.raises(ValueError, match="weight 0"):
        mix.epoch_sources(0)


def test_empty_and_bad_sources(tmp_path, source_dirs):
    with pyloader.ShardWriter(str(tmp_path / "empty"), FIELDS):
        pass
    with pytest.raises(pyloader.ManifestError, match="no records"):
        pyloader.ShardDataset(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="at least one source"):
        pyloader.Mixture([])
    with pytest.raises(ValueError, match="weights"):
        pyloader.Mixture(sources(source_dirs), (1, 1))
    with pytest.raises(ValueError, match="policy"):
        pyloader.Mixture(sources(source_dirs), policy="loop")
    with pytest.raises(TypeError, match="ShardDataset"):
        pyloader.Mixture([object()])  # type: ignore[list-item]


# -- field mapping --------------------------------------------------------------------------------


def test_field_map_renames_a_sources_fields(tmp_path, source_dirs):
    other = {"origin": ("int64", ()), "number": ("int64", ()), "ids": ("int32", (None,))}
    d = write_source(str(tmp_path / "renamed"), 7, 50, other)
    srcs = {"a": pyloader.ShardDataset(source_dirs[0]), "b": pyloader.ShardDataset(d)}
    mix = pyloader.Mixture(srcs, (0.5, 0.5), field_map={"b": {"origin": "src", "number": "idx", "ids": "tokens"}},
                           samples_per_epoch=100)
    assert [f.name for f in mix.fields] == ["src", "idx", "tokens"]
    got = []
    for b in pyloader.DataLoader(mix, batch_size=10, num_workers=2):
        for s, i, t, n in zip(b["src"].tolist(), b["idx"].tolist(), b["tokens"], b["tokens_lengths"].tolist(),
                              strict=True):
            assert t[:n].tolist() == list(range(i % 7))
            got.append((s, i))
    assert Counter(s for s, _ in got) == {0: 50, 7: 50}
    with pytest.raises(pyloader.SchemaError, match="same fields"):
        pyloader.Mixture([pyloader.ShardDataset(source_dirs[0]), pyloader.ShardDataset(d)])
    with pytest.raises(pyloader.SchemaError, match="does not have"):
        pyloader.Mixture([pyloader.ShardDataset(source_dirs[0]), pyloader.ShardDataset(d)],
                         field_map=[None, {"nope": "src"}])
    bad = write_source(str(tmp_path / "wide"), 8, 10, {"src": ("int32", ()), "idx": ("int64", ()),
                                                       "tokens": ("int32", (None,))})
    with pytest.raises(pyloader.SchemaError, match=r"src: int32"):
        pyloader.Mixture([pyloader.ShardDataset(source_dirs[0]), pyloader.ShardDataset(bad)])


def test_loader_stats_name_the_sources(source_dirs):
    mix = pyloader.Mixture({"web": pyloader.ShardDataset(source_dirs[0]), "code": pyloader.ShardDataset(
        source_dirs[1])}, (0.75, 0.25), samples_per_epoch=400)
    loader = pyloader.DataLoader(mix, batch_size=20)
    for _ in loader:
        pass
    got = loader.stats()["sources"]
    assert got == mix.realised() and sum(got.values()) == 400 and abs(got["web"] - 300) <= tolerance(400)


# -- resume ---------------------------------------------------------------------------------------


def test_resume_exact_at_the_same_world_size(source_dirs):
    def mix(rank: int = 0, world: int = 2) -> pyloader.Mixture:
        return pyloader.Mixture(sources(source_dirs), (0.5, 0.3, 0.2), samples_per_epoch=998, shuffle=True,
                                seed=4, rank=rank, world_size=world)
    for rank in (0, 1):
        full = read(mix(rank), batch_size=8)
        loader = pyloader.DataLoader(mix(rank), batch_size=8, num_workers=2)
        it = iter(loader)
        head = pairs(next(it) for _ in range(13))
        state = loader.state_dict()
        del it
        again = pyloader.DataLoader(mix(rank), batch_size=8, num_workers=3)
        again.load_state_dict(state)
        assert head + read_loader(again) == full
        # The next iter() is the next epoch, as an uninterrupted loader's.
        nxt = mix(rank)
        nxt.set_epoch(1)
        assert read_loader(again) == read(nxt, batch_size=8)


def read_loader(loader: pyloader.DataLoader) -> list[tuple[int, int]]:
    return pairs(loader)


@pytest.mark.parametrize("partition", ["pad", "drop"])
def test_resume_at_another_world_size_reads_each_remaining_sample_once(source_dirs, partition):
    def mix(rank: int, world: int) -> pyloader.Mixture:
        return pyloader.Mixture(sources(source_dirs), (0.2, 0.2, 0.6), policy="renormalise", shuffle=True,
                                seed=9, rank=rank, world_size=world, partition=partition)
    every = Counter((k, i) for k, n in enumerate(SIZES) for i in range(n))
    seen: Counter[tuple[int, int]] = Counter()
    states = []
    for r in range(2):  # two ranks take 17 batches of 6 each
        loader = pyloader.DataLoader(mix(r, 2), batch_size=6)
        it = iter(loader)
        seen.update(pairs(next(it) for _ in range(17)))
        states.append(loader.state_dict())
        del it
    assert states[0] == states[1]
    for r in range(3):  # three ranks read the rest
        loader = pyloader.DataLoader(mix(r, 3), batch_size=5)
        loader.load_state_dict(states[0])
        seen.update(read_loader(loader))
    assert set(seen) == set(every)
    extra = sum(seen.values()) - sum(every.values())
    assert 0 <= extra < 3 if partition == "pad" else extra == 0
    with pytest.raises(pyloader.ResumeError, match="another dataset"):
        other = pyloader.Mixture(sources(source_dirs), (0.3, 0.1, 0.6), policy="renormalise", shuffle=True, seed=9,
                                 partition=partition)
        pyloader.DataLoader(other, batch_size=6).load_state_dict(states[0])


# -- remote sources -------------------------------------------------------------------------------


def test_remote_source_streams_through_the_cache(tmp_path, source_dirs):
    from remote_servers import FaultServer

    root = tmp_path / "srv"
    remote_dir = write_source(str(root / "ds"), 5, 150)
    with FaultServer(str(root), max_life=120) as server:
        remote = pyloader.ShardDataset(f"{server.url}/ds", cache_dir=str(tmp_path / "cache"), shuffle_mode="window",
                                       window=32)
        mix = pyloader.Mixture([pyloader.ShardDataset(source_dirs[0]), remote], (0.5, 0.5), samples_per_epoch=300,
                               shuffle=True, seed=1)
        loader = pyloader.DataLoader(mix, batch_size=10, num_workers=2, timeout=60)
        got = pairs(loader)
        stats = loader.stats()
        assert stats["shards_downloaded"] == len(remote.shard_paths) and stats["bytes_fetched"] > 0
        assert sorted(i for s, i in got if s == 5) == list(range(150))
        local = pyloader.Mixture([pyloader.ShardDataset(source_dirs[0]), pyloader.ShardDataset(remote_dir,
                                  shuffle_mode="window", window=32)], (0.5, 0.5), samples_per_epoch=300,
                                 shuffle=True, seed=1)
        assert read(local, batch_size=10) == got  # the same plan as the same data read locally


def test_failing_remote_source_names_its_url(tmp_path, source_dirs):
    from remote_servers import FaultServer

    root = tmp_path / "srv"
    d = write_source(str(root / "ds"), 5, 150)
    with FaultServer(str(root), max_life=120) as server:
        remote = pyloader.ShardDataset(f"{server.url}/ds", cache_dir=str(tmp_path / "cache"))
        victim = sorted(f for f in os.listdir(d) if not f.endswith(".json"))[0]
        os.remove(os.path.join(d, victim))  # the server now answers 404 for it
        mix = pyloader.Mixture([pyloader.ShardDataset(source_dirs[0]), remote], (0.5, 0.5), samples_per_epoch=300)
        with pytest.raises(OSError, match=rf"{server.url}/ds/{victim}"):
            pairs(pyloader.DataLoader(mix, batch_size=10, timeout=60))
