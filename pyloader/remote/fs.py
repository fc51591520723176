"""Remote object I/O through fsspec: URLs, retries with backoff, one-object downloads.

Policy lives here; the cache (``_cache``) decides where bytes go and when they are
trusted. Nothing here writes into the cache directory except through the file
descriptor the cache hands over.

NOTE [fetch retries]: an attempt that fails is classified (``classify``):
  - *permanent* (403, 404, other 4xx, a remote object bigger than the manifest says):
    raised at once;
  - *transient* (connection reset or refused, timeouts, a body that ends early, 408,
    429, 5xx, S3 ``SlowDown``/throttling): retried after ``base * 2**k`` seconds with
    full jitter, capped at ``cap``, or after the server's ``Retry-After`` when it gives
    one (also capped), at most ``attempts`` attempts and never past ``deadline``
    seconds since the first attempt.
A wrong checksum with the right size may be a byte flipped in transit, so it is
retried once; a second mismatch means the object changed after its manifest was read
(``RemoteChangedError``). Every error names the URL and the shard.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import FetchError, RemoteChangedError


def _fetch_error(cls: type[FetchError], message: str, url: str, shard: str | None, err: int = errno.EIO,
                 transient: bool = False) -> FetchError:
    e = cls(err, message)
    e.url, e.shard, e.transient = url, shard, transient
    return e


def is_remote(url: str) -> bool:
    """True for fsspec URLs other than local paths and ``file://``."""
    return "://" in url and not url.startswith("file://")


def filesystem(url: str, storage_options: dict[str, Any] | None, stall_timeout: float) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for ``url``, with read timeouts set by default."""
    import fsspec

    proto = url.split("://", 1)[0]
    opts = dict(storage_options or {})
    if proto in ("http", "https") and "client_kwargs" not in opts:
        import aiohttp

        # A stalled body must fail (and be retried), not hang a download forever.
        opts["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=stall_timeout,
                                                                  sock_read=stall_timeout)}
    if proto in ("s3", "s3a") and "config_kwargs" not in opts:
        opts["config_kwargs"] = {"read_timeout": stall_timeout, "connect_timeout": stall_timeout}
    fs, path = fsspec.core.url_to_fs(url, **opts)
    return fs, path


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {v!r}") from None
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {v!r}")
    return x


@dataclass(frozen=True)
class RetryPolicy:
    """Bounds on retries (NOTE [fetch retries]). ``from_env()`` reads PYLOADER_FETCH_* overrides."""

    attempts: int = 6
    base: float = 0.25
    cap: float = 10.0
    deadline: float = 120.0
    stall_timeout: float = 30.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The default policy with PYLOADER_FETCH_* overrides; raises ``ValueError`` for a bad value."""
        d = cls()
        return cls(attempts=max(1, int(_env_float("PYLOADER_FETCH_ATTEMPTS", d.attempts))),
                   base=_env_float("PYLOADER_FETCH_BACKOFF", d.base),
                   cap=_env_float("PYLOADER_FETCH_BACKOFF_CAP", d.cap),
                   deadline=_env_float("PYLOADER_FETCH_DEADLINE", d.deadline),
                   stall_timeout=max(0.05, _env_float("PYLOADER_FETCH_STALL_TIMEOUT", d.stall_timeout)))

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry ``attempt``: the server's ``retry_after``, else full jitter; capped."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.cap)
        return random.uniform(0.0, min(self.cap, self.base * (2 ** attempt)))


class _ShortBody(Exception):
    """The body ended before the manifest's size: a truncated transfer (transient)."""


_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EAGAIN}
_TRANSIENT_S3_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                       "InternalError", "ServiceUnavailable", "503", "500", "502", "504"}


def _status_of(e: BaseException) -> int | None:
    st = getattr(e, "status", None)
    if isinstance(st, int):
        return st
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        code = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(code, int):
            return code
    return None


def _retry_after(e: BaseException) -> float | None:
    headers = getattr(e, "headers", None)
    if headers is None:
        resp = getattr(e, "response", None)
        if isinstance(resp, dict):
            headers = resp.get("ResponseMetadata", {}).get("HTTPHeaders")
    if not headers:
        return None
    try:
        v = headers.get("Retry-After") or headers.get("retry-after")
    except AttributeError:
        return None
    try:
        return float(v) if v is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


