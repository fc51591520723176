"""Sequence packing: pyloader's native packer against a Python greedy packer, side by side in one run.

One dataset of LM-like documents (one variable-length int32 ``tokens`` field, no
compression; lengths log-normal with mean ``--mean-len`` tokens and sigma 1, clipped to
[16, 32768], so a few percent are longer than 4096 and get split), page cache warm. All
loaders read it shuffled (seed 1) with 2 native threads and make batches of ``--rows``
rows; every variant is one loader kept for the run and read one epoch per round, rounds
interleaved (the order rotated each round) because the machine is shared and noisy. A
packing loader does not start its next epoch ahead (NOTE [epoch ahead]), so the unpacked
loaders here do not either: every timed epoch starts from an empty pipeline, and no loader
works in the background while another is timed.

1. ``native greedy``: ``DataLoader(pack=PackSpec(seq_len, mode="greedy"))`` against
   ``python greedy`` (``python_greedy_pack`` below: the same rule in Python over pyloader's
   unpacked DataLoader of the same documents) at seq_len 4096 and 2048, and against
   ``unpacked read``, the same DataLoader reading the documents without packing, in
   batches of ``PackSpec.doc_batch`` (256) documents as the packer's own input: the cost of
   packing itself. The first epoch of each pair is untimed and checks that the Python
   packer's batches equal the native ones, field by field.
2. ``native first_fit`` with lookahead 8, 64 and 256 at seq_len 4096: padding fraction
   (``stats()["packing"]["padding_fraction"]``) against greedy's, and tokens/s; and
   ``native greedy 4096 db64``, greedy with ``PackSpec(doc_batch=64)``: the packer's input
   is collated in batches of documents each padded to its longest, so the document batch
   size sets how many bytes the pipeline moves.
3. a three-source ``pyloader.Mixture`` (the same documents dealt round-robin to three
   datasets, weights 0.5 / 0.3 / 0.2) packed greedily at 4096 against the one dataset
   packed alike (target: >= 0.9x the tokens/s).

tokens/s is document tokens delivered per second of the consumer's epoch (the consumer
does nothing with a batch); ratios are taken per round (the pair ran seconds apart) and
their median reported, with the median rate of each variant. ``collate_s``: the document
pipeline's threads' time collating (``stats()["collate_s"]``). Prints a table and writes
bench_results/packing.json.

    python benchmarks/bench_packing.py [--quick] [--tokens 64e6] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pyloader
from pyloader.bench import measure as B

VOCAB = 50_257


def document_lengths(tokens: float, mean_len: float, seed: int) -> np.ndarray:
    """Log-normal lengths (sigma 1, mean ``mean_len`` before clipping) summing to about ``tokens``."""
    rng = np.random.default_rng(seed)
    n = int(tokens / mean_len * 1.1) + 16
    lens = np.clip(rng.lognormal(np.log(mean_len) - 0.5, 1.0, n), 16, 32768).astype(np.int64)
    return lens[: int(np.searchsorted(np.cumsum(lens), tokens)) + 1]


def write_documents(path: str, lens: np.ndarray, which: Iterable[int], seed: int) -> None:
    """Writes documents ``which`` (of lengths ``lens``): random tokens, slices of one pool."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(0, VOCAB, 1 << 22, dtype=np.int32)
    starts = rng.integers(0, len(pool) - 32768, len(lens))
    with pyloader.ShardWriter(path, {"tokens": ("int32", (None,))}, compression=None, shard_bytes=32 << 20) as w:
        for i in which:
            w.write({"tokens": pool[starts[i]:starts[i] + lens[i]]})


def read_all(path: str) -> None:
    """Puts the dataset's files in the page cache."""
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb", buffering=0) as fh:
            while fh.read(1 << 24):
                pass


