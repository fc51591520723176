"""The packing rule written plainly in Python: the oracle tests compare the native packer with.

NOTE [packing rule] in csrc/core/packer.h is the rule; ``reference_pack`` is a slow, obvious
implementation of it, kept with the tests: a test oracle, not API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def reference_pack(docs: Sequence[np.ndarray], seq_len: int, *, lookahead: int = 1, split: bool = True,
                   pad_id: int = 0, ranges: Sequence[tuple[int, int]] | None = None
                   ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """NOTE [packing rule], written plainly: (tokens, position_ids, document ids per row).

    Document ids here number pieces over the whole stream (-1: padding). ``ranges``: the
    token range of each document (default: all of it). Slow: for tests.
    """
    def pieces() -> Any:
        for i, d in enumerate(docs):
            a, b = (0, len(d)) if ranges is None else ranges[i]
            b = len(d) if b < 0 else b
            t = a
            while t < b:
                n = min(seq_len, b - t)
                yield d[t:t + n]
                t = t + n if split else b

    src = pieces()
    window: list[np.ndarray] = []
    done = False

    def refill() -> None:
        nonlocal done
        while not done and len(window) < lookahead:
            try:
                window.append(next(src))
            except StopIteration:
                done = True

    toks, poss, ids = [], [], []
    piece_no = 0
    while True:
        refill()
        if not window:
            break
        row: list[np.ndarray] = [window.pop(0)]
        used = len(row[0])
        while True:
            refill()
            k = next((i for i, p in enumerate(window) if len(p) <= seq_len - used), None)
            if k is None:
                break
            p = window.pop(k)
            row.append(p)
            used += len(p)
        dtype = row[0].dtype
        t = np.full(seq_len, pad_id, dtype=dtype)
        pos = np.zeros(seq_len, np.int64)
        did = np.full(seq_len, -1, np.int64)
        at = 0
        for p in row:
            t[at:at + len(p)] = p
            pos[at:at + len(p)] = np.arange(len(p))
            did[at:at + len(p)] = piece_no
            piece_no += 1
            at += len(p)
        toks.append(t)
        poss.append(pos)
        ids.append(did)
    return toks, poss, ids
