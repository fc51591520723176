"""Room for a fetcher's shards: in its own budget, and in a full node cache.

``HeldShards`` counts the shards a ``ShardFetcher`` pins at once against its ``budget``
(bytes) and ``max_open`` (count) (See NOTE [streaming] in pyloader/remote/fetch.py).
``RoomWaits`` follows the shards that found the node cache full: a fetcher waits that
out for a while, for other readers to release theirs, and says so on the
``pyloader.remote`` logger when it lasts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

__all__ = ["HeldShards", "RoomWaits"]

_log = logging.getLogger("pyloader.remote")


class HeldShards:
    """The shards one fetcher pins (running, ready or released) and their bytes, by shard index.

    ``sizes``: the bytes of every shard of the dataset. Not locked itself: its fetcher
    reads and changes it under its own lock.
    """

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        self._held: dict[int, int] = {}  # shard -> its bytes
        self.bytes = 0
        self.peak_bytes = 0

    def __contains__(self, i: object) -> bool:
        return i in self._held

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[int]:
        return iter(self._held)

    def fits(self, i: int, budget: int | None, max_open: int | None) -> bool:
        """Whether shard ``i`` is held already or fits ``budget`` bytes and ``max_open`` shards (None: no bound)."""
        if i in self._held:
            return True
        if max_open is not None and len(self._held) >= max_open:
            return False
        return budget is None or self.bytes + self.sizes[i] <= budget

    def add(self, i: int) -> None:
        """Counts shard ``i`` held (once), past the budget if it must be."""
        if i not in self._held:
            self._held[i] = self.sizes[i]
            self.bytes += self.sizes[i]
            self.peak_bytes = max(self.peak_bytes, self.bytes)

    def drop(self, i: int) -> None:
        """Counts shard ``i`` no longer held, if it was."""
        size = self._held.pop(i, None)
        if size is not None:
            self.bytes -= size


class RoomWaits:
    """The shards of one fetcher that wait for room in a full cache, and the warning while they do.

    A wait is reported on the ``pyloader.remote`` logger once it is ``first_report_s``
    old, then at least every ``report_every_s`` while it lasts; ``reports`` counts the
    reports. Thread-safe.
    """

    first_report_s = 5.0
    report_every_s = 30.0

    def __init__(self) -> None:
        self._since: dict[int, float] = {}  # shard -> when it first found the cache full
        self._reported_at: float | None = None
        self._mu = threading.Lock()
        self.reports = 0

    def wait(self, i: int, error: BaseException, *, deadline: float, cache_dir: str, url: str) -> bool:
        """Shard ``i`` found the cache full (``error``): True while it may wait on, False once past ``deadline`` s.

        Reports the wait when one is due. ``cache_dir`` and ``url`` (the dataset's) name
        what waits in the report.
        """
        now = time.monotonic()
        with self._mu:
            since = self._since.setdefault(i, now)
            waited = now - min(self._since.values())
            due = waited >= self.first_report_s and (
                self._reported_at is None or now - self._reported_at >= self.report_every_s)
            if due:
                self._reported_at = now
            waiting = len(self._since)
        if due:
            self.reports += 1
            _log.warning("pyloader: the cache %s is full: %d shard(s) of %s have waited %.1f s for room, for "
                         "other readers to release theirs; each fails once it has waited %g s "
                         "(PYLOADER_FETCH_DEADLINE). Last: %s. Free disk space, or set a cache_limit this "
                         "disk can hold", cache_dir, waiting, url, waited, deadline, error)
        if now - since > deadline:
            self.done(i)
            return False
        return True

    def done(self, i: int) -> None:
        """Shard ``i`` no longer waits (it was fetched, or gave up); the reports start over once none waits."""
        with self._mu:
            self._since.pop(i, None)
            if not self._since:
                self._reported_at = None
