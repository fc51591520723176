"""Redirects on the native transport: the caller's headers stay with the origin they were given for.

NOTE [redirects] in csrc/core/http_fetch.h. Real loopback servers: A (the dataset's origin)
and B (another port of 127.0.0.1: another origin), and an HTTPS server with a certificate
made here. Each test asserts what every server received (paths and headers), the bytes
written, and the kind of error.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from remote_servers import Fault, FaultServer

import pyloader._C as _C
from pyloader.remote import transport as tr
from pyloader.remote.fs import RetryPolicy, with_retries

pytestmark = [pytest.mark.skipif(not _C.http_available()[0], reason="no libcurl.so.4 here"),
              pytest.mark.timeout(60)]

KEY = "ds/shard-000001.pyl"
SECRET = {"X-Api-Key": "k-123", "Private-Token": "t-456"}


def native(url: str) -> tr.NativeTransport:
    t = tr.transport_for(url, {"headers": SECRET}, stall_timeout=2)
    assert isinstance(t, tr.NativeTransport)
    return t


def get(t: tr.Transport, tmp_path, key: str, size: int) -> bytes:
    path = str(tmp_path / "out")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t.download_into(fd, key, size, url=f"url/{key}", shard=key, cancel=None, on_bytes=None)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        return f.read()


def secrets_seen(server: FaultServer) -> list[str]:
    return [f"{path}: {k}" for path, h in server.request_headers for k in ("x-api-key", "private-token") if k in h]


@pytest.fixture
def other(srv_root):
    with FaultServer(srv_root, max_life=60) as s:
        yield s


def test_same_origin_redirect_keeps_the_headers(server, srv_root, tmp_path):
    size = os.path.getsize(os.path.join(srv_root, KEY))
    server.inject(KEY, Fault("redirect", data=f"{server.url}/{KEY}?moved=1".encode()))
    with open(os.path.join(srv_root, KEY), "rb") as f:
        assert get(native(server.url), tmp_path, KEY, size) == f.read()
    assert len(server.request_headers) == 2
    assert all(h.get("x-api-key") == "k-123" for _, h in server.request_headers)


def test_another_origin_gets_no_header(server, other, srv_root, tmp_path):
    size = os.path.getsize(os.path.join(srv_root, KEY))
    server.inject(KEY, Fault("redirect", data=f"{other.url}/{KEY}".encode()))
    with open(os.path.join(srv_root, KEY), "rb") as f:
        assert get(native(server.url), tmp_path, KEY, size) == f.read()  # followed, without the keys
    assert [p for p, _ in server.request_headers] == [f"/{KEY}"] and secrets_seen(server) == [f"/{KEY}: x-api-key",
                                                                                            f"/{KEY}: private-token"]
    assert [p for p, _ in other.request_headers] == [f"/{KEY}"]
    assert secrets_seen(other) == []
    # and not when B sends it back to A either: once away, the keys stay home for this request
    server.request_headers.clear()
    other.request_headers.clear()
    server.inject(KEY, Fault("redirect", data=f"{other.url}/{KEY}".encode()))
    other.inject(KEY, Fault("redirect", data=f"{server.url}/{KEY}?back=1".encode()))
    get(native(server.url), tmp_path, KEY, size)
    assert len(server.request_headers) == 2 and "x-api-key" not in server.request_headers[1][1]


def test_a_redirect_loop_ends_after_five_hops(server, srv_root, tmp_path):
    size = os.path.getsize(os.path.join(srv_root, KEY))
    server.inject(KEY, Fault("redirect", data=f"{server.url}/{KEY}".encode(), times=None))
    policy = RetryPolicy.from_env()
    with pytest.raises(Exception, match="redirected more than 5 times") as ei:
        with_retries(lambda: get(native(server.url), tmp_path, KEY, size), policy, what="downloading", url="u",
                     shard=KEY)
    assert not isinstance(ei.value, ConnectionError)  # permanent: not retried
    assert server.count(KEY) == 6  # the request and 5 redirects, one attempt
    assert (tmp_path / "out").read_bytes() == b""


def _certificate(tmp_path) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


def test_https_to_plain_http_is_refused(other, srv_root, tmp_path, monkeypatch):
    cert, key = _certificate(tmp_path)
    seen: list[dict[str, str]] = []
    target = f"{other.url}/{KEY}"

    class Redirect(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: object) -> None:
            pass

        def do_GET(self) -> None:
            seen.append({k.lower(): v for k, v in self.headers.items()})
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    timer = threading.Timer(50, httpd.shutdown)
    timer.start()
    try:
        for name in tr._CA_VARIABLES:  # the bundle the transport reads is this test's certificate
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("SSL_CERT_FILE", cert)
        t = native(f"https://127.0.0.1:{httpd.server_address[1]}")
        size = os.path.getsize(os.path.join(srv_root, KEY))
        with pytest.raises(Exception, match="from https to plain http") as ei:
            get(t, tmp_path, KEY, size)
        assert not isinstance(ei.value, ConnectionError)
        assert len(seen) == 1 and seen[0].get("x-api-key") == "k-123"  # the origin got them, over TLS
        assert other.request_headers == []  # plain http was never asked
        assert (tmp_path / "out").read_bytes() == b""
    finally:
        timer.cancel()
        httpd.shutdown()
        httpd.server_close()
