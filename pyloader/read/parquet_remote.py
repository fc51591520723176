"""A remote Parquet dataset: the listing of its files, their node-cache flavour, and why a fetch failed.

``ParquetDataset`` (``parquet.py``) binds a remote folder to the node cache by a listing of
its Parquet files (``list_remote``), caches them as ``ParquetFileCache`` (checked for size
and ``PAR1``), and streams them (NOTE [pending files] in ``pyloader/remote/pending_files.py``);
a file whose fetch failed raises ``fetch_error``'s ``ParquetReadError``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

import pyloader._C as _C

from ..errors import ParquetReadError, PyloaderError
from ..format.arrow import PARQUET_EXT as _PARQUET_EXT
from ..remote.cache import DatasetCache
from ..remote.fs import RetryPolicy, filesystem
from ..remote.names import quote_key

__all__ = ["ParquetFileCache", "fetch_error", "list_remote", "remote_path", "sized_info"]


class ParquetFileCache(DatasetCache):
    """The node cache (pyloader.remote.cache) flavour for Parquet files.

    A Parquet file has no XXH64 in a manifest, so ``open_remote`` binds the listing of the
    files (``list_remote``) instead: each entry carries an identity (XXH64 of path, size
    and the store's ETag or mtime), so a changed object gets a new cache name, never a
    mix. A download is published under NOTE [cache publish] with check (3) replaced by:
    exactly the listed size, and the Parquet magic ``PAR1`` at both ends
    (``DatasetCache.content_problem``); pyarrow then checks the footer when it opens it.
    A file that fails it raises ``ParquetReadError`` at once (no retry).
    """

    retry_bad_content = False  # a file that is not Parquet will not become one on a retry
    identity_listing = True  # open_remote builds its manifest from the listing (NOTE [untrusted manifest])

    def content_error(self, url: str, shard: str, problem: str) -> PyloaderError:
        """A download that is not the listed Parquet file: ``ParquetReadError`` naming its URL."""
        return ParquetReadError(f"{url}: {problem}: the object is not the Parquet file listed when this "
                                "ParquetDataset was opened; replace it with a valid Parquet file, then open the "
                                "dataset again")


def sized_info(fs: Any, url: str, name: str, info: dict[str, Any]) -> dict[str, Any]:
    """``info`` with the file's size, asked of the store itself (an HTTP listing has no sizes: a HEAD)."""
    try:
        full = fs.info(name)
    except Exception as e:  # noqa: BLE001 - any failure to learn the size is reported the same way
        full, why = {}, f"{type(e).__name__}: {e}"
    else:
        why = "the server sends no Content-Length"
    if full.get("size") is None:
        raise ParquetReadError(
            f"{url}: the listing does not give the size of {name!r} and asking for it failed ({why}); "
            "a folder over HTTP can be read only when its server answers HEAD with a Content-Length: "
            "give the URL of one file, or copy the folder to local disk (or to object storage such as s3://)")
    return {**info, **full}


def list_remote(url: str, storage_options: dict[str, Any] | None
                 ) -> tuple[Any, str, str, list[tuple[str, int, str]]]:
    """The Parquet files at ``url``, sorted by path.

    Returns (fsspec filesystem, root path in it, root URL, [(relative path, size, identity)]).
    """
    fs, path = filesystem(url, storage_options, RetryPolicy.from_env().stall_timeout)
    proto = url.split("://", 1)[0]
    http = proto.lower() in ("http", "https")
    infos: list[dict[str, Any]]
    if fs.isdir(path):
        root = path.rstrip("/")
        infos = [i for i in fs.find(root, detail=True).values() if i["name"].lower().endswith(_PARQUET_EXT)]
    else:
        root = path.rsplit("/", 1)[0]
        infos = [fs.info(path)]
    out = []
    for info in sorted(infos, key=lambda i: i["name"]):
        name = info["name"]
        rel = name[len(root):].lstrip("/") if name.startswith(root) else name.rsplit("/", 1)[-1]
        if http:  # a listing's href is quoted: the file's own name is what the manifest holds (quote_key)
            rel = unquote(rel)
        if info.get("size") is None:
            info = sized_info(fs, url, name, info)
        tag = str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")
        size = int(info["size"])
        ident = f"{_C.xxh64(f'{rel}|{size}|{tag}'.encode()):016x}"
        out.append((rel, size, ident))
    root_url = f"{proto}://{root}" if not root.startswith(f"{proto}://") else root
    return fs, root, root_url, out


def remote_path(root: str, url: str, rel: str) -> str:
    """The path in the filesystem of file ``rel`` (a listed name) under ``root`` (``url``'s): quoted over HTTP(S)."""
    http = url.split("://", 1)[0].lower() in ("http", "https")
    return root.rstrip("/") + "/" + (quote_key(rel) if http else rel)


def fetch_error(cache: DatasetCache, i: int, message: str, _errno: int = 0) -> ParquetReadError:
    """Why remote file ``i`` of ``cache`` could not be fetched: ``message``, and whether it changed on the store.

    A file cut short on the store looks like a transfer cut short; its size now tells them apart.
    """
    listed = int(cache.shards[i]["bytes"])
    try:
        fs, root = filesystem(cache.url, cache.storage_options, cache.policy.stall_timeout)
        now = fs.info(remote_path(root, cache.url, cache.shards[i]["path"])).get("size")
    except Exception:  # noqa: BLE001 - the store cannot say: the fetch's own message stands
        now = None
    if now is not None and int(now) != listed:
        message += (f" (the file is {now} bytes on the store now, {listed} when this ParquetDataset listed it: "
                    "it changed since; open the ParquetDataset again)")
    return ParquetReadError(message)
