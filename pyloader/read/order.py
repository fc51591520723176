"""Epoch plan: which samples a (rank, worker) reads, and in what order.

Everything here is a pure function of its arguments. The shuffle sorts by a
hash (splitmix64) of (seed, epoch, stream, sample id) instead of using numpy's
random generators, so the order is identical on every machine and numpy
version. Per-sample work is vectorized numpy, except a global shuffle's order and the
lookup of ids in shards, which run natively (NOTE [native global order] in
csrc/core/order.cpp): the same results, without sorting every key on the training thread.

Global sample id ``g`` of record ``r`` in shard ``s`` is ``offsets[s] + r``,
where ``offsets`` is the exclusive cumulative sum of ``records_per_shard``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import pyloader._C as _C

from ..contract import PARTITIONS, SHUFFLE_MODES

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_INV_M1 = np.uint64(pow(0xBF58476D1CE4E5B9, -1, 1 << 64))
_INV_M2 = np.uint64(pow(0x94D049BB133111EB, -1, 1 << 64))
_CHUNK = 1 << 16  # elements per pass in mix64/_unmix64 (512 KiB: stays in cache)
_STREAM_MUL = 0xD1B54A32D192ED03  # C1 in sample_keys: odd, so streams never collide
STREAM_GLOBAL, STREAM_SHARDS, STREAM_WINDOW, STREAM_FILE_SHARDS = 0, 1, 2, 3


def _int_arg(name: str, value: object, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi)``, else ValueError (bools are rejected)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        # ValueError, not TypeError: callers catch one exception type for bad config.
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")  # noqa: TRY004
    if not lo <= int(value) < hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}), got {int(value)}")
    return int(value)


def _reader_args(rank: object, world_size: object, worker: object, num_workers: object,
                 partition: object) -> tuple[int, int]:
    """(world_size, num_workers) after checking who reads (rank, worker) and how ranks split."""
    world = _int_arg("world_size", world_size, 1, 1 << 31)
    _int_arg("rank", rank, 0, world)
    workers = _int_arg("num_workers", num_workers, 1, 1 << 31)
    _int_arg("worker", worker, 0, workers)
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    return world, workers


def _int_array(name: str, values: object) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):
        raise ValueError(
            f"{name} must be a 1-D integer array, got dtype {arr.dtype}, ndim {arr.ndim}"
        )
    return arr if arr.size else arr.astype(np.int64)


def _counts(records_per_shard: Sequence[int] | np.ndarray) -> np.ndarray:
    counts = _int_array("records_per_shard", records_per_shard)
    if counts.size and (counts.min() < 0 or counts.max() >= 2**62 or counts.size >= 2**31):
        raise ValueError("records_per_shard must be < 2**31 non-negative ints (each < 2**62)")
    return counts.astype(np.int64)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer, elementwise, with wrapping uint64 arithmetic.

    ``z = x + 0x9E3779B97F4A7C15; z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB; return z ^ (z >> 31)``.
    Integer input is reinterpreted as uint64 (two's complement). The map is a
    bijection on uint64: add, xor-shift and odd multiply are all invertible.
    """
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise ValueError(f"mix64 needs an integer array, got dtype {a.dtype}")
    z = a.astype(np.uint64, order="C")  # fresh and C-ordered: updated in place below
    flat, tmp = z.reshape(-1), np.empty(min(z.size, _CHUNK), np.uint64)
    with np.errstate(over="ignore"):
        for lo in range(0, flat.size, _CHUNK):  # cache-sized chunks: ~3x less memory traffic
            c = flat[lo : lo + _CHUNK]
            t = tmp[: c.size]
            np.add(c, _GAMMA, out=c)
            for shift, mul in ((30, _M1), (27, _M2)):
                np.bitwise_xor(c, np.right_shift(c, shift, out=t), out=c)
                np.multiply(c, mul, out=c)
            np.bitwise_xor(c, np.right_shift(c, 31, out=t), out=c)
    return z


