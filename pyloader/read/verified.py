"""Which local shard files were verified in full, so that a new process need not hash them again.

See NOTE [verified files] in csrc/core/shard_reader.cpp for why and for what a record
proves. A process hashes every value the first time it reads it (NOTE [verify once]); once
every record of a local shard was verified, the loader writes the shard file's identity
(``os.stat``'s ``st_dev``, ``st_ino``, ``st_size``, ``st_mtime_ns``, ``st_ctime_ns``, taken from
the descriptor it mapped) to a record file of its own, and a later ``ShardDataset`` over
the same path hands that identity to its native shard set: a shard mapped from a file
whose identity still matches in all five is read without checksum checks.

When checksums are verified, then: every value of a shard file the first time a process
reads it, unless this process or an earlier one read every record of the very same file
(same device and inode) and the file was not written, truncated, renamed over or had
its metadata changed since (each of these sets ``st_ctime``, which no user-space call can
set back). Not recorded, so verified again in the next process: a file whose ``st_ctime``
was within ``RACY_NS`` of the open that began its hashing (a write in the same tick of
the kernel's clock would not change it), shards of remote datasets (the node cache checks
a download's whole-file checksum) and of a ``Mixture`` (which reads through its own set).

The records live in ``<cache dir>/verified/`` (``default_cache_dir()``: ``$PYLOADER_CACHE_DIR``,
else ``$XDG_CACHE_HOME/pyloader``, else ``~/.cache/pyloader``): one JSON file per dataset
folder, written to a temporary name and renamed into place. A file that cannot be read or
parsed, or that names another folder, is taken as empty (nothing is trusted from it); at
most ``MAX_FILES`` files are kept (the least recently written go first), each of at most
``MAX_SHARDS`` shards. Failing to write a record only costs the next process its hashing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from typing import Any

from ..remote.names import default_cache_dir

RACY_NS = 2_000_000_000  # a file changed this close to its open is verified again next time
MAX_FILES = 256  # record files kept (one per dataset folder)
MAX_SHARDS = 1 << 16  # shards per record file
_FORMAT = 1

_Identity = tuple[int, int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns, st_ctime_ns


def store_dir() -> str:
    """Where the records are kept: ``<default_cache_dir()>/verified``."""
    return os.path.join(default_cache_dir(), "verified")


def _record_path(root: str) -> str:
    key = hashlib.sha256(os.path.realpath(root).encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return os.path.join(store_dir(), key + ".json")


def load(root: str) -> dict[str, _Identity]:
    """The identities recorded for the shard files of the dataset folder ``root`` (path -> identity).

    Empty when there is no record or it cannot be trusted (unreadable, not this format, another folder).
    """
    try:
        with open(_record_path(root), "rb") as fh:
            body = json.loads(fh.read(1 << 24))
        if not isinstance(body, dict) or body.get("format") != _FORMAT:
            return {}
        if body.get("root") != os.path.realpath(root) or not isinstance(body.get("shards"), dict):
            return {}
        out: dict[str, _Identity] = {}
        for path, ident in body["shards"].items():
            if (isinstance(path, str) and isinstance(ident, list) and len(ident) == 5
                    and all(type(x) is int and x >= 0 for x in ident)):
                out[path] = (ident[0], ident[1], ident[2], ident[3], ident[4])
        return out
    except (OSError, ValueError, UnicodeDecodeError):
        return {}


def trust_recorded(shards: Any, root: str, paths: list[str]) -> int:
    """Hands the recorded identity of each of ``paths`` (shard ``i`` is ``paths[i]``) to ``shards.trust``.

    Returns how many shards had one.
    """
    known = load(root)
    n = 0
    for i, path in enumerate(paths):
        ident = known.get(os.path.realpath(path))
        if ident is not None:
            shards.trust(i, *ident)
            n += 1
    return n


def record_verified(shards: Any, root: str, paths: list[str]) -> int:
    """Records the shards of ``shards`` verified in full since the last call (``newly_verified``).

    Skips files changed within ``RACY_NS`` of their open. Returns how many were recorded;
    never raises for a store that cannot be written.
    """
    fresh = {os.path.realpath(paths[i]): ident for i, ident, opened_ns in shards.newly_verified()
             if ident[4] < opened_ns - RACY_NS}
    if not fresh:
        return 0
    try:
        known = load(root)
        known.update(fresh)
        if len(known) > MAX_SHARDS:
            return 0
        body = {"format": _FORMAT, "root": os.path.realpath(root),
                "shards": {p: list(v) for p, v in sorted(known.items())}}
        os.makedirs(store_dir(), mode=0o700, exist_ok=True)
        target = _record_path(root)
        fd, tmp = tempfile.mkstemp(dir=store_dir(), prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(body, fh)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        _bound()
        return len(fresh)
    except OSError:
        return 0


def _bound() -> None:
    """Keeps at most ``MAX_FILES`` record files, removing the least recently written."""
    d = store_dir()
    names = [n for n in os.listdir(d) if n.endswith(".json") and not n.startswith(".tmp-")]
    if len(names) <= MAX_FILES:
        return
    aged = []
    for n in names:
        with contextlib.suppress(OSError):
            aged.append((os.stat(os.path.join(d, n)).st_mtime_ns, n))
    aged.sort()
    for _, n in aged[: len(aged) - MAX_FILES]:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(d, n))


__all__ = ["MAX_FILES", "MAX_SHARDS", "RACY_NS", "load", "record_verified", "store_dir", "trust_recorded"]
