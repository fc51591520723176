"""pyloader.read.order's resumption functions against a plain-Python model and the laws of
See NOTE [resume segments]: same world size -> the uninterrupted epoch; any world sizes ->
every sample read once, plus fillers drawn from the filler stream."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyloader.read import order as _plan
from pyloader.read.order import partition, resume_partition, resume_plan, unread, unread_count

FAST = settings(max_examples=150, deadline=None)


def model(order: list[int], segments: list[tuple[int, int, int]], policy: str, world: int) -> list[list[int]]:
    """Each rank's block of the rest of the epoch, by the letter of NOTE [resume segments]."""
    rest = list(order)
    taken: set[int] = set()

    def fillers(count: int) -> list[int]:
        out, k = [], 0
        while len(out) < count:
            if k not in taken:
                out.append(k)
            k += 1
        return out

    def blocks(w: int) -> tuple[int, list[int], list[int]]:
        n = len(rest)
        per = n // w if policy == "drop" else -(-n // w)
        stream = fillers(w * per - n) if policy == "pad" and w * per > n else []
        return per, rest + [order[k % len(order)] for k in stream], stream

    for w, b, s in segments:
        n = len(rest)
        per, ext, stream = blocks(w)
        c = min(s * b, per)
        read = {r * per + t for r in range(w) for t in range(c)}
        taken.update(stream[j - n] for j in read if j >= n)
        rest = [rest[j] for j in range(n) if j not in read]
    if not rest:
        return [[] for _ in range(world)]
    per, ext, _ = blocks(world)
    return [ext[r * per:(r + 1) * per] for r in range(world)]


