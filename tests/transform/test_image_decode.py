"""Image fields decoded on the transform workers: shapes, crops, reproducibility, corrupt images."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import pyloader
from pyloader.transform.image import ImageDecode

N = 40


def jpeg(i: int, size: tuple[int, int] | None = None) -> bytes:
    w, h = size or (64 + 8 * (i % 5), 48 + 4 * (i % 3))
    x = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, h, dtype=np.float32)[:, None, None]
    arr = ((x + y) / 2 + np.array([i * 5 % 255, 40, 200])[None, None, :]) % 256
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((10, 12), i, np.uint8), "L").save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("img") / "ds")
    with pyloader.ShardWriter(d, {"image": "jpeg", "label": "int64"}, shard_bytes=16384) as w:
        for i in range(N):
            w.write({"image": jpeg(i), "label": i})
    return d


def read(path: str, *, decode: Any = None, **kw: Any) -> list[dict[str, torch.Tensor]]:
    ds = pyloader.ShardDataset(path, decode=decode, shuffle=kw.pop("shuffle", False), seed=kw.pop("seed", 0))
    return list(pyloader.DataLoader(ds, batch_size=kw.pop("batch_size", 8), **kw))


def test_image_field_decodes_like_pillow(tmp_path) -> None:
    d = str(tmp_path / "same")
    with pyloader.ShardWriter(d, {"image": "jpeg", "label": "int64"}) as w:
        for i in range(6):
            w.write({"image": jpeg(i, (40, 30)), "label": i})
    got = read(d, batch_size=3, num_workers=2)
    assert got[0]["image"].shape == (3, 30, 40, 3) and got[0]["image"].dtype == torch.uint8
    for b in got:
        for lab, img in zip(b["label"], b["image"]):
            want = np.asarray(Image.open(io.BytesIO(jpeg(int(lab), (40, 30)))).convert("RGB"))
            assert np.array_equal(img.numpy(), want)


def test_images_of_several_sizes_need_a_size(images) -> None:
    with pytest.raises(pyloader.CollateError, match=r"'image'.*ImageDecode\(size="):
        read(images)
    got = read(images, decode=ImageDecode(size=(32, 24)))
    assert all(b["image"].shape[1:] == (32, 24, 3) for b in got)
    chw = read(images, decode=ImageDecode(size=16, crop="center", layout="CHW", mode="L"))
    assert chw[0]["image"].shape == (8, 1, 16, 16)


def test_center_crop_keeps_the_aspect_and_the_middle(tmp_path) -> None:
    d = str(tmp_path / "wide")
    arr = np.zeros((20, 60, 3), np.uint8)
    arr[:, 20:40] = 255  # a white middle third
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "PNG")
    with pyloader.ShardWriter(d, {"image": "png"}) as w:
        w.write({"image": buf.getvalue()})
    got = read(d, decode=ImageDecode(size=10, crop="center"))[0]["image"][0].numpy()
    assert got.shape == (10, 10, 3)
    # Only the middle square, white (its edge columns blend a little with the black beyond
    # the box, as resampling does); a stretch of the whole image would give black thirds.
    assert got[:, 1:-1].min() >= 250 and got.min() > 150


def test_random_crop_and_flip_are_reproducible_and_vary(images) -> None:
    dec = ImageDecode(size=24, crop="random", flip=True)
    a = read(images, decode=dec, num_workers=1, shuffle=True, seed=3)
    b = read(images, decode=dec, num_workers=2, shuffle=True, seed=3)
    c = read(images, decode=dec, num_workers=2, executor="processes", shuffle=True, seed=3)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["image"], z["image"])
    other = read(images, decode=dec, shuffle=True, seed=4)
    by_label = {int(lab): img for bt in a for lab, img in zip(bt["label"], bt["image"])}
    by_label2 = {int(lab): img for bt in other for lab, img in zip(bt["label"], bt["image"])}
    differ = sum(not torch.equal(by_label[i], by_label2[i]) for i in range(N))
    assert differ > N // 2  # another seed: other crops


def test_decode_then_transform_sees_a_tensor(images) -> None:
    def tr(s: dict[str, Any], ctx: pyloader.SampleContext) -> dict[str, Any]:
        img = s["image"]
        assert isinstance(img, torch.Tensor) and img.dtype == torch.uint8 and img.shape == (16, 16, 3)
        return {"x": img.float().mean(), "label": s["label"], "worker": ctx.worker}

    got = read(images, decode=ImageDecode(size=16), transform=tr, num_workers=2)
    assert sum(len(b["x"]) for b in got) == N
    assert {int(w) for b in got for w in b["worker"]} <= {0, 1}


def test_decode_false_gives_the_bytes(images) -> None:
    got = read(images, decode=False, batch_size=None)
    assert got[3]["image"] == jpeg(3)


def test_decode_names_only_image_fields(images) -> None:
    with pytest.raises(ValueError, match="'label' is not an image field"):
        pyloader.ShardDataset(images, decode={"label": ImageDecode()})
    with pytest.raises(ValueError, match="crop='random' needs a size"):
        ImageDecode(crop="random")
    with pytest.raises(ValueError, match="on_error"):
        ImageDecode(on_error="ignore")


def test_dataset_decode_under_torch_dataloader(images) -> None:
    ds = pyloader.ShardDataset(images, decode=ImageDecode(size=20, crop="random", flip=True))
    theirs = list(torch.utils.data.DataLoader(ds, batch_size=8))
    ours = read(images, decode=ImageDecode(size=20, crop="random", flip=True))
    for a, b in zip(theirs, ours):
        assert torch.equal(a["image"], b["image"])


@pytest.fixture(scope="module")
def corrupt(tmp_path_factory) -> str:
    """Records 5 (truncated JPEG) and 11 (not an image) are bad; every shard checksum is valid."""
    d = str(tmp_path_factory.mktemp("bad") / "ds")
    with pyloader.ShardWriter(d, {"image": "image", "label": "int64"}, shard_bytes=8192) as w:
        for i in range(24):
            data = jpeg(i, (32, 32)) if i % 2 else png(i)
            if i == 5:
                data = data[: len(data) // 2]
            if i == 11:
                data = b"GIF89a but not really" * 3
            w.write({"image": data, "label": i})
    return d


@pytest.mark.parametrize("executor", ["threads", "processes"])
def test_corrupt_images_raise_naming_shard_record_and_field(corrupt, executor: str) -> None:
    ds = pyloader.ShardDataset(corrupt, decode=ImageDecode(size=8))
    it = iter(pyloader.DataLoader(ds, batch_size=4, executor=executor, num_workers=2))
    outcomes: list[Any] = []
    for _ in range(6):
        try:
            outcomes.append(next(it)["label"].tolist())
        except pyloader.ImageDecodeError as e:
            assert isinstance(e, ValueError)
            outcomes.append(str(e))
    with pytest.raises(StopIteration):
        next(it)
    assert outcomes[0] == [0, 1, 2, 3] and outcomes[3:] == [[12, 13, 14, 15], [16, 17, 18, 19], [20, 21, 22, 23]]
    for msg in outcomes[1:3]:  # records 5 and 11: the error, then the iteration goes on
        assert isinstance(msg, str)
        assert "shard '" in msg and "field 'image'" in msg and "not a readable image" in msg


def test_corrupt_images_skipped_and_counted(corrupt) -> None:
    for executor in ("threads", "processes"):
        ds = pyloader.ShardDataset(corrupt, decode=ImageDecode(size=8, on_error="skip"))
        loader = pyloader.DataLoader(ds, batch_size=4, executor=executor, num_workers=2)
        got = list(loader)
        labels = [int(v) for b in got for v in b["label"]]
        assert labels == [i for i in range(24) if i not in (5, 11)]
        assert [len(b["label"]) for b in got] == [4, 3, 3, 4, 4, 4]
        assert loader.stats()["skipped_samples"] == 2


def test_truncated_image_error_names_the_record(corrupt) -> None:
    ds = pyloader.ShardDataset(corrupt, decode=ImageDecode(size=8))
    with pytest.raises(pyloader.ImageDecodeError) as ei:
        list(pyloader.DataLoader(ds, batch_size=1))
    e = ei.value
    assert e.field == "image" and e.record is not None
    assert "not a readable image" in str(e) and f"record {e.record}" in str(e) and "shard '" in str(e)


def test_normalisation_in_one_native_pass_matches_torch(images) -> None:
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    for layout in ("CHW", "HWC"):
        plain = read(images, decode=ImageDecode(size=24, crop="random", flip=True, layout=layout), seed=2,
                     shuffle=True)
        normed = read(images, decode=ImageDecode(size=24, crop="random", flip=True, layout=layout, mean=mean,
                                                 std=std), seed=2, shuffle=True, num_workers=2)
        shape = (1, 3, 1, 1) if layout == "CHW" else (1, 1, 1, 3)
        m, s = torch.tensor(mean).view(shape), torch.tensor(std).view(shape)
        for p, q in zip(plain, normed):
            assert q["image"].dtype == torch.float32 and q["image"].shape == p["image"].shape
            assert torch.allclose(q["image"], (p["image"].float() / 255 - m) / s, atol=1e-5)


def test_normalisation_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="both mean and std"):
        ImageDecode(mean=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="needs 1 values for mode='L'"):
        ImageDecode(mode="L", mean=(0.5, 0.5, 0.5), std=(1, 1, 1))
    with pytest.raises(ValueError, match="std must be a positive"):
        ImageDecode(mean=(0, 0, 0), std=(1, 0, 1))
    src = np.zeros((2, 2, 3), np.uint8)
    with pytest.raises(ValueError, match=r"dst 48 \(got 12 and 20\)"):
        pyloader._C.normalize_u8(src, np.zeros(5, np.float32), height=2, width=2, mean=[0, 0, 0], std=[1, 1, 1])
    with pytest.raises(ValueError, match="1 to 4 entries"):
        pyloader._C.normalize_u8(src, np.zeros(12, np.float32), height=2, width=2, mean=[], std=[])


native = pytest.mark.skipif(not pyloader._C.jpeg_available(), reason="built without libjpeg-turbo")


@native
def test_native_jpeg_regions_are_libjpegs_pixels() -> None:
    data = jpeg(3, (96, 72))
    full = np.empty((72, 96, 3), np.uint8)
    pyloader._C.jpeg_decode_region(data, full, denom=1, x=0, y=0, width=96, height=72, channels=3)
    assert np.array_equal(full, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    part = np.empty((30, 40, 3), np.uint8)
    pyloader._C.jpeg_decode_region(data, part, denom=1, x=21, y=17, width=40, height=30, channels=3)
    assert np.array_equal(part, full[17:47, 21:61])
    half = np.empty((36, 48, 3), np.uint8)
    pyloader._C.jpeg_decode_region(data, half, denom=2, x=0, y=0, width=48, height=36, channels=3)
    im = Image.open(io.BytesIO(data))
    im.draft("RGB", (48, 36))
    assert np.array_equal(half, np.asarray(im))
    grey = np.empty((72, 96, 1), np.uint8)
    pyloader._C.jpeg_decode_region(data, grey, denom=1, x=0, y=0, width=96, height=72, channels=1)
    assert pyloader._C.jpeg_header(data) == (96, 72, 3, False)


@native
def test_native_jpeg_refuses_bad_data_and_regions() -> None:
    data = jpeg(1, (64, 48))
    out = np.empty((48, 64, 3), np.uint8)
    for bad, why in ((data[: len(data) // 2], "Premature end"), (b"\xff\xd8 not really", "not a readable JPEG"),
                     (b"GIF89a", "not a readable JPEG")):
        with pytest.raises(ValueError, match=why):
            pyloader._C.jpeg_decode_region(bad, out, denom=1, x=0, y=0, width=64, height=48, channels=3)
    with pytest.raises(ValueError, match="outside"):
        pyloader._C.jpeg_decode_region(data, out, denom=2, x=0, y=0, width=64, height=48, channels=3)
    with pytest.raises(ValueError, match="denom"):
        pyloader._C.jpeg_decode_region(data, out, denom=3, x=0, y=0, width=64, height=48, channels=3)
    with pytest.raises(ValueError, match="dst must hold"):
        pyloader._C.jpeg_decode_region(data, out, denom=1, x=0, y=0, width=10, height=10, channels=3)


@native
def test_native_and_pillow_paths_agree(monkeypatch, images) -> None:
    """The same crops from both decoders: equal shapes and pixels within resampling's rounding."""
    from pyloader.transform import image as image_mod

    for dec in (ImageDecode(), ImageDecode(size=(40, 30), crop="center"), ImageDecode(size=24, mode="L")):
        ds = pyloader.ShardDataset(images, decode=False)
        raw = [s["image"] for s in ds]
        got = {}
        for flag in (True, False):
            monkeypatch.setattr(image_mod, "_NATIVE_JPEG", flag)
            got[flag] = [dec.decode(b, 7) for b in raw]
        for a, b in zip(got[True], got[False]):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert np.abs(a.astype(int) - b.astype(int)).max() <= (0 if dec.size is None else 24)
