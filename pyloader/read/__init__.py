"""Stage ``read``: datasets that plan an epoch and read it in batches (NOTE [dataset contract]).

| file | what it is for |
|---|---|
| ``units.py`` | ``UnitDataset``: a ``PlannedDataset`` (``pyloader.contract``) made of units of records; rank checks |
| ``order.py`` | the epoch plan: shuffle, rank partition, worker split, resumed epochs; pure numpy functions |
| ``shards.py`` | ``ShardDataset`` over a manifest of shards; ``BatchIterator``, the native batch pipeline |
| ``verified.py`` | which local shard files a process verified in full, so later processes skip hashing them (NOTE [verified files]) |
| ``mixture.py`` | ``Mixture``: weighted, scheduled mixtures of ShardDatasets, one plan over their shards' union |
| ``parquet.py`` | ``ParquetDataset`` over Parquet row groups; its decode/collate threads and staging buffers |
| ``frameworks.py`` | a dataset read sample by sample inside accelerate's loaders: raises where that loses data, warns where it is slow |
| ``parquet_remote.py`` | a remote Parquet folder: the listing of its files, their node-cache flavour, why a fetch failed |

Imports ``pyloader.errors``, ``format``, ``remote`` (the node cache) and ``_C``; never loader or bench.
"""


__all__ = ["frameworks", "mixture", "order", "parquet", "parquet_remote", "shards", "units", "verified"]  # its modules (pdoc documents the modules named here)
