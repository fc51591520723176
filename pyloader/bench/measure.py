"""Measurements shared by ``pyloader bench`` and the scripts in ``benchmarks/``.

Every figure is taken in the same process and run as its baseline, so the ratios
hold even on a noisy machine.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import pyloader._C as _C

from ..loader.dataloader import DataLoader
from ..read.shards import ShardDataset
from ..write.writer import ShardWriter


@dataclass(frozen=True)
class Profile:
    """A synthetic record shape: a payload field plus an int64 label."""

    name: str
    record_bytes: int
    kind: str  # "image" (compressible), "tokens" (incompressible), "blob"
    description: str


PROFILES: dict[str, Profile] = {
    "image12k": Profile("image12k", 12288, "image", "12 KB image-like records (compressible)"),
    "tokens8k": Profile("tokens8k", 8192, "tokens", "8 KB token records (incompressible)"),
    "blob150k": Profile("blob150k", 153600, "image", "150 KB image-like records"),
}


def _payload_field(p: Profile) -> tuple[str, tuple[str, tuple[int, ...]]]:
    if p.kind == "tokens":
        return "tokens", ("int32", (p.record_bytes // 4,))
    side = int(np.sqrt(p.record_bytes // 3))
    if 3 * side * side == p.record_bytes:
        return "image", ("uint8", (3, side, side))
    return "image", ("uint8", (p.record_bytes,))


def make_records(p: Profile, n: int, seed: int) -> np.ndarray:
    """Returns ``n`` records of profile ``p`` as one array ``[n, ...]``.

    Image-like records are smooth gradients plus low-amplitude noise (LZ4 compresses them
    ~2x); token records are uniformly random int32 (LZ4 cannot compress them).
    """
    rng = np.random.default_rng(seed)
    name, (dtype, shape) = _payload_field(p)
    if p.kind == "tokens":
        return rng.integers(0, 2**31 - 1, (n, *shape), dtype=np.int32)
    flat = int(np.prod(shape))
    base = (np.arange(flat, dtype=np.uint32) // 64 % 256).astype(np.uint8)
    out = np.empty((n, flat), np.uint8)
    for start in range(0, n, 1024):
        k = min(1024, n - start)
        noise = rng.integers(0, 4, (k, flat), dtype=np.uint8)
        shift = rng.integers(0, 256, (k, 1), dtype=np.uint8)
        out[start : start + k] = base[None, :] + shift + (noise & (noise >> 1))
    return out.reshape(n, *shape)


def write_profile_dataset(path: str, p: Profile, n: int, *, compression: str = "none", seed: int = 0,
                          shard_bytes: int = 64 << 20, version: int = 3) -> np.ndarray:
    """Writes n records of profile p; returns the records (for baselines on the same data).

    ``version``: the newest shard format version written (``ShardWriter``'s): 3 stores the
    int64 label as a column, 2 gives every value an index entry.
    """
    name, spec = _payload_field(p)
    recs = make_records(p, n, seed)
    with ShardWriter(path, {name: spec, "label": ("int64", ())}, compression=compression,
                     shard_bytes=shard_bytes, overwrite=True, version=version) as w:
        for i in range(n):
            w.write({name: recs[i], "label": i})
    return recs


# -- timing helpers -------------------------------------------------------------------
# NOTE [CPU of live children]: a stage's ``cpu_s`` is the CPU time of every thread of this
# process and of every child process, whether it ended during the stage or is still alive
# at its end (torch's persistent workers, pyloader's transform processes).
# ``RUSAGE_CHILDREN`` alone cannot give that: it counts a child only once it has exited and
# been waited for, so a loader's live workers read as zero. So each live descendant's CPU
# time (its own, plus that of the children it has waited for) is read at the start and at
# the end of the block: from /proc/<pid>/stat on Linux, else from psutil when it is
# installed; without either only exited children count (``cpu_accounting()`` says which).
# A process is known by (pid, start time), so a reused pid is a new process. A descendant
# alive at the start and gone at the end has had its whole time counted by whoever waited
# for it (``RUSAGE_CHILDREN`` or its parent's own children's time): the part it had spent
# before the block is taken off again.
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _proc_stat(pid: int) -> tuple[int, int, float] | None:
    """(parent pid, start time in ticks, CPU seconds incl. waited-for children) of ``pid``; None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()  # after "pid (comm) ": the comm may hold spaces
    # fields[i] is stat field i + 3: ppid 4, utime 14, stime 15, cutime 16, cstime 17, starttime 22
    ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return int(fields[1]), int(fields[19]), ticks / _CLK_TCK


def _proc_children(pid: int) -> list[int] | None:
    """The child pids of ``pid`` from /proc/<pid>/task/*/children; None where the kernel has no such file."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread ended meanwhile
            return None
        except OSError:
            continue
    return out


def _live_children_proc() -> dict[tuple[int, int], float]:
    """CPU seconds of every live descendant of this process, by (pid, start time), from /proc."""
    me = os.getpid()
    out: dict[tuple[int, int], float] = {}
    by_parent: dict[int, list[int]] | None = None
    todo = [me]
    while todo:
        pid = todo.pop()
        kids = _proc_children(pid) if by_parent is None else by_parent.get(pid, [])
        if kids is None:  # no children files: one scan of /proc for every process's parent
            by_parent = {}
            for name in os.listdir("/proc"):
                if name.isdigit() and (st := _proc_stat(int(name))) is not None:
                    by_parent.setdefault(st[0], []).append(int(name))
            kids = by_parent.get(pid, [])
        for kid in kids:
            st = _proc_stat(kid)
            if st is not None and (kid, st[1]) not in out:
                out[(kid, st[1])] = st[2]
                todo.append(kid)
    return out


def _live_children_psutil() -> dict[tuple[int, int], float]:
    psutil: Any = importlib.import_module("psutil")  # optional: not a dependency, and untyped
    out: dict[tuple[int, int], float] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
            out[(p.pid, int(p.create_time() * 1e6))] = (t.user + t.system + getattr(t, "children_user", 0.0)
                                                        + getattr(t, "children_system", 0.0))
        except psutil.Error:
            continue
    return out


def cpu_accounting() -> str:
    """How live child processes' CPU time is read here: "proc", "psutil", or "exited only" (See NOTE [CPU of live children])."""
    if os.path.exists(f"/proc/{os.getpid()}/stat"):
        return "proc"
    return "psutil" if importlib.util.find_spec("psutil") is not None else "exited only"


def live_children_cpu() -> dict[tuple[int, int], float]:
    """CPU seconds of every live descendant process, by (pid, start time) (See NOTE [CPU of live children])."""
    how = cpu_accounting()
    if how == "proc":
        return _live_children_proc()
    if how == "psutil":
        return _live_children_psutil()
    return {}


class CpuTimer:
    """Wall and CPU time of a block: every thread of this process and every child process.

    Child processes count whether they exited or are still alive (See NOTE [CPU of live children]).
    After the block: ``wall``, ``cpu`` (the total), ``cpu_self`` (this process's threads) and
    ``cpu_children`` (child processes).
    """

    # Reading the live children takes a fraction of a millisecond: it is done outside the wall time.
    def __enter__(self) -> CpuTimer:
        self._live = live_children_cpu()
        r = resource.getrusage(resource.RUSAGE_SELF)
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._self, self._exited = r.ru_utime + r.ru_stime, c.ru_utime + c.ru_stime
        self._w = time.perf_counter()
        return self

    def elapsed(self) -> float:
        """Wall time since the block started, as ``wall`` will count it."""
        return time.perf_counter() - self._w

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self._w
        live = live_children_cpu()
        r = resource.getrusage(resource.RUSAGE_SELF)
        c = resource.getrusage(resource.RUSAGE_CHILDREN)
        exited = c.ru_utime + c.ru_stime - self._exited
        grown = sum(cpu - self._live.get(key, 0.0) for key, cpu in live.items())
        counted_before = sum(cpu for key, cpu in self._live.items() if key not in live)
        self.cpu_self = r.ru_utime + r.ru_stime - self._self
        self.cpu_children = max(0.0, grown + exited - counted_before)
        self.cpu = self.cpu_self + self.cpu_children


def best_of(fn: Callable[[], float], repeats: int) -> float:
    """Highest throughput of `repeats` runs of fn (which returns a throughput)."""
    return max(fn() for _ in range(repeats))


def interleaved(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Runs each variant once per round; returns each variant's figure of every round.

    The order is rotated every round, so that load from other processes hits every
    variant alike.
    """
    names = list(variants)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(variants[name]())
    return out


def parallel(fn: Callable[[], None], threads: int) -> float:
    """Wall seconds for `threads` Python threads each running fn (fn must release the GIL).

    An exception in any thread is re-raised here, on the calling thread, once all have ended
    (the first one raised; no thread prints a traceback of its own).
    """
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread below
            errors.append(e)

    ts = [threading.Thread(target=run) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall


def forked_rate(work: Callable[[int], int], procs: int, seconds: float) -> float:
    """Units/s of ``procs`` forked processes each calling ``work(i)`` (i = p, p + procs, ...) for ``seconds``.

    ``work`` returns the units it did (samples). Each process runs torch and the BLAS
    libraries on one thread exactly as a loader's transform worker does (its OpenBLAS
    thread server stopped too), keeps its heap as one (NOTE [worker heap] in
    pyloader/transform/stage.py), and reports its count and end time
    through a pipe; the rate is their sum over the time from the first fork to the last
    end (so process start is counted, as in benchmarks/bench_user_transforms.py). A
    process whose ``work`` raises makes this raise ``RuntimeError`` with its error.
    """
    import gc
    import pickle

    gc.collect()  # a child collects nothing a parent's finalizer would (native threads are the parent's)
    t0 = time.perf_counter()
    deadline = t0 + seconds
    kids: list[tuple[int, int]] = []
    for p in range(procs):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            gc.disable()
            os.close(r)
            try:
                from ..transform.stage import as_worker_process

                as_worker_process()  # a worker's threads and heap (See NOTE [worker threads], NOTE [worker heap])
                n, i = 0, p
                while True:
                    n += work(i)
                    i += procs
                    if time.perf_counter() >= deadline:
                        break
                out: Any = (n, time.perf_counter())
            except BaseException as e:  # noqa: BLE001 - told to the parent, which raises it
                out = f"{type(e).__name__}: {e}"
            os.write(w, pickle.dumps(out))
            os._exit(0)
        os.close(w)
        kids.append((pid, r))
    counts, end, errors = 0, t0, []
    for pid, r in kids:
        with os.fdopen(r, "rb") as f:
            data = f.read()
        os.waitpid(pid, 0)
        got = pickle.loads(data) if data else "it ended without a result"
        if isinstance(got, str):
            errors.append(got)
        else:
            counts, end = counts + got[0], max(end, got[1])
    if errors:
        raise RuntimeError(f"a process running the work alone failed: {errors[0]}; run it on one sample in this "
                           f"process to see where")
    return counts / max(end - t0, 1e-9)


def memcpy_gbps(threads: int, nbytes: int = 64 << 20, repeat: int = 8) -> float:
    """Copy bandwidth (GB/s of bytes copied) with numpy copies on `threads` threads."""
    bufs = [(np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)) for _ in range(threads)]
    for s, d in bufs:
        np.copyto(d, s)  # fault the pages in first

    def make(i: int) -> Callable[[], None]:
        def run() -> None:
            s, d = bufs[i]
            for _ in range(repeat):
                np.copyto(d, s)
        return run

    idx = iter(range(threads))
    lock = threading.Lock()

    def worker() -> None:
        with lock:
            i = next(idx)
        make(i)()

    wall = parallel(worker, threads)
    return threads * repeat * nbytes / wall / 1e9


def collate_copy_gbps(threads: int, batch_bytes: int, *, source_bytes: int = 64 << 20,
                      seconds: float = 0.3) -> float:
    """GB/s of bytes copied the way collation copies them, on `threads` threads.

    Each thread copies a large source (out of the CPU caches, like a dataset's mapped
    pages) in batch-sized pieces into one reused batch-sized buffer, as the loader's
    workers fill its pooled batch buffers.
    """
    chunk = max(4096, min(batch_bytes, source_bytes))
    src_n = max(chunk, source_bytes // max(threads, 1) // chunk * chunk)
    bufs = [(np.ones(src_n, np.uint8), np.empty(chunk, np.uint8)) for _ in range(threads)]
    for s, d in bufs:
        np.copyto(d, s[:chunk])
    reps = max(1, int(seconds * 10e9 / max(src_n * threads, 1)))  # sized for ~10 GB/s
    idx = iter(range(threads))
    lock = threading.Lock()

    def worker() -> None:
        with lock:
            s, d = bufs[next(idx)]
        for _ in range(reps):
            for off in range(0, src_n, chunk):
                np.copyto(d, s[off : off + chunk])

    wall = parallel(worker, threads)
    return threads * reps * src_n / wall / 1e9


def read_gbps(paths: list[str], threads: int = 1, *, min_seconds: float = 0.0) -> float:
    """Read bandwidth of files (page cache if they were just written), on `threads` threads.

    The files are cut into 8 MiB pieces dealt round-robin to the threads. With
    ``min_seconds``, each thread reads its pieces again until that much time has passed
    (a small dataset reads in microseconds, too short to time).
    """
    piece = 8 << 20
    work = [(p, off) for p in paths for off in range(0, max(os.path.getsize(p), 1), piece)]
    done: list[int] = []
    lock = threading.Lock()
    deal = iter(range(threads))
    t0 = time.perf_counter()

    def worker() -> None:
        with lock:
            k = next(deal)
        mine = work[k::threads]
        fds = {path: os.open(path, os.O_RDONLY) for path in {p for p, _ in mine}}
        buf = bytearray(min(piece, max((os.path.getsize(p) for p in fds), default=1)))
        n = 0
        try:
            while mine:
                for path, off in mine:
                    n += os.preadv(fds[path], [buf], off)
                if time.perf_counter() - t0 >= min_seconds:
                    break
        finally:
            for fd in fds.values():
                os.close(fd)
        with lock:
            done.append(n)

    wall = parallel(worker, threads)
    return sum(done) / max(wall, 1e-9) / 1e9


def stream_read_gbps(paths: list[str], chunk: int = 128 << 10) -> float:
    """GB/s of reading the files start to end as ``cat`` does: ``chunk``-byte reads on one descriptor each.

    The kernel's read-ahead then runs ahead of the reader; from a cold page cache that read
    2.1 GB/s here where ``read_gbps``'s 8 MiB reads read 0.6-2.0, run to run.
    """
    buf = bytearray(chunk)
    n = 0
    t0 = time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as fh:
            while k := fh.readinto(buf):
                n += k
    return n / max(time.perf_counter() - t0, 1e-9) / 1e9


def drop_pages(paths: list[str]) -> None:
    """Evicts the files' pages from the page cache: written back (fsync), then ``POSIX_FADV_DONTNEED``.

    Needs no root and leaves other files' pages alone. Pages some process has mapped stay.
    """
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def available_memory() -> int:
    """Bytes of memory available to new allocations (``MemAvailable``), 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def pretouch(nbytes: int) -> None:
    """Touches ``nbytes`` of fresh memory and frees it, for pages the machine has backed.

    What is allocated next (a growing page cache) then gets those pages. On a virtual
    machine whose host backs guest memory when it is first touched, and takes freed memory
    back within seconds (a balloon with free page reporting), the first touch costs several
    times the work itself: 2 GiB took 6.1 s to fill the first time and 0.37 s the next, on
    the machine pyloader's figures come from. A measurement that grows the page cache then
    depends on which pages it happens to get; benchmarks call this right before.
    """
    if nbytes > 0:
        a = np.ones(nbytes // 8, np.int64)
        del a


def _file_sizes(d: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return out
    for n in names:
        try:
            out[n] = os.stat(os.path.join(d, n)).st_size
        except FileNotFoundError:
            pass
    return out


def cache_disk_bytes(cache_dir: str) -> int:
    """Bytes of every published shard and temp file in a node cache (what its limit caps).

    A consistent sample: each dataset's ``shards/`` is listed before and after its ``tmp/``,
    again while a download was published in between (it would be counted twice).
    """
    root = os.path.join(cache_dir, "v1")
    try:
        keys = [k for k in os.listdir(root) if os.path.isdir(os.path.join(root, k))]
    except FileNotFoundError:
        return 0
    total = 0
    for k in keys:
        after = _file_sizes(os.path.join(root, k, "shards"))
        for _ in range(100):
            before = after
            temps = _file_sizes(os.path.join(root, k, "tmp"))
            after = _file_sizes(os.path.join(root, k, "shards"))
            if before.keys() == after.keys():
                break
        total += sum(after.values()) + sum(temps.values())
    return total


class CachePeak:
    """The largest ``cache_disk_bytes`` seen, sampled every ``interval`` s on a thread while a block runs."""

    def __init__(self, cache_dir: str, interval: float = 0.003) -> None:
        self.cache_dir, self.interval, self.peak, self.samples = cache_dir, interval, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, cache_disk_bytes(self.cache_dir))
            self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> CachePeak:
        self._t.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._stop.set()
        self._t.join()


def _resident_pages(path: str, start: int, end: int) -> tuple[int, int]:
    """(pages in the page cache, pages) of bytes [start, end) of the file (``mincore`` over a private mapping)."""
    import ctypes
    import mmap

    start -= start % mmap.PAGESIZE  # a mapping starts on a page
    if end <= start:
        return 0, 0
    libc = ctypes.CDLL(None, use_errno=True)
    pages = (end - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), end - start, access=mmap.ACCESS_COPY, offset=start) as mm:
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(end - start), vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore failed on {path!r}")
        return sum(v & 1 for v in vec), pages


def resident_fraction(paths: list[str]) -> float:
    """The share of the files' pages in the page cache now (``mincore`` over a private mapping)."""
    have = total = 0
    for p in paths:
        h, n = _resident_pages(p, 0, os.path.getsize(p))
        have, total = have + h, total + n
    return have / total if total else 0.0


def resident_range_fraction(path: str, start: int, end: int) -> float:
    """The share of the pages of bytes [start, end) of the file ``path`` in the page cache now."""
    have, total = _resident_pages(path, start, end)
    return have / total if total else 0.0


def _value_bytes(x: Any) -> int:
    """Bytes of one collated value: a tensor or array, bytes, a string, or a list of them (a bytes field)."""
    if isinstance(x, torch.Tensor):
        return x.nelement() * x.element_size()
    if isinstance(x, np.ndarray):
        return int(x.nbytes)
    if isinstance(x, (bytes, bytearray, memoryview)):
        return len(x)
    if isinstance(x, str):
        return len(x.encode())
    if isinstance(x, dict):
        return batch_payload(x)[1]
    if isinstance(x, (list, tuple)):
        return sum(_value_bytes(v) for v in x)
    return 0


def _rows(x: Any) -> int | None:
    """How many samples a collated value holds: a tensor's first dimension, a list's length; None if neither."""
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return int(x.shape[0]) if x.ndim else None
    if isinstance(x, (list, tuple)):
        return len(x)
    return None


def batch_payload(batch: Any) -> tuple[int, int]:
    """(samples, payload bytes) of one batch, as its fields hold them.

    A batch is a dict of fields or a tuple of them. Tensors count their elements; a bytes or
    string field collated to a list (torch's ``default_collate``, pyloader's transform
    stage) counts each value's length. A variable field padded to its longest sample counts
    only each sample's ``<name>_lengths`` rows, and the lengths themselves are not payload:
    padding is not data, so an undecoded batch never counts more bytes than were read for it.
    """
    values = list(batch.items()) if isinstance(batch, dict) else list(enumerate(batch))
    keys = {k for k, _ in values}
    n: int | None = None
    nbytes = 0
    for k, x in values:
        if isinstance(k, str) and k.endswith("_lengths") and k[: -len("_lengths")] in keys:
            continue  # a padded field's lengths: counted with the field
        if n is None:
            n = _rows(x)
        lengths = batch.get(f"{k}_lengths") if isinstance(batch, dict) and isinstance(k, str) else None
        if lengths is not None and isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[0] == len(lengths):
            row = math.prod(x.shape[2:]) * x.element_size()  # one step of the padded dimension
            nbytes += int(torch.as_tensor(lengths).sum()) * row
        else:
            nbytes += _value_bytes(x)
    return n or 0, nbytes


def epoch_samples(loader: Any, *, touch: bool = False) -> tuple[int, int]:
    """Iterates one epoch; returns (samples, payload bytes, ``batch_payload``'s). Untimed: callers time whole rounds."""
    n = nbytes = 0
    for batch in loader:
        s, b = batch_payload(batch)
        n, nbytes = n + s, nbytes + b
        if touch:
            first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
            first.view(-1)[0].item()
    return n, nbytes


def loader_epoch(loader: Any, *, touch: bool = False) -> tuple[int, int, CpuTimer]:
    """Iterates one epoch; returns (samples, payload bytes, timer)."""
    with CpuTimer() as t:
        n, nbytes = epoch_samples(loader, touch=touch)
    return n, nbytes, t


def pyloader_loader(path: str, batch_size: int, *, shuffle: bool = False, threads: int = 2,
                    prefetch: int | None = None) -> DataLoader:
    """A pyloader DataLoader over the dataset at ``path`` with ``threads`` native threads (shuffle seed 0)."""
    ds = ShardDataset(path, shuffle=shuffle, seed=0)
    return DataLoader(ds, batch_size=batch_size, num_workers=threads, prefetch=prefetch)


class MemmapDataset(torch.utils.data.Dataset):
    """Torch's usual map-style baseline: one record per __getitem__ from a numpy memmap."""

    def __init__(self, path: str, shape: tuple[int, ...], dtype: str) -> None:
        self.path, self.shape, self.dtype = path, shape, dtype
        self._mm: np.ndarray | None = None

    def _map(self) -> np.ndarray:
        if self._mm is None:
            self._mm = np.load(self.path, mmap_mode="r")
        return self._mm

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.from_numpy(np.array(self._map()[i])), i

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_mm": None}


class BatchGatherDataset(MemmapDataset):
    """The fastest plain baseline: one np.take per batch.

    ``__getitem__`` takes a list of indices and gathers the whole batch from the memmap.
    """

    def __getitem__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]  # a BatchSampler passes a list of indices
        ix = np.asarray(idx)
        return torch.from_numpy(np.take(self._map(), ix, axis=0)), torch.from_numpy(ix)


