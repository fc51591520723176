"""Remote object I/O through fsspec: URLs, retries, per-host request limits, downloads.

A host's request limit adapts to its throttling; a download stops at once on a cancel.

Policy lives here; the cache (``_cache``) decides where bytes go and when they are
trusted. Nothing here writes into the cache directory except through the file
descriptor the cache hands over.

NOTE [fetch retries]: an attempt that fails is classified (``classify``, ``_Failure``):
  - *permanent* (401, 403, 404, 410, other 4xx, a remote object bigger than the
    manifest says): raised at once. A missing object raises ``FetchNotFoundError`` (a
    ``FileNotFoundError``), a forbidden one ``FetchPermissionError`` (a
    ``PermissionError``), anything else a plain ``FetchError``;
  - *throttled* (429, 503, S3 ``SlowDown``/``Throttling``...): the server asks us to
    slow down. It does not count against ``attempts`` nor ``deadline``: the host's
    request limit reacts (NOTE [fetch throttling]) and the attempt is repeated once
    the limit lets it through. Only ``throttle_deadline`` ends it;
  - *refused* (nothing accepts the connection: refused, host or network unreachable):
    transient, but retried at most ``REFUSED_ATTEMPTS`` attempts in all, as a server
    that is down answers the same way to the next request; the message names it;
  - *transient* (connection reset, timeouts, a body that ends before its Content-Length,
    408, 500, 502, 504): retried after ``base * 2**k`` seconds with full jitter, capped at
    ``cap``, or after the server's ``Retry-After`` when it gives one (also capped), at
    most ``attempts`` attempts and never past ``deadline`` seconds of trying (time spent
    waiting on a throttling host is not counted).
A wrong checksum with the right size may be a byte flipped in transit, so it is
retried once; a second mismatch means the object's bytes do not match its manifest
(``RemoteCorruptError``: corrupt at the source or a stale manifest; re-opening does not
help), while a body larger than the manifest says, or a Content-Length smaller than it, is
a changed object
(``RemoteChangedError``: re-open the dataset). Every ``FetchError`` names the URL, the shard (when there is
one) and the number of attempts in its message, and carries them as ``url``, ``shard``
and ``attempts``; its ``errno`` is never 0.

NOTE [download cancel]: on an async filesystem (HTTP, S3, GCS...) a download is one
streaming request read by coroutines on fsspec's event loop; the calling thread waits
for each chunk in slices of ``CANCEL_POLL_S`` and, when ``cancel`` is set, cancels
the coroutine and closes the response, so a stalled server delays a cancel by at most
a slice, not by the stall timeout. Filesystems without async streaming (memory, local,
...) are read synchronously and see the cancel between chunks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import inspect
import math
import os
import random
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urljoin, urlsplit

from ..errors import FetchError, FetchNotFoundError, FetchPermissionError, RemoteChangedError
from .failure_messages import GAVE_UP_FIX, detail_of, permanent_fix, size_mismatch
from .names import is_remote
from .throttle import CANCEL_POLL_S, _Cancelled, _ThrottleExpired, host_key, host_limiter

_T = TypeVar("_T")


def _fetch_error(cls: type[FetchError], message: str, url: str, shard: str | None, err: int = errno.EIO,
                 transient: bool = False, attempts: int = 0) -> FetchError:
    e = cls(err or errno.EIO, message)
    e.url, e.shard, e.transient, e.attempts = url, shard, transient, attempts
    return e


def _attempts(n: int) -> str:
    return f"{n} attempt" if n == 1 else f"{n} attempts"


def _naming(what: str, url: str, shard: str | None) -> str:
    """The start of an error message: what was done to which URL, and which shard."""
    return f"{what} {url} (shard {shard!r})" if shard else f"{what} {url}"


def filesystem(url: str, storage_options: dict[str, Any] | None, stall_timeout: float) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for ``url``, with read timeouts set by default."""
    import fsspec

    proto = url.split("://", 1)[0].lower()
    opts = dict(storage_options or {})
    if proto in ("http", "https"):
        import aiohttp

        given = opts.get("client_kwargs")
        client = dict(given) if isinstance(given, dict) else {}
        if given is None:
            # A stalled body must fail (and be retried), not hang a download forever.
            client["timeout"] = aiohttp.ClientTimeout(total=None, sock_connect=stall_timeout, sock_read=stall_timeout)
        # The proxy variables (HTTPS_PROXY, NO_PROXY...) libcurl and botocore read: the native
        # transport's downloads and these requests go the same way (docs/security.md).
        client.setdefault("trust_env", True)
        # Every request the filesystem makes (a manifest, a listing, a HEAD) keeps the
        # redirect rule, not only the downloads that _follow makes (NOTE [fsspec redirects]).
        client["trace_configs"] = [*client.get("trace_configs", ()), _redirect_rule()]
        opts["client_kwargs"] = client
    if proto in ("s3", "s3a") and "config_kwargs" not in opts:
        opts["config_kwargs"] = {"read_timeout": stall_timeout, "connect_timeout": stall_timeout}
    fs, path = fsspec.core.url_to_fs(url, **opts)
    return fs, path


