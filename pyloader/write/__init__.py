"""Stage ``write``: datasets made from samples (``ShardWriter``) or converted from other formats.

| file | what it is for |
|---|---|
| ``writer.py`` | ``ShardWriter``: validates samples one by one, encodes them with ``ShardEncoder`` |
| ``sources.py`` | convert's sources (Parquet/Arrow, numpy, files, tars): ``open_source``, units, chunks |
| ``hf_saved.py`` | a Hugging Face ``save_to_disk`` folder: the Arrow files that hold its rows (``hf_saved_files``) |
| ``convert.py`` | ``convert()``: compression choice, parallel jobs that encode chunks, progress, leftovers |
| ``cluster.py`` | ``convert(engine="dask")``: the task plan, tasks on a Dask cluster, one manifest merge |
| ``store.py`` | where convert writes: a local folder or an fsspec URL (``s3://``), uploads whole files |
| ``verify.py`` | ``verify_dataset``: reads a dataset back with the native core, compares it with its source |
| ``cli.py`` | the ``pyloader convert`` command |

Imports only ``pyloader.errors``, ``pyloader.format`` and ``pyloader._C``: never read, loader, remote or bench.
"""


__all__ = ["cli", "cluster", "convert", "hf_saved", "sources", "store", "verify", "writer"]  # its modules (pdoc documents the modules named here)
