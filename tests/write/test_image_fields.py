"""Image fields: a bytes field annotated with an encoding ("jpeg", "png", "image").

Written with ShardWriter and by ``pyloader.convert`` (image folders, WebDataset tars), read
back with ShardDataset(decode=False): the manifest carries ``"encoding"``, the shards store
plain bytes, the bytes read are those written, and a manifest with an invalid encoding is
refused naming the field.
"""

from __future__ import annotations

import io
import os
import struct

import numpy as np
import pytest
from convert_util import write_tar
from PIL import Image

import pyloader
from pyloader import _C
from pyloader.errors import ManifestError, SchemaError
from pyloader.format.spec import (
    IMAGE_ENCODINGS,
    MANIFEST_NAME,
    Field,
    dump_manifest,
    encode_schema,
    fields_from_manifest,
    make_field,
    parse_manifest,
)


def image_bytes(i: int, fmt: str = "JPEG", size: tuple[int, int] = (8, 6)) -> bytes:
    """A real encoded image whose pixels depend on ``i``."""
    rng = np.random.default_rng(i)
    img = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def read_manifest(root: str) -> dict:
    with open(os.path.join(root, MANIFEST_NAME), "rb") as fh:
        return parse_manifest(fh.read(), root, _C.xxh64)


def rewrite_manifest(root: str, body: dict) -> None:
    """Replaces the manifest body, framed with a valid checksum (NOTE [manifest checksum])."""
    with open(os.path.join(root, MANIFEST_NAME), "wb") as fh:
        fh.write(dump_manifest(body, _C.xxh64))


def samples_of(path: str) -> list[dict]:
    """Every record in order, image fields as their encoded bytes (decode=False)."""
    return list(pyloader.ShardDataset(path, rank=0, world_size=1, decode=False))


def write_images(root: str, fields: dict, samples: list[dict], **kwargs: object) -> str:
    with pyloader.ShardWriter(root, fields, **kwargs) as w:
        for s in samples:
            w.write(s)
    return root


# -- the Field and make_field ------------------------------------------------------------------
@pytest.mark.parametrize("enc", IMAGE_ENCODINGS)
@pytest.mark.parametrize("form", ["alone", "scalar_shape", "var_shape"])
def test_make_field_image_spellings(enc, form):
    spec = {"alone": enc, "scalar_shape": (enc, ()), "var_shape": (enc, (None,))}[form]
    f = make_field("img", spec)
    assert f == Field("img", "bytes", (None,), encoding=enc)
    assert f.is_image and f.variable
    assert f.to_json() == {"name": "img", "dtype": "bytes", "shape": [None], "encoding": enc}


def test_plain_fields_have_no_encoding_in_json():
    for spec in ("bytes", ("int64", ()), ("uint8", (3, 4))):
        f = make_field("x", spec)
        assert f.encoding is None and not f.is_image
        assert "encoding" not in f.to_json()


def test_encoding_is_not_on_the_wire():
    """The schema block of an image field is that of a bytes field: old readers read it unchanged."""
    assert encode_schema([make_field("img", "jpeg")]) == encode_schema([make_field("img", "bytes")])


def test_encoding_rejected_on_non_bytes_dtype():
    with pytest.raises(SchemaError, match=r"'img'.*bytes field only"):
        Field("img", "uint8", (3,), encoding="jpeg")
    with pytest.raises(SchemaError, match=r"'img'.*unknown encoding 'gif'"):
        Field("img", "bytes", (None,), encoding="gif")
    with pytest.raises(SchemaError, match=r"'img'.*has no shape"):
        make_field("img", ("jpeg", (3, 64, 64)))
    with pytest.raises(SchemaError, match="unknown dtype|unsupported dtype"):
        make_field("img", "webp")  # a file extension, not an encoding


def test_fields_from_manifest_validates_encoding():
    def body(entry: dict) -> dict:
        return {"fields": [{"name": "label", "dtype": "int64", "shape": []}, entry]}

    got = fields_from_manifest(body({"name": "img", "dtype": "bytes", "shape": [None], "encoding": "png"}), "m")
    assert got[1] == Field("img", "bytes", (None,), encoding="png")
    assert got[0].encoding is None
    with pytest.raises(ManifestError, match=r"'img'.*bytes field only"):
        fields_from_manifest(body({"name": "img", "dtype": "uint8", "shape": [None], "encoding": "png"}), "m")
    with pytest.raises(ManifestError, match=r"'img'.*unknown encoding"):
        fields_from_manifest(body({"name": "img", "dtype": "bytes", "shape": [None], "encoding": 3}), "m")
    with pytest.raises(ManifestError, match=r"'img'.*unknown encoding"):
        fields_from_manifest(body({"name": "img", "dtype": "bytes", "shape": [None], "encoding": None}), "m")
    with pytest.raises(ManifestError, match=r"'img'.*dtype 'jpeg' is an encoding"):
        fields_from_manifest(body({"name": "img", "dtype": "jpeg", "shape": [None]}), "m")


