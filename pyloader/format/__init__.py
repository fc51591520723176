"""Stage ``format``: the shard format (versions 1 to 3) and the manifest, shared by every stage above it.

| file | what it is for |
|---|---|
| ``spec.py`` | constants, fields and dtypes, schema block, header pack/unpack, manifest checks |
| ``encode.py`` | ``ShardEncoder`` (values to shard files), ``atomic_write``, the finished dataset's manifest |
| ``arrow.py`` | the field an Arrow column becomes and its values as arrays (convert, ParquetDataset) |
| ``sizes.py`` | ``parse_size``: ``"64M"``, ``"1.5GiB"``... to bytes, for every size option |
| ``owner.py`` | who made a file (``<host>-<boot>-<pidns>`` and pid in its name) and whether that process is provably gone: cache temps, transform slots |

Imports only ``pyloader.errors`` and ``pyloader._C``; pyarrow is imported on first use.
"""


__all__ = ["arrow", "encode", "owner", "sizes", "spec"]  # its modules (pdoc documents the modules named here)
