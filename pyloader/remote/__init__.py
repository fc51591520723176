"""Stage ``remote``: remote (fsspec) data through one node-local cache per node.

| file | what it is for |
|---|---|
| ``fs.py`` | fsspec access: filesystems with timeouts, retries, per-host throttling (``HostLimiter``), whole-object reads, cancellable downloads into a file |
| ``cache.py`` | the node cache: publish, pins, LRU eviction, limits (NOTE [cache publish], NOTE [cache pins]) |
| ``manifest.py`` | ``node_manifest``: a manifest fetched once per node, not per rank (NOTE [manifest once per node]) |
| ``fetch.py`` | ``open_remote`` (a dataset bound to the cache), ``working_set``, ``ShardFetcher`` (prefetch in plan order within a byte budget, releases, self-healing: NOTE [streaming]) |
| ``budget.py`` | the cache-budget policy every remote reader follows: its share of the node cache, the check of its need (NOTE [cache shares]) |
| ``cli.py`` | the ``pyloader cache`` command: warm, ls, stats, verify, evict, clear |

Imports only ``pyloader.errors``, ``pyloader.format`` and ``pyloader._C`` (``cli.py``, a command, also the planner).
"""


__all__ = ["budget", "cache", "cli", "fetch", "fs", "manifest"]  # its modules (pdoc documents the modules named here)
