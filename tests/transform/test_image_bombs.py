"""Decompression bombs: an image header that claims gigabytes is refused before anything is allocated.

NOTE [pixel limit] in csrc/core/jpeg_decode.h. A JPEG of a few hundred bytes whose frame
header says 20000 x 20000, or a PNG of ~100 KB that inflates to 100 M pixels, must fail
from its header on every decode path (native JPEG, Pillow) with an ``ImageDecodeError``
naming the record, above ``ImageDecode(max_pixels=...)`` (default: Pillow's default limit).
The bombs are decoded in a child process that first decodes a normal image the same way,
so its peak RSS (``ru_maxrss``) after the bomb is compared with a normal image's.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from typing import Any

import numpy as np
import pytest
from PIL import Image

import pyloader
from pyloader.transform.image import DEFAULT_MAX_PIXELS, ImageDecode

native = pytest.mark.skipif(not pyloader._C.jpeg_available(), reason="built without libjpeg-turbo")


def small_jpeg(w: int = 16, h: int = 16, progressive: bool = False) -> bytes:
    rng = np.random.default_rng(w * h)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG", quality=80,
                                                                          progressive=progressive)
    return buf.getvalue()


def jpeg_claiming(w: int, h: int, progressive: bool = False) -> bytes:
    """A 16 x 16 JPEG whose frame header (SOF) says w x h: a few hundred bytes."""
    b = bytearray(small_jpeg(progressive=progressive))
    i = 2
    while b[i + 1] not in (0xC0, 0xC1, 0xC2):
        i += 2 + int.from_bytes(b[i + 2:i + 4], "big")
    b[i + 5:i + 9] = struct.pack(">HH", h, w)
    return bytes(b)


def png_bomb(w: int, h: int) -> bytes:
    """A real grey PNG of w x h zero pixels: ~1/1000 of its decoded size, made row by row."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = b"\x00" * (w + 1)  # filter byte 0, then the row
    idat = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def small_png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.arange(256, dtype=np.uint8).reshape(16, 16)).save(buf, "PNG")
    return buf.getvalue()


def test_max_pixels_defaults_to_pillows_limit_and_is_checked() -> None:
    assert DEFAULT_MAX_PIXELS == Image.MAX_IMAGE_PIXELS == ImageDecode().max_pixels == 89_478_485
    assert ImageDecode(max_pixels=None).max_pixels is None
    for bad in (0, -1, 1.5, True, "1M"):
        with pytest.raises(ValueError, match="max_pixels must be a positive int or None"):
            ImageDecode(max_pixels=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["native", "pillow"])
@pytest.mark.parametrize("fmt", ["jpeg", "png"])
def test_max_pixels_is_the_limit_on_every_path(monkeypatch, path: str, fmt: str) -> None:
    """An image one pixel over the limit is refused (as ImageDecodeError, never handed on to
    Pillow), one at the limit decodes; None lifts pyloader's limit."""
    if path == "native" and (fmt == "png" or not pyloader._C.jpeg_available()):
        pytest.skip("the native path decodes JPEG only, in a build with libjpeg-turbo")
    monkeypatch.setattr("pyloader.transform.image._NATIVE_JPEG", path == "native")
    data = small_jpeg() if fmt == "jpeg" else small_png()
    assert ImageDecode(max_pixels=256).decode(data, 0).shape[:2] == (16, 16)
    assert ImageDecode(max_pixels=None, size=8).decode(data, 0).shape[:2] == (8, 8)
    for size in (None, 4):
        with pytest.raises(pyloader.ImageDecodeError, match=r"16x16 = 256 pixels is more than max_pixels \(255\)"):
            ImageDecode(max_pixels=255, size=size).decode(data, 0)


@native
def test_native_decoder_checks_max_pixels_itself() -> None:
    """jpeg_decode_region refuses from the header whatever region it is asked for."""
    out = np.empty((16, 16, 3), np.uint8)
    with pytest.raises(ValueError, match="20000x20000 = 400000000 pixels is more than max_pixels"):
        pyloader._C.jpeg_decode_region(jpeg_claiming(20000, 20000), out, denom=1, x=0, y=0, width=16, height=16,
                                       channels=3)
    data = small_jpeg()
    with pytest.raises(ValueError, match=r"more than max_pixels \(255\)"):
        pyloader._C.jpeg_decode_region(data, out, denom=1, x=0, y=0, width=16, height=16, channels=3, max_pixels=255)
    pyloader._C.jpeg_decode_region(data, out, denom=1, x=0, y=0, width=16, height=16, channels=3, max_pixels=256)


