"""``PendingFiles``: the files of a remote dataset that a Python reader opens itself, as a ``ShardFetcher`` fills them.

The Python counterpart of a pending ``_C.ShardSet`` (NOTE [shard readiness] and NOTE
[working set] in csrc/core/shard_reader.h) for readers whose files are not pyloader shards
(``ParquetDataset``): the same calls, so that a ``ShardFetcher`` streams them exactly as
it streams a native set (NOTE [streaming] in ``pyloader/remote/fetch.py``).

NOTE [pending files]: a reader ``retain()``s a file once for every planned read of it
(each row group of it that its plan decodes), when its iterator is made, and
``release()``s it after each of those reads (or when the iterator is closed before it).
A read runs inside ``reading(i)``, which waits until the fetcher has marked the file
ready and yields its local path; while any read runs the file cannot be unloaded, not
even forcibly. A file whose count drops to zero while ready is *released*: reported to
the fetcher's pilot (``wait_events``), which unloads it (``unload``: back to pending; the
fetcher then unpins its cached copy, which becomes evictable) when the next file does not
fit its budget. A file ready with no planned read left (fetched for an iterator that was
closed) is reported released at once. A read that finds its file pending is reported as
*waiting*, and the fetcher fetches that file next, even past its budget. A reader keeps
no file open between reads, so an unloaded (or evicted) file holds no disk space.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

__all__ = ["PendingFiles"]


class PendingFiles:
    """``n`` files, each pending until a fetcher marks it ready (or failed). Thread-safe.

    ``error(i, message, errno)``: the exception a read of failed file ``i`` raises.
    """

    def __init__(self, n: int, error: Callable[[int, str, int], BaseException]) -> None:
        self._n = n
        self._error = error
        self._cv = threading.Condition()
        self._paths: list[str | None] = [None] * n
        self._failed: dict[int, tuple[str, int]] = {}  # file -> (message, errno)
        self._count = [0] * n  # planned reads not yet done
        self._reads = [0] * n  # reads running now
        self._waits: dict[int, int] = {}  # file -> reads waiting for it now
        self._released: list[int] = []  # files that became idle, for the pilot
        self._changed = False  # an event the pilot has not taken yet
        self.unloads = 0

    # -- the reader's side ---------------------------------------------------------------
    def retain(self, i: int, n: int = 1) -> None:
        """Counts ``n`` more planned reads of file ``i`` (See NOTE [pending files])."""
        with self._cv:
            self._count[i] += n

    def release(self, i: int) -> None:
        """One planned read of file ``i`` is done (or will never run)."""
        with self._cv:
            if self._count[i] <= 0:
                raise ValueError(f"file {i} released more often than retained")
            self._count[i] -= 1
            self._note_idle_locked(i)

    @contextlib.contextmanager
    def reading(self, i: int) -> Iterator[str]:
        """Waits until file ``i`` is ready and yields its local path; it stays in place until the block ends.

        Raises ``error(i, message, errno)`` when its fetch failed.
        """
        with self._cv:
            while self._paths[i] is None and i not in self._failed:
                self._waits[i] = self._waits.get(i, 0) + 1
                self._changed = True
                self._cv.notify_all()
                try:
                    self._cv.wait(0.5)
                finally:
                    self._waits[i] -= 1
                    if not self._waits[i]:
                        del self._waits[i]
                        self._changed = True
            failed = self._failed.get(i)
            path = self._paths[i]
            if failed is None:
                self._reads[i] += 1
        if failed is not None:  # (made outside the lock: making it may ask the store)
            raise self._error(i, *failed)
        try:
            assert path is not None
            yield path
        finally:
            with self._cv:
                self._reads[i] -= 1
                self._note_idle_locked(i)

    def counts(self) -> dict[str, int]:
        """Files ready, ready and idle (released, not yet unloaded), and unloaded so far."""
        with self._cv:
            ready = [i for i in range(self._n) if self._paths[i] is not None]
            idle = sum(1 for i in ready if self._count[i] == 0 and self._reads[i] == 0)
            return {"ready": len(ready), "idle": idle, "unloads": self.unloads}

    def _note_idle_locked(self, i: int) -> None:
        if self._count[i] == 0 and self._reads[i] == 0 and self._paths[i] is not None:
            self._released.append(i)
            self._changed = True
            self._cv.notify_all()

    # -- the fetcher's side (a pending _C.ShardSet's calls) ------------------------------
    def mark_ready(self, i: int, path: str) -> None:
        """File ``i`` is in place at ``path`` (pinned by the fetcher until it unloads it)."""
        with self._cv:
            self._paths[i] = path
            self._failed.pop(i, None)
            self._note_idle_locked(i)  # fetched, but no planned read is left
            self._cv.notify_all()

    def mark_failed(self, i: int, message: str, errno: int = 0) -> None:
        """File ``i`` could not be fetched: its reads raise ``error(i, message, errno)``."""
        with self._cv:
            self._failed[i] = (message, errno)
            self._cv.notify_all()

    def retry(self, i: int) -> bool:
        """A failed file becomes pending again, for a later iterator to fetch. False if it had not failed."""
        with self._cv:
            return self._failed.pop(i, None) is not None

    def unload(self, i: int, force: bool = False) -> bool:
        """File ``i`` becomes pending again: an idle one, or with ``force`` one no read runs on now.

        False (and nothing changes) otherwise; the fetcher then keeps its pin.
        """
        with self._cv:
            if self._paths[i] is None or self._reads[i] or (self._count[i] and not force):
                return False
            self._paths[i] = None
            self.unloads += 1
            return True

    def waiting(self) -> list[int]:
        """The files a read waits on now."""
        with self._cv:
            return sorted(self._waits)

    def wait_events(self, timeout: float = 0.0) -> tuple[list[int], list[int], list[tuple[int, str]]]:
        """Waits up to ``timeout`` s for an event; returns (released, waiting, corrupt) and takes them.

        ``corrupt`` is always empty: pyarrow checks a file as it reads it, and a cached copy
        is checked (size, ``PAR1`` at both ends) before it is published.
        """
        with self._cv:
            if not self._changed:
                self._cv.wait(timeout)
            released, self._released = self._released, []
            self._changed = False
            return released, sorted(self._waits), []