def python_greedy_pack(doc_batches: Iterable[dict[str, torch.Tensor]], seq_len: int, rows: int,
                       pad_id: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Greedy packing as users write it in Python (torchtune's PackedDataset / TRL style), made efficient.

    Reads batches of documents (``tokens`` zero-padded ``[B, L]`` and ``tokens_lengths``, as
    pyloader's unpacked DataLoader yields them) and, for each document in order, cuts it into
    pieces of at most ``seq_len`` tokens; a piece that does not fit the current row's free
    tokens closes that row (the rest stays padding) and starts the next. Each piece is copied
    with numpy slice assignments straight into the batch being built -- tokens, position ids
    (a slice of a precomputed ``arange``) and document ids (the piece's number in the batch)
    -- and its end appended to a Python list of ``cu_seqlens`` (every piece and every row's
    padding run, flattened). A batch of ``rows`` rows is handed out as torch tensors
    (``torch.from_numpy``, no copy) and fresh arrays allocated. The output is the native
    packer's with ``PackSpec(mode="greedy", split=True)``, batch for batch (checked by the
    benchmark). It runs on the consumer's thread, not ahead of it.
    """
    ar = np.arange(seq_len, dtype=np.int64)

    def fresh() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.full((rows, seq_len), pad_id, np.int32), np.zeros((rows, seq_len), np.int64),
                np.full((rows, seq_len), -1, np.int32))

    def out(n: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.from_numpy(tok[:n]), "position_ids": torch.from_numpy(pos[:n]),
                "document_ids": torch.from_numpy(did[:n]), "cu_seqlens": torch.tensor(cu, dtype=torch.int32)}

    tok, pos, did = fresh()
    r = at = piece = 0
    cu = [0]
    for b in doc_batches:
        t = b["tokens"].numpy()
        for i, n in enumerate(b["tokens_lengths"].tolist()):
            doc = t[i]
            s = 0
            while s < n:
                m = min(seq_len, n - s)
                if at + m > seq_len:  # the piece does not fit: close the row
                    if at < seq_len:
                        cu.append((r + 1) * seq_len)
                    r += 1
                    at = 0
                    if r == rows:
                        yield out(rows)
                        tok, pos, did = fresh()
                        r = piece = 0
                        cu = [0]
                e = at + m
                tok[r, at:e] = doc[s:s + m]
                pos[r, at:e] = ar[:m]
                did[r, at:e] = piece
                piece += 1
                at = e
                cu.append(r * seq_len + e)
                s += m
    if at:
        if at < seq_len:
            cu.append((r + 1) * seq_len)
        r += 1
    if r:
        yield out(r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8M tokens, 3 rounds (a smoke run)")
    ap.add_argument("--tokens", type=float, default=None, help="document tokens in the dataset (default 64e6)")
    ap.add_argument("--mean-len", type=float, default=800.0)
    ap.add_argument("--rows", type=int, default=8, help="packed rows per batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None, help="default 7 (--quick: 3)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench_results", "packing.json"))
    args = ap.parse_args()
    tokens = args.tokens if args.tokens is not None else (8e6 if args.quick else 64e6)
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 7)
    doc_batch = pyloader.PackSpec(seq_len=1).doc_batch
    lens = document_lengths(tokens, args.mean_len, seed=0)
    total = int(lens.sum())
    cfg: dict[str, Any] = {"documents": len(lens), "tokens": total, "mean_len": float(lens.mean()),
                           "max_len": int(lens.max()), "rows": args.rows, "threads": args.threads,
                           "rounds": rounds, "doc_batch": doc_batch, "shuffle": True, "seed": 1,
                           "mixture_weights": [0.5, 0.3, 0.2]}
    tmp = tempfile.mkdtemp(prefix="pyloader-bench-packing-")
    try:
        t0 = time.perf_counter()
        full = os.path.join(tmp, "all")
        write_documents(full, lens, range(len(lens)), seed=0)
        parts = [os.path.join(tmp, f"part{k}") for k in range(3)]
        for k, p in enumerate(parts):
            write_documents(p, lens, range(k, len(lens), 3), seed=0)
        for p in [full, *parts]:
            read_all(p)
        cfg["write_s"] = time.perf_counter() - t0

        def ds() -> pyloader.ShardDataset:
            return pyloader.ShardDataset(full, shuffle=True, seed=1)

        def unpacked() -> pyloader.DataLoader:
            loader = pyloader.DataLoader(ds(), batch_size=doc_batch, num_workers=args.threads)
            loader._reads_ahead = lambda: False  # as a packing loader (see above)
            return loader

        def packed(seq_len: int, mode: str = "greedy", lookahead: int | None = None, dataset: Any = None,
                   docs: int = doc_batch) -> pyloader.DataLoader:
            return pyloader.DataLoader(ds() if dataset is None else dataset, batch_size=args.rows,
                                       num_workers=args.threads,
                                       pack=pyloader.PackSpec(seq_len=seq_len, mode=mode, lookahead=lookahead,
                                                              doc_batch=docs))

        seqs = (4096, 2048)
        lookaheads = (8, 64, 256)
        native: dict[str, pyloader.DataLoader] = {}
        python: dict[str, tuple[pyloader.DataLoader, int]] = {}
        for L in seqs:
            native[f"native greedy {L}"] = packed(L)
            python[f"python greedy {L}"] = (unpacked(), L)
        for la in lookaheads:
            native[f"native first_fit {la} 4096"] = packed(4096, "first_fit", la)
        mix = pyloader.Mixture([pyloader.ShardDataset(p) for p in parts], cfg["mixture_weights"], shuffle=True, seed=1)
        native["native greedy 4096 db64"] = packed(4096, docs=64)
        native["mixture of 3 greedy 4096"] = packed(4096, dataset=mix)
        read_loader = unpacked()
        packing: dict[str, list[dict[str, Any]]] = {k: [] for k in native}
        collate: dict[str, list[float]] = {k: [] for k in ["unpacked read", *python, *native]}

        def run_native(name: str) -> float:
            loader = native[name]
            t = time.perf_counter()
            for b in loader:
                del b
            wall = time.perf_counter() - t
            s = loader.stats()
            packing[name].append(s["packing"])
            collate[name].append(s["collate_s"])
            return s["packing"]["tokens"] / wall

        def run_python(name: str) -> float:
            loader, L = python[name]
            t = time.perf_counter()
            for b in python_greedy_pack(loader, L, args.rows):
                del b
            wall = time.perf_counter() - t
            collate[name].append(loader.stats()["collate_s"])
            return total / wall

        def run_read() -> float:
            t = time.perf_counter()
            for b in read_loader:
                del b
            wall = time.perf_counter() - t
            collate["unpacked read"].append(read_loader.stats()["collate_s"])
            return total / wall

        # Untimed first epoch: warms every loader; the Python packer's batches must equal the native ones.
        t0 = time.perf_counter()
        for L in seqs:
            nat, (loader, _) = native[f"native greedy {L}"], python[f"python greedy {L}"]
            nb = 0
            for a, b in zip(nat, python_greedy_pack(loader, L, args.rows), strict=True):
                for field in ("tokens", "position_ids", "document_ids", "cu_seqlens"):
                    if not torch.equal(a[field], b[field]):
                        raise AssertionError(f"seq_len {L}, batch {nb}: the Python packer's {field} differ from native")
                nb += 1
            if nat.stats()["packing"]["tokens"] != total:
                raise AssertionError(f"native greedy {L} packed {nat.stats()['packing']['tokens']} of {total} tokens")
        for name in native:
            if name not in (f"native greedy {L}" for L in seqs):
                run_native(name)
        run_read()
        for pks in packing.values():
            pks.clear()
        for cs in collate.values():
            cs.clear()
        cfg["warm_s"] = time.perf_counter() - t0

        variants: dict[str, Any] = {"unpacked read": run_read}
        variants.update({k: (lambda k=k: run_python(k)) for k in python})
        variants.update({k: (lambda k=k: run_native(k)) for k in native})
        t0 = time.perf_counter()
        rates = B.interleaved(variants, rounds)
        cfg["timed_s"] = time.perf_counter() - t0

        med = statistics.median

        def ratio(a: str, b: str) -> float:
            return med([x / y for x, y in zip(rates[a], rates[b], strict=True)])

        rows: dict[str, dict[str, Any]] = {}
        for name, r in rates.items():
            row: dict[str, Any] = {"tokens_per_s": med(r), "rounds": r, "collate_s": med(collate[name])}
            if name in packing:
                pk = packing[name]
                row.update(padding_fraction=med([p["padding_fraction"] for p in pk]),
                           pack_s=med([p["pack_s"] for p in pk]), input_wait_s=med([p["input_wait_s"] for p in pk]),
                           rows_per_epoch=med([p["rows"] for p in pk]), tokens_per_epoch=med([p["tokens"] for p in pk]))
            rows[name] = row
        for L in seqs:  # the Python packer's rows are the native greedy rows (checked above)
            rows[f"python greedy {L}"]["padding_fraction"] = rows[f"native greedy {L}"]["padding_fraction"]
        ratios = {f"native / python greedy {L}": ratio(f"native greedy {L}", f"python greedy {L}") for L in seqs}
        ratios.update({f"native greedy {L} / unpacked read": ratio(f"native greedy {L}", "unpacked read")
                       for L in seqs})
        ratios.update({f"python greedy {L} / unpacked read": ratio(f"python greedy {L}", "unpacked read")
                       for L in seqs})
        ratios.update({f"first_fit {la} / greedy 4096": ratio(f"native first_fit {la} 4096", "native greedy 4096")
                       for la in lookaheads})
        ratios["greedy 4096 doc_batch 64 / 256"] = ratio("native greedy 4096 db64", "native greedy 4096")
        ratios["mixture of 3 / one source (greedy 4096)"] = ratio("mixture of 3 greedy 4096", "native greedy 4096")

        print(f"{total / 1e6:.1f}M tokens in {len(lens):,} documents (mean {lens.mean():.0f}, max {lens.max()}, "
              f"{(lens > 4096).mean():.1%} > 4096), {args.rows} rows per batch, shuffled, {args.threads} native "
              f"threads, page cache warm; medians of {rounds} interleaved rounds")
        print(f"{'variant':<28}{'Mtokens/s':>11}{'padding':>9}{'pack_s':>8}{'collate_s':>11}")
        for name, row in rows.items():
            pf = f"{row['padding_fraction']:.2%}" if "padding_fraction" in row else "-"
            ps = f"{row['pack_s']:.2f}" if "pack_s" in row else "-"
            print(f"{name:<28}{row['tokens_per_s'] / 1e6:>11.1f}{pf:>9}{ps:>8}{row['collate_s']:>11.2f}")
        print(f"{'ratio (median per round)':<44}{'x':>8}")
        for name, x in ratios.items():
            print(f"{name:<44}{x:>7.2f}x" + ("  (target >= 0.9x)" if name.startswith("mixture") else ""))
        print(f"write {cfg['write_s']:.1f} s, warm/check {cfg['warm_s']:.1f} s, timed {cfg['timed_s']:.1f} s")
        out = {"config": cfg, "environment": {**B.environment(), "pyloader": pyloader.__version__},
               "results": rows, "ratios": ratios}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
        print(f"wrote {args.out}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