def _unmix64(z: np.ndarray) -> np.ndarray:
    """Inverse of ``mix64``, in place on a C-contiguous uint64 array.

    ``y = x ^ (x >> s)`` with ``3 * s >= 64`` inverts as ``x = y ^ ((y ^ (y >> s)) >> s)``.
    """
    flat, tmp = z.reshape(-1), np.empty(min(z.size, _CHUNK), np.uint64)
    with np.errstate(over="ignore"):
        for lo in range(0, flat.size, _CHUNK):
            c = flat[lo : lo + _CHUNK]
            t = tmp[: c.size]
            for shift, inv in ((31, _INV_M2), (27, _INV_M1), (30, np.uint64(1))):
                np.bitwise_xor(c, np.right_shift(c, shift, out=t), out=t)
                np.bitwise_xor(c, np.right_shift(t, shift, out=t), out=c)
                np.multiply(c, inv, out=c)
            np.subtract(c, _GAMMA, out=c)
    return z


def _key_state(seed: int, epoch: int, stream: int) -> np.uint64:
    """``mix64(mix64(seed ^ (stream * C1)) ^ epoch)``: the part shared by all ids' keys."""
    seed = _int_arg("seed", seed, 0, 1 << 64)
    epoch = _int_arg("epoch", epoch, 0, 1 << 64)
    stream = _int_arg("stream", stream, 0, 1 << 64)
    state = mix64(np.array([seed ^ ((stream * _STREAM_MUL) % (1 << 64))], dtype=np.uint64))
    key_state: np.uint64 = mix64(state ^ np.uint64(epoch))[0]
    return key_state


def sample_keys(ids: np.ndarray, *, seed: int, epoch: int, stream: int) -> np.ndarray:
    """uint64 sort keys for non-negative integer ``ids``.

    With all arithmetic mod 2**64 and ``C1 = 0xD1B54A32D192ED03``::

        key(id) = mix64(mix64(mix64(seed ^ (stream * C1)) ^ epoch) ^ id)

    ``stream`` separates independent uses: 0 = global sample shuffle,
    1 = shard order (or file order), 2 = within-window shuffle, 3 = the order of
    the shards within a file (``shard_files``). For fixed (seed, epoch,
    stream) the key is a bijection of the id, so distinct ids never tie and
    sorting by (key, id) is sorting by key alone: a well-defined permutation.
    """
    state = _key_state(seed, epoch, stream)
    arr = _int_array("ids", ids)
    if arr.size and arr.min() < 0:
        raise ValueError("ids must be non-negative")
    return mix64(arr.astype(np.uint64) ^ state)


def _sort_by_key(ids: np.ndarray, seed: int, epoch: int, stream: int) -> np.ndarray:
    """``ids`` sorted by key along the last axis, i.e. ``ids[argsort(keys)]``.

    Keys are a bijection of ids, so we sort the keys themselves and invert the
    hash to recover the ids: ``np.sort`` is ~5x faster than ``np.argsort``,
    and with unique keys every sort algorithm gives the same answer.
    """
    state = _key_state(seed, epoch, stream)
    keys = np.sort(mix64(ids.astype(np.uint64) ^ state), axis=-1)
    return (_unmix64(keys) ^ state).astype(np.int64)


def _order_args(shuffle: object, shuffle_mode: object, window: object, seed: int, epoch: int) -> int:
    """Checks ``epoch_order``'s settings (ValueError); returns ``window``."""
    if not isinstance(shuffle, (bool, np.bool_)):
        raise ValueError(f"shuffle must be a bool, got {type(shuffle).__name__}")  # noqa: TRY004
    if shuffle_mode not in SHUFFLE_MODES:
        raise ValueError(f"shuffle_mode must be one of {SHUFFLE_MODES}, got {shuffle_mode!r}")
    window = _int_arg("window", window, 1, 1 << 62)
    _key_state(seed, epoch, 0)  # validates seed and epoch even when unshuffled
    return window


