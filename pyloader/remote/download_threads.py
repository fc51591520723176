"""The download threads of one ``ShardFetcher``: at most ``jobs`` at once, each taking queued shards.

A thread starts for each queued shard up to ``jobs`` (``spawn_locked``) and runs shards
until nothing is queued, the fetcher stops, or ``jobs`` was lowered below the threads
running (then it leaves after its current download: none is cut short). Threads are
daemons; the fetcher cancels them before the process exits
(See NOTE [downloads at exit] in pyloader/remote/fetch.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["DownloadThreads"]


class DownloadThreads:
    """Up to ``jobs`` threads that run a fetcher's queued shards.

    ``cv`` is the fetcher's condition: it guards the fetcher's queue and ``count``, and
    is notified after each shard. ``next_job()``, called with ``cv`` held, takes the next
    shard to run, or None while none may start (over the fetcher's budget: the thread
    waits for a release); ``queued()``, also under ``cv``, counts the queued shards;
    ``run(i)``, called without it, fetches shard ``i``. ``stop`` ends every thread.
    """

    def __init__(self, cv: threading.Condition, stop: threading.Event, jobs: int,
                 next_job: Callable[[], int | None], queued: Callable[[], int], run: Callable[[int], None]) -> None:
        self.cv, self.stop, self.jobs = cv, stop, jobs
        self._next_job, self._queued, self._run = next_job, queued, run
        self.count = 0  # threads running

    def spawn_locked(self) -> None:
        """With ``cv`` held: starts threads for the queued shards, up to ``jobs`` in all."""
        want = min(self.jobs, self._queued()) - self.count
        for _ in range(max(0, want)):
            self.count += 1
            threading.Thread(target=self._loop, name="pyloader-fetch", daemon=True).start()

    def _loop(self) -> None:
        retired = False
        try:
            while True:
                with self.cv:
                    while True:
                        if self.stop.is_set() or not self._queued():
                            return
                        if self.count > self.jobs:  # jobs lowered: this one leaves
                            self.count -= 1
                            retired = True
                            return
                        i = self._next_job()
                        if i is not None:
                            break
                        self.cv.wait(0.1)  # over budget: wait for a release
                self._run(i)
                with self.cv:
                    self.cv.notify_all()
        finally:
            with self.cv:
                if not retired:
                    self.count -= 1
                self.cv.notify_all()
