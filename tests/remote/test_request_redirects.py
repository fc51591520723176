"""Redirects of the requests that are not downloads: a manifest, a Parquet file's size, a dataset opened.

NOTE [fsspec redirects] in pyloader/remote/fs.py: aiohttp follows these redirects itself, so
the rule is held by a trace on every request of the filesystem ``filesystem()`` makes. Each
test asserts what every loopback server received (paths and headers) and the error's kind.
"""

from __future__ import annotations

import os
import ssl

import pytest
from remote_servers import Fault, FaultServer
from remote_util import fetch_policy
from test_hostile_servers import DATA, KEY, SECRET, Hostile, head, leaked, permanent, redirect_to, serve_ranges

from pyloader.remote import transport as tr
from pyloader.remote.fs import RetryPolicy, filesystem, read_object, with_retries

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def policy(monkeypatch) -> RetryPolicy:
    return fetch_policy(monkeypatch, stall_timeout=2, attempts=3, backoff=0.01)


def read(url: str, policy: RetryPolicy, opts: dict | None = None) -> tuple[bytes | None, BaseException | None]:
    try:
        return read_object(url, {"headers": SECRET, **(opts or {})}, policy), None
    except Exception as e:  # noqa: BLE001 - the test looks at its kind
        return None, e


def test_a_manifest_redirected_to_another_origin_gets_no_header(policy):
    with Hostile(lambda h, s: serve_ranges(h, DATA)) as other:
        with Hostile(redirect_to(lambda: f"{other.url}/{KEY}", times=1)) as srv:
            got, err = read(f"{srv.url}/{KEY}", policy)
    assert err is None and got == DATA
    assert leaked(srv) == [f"/{KEY}"]  # the origin got the key
    assert other.paths() == [f"/{KEY}"] and leaked(other) == []  # the other origin did not


def test_a_manifest_redirected_away_and_back_stays_without_the_header(policy):
    holder: list[Hostile] = []
    with Hostile(redirect_to(lambda: f"{holder[0].url}/{KEY}?back=1", times=1)) as other:
        with Hostile(lambda h, s: (serve_ranges(h, DATA) if s.requests[-1][0].endswith("back=1") else
                                   head(h, 302, Location=f"{other.url}/{KEY}", Content_Length="0"))) as srv:
            holder.append(srv)
            got, err = read(f"{srv.url}/{KEY}", policy)
    assert err is None and got == DATA
    assert srv.paths() == [f"/{KEY}", f"/{KEY}?back=1"] and leaked(srv) == [f"/{KEY}"]
    assert leaked(other) == []


def test_a_same_origin_manifest_redirect_keeps_the_header(policy):
    holder: list[Hostile] = []
    with Hostile(redirect_to(lambda: f"{holder[0].url}/{KEY}?moved=1", times=1)) as srv:
        holder.append(srv)
        got, err = read(f"{srv.url}/{KEY}", policy)
    assert err is None and got == DATA and len(leaked(srv)) == 2


def test_a_manifest_redirect_loop_ends_after_five_hops_and_is_not_retried(policy):
    holder: list[Hostile] = []
    with Hostile(redirect_to(lambda: f"{holder[0].url}/{KEY}")) as srv:
        holder.append(srv)
        got, err = read(f"{srv.url}/{KEY}", policy)
    assert permanent(err) and "redirected more than 5 times" in str(err), err
    assert srv.paths() == [f"/{KEY}"] * 6 and got is None  # one attempt: the request and five hops


def test_a_manifest_from_https_to_plain_http_is_refused(policy, tmp_path, monkeypatch):
    from test_redirects import _certificate

    cert = _certificate(tmp_path)
    for name in tr._CA_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with Hostile(lambda h, s: serve_ranges(h, DATA)) as other:
        with Hostile(redirect_to(lambda: f"{other.url}/{KEY}"), cert=cert) as srv:
            ctx = ssl.create_default_context(cafile=cert[0])
            got, err = read(f"{srv.url}/{KEY}", policy, {"ssl": ctx})
    assert permanent(err) and "from https to plain http" in str(err), err
    assert srv.paths() == [f"/{KEY}"] and other.requests == [] and got is None