def epoch_order(
    records_per_shard: Sequence[int],
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    shuffle_mode: str = "global",
    window: int = 65536,
    shard_files: Sequence[int] | np.ndarray | None = None,
) -> np.ndarray:
    """The epoch's read order: all N global sample ids, int64.

    ``shuffle=False``: ``arange(N)`` (shard order, then record order).
    ``shuffle_mode="global"``: ids sorted by ``sample_keys(arange(N), stream=0)``.
    ``shuffle_mode="window"``: shards sorted by ``sample_keys(arange(S), stream=1)``;
    their ids concatenated in that order; that sequence cut into consecutive
    windows of ``window`` samples, each sorted by ``sample_keys(ids, stream=2)``.
    With ``shard_files`` (the file of each shard, for shards that are parts of
    files: Parquet row groups), window mode sorts the files instead, by
    ``sample_keys(file, stream=1)``, and the shards of each file by
    ``sample_keys(shard, stream=3)``, so a file's shards are consecutive in the
    sequence; the windows are cut and shuffled as above. Unshuffled and global
    orders do not depend on ``shard_files``.

    NOTE [window size]: a window is the unit of both randomness and locality.
    A reader touches only the shards overlapping the current window, so about
    ``window / records_per_shard + 1`` shards are live at once (open, cached
    or being fetched). Larger windows mix samples from more shards (closer to
    a global shuffle) but keep more shards live and cached; smaller windows
    stream with little cache but keep samples near their shard neighbours.
    How far apart neighbours land: two records of one shard that follow each
    other are consecutive in the sequence, so they fall in one window or two
    adjacent ones: less than ``2 * window`` positions apart in the epoch; two
    samples next to each other in the epoch come from one window (or, at its
    edge, from two), and a window from the at most ``window / records_per_shard
    + 2`` shards it overlaps. With
    ``shard_files`` the same holds with files in place of shards: the files are
    what a window overlaps (``window / records_per_file + 2`` at most), so a
    file is live for ``records_per_file + 2 * window`` positions of the epoch at
    most, whatever its number of shards; its shards come in a shuffled order
    within that span, and two records of one shard still land less than
    ``2 * window`` apart. Without it, a file's shards would be spread over the
    whole epoch and every file live from its first shard to its last.
    """
    window = _order_args(shuffle, shuffle_mode, window, seed, epoch)
    counts = _counts(records_per_shard)
    files = _shard_files(shard_files, counts.size)
    n = int(counts.sum())
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    if shuffle_mode == "global":
        return _global_order(n, 0, n, seed, epoch)
    return _window_order(counts, 0, n, seed, epoch, window, files)


def _shard_files(shard_files: Sequence[int] | np.ndarray | None, shards: int) -> np.ndarray | None:
    """``shard_files`` checked (ValueError): one non-negative int per shard, or None."""
    if shard_files is None:
        return None
    files = _int_array("shard_files", shard_files).astype(np.int64)
    if files.size != shards:
        raise ValueError(f"shard_files must name the file of each of the {shards} shards, got {files.size} values")
    if files.size and (files.min() < 0 or files.max() >= 2**62):
        raise ValueError("shard_files must be non-negative ints below 2**62")
    return files


def _shard_sequence(count: int, seed: int, epoch: int, files: np.ndarray | None) -> np.ndarray:
    """The shards of window mode in sequence order (``epoch_order``): by shard key, or by file key then shard key."""
    shards = np.arange(count)
    if files is None:
        return _sort_by_key(shards, seed, epoch, STREAM_SHARDS)
    file_key = sample_keys(files, seed=seed, epoch=epoch, stream=STREAM_SHARDS)  # one key per file: a bijection
    shard_key = sample_keys(shards, seed=seed, epoch=epoch, stream=STREAM_FILE_SHARDS)
    return np.lexsort((shard_key, file_key)).astype(np.int64)


def _global_order(n: int, lo: int, hi: int, seed: int, epoch: int) -> np.ndarray:
    """``epoch_order(...)[lo:hi]`` of a global shuffle of ``n`` ids, from those positions alone.

    The ids sorted by ``sample_keys(arange(n), stream=0)`` (NOTE [native global order]).
    """
    return _C.global_order(n, int(_key_state(seed, epoch, STREAM_GLOBAL)), lo, hi)