# Request headers a redirect to another origin keeps: none of them carries a credential.
_KEPT_ACROSS_ORIGINS = frozenset({"accept", "accept-encoding", "accept-language", "user-agent", "range", "if-range",
                                  "if-match", "if-none-match", "if-modified-since", "if-unmodified-since",
                                  "cache-control", "pragma", "host", "content-length", "content-type"})
_redirect_trace: list[Any] = []


def _redirect_rule() -> Any:
    """The trace of aiohttp's redirects that holds them to NOTE [fsspec redirects] (one per process).

    aiohttp follows a redirect itself with the request's own (mutable) headers, and tells
    the trace before it does: the trace refuses a hop from https to plain http, to another
    scheme or past the fifth (raising, so the request fails, not retried), and, on a hop
    to another origin than the first request's, removes every header but those in
    ``_KEPT_ACROSS_ORIGINS`` for the rest of the request (aiohttp drops ``auth`` itself).
    """
    if _redirect_trace:
        return _redirect_trace[0]
    import aiohttp

    async def on_redirect(session: Any, ctx: Any, params: Any) -> None:
        ctx.hops = getattr(ctx, "hops", 0) + 1
        if ctx.hops > _MAX_REDIRECTS:
            raise _RedirectRefused(f"redirected more than {_MAX_REDIRECTS} times")
        here = str(params.url)
        if not hasattr(ctx, "home"):
            ctx.home = _origin(here)
        location = params.response.headers.get("Location") or params.response.headers.get("URI")
        if not location:
            return
        nxt = urljoin(here, location)
        scheme = urlsplit(nxt).scheme.lower()
        if scheme not in ("http", "https"):
            raise _RedirectRefused(f"redirected to a URL that is not http or https ({scheme}://)")
        if urlsplit(here).scheme.lower() == "https" and scheme == "http":
            raise _RedirectRefused("redirected from https to plain http")
        if _origin(nxt) != ctx.home:
            for name in list(params.headers.keys()):
                if name.lower() not in _KEPT_ACROSS_ORIGINS:
                    params.headers.popall(name, None)

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(on_redirect)
    _redirect_trace.append(trace)
    return trace


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
    """Bounds on retries (NOTE [fetch retries]). ``from_env()`` reads PYLOADER_FETCH_* overrides.

    ``attempts`` (PYLOADER_FETCH_ATTEMPTS), ``base`` and ``cap`` of the backoff
    (PYLOADER_FETCH_BACKOFF, PYLOADER_FETCH_BACKOFF_CAP) and ``deadline``
    (PYLOADER_FETCH_DEADLINE) bound the retries of transient failures;
    ``stall_timeout`` (PYLOADER_FETCH_STALL_TIMEOUT) is how long a connection may send
    nothing; ``throttle_deadline`` (PYLOADER_FETCH_THROTTLE_DEADLINE) how long a host may
    answer nothing but throttles before the requests to it fail (NOTE [fetch throttling]).
    """

    attempts: int = 6
    base: float = 0.25
    cap: float = 10.0
    deadline: float = 120.0
    stall_timeout: float = 30.0
    throttle_deadline: float = 300.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """The default policy with PYLOADER_FETCH_* overrides; raises ``ValueError`` for a bad value."""
        d = cls()
        return cls(attempts=max(1, int(_env_float("PYLOADER_FETCH_ATTEMPTS", d.attempts))),
                   base=_env_float("PYLOADER_FETCH_BACKOFF", d.base),
                   cap=_env_float("PYLOADER_FETCH_BACKOFF_CAP", d.cap),
                   deadline=_env_float("PYLOADER_FETCH_DEADLINE", d.deadline),
                   stall_timeout=max(0.05, _env_float("PYLOADER_FETCH_STALL_TIMEOUT", d.stall_timeout)),
                   throttle_deadline=_env_float("PYLOADER_FETCH_THROTTLE_DEADLINE", d.throttle_deadline))

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait before retry ``attempt``: the server's ``retry_after``, else full jitter; capped."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.cap)
        return random.uniform(0.0, min(self.cap, self.base * (2 ** min(attempt, 30))))

    def throttle_pause(self, streak: int, retry_after: float | None) -> float:
        """Seconds a throttled host is paused (NOTE [fetch throttling]).

        Its ``Retry-After`` (at most ``throttle_deadline``), else full jitter growing with
        ``streak``, the throttled responses since its last success.
        """
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.throttle_deadline)
        return self.delay(max(streak - 1, 0), None)


