"""What a failed fetch's message says (NOTE [fetch retries] in ``fs.py``): the failure, the fix.

``detail_of`` names one failed attempt without an internal class name; ``GAVE_UP_FIX`` is
the one action that fixes each kind of failure once the retries end; ``size_mismatch``
is the error of a remote object whose length is not the manifest's (never retried).
"""

from __future__ import annotations

import errno

from ..errors import FetchError, RemoteChangedError

__all__ = ["GAVE_UP_FIX", "detail_of", "permanent_fix", "size_mismatch"]

GAVE_UP_FIX = {
    "refused": "check that the server is running and that the URL's host and port are right, then run again",
    "short": "the server cut the body short each time; check the server (or a proxy on the way), then run again",
    "transient": "check that the host is up and reachable from here, then run again",
}


def detail_of(e: BaseException, kind: str, unframed: BaseException | None = None) -> str:
    """What one failed attempt (``e``, of failure ``kind``) was; ``unframed``: aiohttp's parser error under it."""
    if kind == "refused":
        return "cannot connect: the connection was refused or the host is unreachable (nothing accepts it there)"
    if unframed is not None:
        return (f"the server's answer is not valid HTTP ({getattr(unframed, 'message', '') or type(unframed).__name__}"
                "): bytes past a body's Content-Length, or not an HTTP server")
    name = type(e).__name__
    if name.startswith("_"):
        return str(e) or "the attempt failed"
    return f"{name}: {e}" if str(e) else name


# What a client raises when it finds no credentials to sign with (botocore's, google-auth's names).
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "NoAuthTokenError",
                   "DefaultCredentialsError"}


def permanent_fix(chain: list[BaseException], kind: str) -> str:
    """The fix for a failure no retry changes, from its cause ``chain`` and its ``kind`` ("" if none is known)."""
    if any(type(x).__name__ in _NO_CREDENTIALS for x in chain):
        return ("; give credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE for s3:// "
                "(GOOGLE_APPLICATION_CREDENTIALS for gs://), or storage_options (--storage-options in the CLI)")
    if kind == "forbidden":
        return "; check that the credentials given may read it"
    return ""


def size_mismatch(url: str, shard: str | None, size: int, actual: int) -> FetchError:
    """The error of a remote object whose length (``actual``) is not the manifest's ``size``: not retried."""
    e = RemoteChangedError(errno.EIO, f"{url}: the server's object (shard {shard!r}) is {actual} bytes, not the "
                           f"manifest's {size} (not retried: a retry gets the same object): the object or the "
                           "manifest changed after the dataset was written; upload the shard again, or re-open the "
                           "dataset if a new manifest was written")
    e.url, e.shard = url, shard
    return e
