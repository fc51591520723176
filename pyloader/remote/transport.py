"""How a download's bytes move: pyloader's native HTTP client, or fsspec.

NOTE [transport choice]: a shard download is one of two transports, chosen per dataset:
  - *native* (``NativeTransport``): the system's libcurl driven from the extension
    (NOTE [native transport] in csrc/core/http_fetch.h). Bytes go from the socket into the
    cache's temp file without passing through Python or an event loop, large objects as
    parallel ranged GETs (``RANGE_MIN`` and up, parts of at least ``PART_MIN``; whole GETs from
    the first throttled ranged attempt on: its parts multiply the request rate of a store
    that already pushes back, and one throttled part fails the attempt and wastes the
    others, so under a lasting throttle no download would complete). It serves
    ``http(s)://`` URLs and ``s3://`` ones, the latter through a URL presigned by botocore
    for each download (credentials, region, endpoint and addressing are botocore's, from
    the same ``storage_options`` s3fs takes);
  - *fsspec* (``FsspecTransport``): every other protocol, and any dataset whose
    ``storage_options`` say something the native transport does not translate (an aiohttp
    session option, an s3fs option other than credentials, endpoint, region and
    requester-pays).
``PYLOADER_TRANSPORT`` picks: ``auto`` (the default: native where it applies and libcurl
loads, else fsspec), ``native`` (an error where it does not apply) or ``fsspec``. Manifests
are always read through fsspec (one small GET per node). Both transports raise the same
failures for the same conditions, classified by ``fs._failure`` (NOTE [fetch retries]):
an HTTP status as an exception with ``status``, ``headers`` (Retry-After) and, for S3,
the error ``Code`` of its XML body; a libcurl transfer error as a ``ConnectionError`` or
``TimeoutError`` (transient; a connection refused or unreachable with ``ECONNREFUSED``) or
a permanent error; a body cut before its end as ``_ShortBody``; a larger or other-sized
object (a Content-Length below the manifest's size too) as ``RemoteChangedError``; a cancel as ``FetchError``
(ECANCELED), seen within ``CANCEL_POLL_S``; a failed write as the ``OSError`` it was.
"""

from __future__ import annotations

import errno
import os
import re
import threading
from collections.abc import Callable
from typing import Any, Protocol

import pyloader._C as _C

from ..errors import FetchError, RemoteChangedError
from .failure_messages import size_mismatch
from .fs import (
    _HTTP_CHUNK,
    _OTHER_CHUNK,
    _fetch_error,
    _LocalWriteError,
    _ShortBody,
    download_into,
    filesystem,
    is_throttle,
)
from .names import quote_key

TRANSPORTS = ("auto", "native", "fsspec")
RANGE_MIN = 64 << 20  # objects at least this big are fetched as parallel ranged GETs
PART_MIN = 16 << 20  # ... in parts of at least this many bytes
MAX_PARTS = 8
WRITE_BUFFER = 1 << 20  # the staging buffer of each part (See NOTE [native transport])
RECV_BUFFER = 4 << 20  # libcurl's receive buffer per part, at most (NOTE [receive buffer] in csrc/core/http_fetch.h)
# libcurl error codes whose failure a retry may fix: proxy and host resolution, connect,
# partial file, HTTP/2 framing, TLS connect, nothing received, send and receive errors.
_CURL_TRANSIENT = {5, 6, 16, 18, 35, 52, 55, 56, 92, 95}
_CURL_TIMEOUT = 28
_CURL_PARTIAL = 18
_CURL_COULDNT_CONNECT = 7  # refused, or the host or network unreachable: fs's "refused" kind
_PROXY_REFUSED = re.compile(r"CONNECT tunnel failed, response (\d{3})")  # libcurl's words (error 56)
_CA_VARIABLES = ("AWS_CA_BUNDLE", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "CURL_CA_BUNDLE")
_WRONG_REGION_CODES = {"AuthorizationHeaderMalformed", "PermanentRedirect", "IncorrectEndpoint",
                       "AuthorizationQueryParametersError"}