def torch_loader(npy_path: str, shape: tuple[int, ...], dtype: str, batch_size: int, *, shuffle: bool,
                 num_workers: int) -> torch.utils.data.DataLoader:
    """Torch's DataLoader over a ``.npy`` file, one record per ``__getitem__`` (the usual baseline)."""
    ds = MemmapDataset(npy_path, shape, dtype)
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers,
                                       generator=g, persistent_workers=num_workers > 0,
                                       prefetch_factor=4 if num_workers else None)


def gather_loader(npy_path: str, shape: tuple[int, ...], dtype: str, batch_size: int, *,
                  shuffle: bool) -> torch.utils.data.DataLoader:
    """Torch's DataLoader over a ``.npy`` file, one gathered batch per ``__getitem__`` (no workers)."""
    ds = BatchGatherDataset(npy_path, shape, dtype)
    n = shape[0]
    if shuffle:
        sampler: Any = torch.utils.data.RandomSampler(range(n), generator=torch.Generator().manual_seed(0))
    else:
        sampler = torch.utils.data.SequentialSampler(range(n))
    bs = torch.utils.data.BatchSampler(sampler, batch_size, drop_last=False)
    return torch.utils.data.DataLoader(ds, sampler=bs, batch_size=None, num_workers=0)


def lz4_package_decode_gbps(blocks: list[tuple[bytes, int]], threads: int, seconds: float = 1.0) -> float:
    """Decoded GB/s of lz4.block.decompress over `blocks` on `threads` threads."""
    import lz4.block

    total = sum(n for _, n in blocks)
    reps = max(1, int(seconds * 1e9 / max(total, 1) / 2))

    def run() -> None:
        for _ in range(reps):
            for b, n in blocks:
                lz4.block.decompress(b, uncompressed_size=n)

    wall = parallel(run, threads)
    return threads * reps * total / wall / 1e9