def _window_order(counts: np.ndarray, lo: int, hi: int, seed: int, epoch: int, window: int,
                  files: np.ndarray | None = None) -> np.ndarray:
    """``epoch_order(...)[lo:hi]`` of window mode, from the windows overlapping ``[lo, hi)`` alone.

    So a rank that reads 1/W of the epoch shuffles about 1/W of it; only the shard order
    (one key per shard) is computed whole. ``files``: checked ``shard_files`` or None.
    """
    if hi <= lo:
        return np.zeros(0, np.int64)
    n = int(counts.sum())
    shard_order = _shard_sequence(counts.size, seed, epoch, files)
    lens = counts[shard_order]
    seg_end = np.cumsum(lens)  # position in the shuffled-shard sequence where each shard ends
    seg_start = seg_end - lens
    first_id = (np.cumsum(counts) - counts)[shard_order]
    w0 = lo // window * window  # [w0, w1): the whole windows that hold [lo, hi)
    w1 = min(n, -(-hi // window) * window)
    # The shards overlapping [w0, w1), each clipped to it: their ids in sequence order,
    # without a Python loop over shards.
    k0 = int(np.searchsorted(seg_end, w0, side="right"))
    k1 = int(np.searchsorted(seg_start, w1, side="left"))
    clipped = np.minimum(seg_end[k0:k1], w1) - np.maximum(seg_start[k0:k1], w0)
    seq = np.arange(w0, w1, dtype=np.int64) + np.repeat(first_id[k0:k1] - seg_start[k0:k1], clipped)
    whole = (min(w1, n // window * window) - w0) // window * window  # then at most the short last window
    out = np.empty(seq.size, dtype=np.int64)
    out[:whole] = _sort_by_key(seq[:whole].reshape(-1, window), seed, epoch, STREAM_WINDOW).ravel()
    out[whole:] = _sort_by_key(seq[whole:], seed, epoch, STREAM_WINDOW)
    return out[lo - w0 : hi - w0]


def partition(order: np.ndarray, *, rank: int, world_size: int, partition: str = "pad") -> np.ndarray:
    """Rank ``rank``'s contiguous block of ``order``; every rank gets the same count.

    ``partition="pad"``: ``per_rank = ceil(N / W)``; ``order`` is extended by
    repeating it cyclically from its start, so even ``N < W`` gives each rank
    ``per_rank >= 1`` samples. ``partition="drop"``: ``per_rank = floor(N / W)``
    and the tail is dropped (all ranks may get 0). Rank r gets
    ``[r * per_rank, (r + 1) * per_rank)`` of the (extended) order; blocks are
    contiguous so window mode keeps its locality. N == 0 raises ValueError.
    """
    arr = _int_array("order", order)
    world_size = _int_arg("world_size", world_size, 1, 1 << 31)
    rank = _int_arg("rank", rank, 0, world_size)
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    if arr.size == 0:
        raise ValueError("cannot partition an empty order (the dataset has no samples)")
    n = arr.size
    per = n // world_size if partition == "drop" else -(-n // world_size)
    start, stop = rank * per, (rank + 1) * per
    if stop <= n:
        return np.array(arr[start:stop])
    return np.take(arr, np.arange(start, stop, dtype=np.int64) % n)



def split_workers(rank_order: np.ndarray, *, worker: int, num_workers: int) -> np.ndarray:
    """Worker ``worker``'s contiguous block, with ``np.array_split`` semantics.

    The first ``n % num_workers`` workers get one extra sample. Returns a view.
    """
    arr = _int_array("rank_order", rank_order)
    num_workers = _int_arg("num_workers", num_workers, 1, 1 << 31)
    worker = _int_arg("worker", worker, 0, num_workers)
    q, rem = divmod(arr.size, num_workers)
    start = worker * q + min(worker, rem)
    return arr[start : start + q + (worker < rem)]


def locate(ids: np.ndarray, records_per_shard: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(shard index int32, record index int64) of each global id in ``ids``.

    Empty shards are skipped. Ids outside ``[0, N)`` raise ValueError.
    """
    arr = _int_array("ids", ids).astype(np.int64, copy=False)
    counts = _counts(records_per_shard)
    ends = np.cumsum(counts)
    n = int(ends[-1]) if ends.size else 0
    try:
        shard, record = _C.locate(arr.reshape(-1), ends)  # NOTE [native global order]
    except ValueError:
        raise ValueError(f"ids must be in [0, {n}), got values in [{arr.min()}, {arr.max()}]") from None
    return shard.reshape(arr.shape), record.reshape(arr.shape)


def plan(
    records_per_shard: Sequence[int],
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    worker: int = 0,
    num_workers: int = 1,
    shuffle_mode: str = "global",
    window: int = 65536,
    partition: str = "pad",
    shard_files: Sequence[int] | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(shard_idx int32, record_idx int64), C-contiguous, in this (rank, worker)'s read order.

    ``epoch_order`` (with ``shard_files``) -> ``partition`` -> ``split_workers`` -> ``locate``, exactly. Arguments
    are validated before any per-sample work is done. The (rank, worker) block is one or
    two runs of positions of the epoch order (two where ``pad`` wraps around), so only
    those positions are computed: without shuffle and in window mode, a reader's cost is
    its share of the epoch, not the epoch; a global shuffle sorts every key.
    """
    world_size, num_workers = _reader_args(rank, world_size, worker, num_workers, partition)
    window = _order_args(shuffle, shuffle_mode, window, seed, epoch)
    counts = _counts(records_per_shard)
    files = _shard_files(shard_files, counts.size)
    n = int(counts.sum())
    if n == 0:
        raise ValueError("cannot partition an empty order (the dataset has no samples)")
    per = _per_rank(n, world_size, partition)
    q, rem = divmod(per, num_workers)
    # Positions [a, a + size) of the order repeated cyclically (``partition``), size <= n.
    a = rank * per + worker * q + min(worker, rem)
    size = q + (worker < rem)
    start = a % n
    runs = [(start, min(start + size, n)), (0, max(0, start + size - n))]
    if not shuffle:
        mine = np.concatenate([np.arange(lo, hi, dtype=np.int64) for lo, hi in runs])
    elif shuffle_mode == "global":  # every position depends on every key: two passes over them all
        mine = np.concatenate([_global_order(n, lo, hi, seed, epoch) for lo, hi in runs])
    else:
        mine = np.concatenate([_window_order(counts, lo, hi, seed, epoch, window, files) for lo, hi in runs])
    shard, record = locate(mine, counts)
    return np.ascontiguousarray(shard), np.ascontiguousarray(record)


# -- resumption ------------------------------------------------------------------------
# NOTE [resume segments]: how an epoch that was stopped and resumed (maybe at another
# world size) is read. The epoch is consumed in *segments*; segment k ran at world size
# W_k with batch size B_k, and every rank took s_k batches (DDP ranks step together).
# Each segment starts from ``rest``: the samples of the epoch order that no earlier
# segment has read, in epoch order (the first segment: the whole order). Its ``n``
# samples are partitioned exactly as ``partition`` does: ``per = ceil(n / W)`` (pad) or
# ``floor(n / W)`` (drop); rank r's block is positions ``[r * per, (r + 1) * per)``.
# Rank r has read the first ``c = min(s * B, per)`` positions of its block. The next
# segment's ``rest`` is every position ``j < n`` not read, i.e. ``j % per >= c`` or (drop)
# ``j >= W * per`` -- the dropped tail stays unread, so another world size may still
# read it.
#
# Pad fillers (positions ``j >= n``) are repeats. They are drawn from one *filler
# stream* per epoch, ``order[0], order[1], ...`` (wrapping after N): the i-th filler
# slot of a segment takes the i-th stream index that no earlier segment's filler has
# read. With no segments this is exactly ``partition`` (which repeats the order from its
# start). Because the unread filler slots of a stopped segment are the lowest unread
# stream indices, resuming at the same world size reads exactly what the uninterrupted
# epoch would have read, batch for batch, fillers included (whatever the batch sizes).
# At another world size every sample not yet read is read exactly once, plus fewer than
# W' new fillers. Everything is a pure function of (order, segments, partition): the state
# stores no per-sample list.


def _segment_arg(i: int, seg: object) -> tuple[int, int, int]:
    if not isinstance(seg, (tuple, list)) or len(seg) != 3:
        raise ValueError(f"segment {i} must be (world_size, batch_size, steps), got {seg!r}")
    w = _int_arg(f"segment {i} world_size", seg[0], 1, 1 << 31)
    b = _int_arg(f"segment {i} batch_size", seg[1], 1, 1 << 62)
    s = _int_arg(f"segment {i} steps", seg[2], 0, 1 << 62)
    return w, b, s


def _per_rank(n: int, world_size: int, partition: str) -> int:
    return n // world_size if partition == "drop" else -(-n // world_size)


def _first_unread(taken: set[int], count: int) -> list[int]:
    """The ``count`` lowest non-negative integers not in ``taken``."""
    out: list[int] = []
    k = 0
    while len(out) < count:
        if k not in taken:
            out.append(k)
        k += 1
    return out


def _segment_read(i: int, n: int, w: int, b: int, s: int, partition: str) -> tuple[int, int]:
    """(per-rank block size, samples each rank read) of segment ``i`` over ``n`` unread samples."""
    per = _per_rank(n, w, partition)
    if s > -(-per // b):
        raise ValueError(
            f"segment {i} took {s} steps but {n} unread samples over world size {w} "
            f"give only {-(-per // b)} batches of {b} per rank (the state does not match "
            "this dataset or partition rule)"
        )
    return per, min(s * b, per)


def unread_count(num_samples: int, *, partition: str = "pad",
                 segments: Sequence[Sequence[int]] = ()) -> int:
    """``unread(order, ...).size`` for any order of ``num_samples``, in O(len(segments)).

    Validates the segments as ``resume_partition`` does (ValueError).
    """
    n = _int_arg("num_samples", num_samples, 0, 1 << 62)
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    for i, seg in enumerate(segments):
        w, b, s = _segment_arg(i, seg)
        per, c = _segment_read(i, n, w, b, s, partition)
        if c:  # positions j < min(n, w * per) with j % per < c were read
            m = min(n, w * per)
            n -= (m // per) * c + min(m % per, c)
    return n


def _rest_runs(n: int, segments: Sequence[Sequence[int]], partition: str) -> tuple[np.ndarray, np.ndarray, set[int]]:
    """(lo, hi, taken): the unread positions of an order of ``n``, as runs, and fillers read.

    The positions ``segments`` left unread are the runs ``[lo[i], hi[i])``, in epoch order;
    ``taken`` holds the filler stream indices the segments read.

    NOTE [resume runs]: a segment keeps the tail of each rank's block (and, with ``drop``,
    the tail past the last block), so what is unread is a few runs of positions: at most one
    per rank of each segment. Working on the runs costs O(sum of the world sizes), never
    O(n): a rank resuming a global shuffle of 100 M samples computes only its own positions
    of the order, as ``plan`` does, instead of the whole order and a mask per segment
    (3.2 GB and 12-40 s per rank at 8,192 ranks, docs/scale.md).
    """
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    lo = np.array([0] if n else [], np.int64)
    hi = np.array([n] if n else [], np.int64)
    taken: set[int] = set()
    left = n
    for i, seg in enumerate(segments):
        w, b, s = _segment_arg(i, seg)
        per, c = _segment_read(i, left, w, b, s, partition)
        if c == 0:
            continue
        if partition == "pad" and w * per > left:
            slots = np.arange(left, w * per, dtype=np.int64)  # fewer than w filler positions
            read = np.flatnonzero(slots % per < c)
            stream = _first_unread(taken, slots.size)
            taken.update(stream[j] for j in read.tolist())
        blocks = np.arange(min(w, -(-left // per)), dtype=np.int64)  # those holding positions < left
        k_lo = blocks * per + c
        k_hi = np.minimum(blocks * per + per, left)
        keep = k_lo < k_hi
        k_lo, k_hi = k_lo[keep], k_hi[keep]
        if w * per < left:  # drop: the tail past the last block stays unread
            k_lo, k_hi = np.append(k_lo, w * per), np.append(k_hi, left)
        lo, hi = _pick(lo, hi, k_lo, k_hi)
        left = int((hi - lo).sum())
    return lo, hi, taken


def _pick(lo: np.ndarray, hi: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The runs of positions at indices ``[a[i], b[i])`` of the sequence the runs ``(lo, hi)`` make.

    ``a``/``b`` are ascending and disjoint; the result is in order, touching runs merged.
    Vectorized: a state with millions of ranges (a segment of a huge world size) costs what
    numpy costs, not a Python loop per range.
    """
    a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
    lens = hi - lo
    ends = np.cumsum(lens)
    first = ends - lens  # each run's first index in the sequence
    j0 = np.searchsorted(ends, a, side="right")  # the first run ending after a
    j1 = np.searchsorted(first, b, side="left")  # past the last run starting before b
    cnt = np.maximum(j1 - j0, 0)
    q = np.repeat(np.arange(a.size), cnt)  # each piece's range...
    j = np.repeat(j0 - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))  # ...and run
    start, stop = np.maximum(a[q], first[j]), np.minimum(b[q], ends[j])
    keep = stop > start
    p_lo = (lo[j] + start - first[j])[keep]
    return _merged(p_lo, p_lo + (stop - start)[keep])


def _merged(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs ``[lo[i], hi[i])`` with each run that starts where the one before ends joined to it."""
    if lo.size == 0:
        return lo, hi
    starts = np.flatnonzero(np.concatenate([[True], lo[1:] != hi[:-1]]))
    return lo[starts], hi[np.append(starts[1:] - 1, lo.size - 1)]


def _resume_point(
    order: np.ndarray, segments: Sequence[Sequence[int]], partition: str
) -> tuple[np.ndarray, set[int]]:
    """(unread samples in epoch order, filler stream indices read) after ``segments``."""
    full = _int_array("order", order)
    lo, hi, taken = _rest_runs(full.size, segments, partition)
    if lo.size == 0:
        return np.array(full[:0]), taken
    return np.concatenate([full[x:y] for x, y in zip(lo.tolist(), hi.tolist())]), taken


def resume_partition(
    order: np.ndarray,
    *,
    rank: int,
    world_size: int,
    partition: str = "pad",
    segments: Sequence[Sequence[int]] = (),
) -> np.ndarray:
    """Rank ``rank``'s block of what ``segments`` left unread of ``order``.

    ``segments`` lists how the epoch was consumed so far, as
    ``(world_size, batch_size, steps)`` per segment: NOTE [resume segments]. With no
    segments this equals ``partition(order, ...)``. Every rank gets the same count; when
    nothing is left, every rank gets an empty block.
    """
    world_size = _int_arg("world_size", world_size, 1, 1 << 31)
    rank = _int_arg("rank", rank, 0, world_size)
    full = _int_array("order", order)
    rest, taken = _resume_point(full, segments, partition)
    n = rest.size
    if n == 0:
        return np.zeros(0, np.int64)
    per = _per_rank(n, world_size, partition)
    start, stop = rank * per, (rank + 1) * per
    if stop <= n:
        return np.array(rest[start:stop])
    slots = np.arange(n, world_size * per, dtype=np.int64)
    stream = np.asarray(_first_unread(taken, slots.size), dtype=np.int64)
    ext = np.concatenate([rest[start:], full[stream % full.size]])
    return ext[: stop - start] if start < n else np.array(ext[start - n : stop - n])


def unread(order: np.ndarray, *, partition: str = "pad",
           segments: Sequence[Sequence[int]] = ()) -> np.ndarray:
    """The samples of ``order`` that ``segments`` have not read (fillers aside), in epoch order."""
    return _resume_point(order, segments, partition)[0]


def resume_plan(
    records_per_shard: Sequence[int],
    *,
    shuffle: bool,
    seed: int,
    epoch: int,
    rank: int,
    world_size: int,
    segments: Sequence[Sequence[int]] = (),
    worker: int = 0,
    num_workers: int = 1,
    shuffle_mode: str = "global",
    window: int = 65536,
    partition: str = "pad",
    shard_files: Sequence[int] | np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``plan`` for the rest of an epoch already consumed by ``segments``.

    Equals ``epoch_order`` (with ``shard_files``) -> ``resume_partition`` -> ``split_workers`` -> ``locate``, and
    with no segments it equals ``plan``; like ``plan`` it computes only this (rank,
    worker)'s positions of the order (NOTE [resume runs]).
    """
    world_size, num_workers = _reader_args(rank, world_size, worker, num_workers, partition)
    segs = [_segment_arg(i, s) for i, s in enumerate(segments)]
    window = _order_args(shuffle, shuffle_mode, window, seed, epoch)
    counts = _counts(records_per_shard)
    files = _shard_files(shard_files, counts.size)
    n = int(counts.sum())
    if n == 0:
        raise ValueError("cannot partition an empty order (the dataset has no samples)")
    lo, hi, taken = _rest_runs(n, segs, partition)
    left = int((hi - lo).sum())
    r_lo = r_hi = np.zeros(0, np.int64)
    if left:
        per = _per_rank(left, world_size, partition)
        q, rem = divmod(per, num_workers)
        # this worker's indices of the rank's block of (unread samples ++ fillers)
        a = rank * per + worker * q + min(worker, rem)
        z = a + q + (worker < rem)
        if a < left:
            r_lo, r_hi = _pick(lo, hi, np.array([a]), np.array([min(z, left)]))
        if z > left:  # pad fillers: the lowest filler stream indices not read, wrapping after n
            k = np.asarray(_first_unread(taken, z - left)[max(a, left) - left:], np.int64) % n
            r_lo, r_hi = _merged(np.concatenate([r_lo, k]), np.concatenate([r_hi, k + 1]))
    mine = _order_at_runs(counts, n, r_lo, r_hi, shuffle, shuffle_mode, seed, epoch, window, files)
    shard, record = locate(mine, counts)
    return np.ascontiguousarray(shard), np.ascontiguousarray(record)


_MAX_ORDER_RANGES = 16


def _order_at_runs(counts: np.ndarray, n: int, lo: np.ndarray, hi: np.ndarray, shuffle: bool, shuffle_mode: str,
                   seed: int, epoch: int, window: int, files: np.ndarray | None = None) -> np.ndarray:
    """``epoch_order(...)`` at the positions of the runs ``[lo[i], hi[i])``, concatenated.

    Computed from ranges of positions around the runs only. Ascending runs with gaps no longer than the run before plus 1 M share one range (a
    global shuffle passes over every key once per range); past ``_MAX_ORDER_RANGES`` ranges,
    one range spans them all.
    """
    lens = hi - lo
    offs = np.cumsum(lens) - lens  # each run's first index in the result
    pos = np.repeat(lo - offs, lens) + np.arange(int(lens.sum()))
    if not shuffle or pos.size == 0:
        return pos
    gap = lo[1:] - hi[:-1]
    cuts = np.flatnonzero((gap < 0) | (gap > lens[:-1] + (1 << 20))) + 1
    if cuts.size >= _MAX_ORDER_RANGES:
        cuts = cuts[:0]
    out = np.empty(pos.size, np.int64)
    for g0, g1 in zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [lo.size]]).tolist()):
        x, y = int(lo[g0:g1].min()), int(hi[g0:g1].max())
        if shuffle_mode == "global":
            vals = _global_order(n, x, y, seed, epoch)
        else:
            vals = _window_order(counts, x, y, seed, epoch, window, files)
        o0, o1 = int(offs[g0]), int(offs[g1 - 1] + lens[g1 - 1])
        out[o0:o1] = vals[pos[o0:o1] - x]
    return out


__all__ = ["STREAM_GLOBAL", "STREAM_SHARDS", "STREAM_WINDOW", "STREAM_FILE_SHARDS", "SHUFFLE_MODES", "PARTITIONS",
           "mix64", "sample_keys", "epoch_order", "partition", "split_workers", "locate", "plan", "unread_count", "resume_partition", "unread",
           "resume_plan"]
