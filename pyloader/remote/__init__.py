"""Stage ``remote``: remote (fsspec) data through one node-local cache per node.

| file | what it is for |
|---|---|
| ``fs.py`` | fsspec access: filesystems with timeouts, retries, per-host throttling (``HostLimiter``), whole-object reads, cancellable downloads into a file |
| ``failure_messages.py`` | what a failed fetch's message says: each failure without internal names, the fix once retries end, a remote object of another size (NOTE [fetch retries]) |
| ``transport.py`` | how a download's bytes move: the native libcurl client for ``http(s)://`` and ``s3://`` (presigned), fsspec for the rest (NOTE [transport choice]) |
| ``throttle.py`` | per-host request limits: one adaptive window of requests in flight per host (``HostLimiter``; NOTE [fetch throttling]) |
| ``locks.py`` | lock files: ``open_lockfile`` / ``close_lockfile`` (closed in a forked child: NOTE [lock files across fork]), flock with a timeout (``Flock``), OFD byte locks, the node-wide ``SpaceLock`` |
| ``names.py`` | the file names the cache keeps for a shard: its cached copy (``shard_cache_name``) and its download lock (``lock_file_name``), each one component within NAME_MAX (NOTE [cache paths]) |
| ``pins.py`` | pins: one byte of a dataset's ``pins.lock`` per shard a process may have mapped (``DatasetPins``; NOTE [cache pins]) |
| ``temps.py`` | temp files of downloads: their names and owners, which writers are gone, reclaiming them, removal at SIGTERM (NOTE [temps at SIGTERM]) |
| ``cache.py`` | the node cache: paths (NOTE [cache paths]), publish (NOTE [cache publish]), limits and LRU eviction |
| ``index.py`` | the index of the node cache shared by its processes: bytes held and LRU order, O(1) per download (NOTE [cache index]) |
| ``bad_copies.py`` | cached copies that fail their check: ``verify_entry``, ``remove_entry``, ``discard`` |
| ``manifest.py`` | ``node_manifest``: a manifest fetched once per node, not per rank (NOTE [manifest once per node]) |
| ``fetch.py`` | ``open_remote`` (a dataset bound to the cache), ``working_set``, ``ShardFetcher`` (prefetch in plan order within a byte budget, releases, self-healing: NOTE [streaming]) |
| ``budget.py`` | the cache-budget policy every remote reader follows: its share of the node cache, the check of its need (NOTE [cache shares]) |
| ``room.py`` | room for a fetcher's shards: ``HeldShards`` (what it pins, against its budget) and ``RoomWaits`` (shards waiting out a full cache, and the warning while they do) |
| ``pending_files.py`` | ``PendingFiles``: the files a Python reader (``ParquetDataset``) opens itself, retained and released as a pending native set's shards, for a ``ShardFetcher`` to stream (NOTE [pending files]) |
| ``download_threads.py`` | ``DownloadThreads``: a fetcher's up to ``jobs`` download threads |
| ``cli.py`` | the ``pyloader cache`` command: warm, ls, stats, verify, evict, clear |

Imports only ``pyloader.errors``, ``pyloader.format`` and ``pyloader._C`` (``cli.py``, a command, also the planner).
"""


__all__ = ["bad_copies", "budget", "cache", "cli", "download_threads", "failure_messages", "fetch", "fs", "index", "locks", "manifest", "names",
           "pending_files", "pins", "room", "temps", "throttle", "transport"]  # its modules (pdoc documents the modules named here)
