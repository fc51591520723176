"""A first epoch from a cold page cache: pyloader vs torch's batched gather vs a sequential read.

For each record size (12 KB image-like, 8 KB tokens, 150 KB blobs; raw, no compression) the
same records are written as pyloader shards and as one ``.npy`` file. Every measurement runs
in a fresh process after the dataset's pages were dropped from the page cache (``--drop
fadvise``: ``posix_fadvise(DONTNEED)`` on each of its files, which needs no root and leaves
other programs' pages alone; ``--drop all``: ``sync; echo 3 > /proc/sys/vm/drop_caches``,
root only):

- ``pyloader``: one in-order epoch (``shuffle=False``, the peers' default and the first epoch
  of most jobs) of ``pyloader.DataLoader(num_workers=2)``, from the constructor to the last
  batch (and to the first: ``first_batch_s``), then the same loader's next epoch, warm
  (``warm_gbps``); ``pyloader_shuf``: the same, globally shuffled. A global shuffle's batches
  each need records from all over the dataset, so with bounded batch memory almost none can
  be finished before the last read: its limit is the sequential read followed by the
  collation of every batch at the warm rate (``shuffled_limit_of_best_seq``, per round; an
  epoch of a few batches can beat it, as those whose records are queued first finish early);
- ``gather``: torch's DataLoader over the ``.npy`` file, one ``np.take`` of the whole batch
  per step (the fastest plain peer of bench_core.py), in order; ``gather_shuf``: shuffled;
- ``seq``: the storage's sequential bandwidth: the shard files read start to end in 8 MiB
  reads (``pyloader.bench.measure.read_gbps``), one thread; ``seq2``: the same on two
  threads; ``cat``: ``cat`` of the shard files to /dev/null (128 KiB reads on one
  descriptor: the kernel's read-ahead runs ahead of it; here it read 2.1 GB/s where the
  8 MiB reads of ``seq`` read 0.6-2.0, run to run). "best seq" is the highest of the three;
- with ``--baseline ROOT`` (a checkout with its own built ``_C``): ``pyloader`` run from it.

Ratios are of medians, and (``per round``) the median of each round's variant over that
round's best sequential read: the device's speed drifts from round to round.

Variants are interleaved (round 1 of each, then round 2, ...) and medians reported: the
machine is shared. Before each child, ``--pretouch`` times the dataset's size of memory is
touched and freed: on a virtual machine whose host backs guest memory only when it is first
touched (and takes freed memory back within seconds), a page cache growing into such memory
costs several times the read (2 GiB first touched here: 6.1 s; touched again: 0.37 s), and
which child got such pages decided its figure. GB/s are payload bytes over wall time. Writes JSON and prints a table.

    python benchmarks/bench_cold_read.py [--mb 400] [--rounds 3] [--baseline /path/to/old/checkout]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drop(paths: list[str], how: str) -> None:
    if how == "all":
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dataset_files(d: str) -> list[str]:
    return sorted(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".pyl"))


def child(kind: str, path: str, npy: str, batch: int) -> dict:
    from pyloader.bench import measure as B

    t0 = time.perf_counter()
    if kind in ("seq", "seq2"):
        files = dataset_files(path)
        gbps = B.read_gbps(files, 2 if kind == "seq2" else 1)
        return {"gbps": gbps, "bytes": sum(os.path.getsize(f) for f in files)}
    if kind == "cat":
        files = dataset_files(path)
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
        size = sum(os.path.getsize(f) for f in files)
        return {"gbps": size / (time.perf_counter() - t0) / 1e9, "bytes": size}
    shuffle = kind.endswith("_shuf")
    if kind.startswith("pyloader"):
        loader = B.pyloader_loader(path, batch, shuffle=shuffle, threads=2)
    else:
        import numpy as np

        mm = np.load(npy, mmap_mode="r")
        loader = B.gather_loader(npy, mm.shape, str(mm.dtype), batch, shuffle=shuffle)
        del mm
    it = iter(loader)
    first = next(it)
    t_first = time.perf_counter() - t0
    n = nbytes = 0
    for batch in itertools.chain([first], it):
        tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
        n += int(tensors[0].shape[0])
        nbytes += sum(x.nelement() * x.element_size() for x in tensors)
    wall = time.perf_counter() - t0
    out = {"gbps": nbytes / wall / 1e9, "samples": n, "wall_s": wall, "first_batch_s": t_first}
    if kind.startswith("pyloader"):
        # The same loader's next epoch, its files now in memory and mapped: the rate at which
        # the batches a cold shuffled epoch could not finish before its last read are made.
        t1 = time.perf_counter()
        for _ in loader:
            pass
        out["warm_gbps"] = nbytes / (time.perf_counter() - t1) / 1e9
    return out


def run_child(root: str, how: str, kind: str, path: str, npy: str, batch: int, warm_bytes: int = 0) -> dict:
    from pyloader.bench.measure import pretouch

    pretouch(warm_bytes)  # the child's page cache gets pages the machine has backed
    drop(dataset_files(path) + [npy], how)
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, path, npy, str(batch)],
                         env=env, check=True, capture_output=True, text=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=400, help="dataset size per profile (MB)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profiles", default="image12k,tokens8k,blob150k")
    ap.add_argument("--order", choices=("inorder", "shuffled", "both"), default="both",
                    help="the epochs measured: in order (shuffle=False), globally shuffled, or both")
    ap.add_argument("--drop", choices=("fadvise", "all"), default="fadvise")
    ap.add_argument("--pretouch", type=float, default=3.0,
                    help="memory touched and freed before each child, in dataset sizes (0: none)")
    ap.add_argument("--baseline", help="a checkout with a built _C: its pyloader is measured too")
    ap.add_argument("--dir", help="where to write (default: a temporary folder, removed after)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "cold_read.json"))
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.child[2], int(a.child[3]))))
        return
    import numpy as np

    from pyloader.bench import measure as B

    tmp = a.dir or tempfile.mkdtemp(prefix="pyloader-bench-cold-read-")
    suffixes = {"inorder": [""], "shuffled": ["_shuf"], "both": ["", "_shuf"]}[a.order]
    variants = {"seq": ROOT, "seq2": ROOT, "cat": ROOT}
    for sfx in suffixes:
        variants.update({f"pyloader{sfx}": ROOT, f"gather{sfx}": ROOT})
        if a.baseline:
            variants[f"pyloader_baseline{sfx}"] = a.baseline
    result: dict = {"config": vars(a), "cpus": os.cpu_count(), "profiles": {}}
    try:
        for name in a.profiles.split(","):
            p = B.PROFILES[name]
            n = int(a.mb * 1e6 / p.record_bytes)
            path, npy = os.path.join(tmp, name), os.path.join(tmp, name + ".npy")
            if not os.path.exists(npy):
                recs = B.write_profile_dataset(path, p, n, compression="none")
                np.save(npy, recs)
                del recs
            runs: dict[str, list[float]] = {v: [] for v in variants}
            firsts: dict[str, list[float]] = {}
            warm: dict[str, list[float]] = {}
            for _ in range(a.rounds):
                for v, root in variants.items():
                    kind = v.replace("_baseline", "")
                    got = run_child(root, a.drop, kind, path, npy, a.batch, int(a.pretouch * a.mb * 1e6))
                    runs[v].append(got["gbps"])
                    if "warm_gbps" in got:
                        warm.setdefault(v, []).append(got["warm_gbps"])
                    if "first_batch_s" in got:
                        firsts.setdefault(v, []).append(got["first_batch_s"])
            med = {v: statistics.median(r) for v, r in runs.items()}
            first = {v: statistics.median(f) for v, f in firsts.items()}
            result["profiles"][name] = {"records": n, "record_bytes": p.record_bytes, "gbps": runs, "median": med,
                                        "first_batch_s": firsts, "first_batch_median_s": first}
            line = " ".join(f"{v} {g:.3f}" for v, g in med.items())
            seq = max(med["seq"], med["seq2"], med["cat"])
            # Each round's own ratio too: the device's speed drifts between rounds (here 0.6-2.5 GB/s
            # for the same sequential read), and a round's variants ran minutes apart at most.
            best = [max(x, y, z) for x, y, z in zip(runs["seq"], runs["seq2"], runs["cat"])]
            paired = {v: statistics.median(g / b for g, b in zip(runs[v], best)) for v in runs}
            result["profiles"][name]["of_best_seq_per_round_median"] = paired
            result["profiles"][name]["warm_gbps"] = warm
            # A global shuffle's batches each need records from all over the dataset, so with
            # batch memory bounded (a few batches) almost none can be finished before the last
            # read: the epoch takes at least the sequential read plus the collation of (almost)
            # every batch at the warm rate. Its rate over the best sequential read, per round.
            limit = None
            if "pyloader_shuf" in warm:
                limit = statistics.median(1 / (1 / b + 1 / w) / b for b, w in zip(best, warm["pyloader_shuf"]))
                result["profiles"][name]["shuffled_limit_of_best_seq"] = limit
            ratios = []
            for sfx in suffixes:
                pl, g = med["pyloader" + sfx], med["gather" + sfx]
                r = (f"{'shuffled' if sfx else 'in order'}: pyloader/gather {pl / g:.2f}x, pyloader/best seq {pl / seq:.2f}"
                     f" (per round {paired['pyloader' + sfx]:.2f}; gather {paired['gather' + sfx]:.2f})")
                if sfx and limit:
                    r += f", limit (read, then collate at the warm rate) {limit:.2f} of best seq"
                if a.baseline:
                    b = med["pyloader_baseline" + sfx]
                    r += f", baseline/gather {b / g:.2f}x, baseline/best seq {b / seq:.2f}"
                ratios.append(r)
            print(f"{name:>9}: GB/s {line} | " + "; ".join(ratios) + "; first batch (ms) "
                  + " ".join(f"{v} {1e3 * f:.0f}" for v, f in first.items()) + f"  (rounds: {runs})", flush=True)
    finally:
        if not a.dir:
            shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
