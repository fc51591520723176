"""The cache-budget policy every remote reader follows: its share of the node cache, and the check of its need.

NOTE [cache shares]: every reader on a node shares the node cache's ``cache_limit``:
``LOCAL_WORLD_SIZE`` ranks, each with its reading processes (torch's DataLoader workers, or
the transform processes of ``executor="processes"``). A reader's share is the limit
divided by those readers (``reader_share``). A reader that knows its plan checks what it
must hold at once against its share (``check_share``), when it is built and at each epoch:
its working set (``fetch.working_set``). Every reader streams: ``ShardDataset`` and
``Mixture`` hold the shards overlapping their window plus the batches read ahead;
``ParquetDataset`` the files whose row groups its plan decodes at once plus those read
ahead, each held from its first to its last row group read (NOTE [pending files] in
``pyloader.remote.pending_files``): a window shuffle orders files, then the row groups of
each, so a file is held while a window overlaps it (NOTE [window size] in
``pyloader.read.order``); a global shuffle holds every file. A need above the share raises
``CacheLimitError`` naming both numbers and the limit that would do; the streaming fetcher
is then held to the share (its ``budget``).
"""

from __future__ import annotations

import os

from ..errors import CacheLimitError
from ..format.sizes import format_size

# Shards a streaming reader keeps open (mapped and pinned) at most, beyond its working set.
MAX_OPEN = 4096


def readers_on_node(processes: int = 1) -> int:
    """Readers sharing this node's cache: ``LOCAL_WORLD_SIZE`` ranks times ``processes`` reading for each."""
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return local * max(1, processes)


def reader_share(limit: int | None, readers: int) -> int | None:
    """The bytes one of ``readers`` readers may hold of a cache of ``limit`` bytes (None: no limit)."""
    return None if limit is None else limit // max(1, readers)


def check_share(url: str, limit: int | None, need: int, readers: int, what: str, hint: str) -> None:
    """Raises ``CacheLimitError`` when ``readers`` readers each needing ``need`` bytes overflow ``limit``.

    ``what`` says what the bytes are (``"12 shards: ..."``); ``hint`` the other ways out
    besides a larger limit. See NOTE [cache shares].
    """
    if limit is None or need * readers <= limit:
        return
    who = f" x {readers} readers on this node (LOCAL_WORLD_SIZE, DataLoader workers)" if readers > 1 else ""
    raise CacheLimitError(
        f"{url}: the cache limit of {format_size(limit)} ({limit} bytes) is below what this reader needs at once: "
        f"{format_size(need)} ({need} bytes: {what}){who}; set cache_limit >= {format_size(need * readers)} "
        f"({need * readers} bytes), {hint}")


__all__ = ["MAX_OPEN", "check_share", "reader_share", "readers_on_node"]