def classify(e: BaseException) -> tuple[bool, float | None]:
    """(transient?, Retry-After seconds or None) for one failed attempt (NOTE [fetch retries])."""
    # Walk the cause chain: fsspec and s3fs wrap the client's exception.
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    for x in seen:
        if isinstance(x, _ShortBody):
            return True, None
        status = _status_of(x)
        if status is not None:
            if status in (408, 429) or status >= 500:
                return True, _retry_after(x)
            return False, None
        code = getattr(x, "response", None)
        if isinstance(code, dict):
            c = str(code.get("Error", {}).get("Code", ""))
            if c in _TRANSIENT_S3_CODES:
                return True, _retry_after(x)
    for x in seen:
        if isinstance(x, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
            return False, None
        name = type(x).__name__
        mod = type(x).__module__ or ""
        if isinstance(x, (TimeoutError, ConnectionError)):
            return True, None
        if mod.startswith("aiohttp") and name != "InvalidURL":
            return True, None  # payload errors, disconnects, client/server connection errors
        if mod.startswith(("botocore", "urllib3", "requests")) and any(
                k in name for k in ("Timeout", "Connection", "ProtocolError", "IncompleteRead", "ResponseStreaming")):
            return True, None
        if name in ("IncompleteReadError", "ContentLengthError", "ClientPayloadError"):
            return True, None
        if isinstance(x, OSError) and x.errno in _TRANSIENT_ERRNOS:
            return True, None
    return False, None


def with_retries(fn: Callable[[], Any], policy: RetryPolicy, *, what: str, url: str, shard: str | None,
                 cancel: threading.Event | None = None) -> Any:
    """Calls ``fn`` until it succeeds, retrying transient failures (NOTE [fetch retries])."""
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return fn()
        except (FetchError, KeyboardInterrupt):
            raise
        except Exception as e:
            transient, retry_after = classify(e)
            attempt += 1
            detail = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if not transient:
                err = getattr(e, "errno", None) or errno.EIO
                if isinstance(e, FileNotFoundError):
                    err = errno.ENOENT
                elif isinstance(e, PermissionError):
                    err = errno.EACCES
                raise _fetch_error(FetchError, f"{what} {url}: {detail} (permanent, not retried)", url, shard,
                                   err) from e
            wait = policy.delay(attempt - 1, retry_after)
            elapsed = time.monotonic() - start
            if attempt >= policy.attempts or elapsed + wait > policy.deadline:
                raise _fetch_error(FetchError, f"{what} {url}: {detail} (gave up after {attempt} attempts in "
                                   f"{elapsed:.1f} s)", url, shard, transient=True) from e
            if cancel is not None:
                if cancel.wait(wait):
                    raise _fetch_error(FetchError, f"{what} {url}: cancelled", url, shard) from e
            else:
                time.sleep(wait)


def read_object(url: str, storage_options: dict[str, Any] | None, policy: RetryPolicy) -> bytes:
    """The whole object at ``url`` (a manifest), with retries."""
    fs, path = filesystem(url, storage_options, policy.stall_timeout)
    return with_retries(lambda: fs.cat_file(path), policy, what="reading", url=url, shard=None)


_HTTP_CHUNK = 1 << 20
_OTHER_CHUNK = 8 << 20


def download_into(fd: int, fs: Any, path: str, size: int, *, url: str, shard: str,
                  cancel: threading.Event | None = None,
                  on_bytes: Callable[[int], None] | None = None) -> None:
    """One attempt: streams the object into ``fd`` from offset 0; raises unless exactly ``size`` bytes came.

    A body longer than ``size`` is a changed object (permanent); a shorter one a
    truncated transfer (transient).
    """
    from fsspec.implementations.http import HTTPFileSystem

    os.lseek(fd, 0, os.SEEK_SET)
    if isinstance(fs, HTTPFileSystem):
        # size= skips the HEAD request; block_size=0 is one streaming GET.
        f = fs.open(path, "rb", block_size=0, size=size)
        chunk = _HTTP_CHUNK
    else:
        f = fs.open(path, "rb", cache_type="none", block_size=_OTHER_CHUNK)
        chunk = _OTHER_CHUNK
    got = 0
    try:
        while True:
            if cancel is not None and cancel.is_set():
                raise _fetch_error(FetchError, f"downloading {url}: cancelled", url, shard)
            want = min(chunk, size + 1 - got)
            data = f.read(want)
            if not data:
                break
            got += len(data)
            if got > size:
                raise _fetch_error(RemoteChangedError, f"{url}: shard {shard!r} is larger than the manifest's "
                                   f"{size} bytes: the object changed after the manifest was read", url, shard)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if on_bytes is not None:
                on_bytes(len(data))
    finally:
        with contextlib.suppress(Exception):  # closing a broken stream must not hide the real error
            f.close()
    if got < size:
        raise _ShortBody(f"the body ended after {got} of {size} bytes")