# -- ShardWriter -------------------------------------------------------------------------------
def test_writer_jpeg_field_roundtrip(tmp_path):
    jpegs = [image_bytes(i) for i in range(7)]
    values = [jpegs[0], bytearray(jpegs[1]), memoryview(jpegs[2]), np.frombuffer(jpegs[3], np.uint8),
              *jpegs[4:]]
    root = write_images(str(tmp_path / "ds"), {"image": "jpeg", "label": "int64"},
                        [{"image": v, "label": i} for i, v in enumerate(values)])
    m = read_manifest(root)
    assert m["fields"] == [{"name": "image", "dtype": "bytes", "shape": [None], "encoding": "jpeg"},
                           {"name": "label", "dtype": "int64", "shape": []}]
    ds = pyloader.ShardDataset(root, rank=0, world_size=1)
    assert [f.encoding for f in ds.fields] == ["jpeg", None]
    assert ds.fields[0].is_image
    got = samples_of(root)
    assert [g["image"] for g in got] == jpegs  # the exact bytes written, as bytes
    assert all(isinstance(g["image"], bytes) for g in got)
    assert [int(g["label"]) for g in got] == list(range(7))
    assert Image.open(io.BytesIO(got[5]["image"])).format == "JPEG"



def test_writer_png_field_uncompressed(tmp_path):
    pngs = [image_bytes(i, "PNG", (5 + i, 4)) for i in range(3)]
    root = write_images(str(tmp_path / "ds"), {"img": ("png", ())}, [{"img": p} for p in pngs], compression=None)
    assert read_manifest(root)["fields"][0]["encoding"] == "png"
    assert [g["img"] for g in samples_of(root)] == pngs


def test_writer_plain_bytes_manifest_has_no_encoding(tmp_path):
    root = write_images(str(tmp_path / "ds"), {"b": "bytes"}, [{"b": image_bytes(0)}])
    assert read_manifest(root)["fields"] == [{"name": "b", "dtype": "bytes", "shape": [None]}]


def test_writer_image_field_rejects_non_bytes_values(tmp_path):
    with pyloader.ShardWriter(str(tmp_path / "ds"), {"image": "jpeg"}) as w:
        with pytest.raises(SchemaError, match="'image'.*expected bytes"):
            w.write({"image": np.zeros((2, 2), np.float32)})
        w.write({"image": image_bytes(0)})


def test_writer_does_not_validate_image_content(tmp_path):
    """Writing stays a copy: bytes that are no JPEG are stored as given."""
    root = write_images(str(tmp_path / "ds"), {"image": "jpeg"}, [{"image": b"not a jpeg"}, {"image": b""}])
    assert [g["image"] for g in samples_of(root)] == [b"not a jpeg", b""]


@pytest.mark.parametrize(("entry", "match"), [
    ({"encoding": "webp"}, r"'image'.*unknown encoding 'webp'"),
    ({"encoding": ["jpeg"]}, r"'image'.*unknown encoding"),
])
def test_manifest_with_bad_encoding_is_refused(tmp_path, entry, match):
    root = write_images(str(tmp_path / "ds"), {"image": "jpeg", "label": "int64"},
                        [{"image": image_bytes(0), "label": 0}])
    body = read_manifest(root)
    body["fields"][0].update(entry)
    rewrite_manifest(root, body)
    with pytest.raises(ManifestError, match=match):
        pyloader.ShardDataset(root, rank=0, world_size=1)


def test_manifest_with_encoding_on_int_field_is_refused(tmp_path):
    root = write_images(str(tmp_path / "ds"), {"image": "jpeg", "label": "int64"},
                        [{"image": image_bytes(0), "label": 0}])
    body = read_manifest(root)
    body["fields"][1]["encoding"] = "jpeg"
    rewrite_manifest(root, body)
    with pytest.raises(ManifestError, match=r"'label'.*bytes field only"):
        pyloader.ShardDataset(root, rank=0, world_size=1)


def test_manifest_encoding_added_to_plain_bytes_dataset_reads(tmp_path):
    """The shards do not store the encoding: annotating a bytes dataset's manifest is enough."""
    pngs = [image_bytes(i, "PNG") for i in range(2)]
    root = write_images(str(tmp_path / "ds"), {"img": "bytes"}, [{"img": p} for p in pngs])
    body = read_manifest(root)
    body["fields"][0]["encoding"] = "png"
    rewrite_manifest(root, body)
    ds = pyloader.ShardDataset(root, rank=0, world_size=1)
    assert ds.fields[0].encoding == "png"
    assert [g["img"] for g in samples_of(root)] == pngs


