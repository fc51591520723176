"""The names of a shard: its cache files (NOTE [cache paths] in cache.py) and its URL path; the cache root's default."""

from __future__ import annotations

import os
import re
import urllib.parse

import pyloader._C as _C

__all__ = ["default_cache_dir", "is_remote", "lock_file_name", "shard_cache_name", "quote_key"]

_NAME_MAX = 255


def shard_cache_name(path: str, digest: str) -> str:
    """The cached file name of shard ``path`` whose manifest checksum is ``digest`` (NOTE [cache paths]).

    Raises ValueError unless the result is one file-name component.
    """
    q = _quote(path)
    if len(q) + 17 > _NAME_MAX:
        q = f"{q[:160]}~{_C.xxh64(path.encode('utf-8')):016x}"
    name = f"{q}.{digest}"
    if "/" in name or "\0" in name or name in (".", "..") or len(name.encode("utf-8")) > _NAME_MAX:
        raise ValueError(f"shard {path!r}: its cache name {name!r} is not one file-name component")
    return name


_PLAIN = re.compile(r"[A-Za-z0-9_.~-]+")  # what quote(safe="") leaves as it is


def _quote(path: str) -> str:
    return path if _PLAIN.fullmatch(path) else urllib.parse.quote(path, safe="")


def lock_file_name(name: str) -> str:
    """The file name of the download lock of shard file ``name``: ``<name>.lock``, within NAME_MAX.

    A shard name may take all of a file name's 255 bytes (NOTE [cache paths] in
    ``pyloader/remote/cache.py``); its lock then keeps the first 160 characters and adds
    ``~`` and the XXH64 of the whole name, as the shard name does for a long path.
    """
    if len(os.fsencode(name)) + 5 <= 255:
        return name + ".lock"
    return f"{name[:160]}~{_C.xxh64(name.encode('utf-8')):016x}.lock"


def quote_key(key: str) -> str:
    """A manifest's shard path as the path of an HTTP(S) URL: every byte of the name is the name's.

    A path is a name, not a URL (NOTE [untrusted manifest] in pyloader/format/spec.py): a
    ``%``, ``#``, ``?`` or space in it is quoted, so a file named ``a%20b`` is asked for as
    ``a%2520b``, never as ``a b``; both transports send these same bytes.
    """
    return urllib.parse.quote(key, safe="/~!$&'()*+,;=:@")


def default_cache_dir() -> str:
    """The cache root when none is given.

    ``$PYLOADER_CACHE_DIR``, else ``$XDG_CACHE_HOME/pyloader``, else ``~/.cache/pyloader``.
    """
    env = os.environ.get("PYLOADER_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pyloader")


def is_remote(url: str) -> bool:
    """True for fsspec URLs other than local paths and ``file://``."""
    return "://" in url and not url.startswith("file://")