class _LocalWriteError(OSError):
    """A download's bytes could not be written to the local file (no space, a file-size limit).

    Not the server's failure: it is neither retried nor reported as a fetch error; the
    cache reports it as a ``CacheError`` naming the cache.
    """


# -- classifying failures (NOTE [fetch retries]) -------------------------------------------
class _ShortBody(Exception):
    """The body ended before the manifest's size: a truncated transfer (transient)."""


REFUSED_ATTEMPTS = 3  # attempts at a connection that is refused (NOTE [fetch retries])
_REFUSED_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH}
_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EAGAIN}
_THROTTLE_S3_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                      "TooManyRequestsException", "ServiceUnavailable", "503"}
_TRANSIENT_S3_CODES = {"RequestTimeout", "RequestTimeTooSkewed", "InternalError", "500", "502", "504"}
_NOT_FOUND_S3_CODES = {"NoSuchKey", "NoSuchBucket", "NotFound", "404"}
_FORBIDDEN_S3_CODES = {"AccessDenied", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"}
_THROTTLE_STATUSES = {429, 503}


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


def _s3_code(e: BaseException) -> str:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        err = resp.get("Error")
        if isinstance(err, dict):
            return str(err.get("Code", ""))
    return ""


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
        x = float(v) if v is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff
    # "nan", "-5": not a wait a server can mean (nan would reach time.sleep, a negative
    # one would repeat the request at once): our own backoff instead.
    return None if x is None or math.isnan(x) or x < 0 else x  # inf stays: capped like any long wait


@dataclass(frozen=True)
class _Failure:
    """What one failed attempt means (NOTE [fetch retries])."""

    kind: str  # "throttle" | "transient" | "refused" | "not_found" | "forbidden" | "permanent"
    retry_after: float | None = None
    signal: str = ""  # for a throttle: what the server said, e.g. "HTTP 503"

    @property
    def transient(self) -> bool:
        return self.kind in ("throttle", "transient", "refused")


def _chain(e: BaseException) -> list[BaseException]:
    # The cause chain: fsspec and s3fs wrap the client's exception.
    seen: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in seen and len(seen) < 8:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def _unframed(e: BaseException) -> BaseException | None:
    """The error of aiohttp's parser under ``e``, if any: bytes that are not HTTP, not the server's status.

    aiohttp reports it as a ``ClientResponseError`` with status 400 (e.g. "Bad status line"
    where bytes past a body's Content-Length came in the same read): a transient failure
    of the transfer, never taken for the server's own 400.
    """
    return next((x for x in _chain(e) if type(x).__module__ == "aiohttp.http_exceptions"), None)


def _failure(e: BaseException) -> _Failure:
    seen = _chain(e)
    if _unframed(e) is not None:
        return _Failure("transient")
    for x in seen:
        if isinstance(x, _ShortBody):
            return _Failure("transient")
        code = _s3_code(x)
        status = _status_of(x)
        if code in _THROTTLE_S3_CODES or status in _THROTTLE_STATUSES:
            return _Failure("throttle", _retry_after(x), f"S3 {code}" if code else f"HTTP {status}")
        if code in _NOT_FOUND_S3_CODES or status in (404, 410):
            return _Failure("not_found")
        if code in _FORBIDDEN_S3_CODES or status in (401, 403):
            return _Failure("forbidden")
        if code in _TRANSIENT_S3_CODES:
            return _Failure("transient", _retry_after(x))
        if status is not None:
            if status == 408 or status >= 500:
                return _Failure("transient", _retry_after(x))
            return _Failure("permanent")
    for x in seen:
        if isinstance(x, FileNotFoundError):
            return _Failure("not_found")
        if isinstance(x, PermissionError):
            return _Failure("forbidden")
        if isinstance(x, (IsADirectoryError, NotADirectoryError)):
            return _Failure("permanent")
        if isinstance(x, OSError) and x.errno in _REFUSED_ERRNOS:
            return _Failure("refused")  # aiohttp's ClientConnectorError, the native transport's _CurlRefused
        name = type(x).__name__
        mod = type(x).__module__ or ""
        if isinstance(x, (TimeoutError, ConnectionError)):
            return _Failure("transient")
        if mod.startswith("aiohttp") and name != "InvalidURL":
            return _Failure("transient")  # payload errors, disconnects, client/server connection errors
        if mod.startswith(("botocore", "urllib3", "requests")) and any(
                k in name for k in ("Timeout", "Connection", "ProtocolError", "IncompleteRead", "ResponseStreaming")):
            return _Failure("transient")
        if name in ("IncompleteReadError", "ContentLengthError", "ClientPayloadError"):
            return _Failure("transient")
        if isinstance(x, OSError) and x.errno in _TRANSIENT_ERRNOS:
            return _Failure("transient")
    return _Failure("permanent")


def classify(e: BaseException) -> tuple[bool, float | None]:
    """(transient?, Retry-After seconds or None) for one failed attempt (NOTE [fetch retries])."""
    f = _failure(e)
    return f.transient, f.retry_after


def is_throttle(e: BaseException) -> bool:
    """True if the attempt that raised ``e`` was throttled: 429, 503, S3 ``SlowDown``..."""
    return _failure(e).kind == "throttle"


_PERMANENT_CLASS: dict[str, tuple[type[FetchError], int]] = {
    "not_found": (FetchNotFoundError, errno.ENOENT),
    "forbidden": (FetchPermissionError, errno.EACCES),
}


class _AttemptStop(threading.Event):
    """The cancel one attempt is given: set once ``cancel`` is, or once ``end`` (monotonic) passed.

    Only ``is_set`` is meant to be asked (what the transports poll: NOTE [download cancel]).
    """

    def __init__(self, cancel: threading.Event | None, end: float) -> None:
        super().__init__()
        self.cancel, self.end = cancel, end

    def expired(self) -> bool:
        return time.monotonic() >= self.end and not (self.cancel is not None and self.cancel.is_set())

    def is_set(self) -> bool:
        return (self.cancel is not None and self.cancel.is_set()) or time.monotonic() >= self.end


def with_retries(fn: Callable[..., _T], policy: RetryPolicy, *, what: str, url: str, shard: str | None,
                 cancel: threading.Event | None = None, attempt_stop: bool = False) -> _T:
    """Calls ``fn`` until it succeeds, retrying transient failures (NOTE [fetch retries]).

    Each call holds a place in ``url``'s host limit (NOTE [fetch throttling]). With
    ``attempt_stop``, ``fn`` takes the attempt's cancel (``_AttemptStop``): set by ``cancel``
    and by the deadline, so an attempt that never stalls (a server sending a byte at a
    time) still ends at ``deadline`` instead of whenever its body does.
    """
    limiter = host_limiter(url)
    start = time.monotonic()
    attempts = 0  # requests made
    hard = 0  # failed attempts that count against policy.attempts
    throttled = 0  # of the attempts, those throttled
    waited = 0.0  # seconds spent on throttling: not counted against policy.deadline

    def throttle_error(host_s: float) -> FetchError:
        return _fetch_error(
            FetchError,
            f"{_naming(what, url, shard)}: the server throttled every request ({limiter.last_signal}) for "
            f"{host_s:.1f} s, over the throttle deadline of {policy.throttle_deadline:g} s "
            f"(PYLOADER_FETCH_THROTTLE_DEADLINE): {limiter.streak} throttled responses from "
            f"{host_key(url)} since its last success ({throttled} to this request, {limiter.throttles} in all); "
            f"concurrency cut from {limiter.peak} to {limiter.window} (gave up after {_attempts(attempts)})",
            url, shard, errno.EAGAIN, transient=True, attempts=attempts)

    def cancelled() -> FetchError:
        return _fetch_error(FetchError, f"{_naming(what, url, shard)}: cancelled (after {_attempts(attempts)})",
                            url, shard, errno.ECANCELED, attempts=attempts)

    last: BaseException | None = None
    while True:
        t0 = time.monotonic()
        try:
            with limiter.slot(cancel, give_up_after=policy.throttle_deadline) as granted:
                waited += granted - t0
                attempts += 1
                stop = _AttemptStop(cancel, start + waited + policy.deadline) if attempt_stop else None
                try:
                    result = fn(stop) if stop is not None else fn()
                except FetchError as e:  # cancelled, or a changed object: final
                    if stop is not None and e.errno == errno.ECANCELED and stop.expired():
                        raise _fetch_error(
                            FetchError, f"{_naming(what, url, shard)}: the server was still sending at the "
                            f"{policy.deadline:g} s deadline (PYLOADER_FETCH_DEADLINE; gave up after "
                            f"{_attempts(attempts)} in {time.monotonic() - start:.1f} s): it sends too slowly to "
                            "finish in time; check the host, or raise PYLOADER_FETCH_DEADLINE", url, shard,
                            errno.ETIMEDOUT, transient=True, attempts=attempts) from e
                    if not e.attempts:
                        e.attempts = attempts
                    raise
                except Exception as e:
                    failure = _failure(e)
                    if failure.kind != "throttle":
                        raise
                    throttled += 1
                    signal = failure.signal + (f", Retry-After {failure.retry_after:g} s"
                                               if failure.retry_after is not None else "")
                    pause = policy.throttle_pause(limiter.streak + 1, failure.retry_after)
                    host_s = limiter.throttled(granted, pause, signal)
                    waited += time.monotonic() - granted
                    if host_s > policy.throttle_deadline:
                        raise throttle_error(host_s) from e
                    last = e
                    continue  # the limiter's pause is the backoff
                limiter.ok()
                return result
        except _Cancelled:
            raise cancelled() from last
        except _ThrottleExpired:
            raise throttle_error(limiter.streak_seconds()) from last
        except (FetchError, _LocalWriteError, KeyboardInterrupt):
            raise
        except Exception as e:
            last = e
            failure = _failure(e)
            hard += 1
            detail = detail_of(e, failure.kind, _unframed(e))
            also = f", {throttled} of them throttled" if throttled else ""
            if not failure.transient:
                cls, err = _PERMANENT_CLASS.get(failure.kind, (FetchError, 0))
                if not err:
                    err = getattr(e, "errno", None) or errno.EIO
                raise _fetch_error(cls, f"{_naming(what, url, shard)}: {detail} (permanent, not retried; "
                                   f"{_attempts(attempts)}{also}){permanent_fix(_chain(e), failure.kind)}", url,
                                   shard, err, attempts=attempts) from e
            wait = policy.delay(hard - 1, failure.retry_after)
            elapsed = time.monotonic() - start - waited
            limit = min(policy.attempts, REFUSED_ATTEMPTS) if failure.kind == "refused" else policy.attempts
            if hard >= limit or elapsed + wait > policy.deadline:
                if hard < limit:
                    bound = f"the next retry would pass the {policy.deadline:g} s deadline, PYLOADER_FETCH_DEADLINE"
                elif limit < policy.attempts:  # a refused connection's own bound
                    bound = f"at most {limit} attempts at a refused connection"
                else:
                    bound = f"the limit of {limit} attempts, PYLOADER_FETCH_ATTEMPTS"
                fix = GAVE_UP_FIX.get("short" if isinstance(e, _ShortBody) else failure.kind, GAVE_UP_FIX["transient"])
                raise _fetch_error(FetchError, f"{_naming(what, url, shard)}: {detail} (gave up after "
                                   f"{_attempts(attempts)} in {time.monotonic() - start:.1f} s{also}: {bound}); {fix}",
                                   url, shard, transient=True, attempts=attempts) from e
            if cancel is not None:
                if cancel.wait(wait):
                    raise cancelled() from e
            else:
                time.sleep(wait)


def read_object(url: str, storage_options: dict[str, Any] | None, policy: RetryPolicy) -> bytes:
    """The whole object at ``url`` (a manifest), with retries."""
    fs, path = filesystem(url, storage_options, policy.stall_timeout)
    data: bytes = with_retries(lambda: fs.cat_file(path), policy, what="reading", url=url, shard=None)
    return data


# -- downloads (NOTE [download cancel]) ------------------------------------------------------
_HTTP_CHUNK = 1 << 20
_OTHER_CHUNK = 8 << 20
_CLOSE_WAIT_S = 1.0


def _run_on(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, _T], cancel: threading.Event | None,
            timeout: float | None = None) -> _T:
    """Runs ``coro`` on ``loop`` (another thread's); waits in slices, cancelling it when ``cancel`` is set.

    Raises ``_Cancelled`` on a cancel, ``TimeoutError`` after ``timeout`` seconds.
    """
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    end = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            concurrent.futures.wait([fut], timeout=CANCEL_POLL_S)
            if fut.done():
                return fut.result()
            if cancel is not None and cancel.is_set():
                raise _Cancelled()
            if end is not None and time.monotonic() > end:
                raise TimeoutError("no answer from the event loop")
    finally:
        if not fut.done():
            fut.cancel()  # cancels the task on the loop: its pending read ends with CancelledError