# -- pyloader.convert ----------------------------------------------------------------------------
def make_image_folder(root, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return str(root)


def test_convert_image_folder_with_labels(tmp_path):
    files = {f"{cls}/{n}.jpg": image_bytes(10 * k + n) for k, cls in enumerate(["cat", "dog"]) for n in range(3)}
    src = make_image_folder(tmp_path / "images", files)
    res = pyloader.convert(src, str(tmp_path / "out"), labels=True, verify=True)
    assert res.verified is not None and res.verified["records"] == 6
    fields = read_manifest(str(tmp_path / "out"))["fields"]
    assert fields == [{"name": "data", "dtype": "bytes", "shape": [None], "encoding": "jpeg"},
                      {"name": "path", "dtype": "bytes", "shape": [None]},
                      {"name": "label", "dtype": "int64", "shape": []}]
    got = samples_of(str(tmp_path / "out"))
    assert [g["path"].decode() for g in got] == sorted(files)
    assert [g["data"] for g in got] == [files[r] for r in sorted(files)]
    assert [int(g["label"]) for g in got] == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize(("names", "enc"), [
    (["a.png", "b.PNG"], "png"),
    (["a.jpg", "b.jpeg", "c.JPG"], "jpeg"),
    (["a.jpg", "b.png"], "image"),
    (["a.webp", "b.webp"], "image"),
    (["a.tif", "b.bmp", "c.gif"], "image"),
    (["a.jpg", "notes.txt"], None),
    (["a.jpg", "README"], None),
])
def test_convert_folder_encoding_by_extension(tmp_path, names, enc):
    src = make_image_folder(tmp_path / "src", {n: image_bytes(i, "PNG") for i, n in enumerate(names)})
    pyloader.convert(src, str(tmp_path / "out"), kind="files")
    data = read_manifest(str(tmp_path / "out"))["fields"][0]
    assert data["name"] == "data"
    assert data.get("encoding") == enc
    assert data["dtype"] == "bytes"


def test_convert_text_folder_stays_bytes(tmp_path):
    files = {f"docs/{n}.txt": f"text {n}".encode() for n in range(4)}
    src = make_image_folder(tmp_path / "txt", files)
    pyloader.convert(src, str(tmp_path / "out"), verify=True)
    fields = read_manifest(str(tmp_path / "out"))["fields"]
    assert all("encoding" not in f for f in fields)
    ds = pyloader.ShardDataset(str(tmp_path / "out"), rank=0, world_size=1)
    assert not any(f.is_image for f in ds.fields)
    assert [g["data"] for g in samples_of(str(tmp_path / "out"))] == [files[r] for r in sorted(files)]


def test_convert_tar_image_members(tmp_path):
    samples = [(f"s{i:03d}", {"jpg": image_bytes(i), "cls": str(i % 3).encode(),
                              "seg.png": image_bytes(i, "PNG")}) for i in range(5)]
    tar = write_tar(tmp_path / "shard-0.tar", samples)
    res = pyloader.convert(tar, str(tmp_path / "out"), verify=True)
    assert res.verified is not None
    by_name = {f["name"]: f for f in read_manifest(str(tmp_path / "out"))["fields"]}
    assert set(by_name) == {"__key__", "cls", "jpg", "seg_png"}
    assert by_name["jpg"].get("encoding") == "jpeg"
    assert by_name["seg_png"].get("encoding") == "png"
    assert "encoding" not in by_name["cls"] and "encoding" not in by_name["__key__"]
    assert all(f["dtype"] == "bytes" for f in by_name.values())
    got = samples_of(str(tmp_path / "out"))
    assert [g["jpg"] for g in got] == [m["jpg"] for _, m in samples]
    assert [g["seg_png"] for g in got] == [m["seg.png"] for _, m in samples]
    assert [g["cls"] for g in got] == [m["cls"] for _, m in samples]


def test_convert_refuses_encoding_as_a_cast(tmp_path):
    with pytest.raises(ValueError, match="'img'.*encoding, not a dtype"):
        pyloader.convert({"img": np.zeros((2, 3), np.uint8)}, str(tmp_path / "out"), fields={"img": "jpeg"})


def test_verify_compares_the_encoding(tmp_path):
    """A dataset whose manifest lost the source's encoding no longer verifies against it."""
    files = {f"c/{n}.png": image_bytes(n, "PNG") for n in range(2)}
    src = make_image_folder(tmp_path / "images", files)
    out = str(tmp_path / "out")
    pyloader.convert(src, out)
    assert pyloader.verify_conversion(src, out)["records"] == 2
    body = read_manifest(out)
    del body["fields"][0]["encoding"]
    rewrite_manifest(out, body)
    with pytest.raises(pyloader.VerifyError, match="fields"):
        pyloader.verify_conversion(src, out)


def test_stored_shard_schema_is_plain_bytes(tmp_path):
    """The shard files of an image field hold the dtype code of bytes (14), nothing more."""
    root = write_images(str(tmp_path / "ds"), {"image": "jpeg"}, [{"image": image_bytes(0)}])
    shard = read_manifest(root)["shards"][0]["path"]
    with open(os.path.join(root, shard), "rb") as fh:
        data = fh.read()
    (schema_off, schema_size) = struct.unpack_from("<QQ", data, 32)
    assert data[schema_off:schema_off + schema_size] == encode_schema([make_field("image", "bytes")])