def random_segments(data, n: int, policy: str, max_segments: int = 4, same: tuple[int, int] | None = None):
    """Segments a job could have produced: steps never exceed what a segment has."""
    segs: list[tuple[int, int, int]] = []
    for _ in range(data.draw(st.integers(0, max_segments))):
        w = same[0] if same else data.draw(st.integers(1, 6))
        b = data.draw(st.integers(1, 5))
        left = unread_count(n, partition=policy, segments=segs)
        per = left // w if policy == "drop" else -(-left // w)
        segs.append((w, b, data.draw(st.integers(0, -(-per // b)))))
    return segs


@FAST
@given(st.data(), st.integers(1, 60), st.sampled_from(["pad", "drop"]), st.integers(1, 7))
def test_matches_the_model(data, n, policy, world):
    order = np.random.default_rng(n).permutation(n)
    segs = random_segments(data, n, policy)
    want = model(order.tolist(), segs, policy, world)
    for r in range(world):
        assert resume_partition(order, rank=r, world_size=world, partition=policy, segments=segs).tolist() == want[r]
    assert unread(order, partition=policy, segments=segs).size == unread_count(n, partition=policy, segments=segs)


@FAST
@given(st.integers(1, 80), st.sampled_from(["pad", "drop"]), st.integers(1, 9))
def test_no_segments_is_partition(n, policy, world):
    order = np.random.default_rng(n).permutation(n)
    for r in range(world):
        assert np.array_equal(resume_partition(order, rank=r, world_size=world, partition=policy),
                              partition(order, rank=r, world_size=world, partition=policy))


@FAST
@given(st.data(), st.integers(1, 80), st.sampled_from(["pad", "drop"]), st.integers(1, 6))
def test_same_world_size_resumes_the_uninterrupted_epoch(data, n, policy, world):
    """Stops at any steps, with any batch sizes: each rank reads its uninterrupted block."""
    order = np.random.default_rng(n + 1).permutation(n)
    segs = random_segments(data, n, policy, same=(world, 0))
    full = [partition(order, rank=r, world_size=world, partition=policy).tolist() for r in range(world)]
    per = len(full[0])
    done = min(per, sum(min(b * s, per) for _, b, s in segs))  # each rank's samples already read
    for r in range(world):
        rest = resume_partition(order, rank=r, world_size=world, partition=policy, segments=segs).tolist()
        assert rest == full[r][done:] or (done == per and rest == [])


def read_by(order: np.ndarray, segs: list[tuple[int, int, int]], policy: str) -> collections.Counter[int]:
    """Every sample read by the segments, each segment's ranks reading their first s*b."""
    seen: collections.Counter[int] = collections.Counter()
    for k, (w, b, s) in enumerate(segs):
        for r in range(w):
            block = resume_partition(order, rank=r, world_size=w, partition=policy, segments=segs[:k])
            seen.update(block[: s * b].tolist())
    return seen


@FAST
@given(st.data(), st.integers(1, 80), st.sampled_from(["pad", "drop"]), st.integers(1, 6))
def test_elastic_resume_reads_every_sample_once(data, n, policy, world):
    order = np.random.default_rng(n + 2).permutation(n)
    segs = random_segments(data, n, policy)
    seen = read_by(order, segs, policy)
    for r in range(world):  # the resumed job reads its blocks to the end
        seen.update(resume_partition(order, rank=r, world_size=world, partition=policy, segments=segs).tolist())
    worlds = [w for w, _, _ in segs] + [world]
    repeats = sum(seen.values()) - len(seen)
    if policy == "pad":
        assert sorted(seen) == list(range(n)), "pad: no sample is skipped"
        # Fillers: fewer than W per segment, distinct entries of the filler stream.
        assert repeats <= sum(w - 1 for w in worlds)
        if sum(worlds) <= n:
            assert max(seen.values()) <= 2
            assert set(k for k, v in seen.items() if v == 2) <= set(order[:sum(worlds)].tolist())
    else:
        assert repeats == 0, "drop: no sample is read twice"
        assert n - len(seen) < world, "drop: only the last segment's tail (< W) stays unread"


def test_fillers_continue_the_stream_across_world_sizes():
    order = np.arange(10)
    # W=4: per=3, fillers at positions 10, 11 (rank 3) = stream 0, 1. Rank 3 reads 9, 0.
    assert resume_partition(order, rank=3, world_size=4).tolist() == [9, 0, 1]
    segs = [(4, 2, 1)]  # every rank read 2: ranks 0..3 read 0,1 3,4 6,7 9,0(filler 0)
    assert unread(order, segments=segs).tolist() == [2, 5, 8]
    # W=2 now: per=2, one filler: stream index 1 (0 is taken) = order[1].
    assert [resume_partition(order, rank=r, world_size=2, segments=segs).tolist() for r in range(2)] == [[2, 5],
                                                                                                          [8, 1]]


@pytest.mark.parametrize("segs, match", [
    ([(4, 2, 3)], "took 3 steps"),  # 10 samples / 4 ranks: 3 per rank = 2 batches of 2
    ([(0, 1, 1)], "world_size"),
    ([(2, 0, 1)], "batch_size"),
    ([(2, 1, -1)], "steps"),
    ([(2, 1)], "segment 0 must be"),
    ([(1, 10, 1), (1, 1, 1)], "segment 1 took 1 steps"),  # the first read everything
])
def test_inconsistent_segments_raise(segs, match):
    with pytest.raises(ValueError, match=match):
        unread_count(10, segments=segs)
    with pytest.raises(ValueError, match=match):
        resume_partition(np.arange(10), rank=0, world_size=1, segments=segs)


def test_resume_plan_is_plan_without_segments_and_locates_the_rest():
    counts = [5, 0, 7, 3]
    kw = dict(shuffle=True, seed=3, epoch=2, shuffle_mode="window", window=4)
    for r in range(3):
        a = _plan.plan(counts, rank=r, world_size=3, **kw)
        b = resume_plan(counts, rank=r, world_size=3, **kw)
        assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    order = _plan.epoch_order(counts, **kw)
    segs = [(3, 2, 1)]
    shard, rec = resume_plan(counts, rank=1, world_size=2, segments=segs, **kw)
    ids = np.cumsum([0] + counts[:-1])[shard] + rec
    assert ids.tolist() == resume_partition(order, rank=1, world_size=2, segments=segs).tolist()


@FAST
@given(st.data(), st.lists(st.integers(0, 9), min_size=1, max_size=8), st.sampled_from(["pad", "drop"]),
       st.integers(1, 7), st.integers(1, 3), st.sampled_from(["none", "global", "window"]))
def test_resume_plan_computes_the_same_positions_as_the_whole_order(data, counts, policy, world, workers, mode):
    """resume_plan computes only its reader's positions of the order (NOTE [resume runs]):
    the same samples as the whole order -> resume_partition -> split_workers -> locate."""
    n = sum(counts)
    if n == 0:
        return
    segs = random_segments(data, n, policy)
    kw = dict(shuffle=mode != "none", seed=data.draw(st.integers(0, 3)), epoch=1,
              shuffle_mode="window" if mode == "none" else mode, window=data.draw(st.integers(1, 6)))
    order = _plan.epoch_order(counts, **kw)
    starts = np.cumsum([0] + counts[:-1])
    for rank in range(world):
        block = resume_partition(order, rank=rank, world_size=world, partition=policy, segments=segs)
        for worker in range(workers):
            want = _plan.split_workers(block, worker=worker, num_workers=workers)
            shard, rec = resume_plan(counts, rank=rank, world_size=world, segments=segs, worker=worker,
                                     num_workers=workers, partition=policy, **kw)
            assert (starts[shard] + rec).tolist() == want.tolist(), (rank, worker, segs)


def test_resume_plan_at_scale_computes_its_share_only():
    """A rank of 512 resuming a global shuffle of 20 M samples after a stop at 1,024 ranks
    holds its share of the order, not the whole order and its masks (NOTE [resume runs])."""
    import tracemalloc

    counts = [1000] * 20_000
    segs = [(1024, 64, 100)]
    kw = dict(shuffle=True, seed=1, epoch=0, shuffle_mode="global", world_size=512, segments=segs)
    tracemalloc.start()
    shard, rec = resume_plan(counts, rank=7, **kw)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert shard.size == -(-(20_000_000 - 1024 * 6400) // 512)
    assert peak < 64 << 20, f"peak {peak / 2**20:.0f} MiB of traced memory"


@pytest.mark.parametrize("mode", ["global", "window"])
def test_resume_plan_after_a_segment_of_many_ranks(mode):
    """A segment of thousands of ranks leaves thousands of runs (more than one range per
    computation of the order): still the same samples as the whole order's path."""
    counts = [7] * 800  # 5,600 samples
    kw = dict(shuffle=True, seed=5, epoch=3, shuffle_mode=mode, window=64)
    order = _plan.epoch_order(counts, **kw)
    starts = np.cumsum([0] + counts[:-1])
    for segs, world in [([(2000, 1, 1)], 3), ([(2000, 1, 1), (1000, 1, 1)], 1), ([(5600, 1, 1)], 4)]:
        for rank in range(world):
            want = resume_partition(order, rank=rank, world_size=world, segments=segs)
            shard, rec = resume_plan(counts, rank=rank, world_size=world, segments=segs, **kw)
            assert (starts[shard] + rec).tolist() == want.tolist(), (segs, world, rank)