async def _read_up_to(f: Any, n: int) -> bytes:
    """Up to ``n`` bytes of stream ``f``: fewer only at its end."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        b = await f.read(n - got)
        if not b:
            break
        parts.append(b)
        got += len(b)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def _close_stream(f: Any) -> None:
    # fsspec's HTTP stream closes its response in close(); s3fs's keeps the body in .r.
    body = getattr(f, "r", None)
    with contextlib.suppress(Exception):
        await f.close()
    close = getattr(body, "aclose", None) or getattr(body, "close", None)
    if close is not None:
        with contextlib.suppress(Exception):
            res = close()
            if inspect.isawaitable(res):
                await res


class _AsyncStream:
    """One streaming GET of an async filesystem's object, read from a plain thread (NOTE [download cancel])."""

    def __init__(self, fs: Any, path: str, cancel: threading.Event | None, kw: dict[str, Any]) -> None:
        self.loop = fs.loop
        self.cancel = cancel
        http = "allow_redirects" in kw
        # The open may finish on the loop just after this thread saw the cancel and gave up:
        # that file is never handed over, and its finaliser would make a close() coroutine
        # nobody awaits (a RuntimeWarning at a later garbage collection). Whichever side
        # comes second marks it closed (nothing to release: no request was made yet).
        made: list[Any] = []
        abandoned = [False]

        async def open_file() -> Any:
            f = await fs.open_async(path, "rb", **kw)
            made.append(f)
            if abandoned[0]:
                f.closed = True
            if http:
                # fsspec's AsyncStreamFile loses its request options (its base class's __init__
                # replaces .kwargs): without this, no storage_options header was ever sent.
                f.kwargs = {k: v for k, v in kw.items() if k != "size"}
                await f.read(0)  # the request: its status and headers before any byte of its body
            return f

        try:
            self.f = _run_on(self.loop, open_file(), cancel)
        except BaseException:
            abandoned[0] = True
            for f in made:
                with contextlib.suppress(Exception):
                    f.closed = True
            raise

    def read(self, n: int) -> bytes:
        return _run_on(self.loop, _read_up_to(self.f, n), self.cancel)

    def response(self) -> Any:
        """The HTTP response (aiohttp's) once the request was made, else None."""
        return getattr(self.f, "r", None)

    def close(self) -> None:
        try:
            with contextlib.suppress(Exception):  # closing a broken stream must not hide the real error
                _run_on(self.loop, _close_stream(self.f), None, timeout=_CLOSE_WAIT_S)
        finally:
            # A close that could not finish (its task cancelled at the timeout, the loop busy)
            # must not be tried again by the file's finaliser: that would make a close()
            # coroutine nobody awaits (a RuntimeWarning at some later garbage collection).
            with contextlib.suppress(Exception):
                self.f.closed = True