_CURL_NATIVE_PROTOCOLS = ("http", "https", "s3", "s3a")
_REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-\d{1,2}")  # what an S3 error may name as a region
# storage_options keys of fsspec's cache layer that change nothing about the bytes.
_NEUTRAL_KEYS = {"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"}
_S3_KEYS = {"key", "secret", "token", "anon", "endpoint_url", "client_kwargs", "config_kwargs", "requester_pays",
            "profile"}
_S3_CLIENT_KEYS = {"endpoint_url", "region_name", "aws_access_key_id", "aws_secret_access_key",
                   "aws_session_token", "verify"}
# botocore Config keys that only shape the presigned URL (the download itself is libcurl's):
# any other (proxies, timeouts, retries, pools) would be silently ignored, so it goes to fsspec.
_S3_CONFIG_KEYS = {"signature_version", "s3", "region_name"}


def transport_setting() -> str:
    """``PYLOADER_TRANSPORT`` (NOTE [transport choice]): ``auto`` unless set."""
    v = os.environ.get("PYLOADER_TRANSPORT", "").strip().lower() or "auto"
    if v not in TRANSPORTS:
        raise ValueError(f"PYLOADER_TRANSPORT must be one of {', '.join(TRANSPORTS)}, got {v!r}")
    return v


class Transport(Protocol):
    """What the cache downloads through (NOTE [transport choice])."""

    name: str

    def download_into(self, fd: int, key: str, size: int, *, url: str, shard: str,
                      cancel: threading.Event | None, on_bytes: Callable[[int], None] | None) -> int | None:
        """One attempt: object ``key`` (relative to the dataset) into ``fd`` from offset 0, exactly ``size`` bytes.

        Returns the XXH64 of the bytes written when the transport computed it on the way, else None.
        """

    def buffer_bytes(self, size: int) -> int:
        """Memory one download of an object of ``size`` bytes holds (its buffers)."""


class FsspecTransport:
    """Downloads through an fsspec filesystem (NOTE [download cancel] in ``fs.py``)."""

    name = "fsspec"

    def __init__(self, url: str, storage_options: dict[str, Any] | None, stall_timeout: float) -> None:
        self.fs, self.root = filesystem(url, storage_options, stall_timeout)
        self._http = url.split("://", 1)[0].lower() in ("http", "https")
        self._chunk = _HTTP_CHUNK if self._http else _OTHER_CHUNK

    def download_into(self, fd: int, key: str, size: int, *, url: str, shard: str,
                      cancel: threading.Event | None, on_bytes: Callable[[int], None] | None) -> int | None:
        """One attempt through fsspec (``fs.download_into``); no hash on the way."""
        # fsspec's HTTP filesystem keeps a valid %XX of a URL as it is: the key is quoted here.
        path = self.root.rstrip("/") + "/" + (quote_key(key) if self._http else key)
        download_into(fd, self.fs, path, size, url=url, shard=shard, cancel=cancel, on_bytes=on_bytes)
        return None

    def buffer_bytes(self, size: int) -> int:
        """The read chunk of one download."""
        return self._chunk


class _HttpStatus(Exception):
    """A non-2xx answer to a native download, shaped for ``fs._failure``: ``status``, ``headers``, ``response``."""

    def __init__(self, status: int, retry_after: str, body: bytes, bucket_region: str = "") -> None:
        self.status = status
        self.headers = {"Retry-After": retry_after} if retry_after else {}
        text = body[:4096].decode("utf-8", "replace")
        code, message = _xml_field(text, "Code"), _xml_field(text, "Message")
        self.response: dict[str, Any] | None = {"Error": {"Code": code, "Message": message},
                                                "ResponseMetadata": {"HTTPStatusCode": status}} if code else None
        detail = f"{code}: {message}" if code else _first_line(text)
        # S3's answer to a request signed for another region names the bucket's region.
        self.region = bucket_region or _xml_field(text, "Region") if code in _WRONG_REGION_CODES else ""
        super().__init__(f"HTTP {status}" + (f" ({detail})" if detail else ""))


class _CurlError(ConnectionError):
    """A transfer that libcurl ended with an error a retry may fix (refused, reset, resolve...)."""


class _CurlRefused(ConnectionRefusedError):
    """A connection libcurl could not make (its error 7): refused or unreachable, as aiohttp's ClientConnectorError."""


