"""ParquetDataset over a folder served by plain HTTP: the listing has no sizes, so they are asked for."""

from __future__ import annotations

import functools
import http.server
import threading
import urllib.parse
from collections.abc import Iterator

import pytest

import pyloader

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    no_length = False

    def log_message(self, *a: object) -> None:
        pass

    def send_header(self, key: str, value: str) -> None:
        if self.no_length and key.lower() == "content-length" and self.path.endswith(".parquet"):
            return
        super().send_header(key, value)


@pytest.fixture
def folder_server(tmp_path) -> Iterator[tuple[str, type[_Quiet]]]:
    root = tmp_path / "www"
    (root / "data").mkdir(parents=True)
    for k in range(3):
        pq.write_table(pa.table({"x": pa.array(range(10 * k, 10 * k + 10), pa.int64())}),
                       str(root / "data" / f"part-{k}.parquet"), row_group_size=4)
    handler = type("Handler", (_Quiet,), {})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)


@pytest.mark.timeout(120)
def test_a_folder_over_http_is_listed_and_read(folder_server, tmp_path) -> None:
    url, _ = folder_server
    ds = pyloader.ParquetDataset(url + "/data/", cache_dir=str(tmp_path / "cache"))
    assert ds.num_records == 30 and len(ds.files) == 3
    got = sorted(int(v) for b in ds.batches(8) for v in b["x"])
    assert got == list(range(30))


@pytest.mark.timeout(120)
def test_a_folder_whose_sizes_cannot_be_learned_says_what_to_do(folder_server, tmp_path) -> None:
    url, handler = folder_server
    handler.no_length = True
    with pytest.raises(pyloader.ParquetReadError, match="does not give the size") as ei:
        pyloader.ParquetDataset(url + "/data/", cache_dir=str(tmp_path / "cache"))
    assert "part-0.parquet" in str(ei.value) and "copy the folder" in str(ei.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["native", "fsspec"])
def test_files_named_with_spaces_and_percent_signs_are_read_by_their_names(tmp_path, monkeypatch, transport) -> None:
    """The listing's hrefs are quoted; the files are asked for by their own names on both transports."""
    import pyloader._C as _C

    if transport == "native" and not _C.http_available()[0]:
        pytest.skip("no libcurl.so.4 here")
    monkeypatch.setenv("PYLOADER_TRANSPORT", transport)
    root = tmp_path / "www"
    (root / "data").mkdir(parents=True)
    names = ["a b.parquet", "a%20b.parquet", "100%.parquet", "x#y.parquet"]
    for k, name in enumerate(names):  # "a b" and "a%20b" are two files: the second must not be read as the first
        pq.write_table(pa.table({"x": pa.array(range(10 * k, 10 * k + 10 + k), pa.int64())}), str(root / "data" / name))
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/data/"
        ds = pyloader.ParquetDataset(url, cache_dir=str(tmp_path / "cache"))
        assert sorted(urllib.parse.unquote(f.rsplit("/", 1)[1]) for f in ds.files) == sorted(names)
        got = sorted(int(v) for b in ds.batches(8) for v in b["x"])
        assert got == sorted(v for k in range(len(names)) for v in range(10 * k, 10 * k + 10 + k))
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(10)