def test_a_size_asked_of_a_redirecting_server_keeps_the_rule(policy):
    """A HEAD (what a remote Parquet dataset asks of each file) follows the same rule."""
    heads: list[dict[str, str]] = []
    with Hostile(lambda h, s: serve_ranges(h, DATA)) as other:
        handler = other.httpd.RequestHandlerClass

        def do_head(h) -> None:  # noqa: ANN001 - the handler's own method
            heads.append({k.lower(): v for k, v in h.headers.items()})
            head(h, 200, Content_Length=str(len(DATA)))

        handler.do_HEAD = do_head  # type: ignore[attr-defined]
        with Hostile(redirect_to(lambda: f"{other.url}/{KEY}")) as srv:
            srv.httpd.RequestHandlerClass.do_HEAD = lambda h: head(h, 302, Location=f"{other.url}/{KEY}",
                                                                    Content_Length="0")
            fs, path = filesystem(f"{srv.url}/{KEY}", {"headers": SECRET}, 2.0)
            info = with_retries(lambda: fs.info(path), policy, what="reading", url=path, shard=None)
    assert info["size"] == len(DATA)
    assert len(heads) == 1 and "x-api-key" not in heads[0]


def test_a_dataset_whose_manifest_moved_to_another_origin_opens_without_leaking(srv_root, tmp_path):
    with FaultServer(srv_root, max_life=60) as a, FaultServer(srv_root, max_life=60) as b:
        a.inject("/ds/manifest.json", Fault("redirect", data=f"{b.url}/ds/manifest.json".encode()))
        import pyloader

        ds = pyloader.ShardDataset(f"{a.url}/ds", cache_dir=str(tmp_path / "cache"),
                                   storage_options={"headers": SECRET})
        assert sorted(int(x) for batch in ds.batches(64) for x in batch["label"]) == list(range(len(ds)))
    assert [p for p, h in a.request_headers if p == "/ds/manifest.json" and h.get("x-api-key") == "k-123"]
    assert b.gets["/ds/manifest.json"] == 1
    assert [p for p, h in b.request_headers if "x-api-key" in h] == []
    assert os.listdir(tmp_path / "cache")


# -- the name a shard is asked for: the same bytes on the wire from both transports --------
ODD_KEYS = ["dir/a b.bin", "dir/100%.bin", "dir/a%20b.bin", "dir/x#y.bin", "dir/q?v=1.bin", "dir/ü.bin",
            "year=2024/m+n,o;p.bin"]


@pytest.mark.parametrize("transport", ["native", "fsspec"])
def test_a_shard_path_is_asked_for_as_its_literal_name(transport, policy, tmp_path):
    """A manifest's path is a name, not a URL: a '%' or '#' in it is part of the name, on both transports."""
    from test_hostile_servers import fetch, make

    import pyloader._C as _C

    if transport == "native" and not _C.http_available()[0]:
        pytest.skip("no libcurl.so.4 here")
    from urllib.parse import unquote

    files = {k: os.urandom(100 + i) for i, k in enumerate(ODD_KEYS)}

    def behave(h, s) -> None:  # noqa: ANN001 - the handler and the server
        data = files.get(unquote(h.path.lstrip("/")))
        if data is None:
            head(h, 404, Content_Length="0")
        else:
            head(h, 200, Content_Length=str(len(data)))
            h.wfile.write(data)

    with Hostile(behave) as srv:
        for key, data in files.items():
            took, err, got = fetch(make(transport, srv.url), srv.url, len(data), policy, tmp_path, key=key)
            assert err is None and got == data, (key, err)
    assert len(srv.requests) == len(files)