class _CurlPermanent(Exception):
    """A transfer that libcurl ended with an error a retry does not fix (bad URL, certificate...)."""


def _xml_field(text: str, name: str) -> str:
    m = re.search(rf"<{name}>([^<]{{1,200}})</{name}>", text)
    return m.group(1) if m else ""


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return "".join(c if c.isprintable() else "?" for c in line[:120])


def _parts(size: int) -> list[tuple[int, int]]:
    """(offset, length) of the ranged GETs of an object of ``size`` bytes; [] for one whole GET."""
    if size < RANGE_MIN:
        return []
    n = max(1, min(MAX_PARTS, size // PART_MIN))
    step = -(-size // n)
    return [(o, min(step, size - o)) for o in range(0, size, step)]


class NativeTransport:
    """Downloads through the extension's libcurl client (NOTE [transport choice])."""

    name = "native"

    def __init__(self, url: str, storage_options: dict[str, Any] | None, *, connect_timeout: float,
                 stall_timeout: float) -> None:
        self.proto = url.split("://", 1)[0].lower()
        opts = dict(storage_options or {})
        self.headers = [f"{k}: {v}" for k, v in (opts.get("headers") or {}).items()]
        self.connect_timeout, self.stall_timeout = connect_timeout, stall_timeout
        self.base = url.rstrip("/")
        self._opts = opts
        self._presigner = _S3Presigner(opts) if self.proto in ("s3", "s3a") else None
        self.ranges = True  # False once the server answered a ranged GET with the whole object
        # A CA bundle named the way Python's and AWS's clients are told of one (libcurl reads no variable):
        # s3fs's client_kwargs["verify"] path first, as botocore would use it.
        verify = (opts.get("client_kwargs") or {}).get("verify")
        self.ca_file = verify if isinstance(verify, str) and verify else \
            next((v for k in _CA_VARIABLES if (v := os.environ.get(k, ""))), "")

    def target(self, key: str) -> str:
        """The HTTP(S) URL that the GET of object ``key`` (relative to the dataset) goes to."""
        if self._presigner is not None:
            bucket_key = self.base.split("://", 1)[1] + "/" + key
            bucket, _, obj = bucket_key.partition("/")
            return self._presigner.url(bucket, obj)
        return self.base + "/" + quote_key(key)

    def buffer_bytes(self, size: int) -> int:
        """A staging buffer and libcurl's receive buffer (no larger than the part) per part."""
        parts = (_parts(size) if self.ranges else []) or [(0, size)]
        return sum(WRITE_BUFFER + min(RECV_BUFFER, max(16 << 10, n)) for _, n in parts)

    def download_into(self, fd: int, key: str, size: int, *, url: str, shard: str,
                      cancel: threading.Event | None, on_bytes: Callable[[int], None] | None) -> int | None:
        """One attempt (See NOTE [transport choice] for what it raises); a whole GET's XXH64 (NOTE [native transport])."""
        target = self.target(key)
        parts = _parts(size) if self.ranges else []
        resigned = False
        while True:
            if cancel is not None and cancel.is_set():  # seen between the requests of an attempt too
                raise _fetch_error(FetchError, f"downloading {url} (shard {shard!r}): cancelled", url, shard,
                                   errno.ECANCELED)
            r = _C.http_download(fd, target, size, parts=parts, headers=self.headers,
                                 connect_timeout=self.connect_timeout, stall_timeout=self.stall_timeout,
                                 write_buffer=WRITE_BUFFER, recv_buffer=RECV_BUFFER, ca_file=self.ca_file,
                                 cancel=cancel, on_bytes=on_bytes)
            if r["cancelled"]:
                raise _fetch_error(FetchError, f"downloading {url} (shard {shard!r}): cancelled", url, shard,
                                   errno.ECANCELED)
            try:
                _judge(r["parts"], parts, size, url=url, shard=shard)
                digest: int | None = r["parts"][0]["xxh64"] if not parts else None
                return digest
            except _NoRanges:
                self.ranges = False  # the server sends whole objects: one GET from now on
                parts = []
            except _HttpStatus as e:
                if parts and is_throttle(e):
                    self.ranges = False  # a throttling store: one GET per object from now on (NOTE above)
                # A bucket in another region than the one signed for (no region configured):
                # sign for the region S3 names, once per attempt, as s3fs and boto do. An
                # endpoint that names yet another region then fails the attempt, which the
                # caller's attempts, deadline and host limit count (NOTE [fetch retries]).
                p = self._presigner
                if (p is None or resigned or not e.region or e.region == p.region
                        or not _REGION.fullmatch(e.region)):
                    raise
                resigned = True
                self._presigner = _S3Presigner(self._opts, region=e.region)
                target = self.target(key)


class _NoRanges(Exception):
    pass


def _changed(url: str, shard: str, size: int, actual: int | None) -> FetchError:
    what = f"is {actual} bytes, not the manifest's {size}" if actual is not None and actual < size else \
        f"is larger than the manifest's {size} bytes"
    return _fetch_error(RemoteChangedError, f"{url}: shard {shard!r} {what}: the object changed after the manifest "
                        "was read; re-open the dataset to read the new manifest", url, shard)


def _judge(results: list[dict[str, Any]], parts: list[tuple[int, int]], size: int, *, url: str, shard: str) -> None:
    """Raises the failure of one native attempt, if any (See NOTE [transport choice])."""
    ended = [p for p in results if p["curl_code"] >= 0]
    for p in ended:  # what the object is decides first: a changed object is final
        wrong = p["wrong"]
        if not wrong:
            continue
        if p["wrong_kind"] == "redirect":  # See NOTE [redirects] in csrc/core/http_fetch.h
            raise _CurlPermanent(f"{wrong} (after {p['redirects']} redirects)")
        if parts and p["wrong_kind"] == "range":
            raise _NoRanges()
        if p["range_total"] >= 0 and p["range_total"] != size:
            raise _changed(url, shard, size, p["range_total"])
        raise _changed(url, shard, size, None)
    for p in ended:  # a whole object shorter than the manifest: See NOTE [fetch retries]
        if not parts and p["status"] == 200 and 0 <= p["content_length"] < size:
            raise size_mismatch(url, shard, size, p["content_length"])
    for p in ended:
        if p["write_errno"]:
            raise _LocalWriteError(p["write_errno"], os.strerror(p["write_errno"]))
    for p in ended:
        if p["curl_code"] == 0 and not 200 <= p["status"] <= 299:
            raise _HttpStatus(p["status"], p["retry_after"], p["error_body"], p["bucket_region"])
    for p in ended:
        code = p["curl_code"]
        if code > 0:
            if p["status"] and not 200 <= p["status"] <= 299 and p["status"] not in (301, 302, 303, 307, 308):
                raise _HttpStatus(p["status"], p["retry_after"], p["error_body"], p["bucket_region"])
            msg = f"libcurl error {code}: {p['curl_error']}"
            if (m := _PROXY_REFUSED.search(p["curl_error"])) is not None:  # the proxy's status, as aiohttp's
                raise _HttpStatus(int(m.group(1)), "", f"the proxy refused the CONNECT tunnel ({msg})".encode())
            if code == _CURL_TIMEOUT:
                raise TimeoutError(msg)
            if code == _CURL_PARTIAL:  # the body cut before its Content-Length: as fsspec's (fs.download_into)
                n = next((n for (_, n), q in zip(parts, results) if q is p), size)
                raise _ShortBody(f"the body ended after {p['written']} of {n} bytes")
            if code == _CURL_COULDNT_CONNECT:
                raise _CurlRefused(errno.ECONNREFUSED, msg)
            if code in _CURL_TRANSIENT:
                raise _CurlError(msg)
            raise _CurlPermanent(msg)
    expected = [n for _, n in parts] if parts else [size]
    if len(ended) < len(results):  # stopped unfinished without a failure: cannot happen but never pass it
        raise _CurlError("the transfer stopped before its end")
    for p, n in zip(results, expected):
        if p["written"] < n:
            raise _ShortBody(f"the body ended after {p['written']} of {n} bytes")


class _S3Presigner:
    """Presigned GET URLs for ``s3://`` objects, from botocore and s3fs-style ``storage_options``."""

    def __init__(self, opts: dict[str, Any], region: str | None = None) -> None:
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config

        client_kw = dict(opts.get("client_kwargs") or {})
        endpoint = opts.get("endpoint_url") or client_kw.pop("endpoint_url", None) \
            or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = region or client_kw.pop("region_name", None)
        client_kw.pop("region_name", None)
        session = botocore.session.Session(profile=opts.get("profile"))
        self.region = region or session.get_config_variable("region") or "us-east-1"
        cfg: dict[str, Any] = dict(opts.get("config_kwargs") or {})
        cfg.setdefault("signature_version", UNSIGNED if opts.get("anon") else "s3v4")
        if endpoint:
            cfg.setdefault("s3", {"addressing_style": "path"})
        self.client = session.create_client(
            "s3", endpoint_url=endpoint, region_name=self.region,
            aws_access_key_id=opts.get("key") or client_kw.pop("aws_access_key_id", None),
            aws_secret_access_key=opts.get("secret") or client_kw.pop("aws_secret_access_key", None),
            aws_session_token=opts.get("token") or client_kw.pop("aws_session_token", None),
            config=Config(**cfg), **{k: v for k, v in client_kw.items() if k == "verify"})
        self.params = {"RequestPayer": "requester"} if opts.get("requester_pays") else {}

    def url(self, bucket: str, key: str) -> str:
        u: str = self.client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key, **self.params},
                                                   ExpiresIn=3600)
        return u


def native_unsupported(url: str, storage_options: dict[str, Any] | None) -> str | None:
    """Why the native transport cannot serve ``url`` with these options, or None (NOTE [transport choice])."""
    proto = url.split("://", 1)[0].lower() if "://" in url else "file"
    if proto not in _CURL_NATIVE_PROTOCOLS:
        return f"the native transport serves {', '.join(_CURL_NATIVE_PROTOCOLS)} URLs, not {proto}://"
    ok, why = _C.http_available()
    if not ok:
        return why
    opts = {k: v for k, v in (storage_options or {}).items() if k not in _NEUTRAL_KEYS}
    if proto in ("http", "https"):
        extra = sorted(set(opts) - {"headers"})
        headers = opts.get("headers") or {}
        if extra:
            return f"storage_options {extra} are aiohttp/fsspec settings the native transport does not translate"
        if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) and "\n" not in k + v
                                                    and "\r" not in k + v for k, v in headers.items()):
            return "storage_options['headers'] must be a dict of one-line strings"
        return None
    extra = sorted(set(opts) - _S3_KEYS)
    client_extra = sorted(set(opts.get("client_kwargs") or {}) - _S3_CLIENT_KEYS)
    config_extra = sorted(f"config_kwargs[{k!r}]" for k in set(opts.get("config_kwargs") or {}) - _S3_CONFIG_KEYS)
    if extra or client_extra or config_extra:
        return (f"storage_options {extra + client_extra + config_extra} are s3fs settings the native transport "
                "does not translate")
    verify = (opts.get("client_kwargs") or {}).get("verify")
    if verify is not None and not (isinstance(verify, str) and verify) and verify is not True:
        return "client_kwargs['verify'] turns TLS verification off, which the native transport never does"
    try:
        import botocore  # noqa: F401
    except ImportError:
        return "botocore is not installed"
    return None


def transport_for(url: str, storage_options: dict[str, Any] | None, *, stall_timeout: float,
                  setting: str | None = None) -> Transport:
    """The transport of dataset ``url`` (NOTE [transport choice]); ValueError for ``native`` where it cannot serve."""
    setting = setting or transport_setting()
    if setting != "fsspec":
        why = native_unsupported(url, storage_options)
        if why is None:
            return NativeTransport(url, storage_options, connect_timeout=max(stall_timeout, 1.0),
                                   stall_timeout=stall_timeout)
        if setting == "native":
            raise ValueError(f"PYLOADER_TRANSPORT=native cannot download {url}: {why}; unset PYLOADER_TRANSPORT "
                             "(auto) to use fsspec for it")
    return FsspecTransport(url, storage_options, stall_timeout)


__all__ = ["TRANSPORTS", "RANGE_MIN", "PART_MIN", "MAX_PARTS", "WRITE_BUFFER", "RECV_BUFFER", "Transport", "FsspecTransport",
           "NativeTransport", "transport_setting", "native_unsupported", "transport_for"]
