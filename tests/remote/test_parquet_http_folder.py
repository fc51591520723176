"""ParquetDataset over a folder served by plain HTTP: the listing has no sizes, so they are asked for."""

from __future__ import annotations

import functools
import http.server
import threading
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
