"""The native transport (NOTE [transport choice]): the same bytes and the same failures as fsspec's,
against real loopback servers (the fault-injecting HTTP server, moto's S3)."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
from remote_servers import Fault, FaultServer
from remote_util import labels

import pyloader
import pyloader._C as _C
from pyloader.errors import FetchError, FetchNotFoundError, RemoteChangedError
from pyloader.remote import transport as tr
from pyloader.remote.fetch import open_remote
from pyloader.remote.fs import RetryPolicy, is_throttle, with_retries

pytestmark = pytest.mark.skipif(not _C.http_available()[0], reason="no libcurl.so.4 here")

BIG = "big/blob.bin"


@pytest.fixture
def big(srv_root) -> bytes:
    data = os.urandom(3 << 20)
    os.makedirs(os.path.join(srv_root, "big"), exist_ok=True)
    with open(os.path.join(srv_root, BIG), "wb") as f:
        f.write(data)
    return data


@pytest.fixture
def small_ranges(monkeypatch):
    """Objects of 1 MiB and up fetched as ranged parts of 512 KiB: a 3 MiB object is 6 parts."""
    monkeypatch.setattr(tr, "RANGE_MIN", 1 << 20)
    monkeypatch.setattr(tr, "PART_MIN", 512 << 10)


def _native(server: FaultServer) -> tr.NativeTransport:
    t = tr.transport_for(server.url, None, stall_timeout=1)
    assert isinstance(t, tr.NativeTransport)
    return t


def _get(t: tr.Transport, tmp_path, key: str, size: int, **kw) -> bytes:
    path = str(tmp_path / "out")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t.download_into(fd, key, size, url=f"url/{key}", shard=key, cancel=kw.pop("cancel", None),
                        on_bytes=kw.pop("on_bytes", None))
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        return f.read()


def _ranged_gets(server: FaultServer, path: str, at_least: int = 0) -> list[int]:
    """The statuses of the GETs of ``path`` the server logged (it logs after the body: wait for ``at_least``)."""
    end = time.monotonic() + 5
    while True:
        got = [st for _, m, p, st in server.log if m == "GET" and p == "/" + path]
        if len(got) >= at_least or time.monotonic() > end:
            return got
        time.sleep(0.01)


# -- the choice ------------------------------------------------------------------------------
def test_the_choice_follows_the_url_options_and_setting(server, monkeypatch):
    assert tr.transport_for(server.url + "/ds", None, stall_timeout=1).name == "native"
    assert tr.transport_for("s3://bucket/ds", {"key": "k", "secret": "s", "skip_instance_cache": True},
                            stall_timeout=1).name == "native"
    # What the native client does not translate goes through fsspec, as does any other protocol.
    assert tr.transport_for(server.url + "/ds", {"client_kwargs": {"trust_env": True}}, stall_timeout=1).name == \
        "fsspec"
    assert tr.transport_for("memory://ds", None, stall_timeout=1).name == "fsspec"
    # s3fs options: a CA bundle in client_kwargs["verify"] reaches libcurl; verification off, or a
    # botocore Config the download would ignore (proxies, timeouts), goes through fsspec.
    s3 = {"key": "k", "secret": "s"}
    t = tr.transport_for("s3://bucket/ds", {**s3, "client_kwargs": {"verify": "/etc/my-ca.pem"}}, stall_timeout=1)
    assert t.name == "native" and isinstance(t, tr.NativeTransport) and t.ca_file == "/etc/my-ca.pem"
    assert tr.transport_for("s3://bucket/ds", {**s3, "client_kwargs": {"verify": False}}, stall_timeout=1).name == \
        "fsspec"
    assert tr.transport_for("s3://bucket/ds", {**s3, "config_kwargs": {"proxies": {"https": "p:1"}}},
                            stall_timeout=1).name == "fsspec"
    assert tr.transport_for("s3://bucket/ds", {**s3, "config_kwargs": {"signature_version": "s3v4"}},
                            stall_timeout=1).name == "native"
    monkeypatch.setenv("PYLOADER_TRANSPORT", "fsspec")
    assert tr.transport_for(server.url + "/ds", None, stall_timeout=1).name == "fsspec"
    monkeypatch.setenv("PYLOADER_TRANSPORT", "native")
    with pytest.raises(ValueError, match=r"PYLOADER_TRANSPORT=native cannot download memory://ds: .*memory://"):
        tr.transport_for("memory://ds", None, stall_timeout=1)
    monkeypatch.setenv("PYLOADER_TRANSPORT", "curl")
    with pytest.raises(ValueError, match="PYLOADER_TRANSPORT must be one of auto, native, fsspec, got 'curl'"):
        tr.transport_for(server.url + "/ds", None, stall_timeout=1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", ["native", "fsspec"])
def test_a_dataset_reads_the_same_through_either_transport(server, cache_dir, monkeypatch, setting):
    monkeypatch.setenv("PYLOADER_TRANSPORT", setting)
    ds = pyloader.ShardDataset(server.url + "/ds", cache_dir=cache_dir, shuffle=True)
    assert ds._remote.transport().name == setting
    assert labels(ds) == list(range(300))


# -- bytes -----------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_large_objects_come_as_parallel_ranged_gets(server, big, small_ranges, tmp_path):
    t = _native(server)
    seen: list[int] = []
    assert _get(t, tmp_path, BIG, len(big), on_bytes=seen.append) == big
    assert _ranged_gets(server, BIG, 6) == [206] * 6
    assert sum(seen) == len(big)
    # each part: a staging buffer, and libcurl's receive buffer no larger than the part (512 KiB)
    assert t.buffer_bytes(len(big)) == 6 * (tr.WRITE_BUFFER + (512 << 10))
    assert t.buffer_bytes(64 << 20) == 8 * (tr.WRITE_BUFFER + tr.RECV_BUFFER)


@pytest.mark.timeout(60)
def test_a_whole_get_hashes_every_byte_whatever_pieces_it_comes_in(server, srv_root, tmp_path):
    # The hash is taken as libcurl's pieces are staged (NOTE [native transport]): pieces that end
    # mid-stripe, objects shorter than a stripe, staging buffers that fill mid-piece.
    t = _native(server)
    os.makedirs(os.path.join(srv_root, "odd"), exist_ok=True)
    for size in (1, 31, 32, 33, 16 << 10 | 5, (1 << 20) - 3, (3 << 20) + 7):
        data = os.urandom(size)
        with open(os.path.join(srv_root, "odd", str(size)), "wb") as f:
            f.write(data)
        fd = os.open(str(tmp_path / "out"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            digest = t.download_into(fd, f"odd/{size}", size, url="u", shard="s", cancel=None, on_bytes=None)
        finally:
            os.close(fd)
        assert (tmp_path / "out").read_bytes() == data, size
        assert digest == _C.xxh64(data), size


@pytest.mark.timeout(60)
def test_a_server_without_ranges_gets_whole_gets_from_then_on(server, srv_root, big, small_ranges, tmp_path):
    t = _native(server)
    server.inject(BIG, Fault("norange", times=None))
    assert _get(t, tmp_path, BIG, len(big)) == big
    assert not t.ranges
    n = len(_ranged_gets(server, BIG, 7))  # 6 ranged GETs answered whole, then one whole GET
    fd = os.open(str(tmp_path / "whole"), os.O_RDWR | os.O_CREAT, 0o644)
    try:  # a whole GET hashes its bytes on the way (NOTE [native transport]): the cache reads nothing back
        assert t.download_into(fd, BIG, len(big), url="u", shard="s", cancel=None, on_bytes=None) == _C.xxh64(big)
    finally:
        os.close(fd)
    open(os.path.join(srv_root, "big", "empty"), "wb").close()
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        assert t.download_into(fd, "big/empty", 0, url="u", shard="s", cancel=None, on_bytes=None) == _C.xxh64(b"")
    finally:
        os.close(fd)
    assert _ranged_gets(server, BIG, n + 1)[n:] == [200]  # one GET of the whole object


@pytest.mark.timeout(60)
def test_a_throttling_server_gets_whole_gets_from_then_on(server, big, small_ranges, tmp_path):
    t = _native(server)
    server.inject(BIG, Fault("status", status=503, retry_after="0"))  # one of the 6 parts is throttled
    with pytest.raises(Exception) as e:
        _get(t, tmp_path, BIG, len(big))
    assert is_throttle(e.value)
    assert not t.ranges
    assert _get(t, tmp_path, BIG, len(big)) == big
    # The 6 parts of the throttled attempt, then one GET of the whole object.
    assert sorted(_ranged_gets(server, BIG, 7)) == [200] + [206] * 5 + [503]


@pytest.mark.timeout(60)
def test_an_object_of_another_size_is_a_changed_object(server, big, small_ranges, tmp_path):
    t = _native(server)
    # Ranged: the Content-Range total tells the object's real size, before any byte is written.
    with pytest.raises(RemoteChangedError, match=rf"is {len(big)} bytes, not the manifest's {len(big) + 1}"):
        _get(t, tmp_path, BIG, len(big) + 1)
    with pytest.raises(RemoteChangedError, match=f"is larger than the manifest's {len(big) - 1} bytes"):
        _get(t, tmp_path, BIG, len(big) - 1)
    # Whole: a Content-Length above the size is refused before the body; below it is a short body.
    t.ranges = False
    with pytest.raises(RemoteChangedError, match="is larger than the manifest's 1000 bytes"):
        _get(t, tmp_path, BIG, 1000)
    assert os.path.getsize(tmp_path / "out") == 0


@pytest.mark.timeout(60)
def test_failures_keep_their_kind(server, srv_root, tmp_path):
    t = _native(server)
    size = os.path.getsize(os.path.join(srv_root, "ds", "shard-000001.pyl"))
    key = "ds/shard-000001.pyl"

    def attempt_kind(*faults: Fault) -> tuple[bool, float | None]:
        from pyloader.remote.fs import classify

        server.inject(key, *faults)
        try:
            _get(t, tmp_path, key, size)
        except Exception as e:  # noqa: BLE001 - classified below
            return classify(e)
        raise AssertionError("the attempt succeeded")

    assert attempt_kind(Fault("status", status=503, retry_after="7")) == (True, 7.0)
    assert attempt_kind(Fault("status", status=500)) == (True, None)
    assert attempt_kind(Fault("status", status=403)) == (False, None)
    # libcurl sends a request again, once, on a fresh connection when a kept-alive one
    # dies before any answer (it may have gone stale): two resets reach the caller.
    assert attempt_kind(Fault("reset", times=2)) == (True, None)
    assert attempt_kind(Fault("truncate")) == (False, None)  # a short Content-Length: another object
    assert attempt_kind(Fault("drop")) == (True, None)
    with pytest.raises(FetchNotFoundError):
        with_retries(lambda: _get(t, tmp_path, "ds/missing.pyl", 10), RetryPolicy.from_env(), what="downloading",
                     url="u", shard="missing.pyl")


@pytest.mark.timeout(60)
def test_redirects_stay_on_http(server, srv_root, tmp_path):
    t = _native(server)
    key = "ds/shard-000001.pyl"
    size = os.path.getsize(os.path.join(srv_root, key))
    server.inject(key, Fault("redirect", data=f"{server.url}/ds/shard-000001.pyl?again=1".encode()))
    with open(os.path.join(srv_root, key), "rb") as f:
        assert _get(t, tmp_path, key, size) == f.read()
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * size)
    server.inject(key, Fault("redirect", data=f"file://{secret}".encode()))
    with pytest.raises(Exception, match="redirected to a URL that is not http or https") as ei:
        _get(t, tmp_path, key, size)
    assert not isinstance(ei.value, ConnectionError)  # permanent: a retry does not change a protocol
    assert (tmp_path / "out").read_bytes() == b""


@pytest.mark.timeout(60)
def test_a_cancel_ends_a_stalled_download_at_once(server, big, tmp_path):
    t = _native(server)
    server.inject(BIG, Fault("stall", seconds=30))
    t.stall_timeout = 20
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(FetchError) as ei:
        _get(t, tmp_path, BIG, len(big), cancel=cancel)
    assert ei.value.errno == errno.ECANCELED and time.monotonic() - t0 < 3


@pytest.mark.timeout(60)
def test_a_forked_child_makes_its_own_connections(server, srv_root, tmp_path):
    t = _native(server)
    key = "ds/shard-000001.pyl"
    size = os.path.getsize(os.path.join(srv_root, key))
    with open(os.path.join(srv_root, key), "rb") as f:
        want = f.read()
    assert _get(t, tmp_path, key, size) == want  # this thread now keeps a connection open
    (tmp_path / "child").mkdir()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if _get(t, tmp_path / "child", key, size) == want else 2
        except BaseException:  # noqa: BLE001 - the exit code says it
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _get(t, tmp_path, key, size) == want  # the parent's connection was not disturbed


# -- S3 ----------------------------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_s3_through_presigned_urls(srv_root, cache_dir):
    pytest.importorskip("moto.server")
    import boto3
    from remote_servers import S3Server

    srv = S3Server(max_life=80).start()
    try:
        opts = srv.storage_options()
        s3 = boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                          aws_secret_access_key="testing")
        s3.create_bucket(Bucket="transport")  # moto's buckets outlive its server: a name of its own
        src = os.path.join(srv_root, "ds")
        for name in sorted(os.listdir(src)):
            s3.upload_file(os.path.join(src, name), "transport", f"ds/{name}")
        d = open_remote("s3://transport/ds", cache_dir=cache_dir, storage_options=opts)
        assert d.transport().name == "native"
        assert d.ensure(3) == (d.shard_file(3), True)
        with open(d.shard_file(3), "rb") as f, open(os.path.join(src, d.shards[3]["path"]), "rb") as g:
            assert f.read() == g.read()
        s3.delete_object(Bucket="transport", Key="ds/" + d.shards[4]["path"])
        with pytest.raises(FetchNotFoundError, match=r"s3://transport/ds/shard-000004.pyl.*NoSuchKey.*permanent"):
            d.ensure(4)
    finally:
        srv.stop()


@pytest.mark.timeout(60)
def test_s3_signs_again_for_the_region_the_bucket_is_in(server, srv_root, tmp_path):
    pytest.importorskip("botocore")
    key = "shard-000001.pyl"  # bucket "ds", path-style on the fault server
    size = os.path.getsize(os.path.join(srv_root, "ds", key))
    t = tr.transport_for("s3://ds", {"key": "k", "secret": "s", "endpoint_url": server.url,
                                     "client_kwargs": {"region_name": "us-east-1"}}, stall_timeout=1)
    assert isinstance(t, tr.NativeTransport)
    wrong = (b"<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region 'us-east-1' is wrong; "
             b"expecting '%s'</Message><Region>%s</Region></Error>")
    server.inject("ds/" + key, Fault("status", status=400, data=wrong % (b"eu-west-2", b"eu-west-2")))
    with open(os.path.join(srv_root, "ds", key), "rb") as f:
        assert _get(t, tmp_path, key, size) == f.read()
    assert "eu-west-2" in t.target(key) and t._presigner is not None and t._presigner.region == "eu-west-2"
    # A region that is no region is not signed for: the error stands.
    server.inject("ds/" + key, Fault("status", status=400, data=wrong % (b"x/../y", b"x/../y")))
    with pytest.raises(Exception, match="HTTP 400 .AuthorizationHeaderMalformed"):
        _get(t, tmp_path, key, size)


@pytest.mark.timeout(60)
def test_an_endpoint_naming_regions_in_turn_costs_two_requests_an_attempt(server, srv_root, tmp_path, monkeypatch):
    """Re-signing for the region S3 names happens once per attempt; the attempts bound the rest."""
    pytest.importorskip("botocore")
    key = "shard-000001.pyl"
    size = os.path.getsize(os.path.join(srv_root, "ds", key))
    t = tr.transport_for("s3://ds", {"key": "k", "secret": "s", "endpoint_url": server.url,
                                     "client_kwargs": {"region_name": "us-east-1"}}, stall_timeout=1)
    wrong = (b"<Error><Code>AuthorizationHeaderMalformed</Code><Message>wrong region</Message>"
             b"<Region>%s</Region></Error>")
    server.inject("ds/" + key, *[Fault("status", status=400, data=wrong % r) for r in
                                 [b"eu-west-2", b"us-west-1"] * 50])
    with pytest.raises(Exception, match="AuthorizationHeaderMalformed"):
        _get(t, tmp_path, key, size)
    assert server.count("ds/" + key) == 2  # the request and one re-signed request: the attempt ends
    monkeypatch.setenv("PYLOADER_FETCH_ATTEMPTS", "3")
    monkeypatch.setenv("PYLOADER_FETCH_BACKOFF", "0.01")
    with pytest.raises(Exception, match="AuthorizationHeaderMalformed"):
        with_retries(lambda: _get(t, tmp_path, key, size), RetryPolicy.from_env(), what="downloading", url="u",
                     shard=key)
    assert server.count("ds/" + key) <= 2 + 3 * 2
    # a cancel set while the requests of an attempt go on is seen before the next one
    before = server.count("ds/" + key)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(FetchError) as ei:
        _get(t, tmp_path, key, size, cancel=cancel)
    assert ei.value.errno == errno.ECANCELED and server.count("ds/" + key) == before