def test_bomb_in_a_dataset_names_the_record_and_can_be_skipped(tmp_path) -> None:
    d = str(tmp_path / "ds")
    with pyloader.ShardWriter(d, {"image": "image", "label": "int64"}) as w:
        for i in range(6):
            w.write({"image": jpeg_claiming(65500, 65500) if i == 3 else small_jpeg(), "label": i})
    ds = pyloader.ShardDataset(d, decode=ImageDecode(size=8))
    with pytest.raises(pyloader.ImageDecodeError, match="max_pixels") as ei:
        list(pyloader.DataLoader(ds, batch_size=2))
    assert (ei.value.record, ei.value.field) == (3, "image") and "record 3" in str(ei.value)
    loader = pyloader.DataLoader(pyloader.ShardDataset(d, decode=ImageDecode(size=8, on_error="skip")), batch_size=2)
    assert [int(v) for b in loader for v in b["label"]] == [0, 1, 2, 4, 5]
    assert loader.stats()["skipped_samples"] == 1


# --- peak memory of a bomb against a normal image, in a child process ------------------------

_CHILD = textwrap.dedent("""
    import json, resource, sys, warnings
    sys.path.insert(0, sys.argv[1])
    import test_image_bombs as t
    from pyloader.transform.image import ImageDecode

    kind, size = sys.argv[2], None if sys.argv[3] == "none" else int(sys.argv[3])
    normal = t.small_png() if kind == "png" else t.small_jpeg()
    bomb = t.png_bomb(10000, 10000) if kind == "png" else t.jpeg_claiming(*map(int, kind.split("x")))
    dec = ImageDecode(size=size)
    dec.decode(normal, 0)  # the same path once: libraries loaded, buffers made
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    warnings.simplefilter("ignore")  # Pillow's DecompressionBombWarning, between its limit and twice it
    try:
        dec.decode(bomb, 0)
        out = {"error": None}
    except Exception as e:
        out = {"error": type(e).__name__, "message": str(e)}
    out["growth_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    out["bomb_bytes"] = len(bomb)
    print(json.dumps(out))
""")


def decode_in_child(kind: str, size: int | None, pillow: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if pillow:
        env["PYLOADER_NATIVE_JPEG"] = "0"
    p = subprocess.run([sys.executable, "-c", _CHILD, os.path.dirname(os.path.abspath(__file__)), kind,
                        "none" if size is None else str(size)], capture_output=True, text=True, timeout=120, env=env,
                       check=False)
    assert p.returncode == 0, f"child exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("kind", "size", "pillow"), [
    ("20000x20000", None, False),  # the case: 1.3 GB and ~3 s on the native path before
    ("65500x65500", 224, False),
    ("10000x10000", None, True),   # within Pillow's warning band (1x..2x its limit): Pillow alone decodes it
    ("png", None, True),           # a real PNG bomb: ~100 KB that inflates to 100 M pixels
])
def test_bomb_peak_memory_stays_that_of_a_normal_image(kind: str, size: int | None, pillow: bool) -> None:
    if not pillow and not pyloader._C.jpeg_available():
        pytest.skip("built without libjpeg-turbo")
    got = decode_in_child(kind, size, pillow)
    assert got["error"] == "ImageDecodeError" and "more than max_pixels (89478485)" in got["message"], got
    assert got["growth_kb"] < 4096, f"a {got['bomb_bytes']}-byte bomb took {got['growth_kb'] / 1024:.1f} MB more"


_WARNING_CHILD = textwrap.dedent("""
    import json, resource, sys, time
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import test_image_bombs as t
    from pyloader import _C

    data = t.jpeg_claiming(8000, 8000, progressive=sys.argv[2] == "progressive")
    out = np.empty((8000, 8000, 3), np.uint8)  # untouched pages: memory only once written
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    try:
        _C.jpeg_decode_region(data, out, denom=1, x=0, y=0, width=8000, height=8000, channels=3)
        res = {"error": None}
    except ValueError as e:
        res = {"error": str(e)}
    res["seconds"] = time.perf_counter() - t0
    res["growth_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps(res))
""")


@native
@pytest.mark.parametrize("mode", ["baseline", "progressive"])
def test_corrupt_data_warning_stops_the_native_decode_at_once(mode: str) -> None:
    """Under the pixel limit, a header that claims 8000 x 8000 over 16 x 16 pixels of data:
    libjpeg's first warning ends the decode, before it fills the other rows with grey (which
    wrote all 192 MB of the output) or touches its coefficient buffers."""
    p = subprocess.run([sys.executable, "-c", _WARNING_CHILD, os.path.dirname(os.path.abspath(__file__)), mode],
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr[-4000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["error"] and "the decode stopped at this first warning" in got["error"], got
    assert got["growth_kb"] < 4096 and got["seconds"] < 0.5, got