def native_decode_gbps(blocks: list[tuple[bytes, int]], threads: int, seconds: float = 1.0) -> float:
    """Decoded GB/s of pyloader's LZ4 decoder (into a reused buffer) on `threads` threads."""
    total = sum(n for _, n in blocks)
    reps = max(1, int(seconds * 1e9 / max(total, 1) / 2))
    outs: dict[int, dict[int, bytearray]] = {}  # thread id -> decoded size -> its reused buffer

    def run() -> None:
        tid = threading.get_ident()
        dst = {n: bytearray(n) for _, n in blocks} if tid not in outs else outs[tid]
        outs[tid] = dst
        for _ in range(reps):
            for b, n in blocks:
                _C.lz4_decode_into(b, dst[n])

    wall = parallel(run, threads)
    return threads * reps * total / wall / 1e9


def environment() -> dict[str, Any]:
    """Versions (Python, torch, numpy), CPU count, platform and how child processes' CPU time is read."""
    import platform

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "cpus": os.cpu_count(),
        "cpu_accounting": cpu_accounting(),
        "machine": platform.machine(),
        "platform": platform.platform(),
    }


__all__ = ["available_memory", "pretouch", "Profile", "PROFILES", "make_records", "write_profile_dataset", "CpuTimer", "cpu_accounting", "live_children_cpu", "best_of", "interleaved", "forked_rate",
           "parallel", "memcpy_gbps", "collate_copy_gbps", "read_gbps", "stream_read_gbps", "drop_pages", "cache_disk_bytes", "CachePeak", "resident_fraction", "resident_range_fraction", "batch_payload", "epoch_samples", "loader_epoch", "pyloader_loader",
           "MemmapDataset", "BatchGatherDataset", "torch_loader", "gather_loader", "lz4_package_decode_gbps",
           "native_decode_gbps", "environment"]