class _SyncStream:
    """A file of a synchronous filesystem (memory, local...): the cancel is seen between chunks."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def read(self, n: int) -> bytes:
        data: bytes = self.f.read(n)
        return data

    def response(self) -> Any:
        return None

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing a broken stream must not hide the real error
            self.f.close()


class _RedirectRefused(Exception):
    """A redirect that is not followed (NOTE [fsspec redirects]): permanent."""


class _RedirectStatus(Exception):
    """A 3xx answer that is not a redirect to follow: its ``status`` is classified as any other."""

    def __init__(self, status: int) -> None:
        self.status = status
        super().__init__(f"HTTP {status}")


_MAX_REDIRECTS = 5  # as the native transport's kMaxRedirects (NOTE [redirects] in csrc/core/http_fetch.h)
_REDIRECTS = (301, 302, 303, 307, 308)


def _origin(url: str) -> tuple[str, str, int | None]:
    u = urlsplit(url)
    scheme = u.scheme.lower()
    return scheme, (u.hostname or "").lower(), u.port or {"http": 80, "https": 443}.get(scheme)


def _follow(fs: Any, path: str, size: int, cancel: threading.Event | None) -> _AsyncStream:
    """The stream of ``path`` over HTTP(S), redirects followed here (NOTE [fsspec redirects]).

    NOTE [fsspec redirects]: aiohttp would follow a redirect with every header of the
    request, ``storage_options["headers"]`` (API keys, tokens) included, to whatever
    origin it names. Each request is made with ``allow_redirects=False`` and its 3xx
    followed here, by the native transport's rule (NOTE [redirects] in
    csrc/core/http_fetch.h): at most 5 per request; to the same origin (scheme, host,
    port) with the filesystem's request options, to another without its ``headers`` and
    ``auth`` (from then on, also if a later hop comes back); never from https to plain
    http nor to another scheme. The size skips a HEAD request. The requests fsspec makes
    itself (a manifest's ``cat_file``, a HEAD, a listing) follow aiohttp's redirects, held
    to the same rule by a trace on each of them (``_redirect_rule``).
    """
    kw: dict[str, Any] = {**getattr(fs, "kwargs", {}), "size": size, "allow_redirects": False}
    home, target = _origin(path), path
    for _ in range(_MAX_REDIRECTS + 1):
        stream = _AsyncStream(fs, target, cancel, kw)
        r = stream.response()
        status = getattr(r, "status", 200)
        if not 300 <= status <= 399:
            return stream
        location = r.headers.get("Location", "") if status in _REDIRECTS else ""
        stream.close()
        if not location:
            raise _RedirectStatus(status)
        nxt = urljoin(target, location)
        scheme = urlsplit(nxt).scheme.lower()
        if scheme not in ("http", "https"):
            raise _RedirectRefused(f"redirected to a URL that is not http or https ({scheme}://)")
        if urlsplit(target).scheme.lower() == "https" and scheme == "http":
            raise _RedirectRefused("redirected from https to plain http")
        if _origin(nxt) != home:
            kw = {k: v for k, v in kw.items() if k not in ("headers", "auth")}
        target = nxt
    raise _RedirectRefused(f"redirected more than {_MAX_REDIRECTS} times")


def _open_stream(fs: Any, path: str, size: int, cancel: threading.Event | None) -> tuple[_AsyncStream | _SyncStream,
                                                                                         int]:
    """(stream, chunk size) for one download of ``path`` (NOTE [download cancel])."""
    from fsspec.implementations.http import HTTPFileSystem

    http = isinstance(fs, HTTPFileSystem)
    chunk = _HTTP_CHUNK if http else _OTHER_CHUNK
    if http and not getattr(fs, "asynchronous", False):
        return _follow(fs, path, size, cancel), chunk
    if getattr(fs, "async_impl", False) and not getattr(fs, "asynchronous", False):
        try:
            return _AsyncStream(fs, path, cancel, {}), chunk
        except NotImplementedError:
            pass  # no async streaming for this filesystem: read it synchronously
    if http:
        # size= skips the HEAD request; block_size=0 is one streaming GET.
        return _SyncStream(fs.open(path, "rb", block_size=0, size=size)), chunk
    return _SyncStream(fs.open(path, "rb", cache_type="none", block_size=_OTHER_CHUNK)), chunk


def download_into(fd: int, fs: Any, path: str, size: int, *, url: str, shard: str,
                  cancel: threading.Event | None = None,
                  on_bytes: Callable[[int], None] | None = None) -> None:
    """One attempt: streams the object into ``fd`` from offset 0; raises unless exactly ``size`` bytes came.

    A body longer than ``size`` is a changed object (permanent); a shorter one a
    truncated transfer (transient). A set ``cancel`` ends it within about
    ``CANCEL_POLL_S`` on an async filesystem, even while the server sends nothing
    (NOTE [download cancel]); nothing is written to ``fd`` after the cancel is seen.
    """

    def cancelled() -> FetchError:
        return _fetch_error(FetchError, f"downloading {url} (shard {shard!r}): cancelled", url, shard,
                            errno.ECANCELED)

    os.lseek(fd, 0, os.SEEK_SET)
    try:
        stream, chunk = _open_stream(fs, path, size, cancel)
    except _Cancelled:
        raise cancelled() from None
    got = 0
    try:
        r = stream.response()
        length = getattr(r, "content_length", None) if getattr(r, "status", None) == 200 else None
        if isinstance(length, int) and length < size:  # the whole object, shorter: no retry changes it
            raise size_mismatch(url, shard, size, length)
        while True:
            if cancel is not None and cancel.is_set():
                raise cancelled()
            want = min(chunk, size + 1 - got)
            try:
                data = stream.read(want)
            except _Cancelled:
                raise cancelled() from None
            except Exception as e:  # aiohttp's words for a body cut before its Content-Length: ours, as native's
                if type(e).__name__ not in ("ClientPayloadError", "ContentLengthError"):
                    raise
                raise _ShortBody(f"the body ended after {got} of {size} bytes") from e
            if not data:
                break
            if cancel is not None and cancel.is_set():
                raise cancelled()
            got += len(data)
            if got > size:
                raise _fetch_error(RemoteChangedError, f"{url}: shard {shard!r} is larger than the manifest's "
                                   f"{size} bytes: the object changed after the manifest was read; re-open the "
                                   "dataset to read the new manifest", url, shard)
            view = memoryview(data)
            while view:
                try:
                    n = os.write(fd, view)
                except OSError as e:
                    raise _LocalWriteError(e.errno, e.strerror) from None
                view = view[n:]
            if on_bytes is not None:
                on_bytes(len(data))
    finally:
        stream.close()
    if got < size:
        raise _ShortBody(f"the body ended after {got} of {size} bytes")


__all__ = ["REFUSED_ATTEMPTS", "is_remote", "filesystem", "RetryPolicy", "classify", "is_throttle",
           "with_retries", "read_object", "download_into"]
