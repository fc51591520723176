"""Decoding encoded image fields (JPEG, PNG and what Pillow reads) on the transform workers.

NOTE [image decode]: an image field (``Field.is_image``: written as ``"jpeg"``, ``"png"``
or ``"image"``) is decoded on the transform workers. A JPEG goes to the native decoder
when the extension was built with libjpeg-turbo (``_C.jpeg_available()``; setup.py links
it where its headers are installed): it reads the header, draws the crop, and decodes only
the crop's rows (the rows above are skipped, those below never decoded) and, nearly, only
its columns (libjpeg-turbo's ``jpeg_crop_scanline``), at the smallest DCT scale that still
covers the output, all without the GIL; any libjpeg warning (corrupt or truncated data) is
an error there. What it refuses (CMYK, damaged data) and every other format goes to Pillow,
whose decoders also run without the GIL (JPEG at the same DCT scale, ``Image.draft``) and
which decides: a readable image or ``ImageDecodeError``. Both give the same pixels for a
whole JPEG (the same libjpeg-turbo arithmetic). Crop and resize are then one antialiased
bilinear pass of torch's vectorised uint8 kernel (GIL released; Pillow's own resampling
gives the same pixels within rounding at about four times the cost); the random choices
come from the sample's seed (NOTE [sample seeds]), so augmented images are reproducible
on a given build. A record that is not a readable image raises ``ImageDecodeError``
naming the shard, record and field, or, with ``on_error="skip"``, drops the sample and
counts it. ``PYLOADER_NATIVE_JPEG=0`` sends every image to Pillow.

An image of more than ``ImageDecode.max_pixels`` pixels is refused from its header, on
either path, before anything is allocated for it (NOTE [pixel limit] in
csrc/core/jpeg_decode.h): ``ImageDecodeError`` naming the record, never a fall-back to
Pillow. Pillow's own process-wide limit (``PIL.Image.MAX_IMAGE_PIXELS``: a warning above
it, an error above twice it) applies on its path as well, so a ``max_pixels`` above
Pillow's needs that raised too.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import random
from typing import Any

import numpy as np
import torch

import pyloader._C as _C

from ..errors import ImageDecodeError

# PYLOADER_NATIVE_JPEG=0 decodes every image with Pillow (the native decoder is used where
# the extension was built with libjpeg-turbo).
_NATIVE_JPEG = _C.jpeg_available() and os.environ.get("PYLOADER_NATIVE_JPEG", "1") != "0"
CROPS = ("resize", "center", "random")
LAYOUTS = ("HWC", "CHW")
ON_ERROR = ("raise", "skip")
# ImageDecode's default max_pixels: Pillow's default PIL.Image.MAX_IMAGE_PIXELS (~256 MiB of RGB).
DEFAULT_MAX_PIXELS = 89_478_485
_NO_PIXEL_LIMIT = 2**64 - 1  # max_pixels=None, for the native decoder
# Pillow's modes with 8 bits per channel, and their channel counts.
_MODES = {"RGB": 3, "L": 1, "RGBA": 4}


def _pair(name: str, value: Any, kind: type) -> tuple[Any, Any]:
    try:
        a, b = value
    except (TypeError, ValueError):
        raise ValueError(f"ImageDecode: {name} must be a pair, got {value!r}") from None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (a, b)):
        raise ValueError(f"ImageDecode: {name} must hold numbers, got {value!r}")
    return kind(a), kind(b)


@dataclasses.dataclass(frozen=True)
class ImageDecode:
    """How an image field is decoded into a ``uint8`` tensor (NOTE [image decode]).

    Args:
        size: ``(height, width)`` (or one int for a square) of every decoded image, so a
            batch is a dense ``[B, H, W, C]`` tensor; None keeps each image's own size (a
            batch then needs images of one size, or a ``transform`` that makes them so).
        crop: how an image reaches ``size``: ``"resize"`` (the whole image, aspect ratio
            not kept), ``"center"`` (resize the shorter side to the target's, then a
            centre crop: evaluation), ``"random"`` (a random resized crop of ``scale`` of
            the area and an aspect ratio in ``ratio``, as torchvision's
            ``RandomResizedCrop``: training).
        scale, ratio: the random crop's area fraction and aspect-ratio ranges.
        flip: flip horizontally with probability 1/2 (from the sample's seed).
        mode: ``"RGB"`` (3 channels), ``"L"`` (grey, 1 channel) or ``"RGBA"``.
        layout: ``"HWC"`` (Pillow's and numpy's) or ``"CHW"`` (torch's convolution layout).
        mean, std: per-channel values in [0, 1] units (torchvision's ``Normalize`` after
            ``ToTensor``, e.g. ImageNet's ``(0.485, 0.456, 0.406)`` and ``(0.229, 0.224, 0.225)``):
            the image comes out as ``float32`` ``(x / 255 - mean) / std``, made in one native
            pass with the GIL released (torch's chain of ops makes four). Both or neither.
        on_error: ``"raise"`` an ``ImageDecodeError`` for an unreadable image, or
            ``"skip"`` the sample (the batch is one sample shorter; counted in
            ``stats()["skipped_samples"]``).
        max_pixels: the most pixels (width x height, from the image's header) an image may
            have; a larger one is refused before it is decoded, as unreadable
            (``ImageDecodeError``, or skipped with ``on_error="skip"``): a few hundred
            bytes can claim 65535 x 65535. Default: Pillow's default limit, 89,478,485.
            None: no limit of pyloader's (Pillow's own still applies to what it decodes).
    """

    size: tuple[int, int] | int | None = None
    crop: str = "resize"
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = False
    mode: str = "RGB"
    layout: str = "HWC"
    on_error: str = "raise"
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    max_pixels: int | None = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        size: Any = self.size
        if size is not None:
            if isinstance(size, int) and not isinstance(size, bool):
                size = (size, size)
            h, w = _pair("size", size, int)
            if h < 1 or w < 1 or (h, w) != tuple(size):
                raise ValueError(f"ImageDecode: size must be positive ints (height, width), got {self.size!r}")
            object.__setattr__(self, "size", (h, w))
        if self.crop not in CROPS:
            raise ValueError(f"ImageDecode: crop must be one of {CROPS}, got {self.crop!r}")
        if self.crop != "resize" and size is None:
            raise ValueError(f"ImageDecode: crop={self.crop!r} needs a size")
        lo, hi = _pair("scale", self.scale, float)
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"ImageDecode: scale must satisfy 0 < min <= max <= 1, got {self.scale!r}")
        rlo, rhi = _pair("ratio", self.ratio, float)
        if not 0 < rlo <= rhi:
            raise ValueError(f"ImageDecode: ratio must satisfy 0 < min <= max, got {self.ratio!r}")
        object.__setattr__(self, "scale", (lo, hi))
        object.__setattr__(self, "ratio", (rlo, rhi))
        if self.mode not in _MODES:
            raise ValueError(f"ImageDecode: mode must be one of {tuple(_MODES)}, got {self.mode!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"ImageDecode: layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"ImageDecode: on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.max_pixels is not None and (not isinstance(self.max_pixels, int) or isinstance(self.max_pixels, bool)
                                            or self.max_pixels < 1):
            raise ValueError(f"ImageDecode: max_pixels must be a positive int or None, got {self.max_pixels!r}")
        if not isinstance(self.flip, bool):
            raise ValueError(f"ImageDecode: flip must be a bool, got {self.flip!r}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("ImageDecode: give both mean and std, or neither")
        if self.mean is not None:
            for name in ("mean", "std"):
                v = getattr(self, name)
                try:
                    vals = tuple(float(x) for x in v)
                except (TypeError, ValueError):
                    raise ValueError(f"ImageDecode: {name} must be a sequence of numbers, got {v!r}") from None
                if len(vals) != self.channels:
                    raise ValueError(f"ImageDecode: {name} needs {self.channels} values for mode={self.mode!r}, "
                                     f"got {len(vals)}")
                object.__setattr__(self, name, vals)
            if not all(x > 0 and math.isfinite(x) for x in self.std):  # type: ignore[union-attr]
                raise ValueError(f"ImageDecode: every std must be a positive number, got {self.std!r}")

    @property
    def channels(self) -> int:
        """Channels of a decoded image."""
        return _MODES[self.mode]

    def _check_pixels(self, w: int, h: int) -> None:
        """Refuses an image whose header claims more than ``max_pixels`` (NOTE [pixel limit])."""
        if self.max_pixels is not None and w * h > self.max_pixels:
            raise ImageDecodeError(f"image of {w}x{h} = {w * h} pixels is more than max_pixels ({self.max_pixels}): "
                                   "refused from its header before decoding (a decompression bomb, or pass "
                                   "ImageDecode(max_pixels=...) to allow images this large)")

    def needs_random(self) -> bool:
        """Whether decoding draws random numbers (a random crop or flip)."""
        return self.crop == "random" or self.flip

    def _box(self, w: int, h: int, rnd: random.Random | None) -> tuple[float, float, float, float]:
        """The source box (left, top, right, bottom) that is resampled to ``size``."""
        assert self.size is not None
        th, tw = self.size  # type: ignore[misc]
        if self.crop == "center":
            s = max(th / h, tw / w)  # resize the shorter side (relative to the target) to fit
            cw, ch = tw / s, th / s
            left, top = (w - cw) / 2, (h - ch) / 2
            return left, top, left + cw, top + ch
        if self.crop == "random":
            assert rnd is not None
            return random_resized_crop(w, h, rnd, self.scale, self.ratio)
        return 0.0, 0.0, float(w), float(h)

    def decode(self, data: Any, seed: int) -> np.ndarray:
        """Decodes ``data`` (a bytes-like object) into a ``uint8`` array (``layout``; float32 with ``mean``/``std``).

        ``seed`` drives the random crop and flip. Raises ``ImageDecodeError`` (without the
        shard and record, which the caller adds) when ``data`` is not a readable image.
        """
        t: torch.Tensor | None = None
        if _NATIVE_JPEG and self.mode != "RGBA" and bytes(data[:2]) == b"\xff\xd8":
            rnd = random.Random(seed) if self.needs_random() else None
            try:
                t = self._native_jpeg(data, rnd)
            except ImageDecodeError:
                raise  # over max_pixels: refused, not handed to Pillow
            except ValueError:
                t = None  # what libjpeg refuses (CMYK, corrupt data) goes to Pillow, which decides
        if t is None:
            rnd = random.Random(seed) if self.needs_random() else None
            t = self._pillow(data, rnd)
        if rnd is not None and self.flip and rnd.random() < 0.5:
            t = t.flip(-1)
        hwc = t.permute(1, 2, 0)
        if self.mean is not None:
            src = hwc.contiguous()
            h, w, c = src.shape
            out = np.empty((c, h, w) if self.layout == "CHW" else (h, w, c), dtype=np.float32)
            _C.normalize_u8(src.numpy(), out, height=h, width=w, mean=self.mean, std=self.std,  # type: ignore[arg-type]
                            chw=self.layout == "CHW")
            return out
        return (hwc if self.layout == "HWC" else t).contiguous().numpy()

    def _native_jpeg(self, data: Any, rnd: random.Random | None) -> torch.Tensor:
        """A JPEG through the native decoder (NOTE [image decode]): only the crop's rows and columns, at a DCT scale.

        Returns the CHW uint8 image at ``size``. Raises ValueError for what it cannot decode.
        """
        w, h, _, _ = _C.jpeg_header(data)
        self._check_pixels(w, h)  # before anything is allocated for the image
        channels = self.channels
        limit = _NO_PIXEL_LIMIT if self.max_pixels is None else self.max_pixels
        if self.size is None:
            arr = np.empty((h, w, channels), dtype=np.uint8)
            _C.jpeg_decode_region(data, arr, denom=1, x=0, y=0, width=w, height=h, channels=channels,
                                  max_pixels=limit)
            return torch.from_numpy(arr).permute(2, 0, 1)
        th, tw = self.size  # type: ignore[misc]
        box = self._box(w, h, rnd)
        bw, bh = box[2] - box[0], box[3] - box[1]
        # The smallest DCT scale that keeps the crop at least the target size.
        denom = next((d for d in (8, 4, 2) if bw / d >= tw and bh / d >= th), 1)
        sw, sh = -(-w // denom), -(-h // denom)
        left = min(max(0, int(box[0] / denom + 0.5)), sw - 1)
        top = min(max(0, int(box[1] / denom + 0.5)), sh - 1)
        right = max(left + 1, min(sw, int(box[2] / denom + 0.5)))
        bottom = max(top + 1, min(sh, int(box[3] / denom + 0.5)))
        arr = np.empty((bottom - top, right - left, channels), dtype=np.uint8)
        _C.jpeg_decode_region(data, arr, denom=denom, x=left, y=top, width=right - left, height=bottom - top,
                              channels=channels, max_pixels=limit)
        return _crop_resize(torch.from_numpy(arr).permute(2, 0, 1), (0, 0, right - left, bottom - top), (th, tw))

    def _pillow(self, data: Any, rnd: random.Random | None) -> torch.Tensor:
        """Any image Pillow reads: the CHW uint8 image (at ``size`` when set)."""
        try:
            from PIL import Image  # Pillow: imported on first decode
        except ImportError:
            raise ImportError("decoding image fields needs Pillow: pip install 'pyloader[image]' "
                              "(or read the encoded bytes with decode=False)") from None
        try:
            img: Any = Image.open(io.BytesIO(data))  # reads the header only
            self._check_pixels(*img.size)  # See NOTE [pixel limit]: before Pillow allocates the image
            box = None
            if self.size is not None:
                w, h = img.size
                box = self._box(w, h, rnd)
                th, tw = self.size  # type: ignore[misc]
                if img.format == "JPEG":
                    # Decode at the smallest DCT scale that keeps the box at least the target size.
                    bw, bh = box[2] - box[0], box[3] - box[1]
                    want = (max(1, math.ceil(w * tw / bw)), max(1, math.ceil(h * th / bh)))
                    img.draft(self.mode if self.mode != "RGBA" else "RGB", want)
                    sx, sy = img.size[0] / w, img.size[1] / h
                    box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
            if img.mode != self.mode:
                img = img.convert(self.mode)
            arr = np.array(img)  # (np.asarray of an Image is a read-only view: torch wants it writable)
        except ImageDecodeError:
            raise
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            # (UnidentifiedImageError and "image file is truncated" are OSErrors; Pillow's
            # DecompressionBombWarning is raised only where warnings are errors.)
            raise ImageDecodeError(f"not a readable image: {type(e).__name__}: {e}") from e
        if arr.ndim == 2:
            arr = arr[:, :, None]
        t = torch.from_numpy(arr).permute(2, 0, 1)  # CHW view
        if box is not None:
            t = _crop_resize(t, box, self.size)  # type: ignore[arg-type]
        return t


def random_resized_crop(w: int, h: int, rnd: random.Random, scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """A random crop box (left, top, right, bottom) of a ``w`` x ``h`` image, by torchvision's RandomResizedCrop rule.

    Up to 10 draws of an area fraction in ``scale`` and a log-uniform aspect ratio in
    ``ratio``; when none fits, the largest centred crop whose aspect lies within ``ratio``.
    """
    area = w * h
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rnd.uniform(*scale)
        aspect = math.exp(rnd.uniform(log_lo, log_hi))
        cw = int(round(math.sqrt(target * aspect)))
        ch = int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            top = rnd.randint(0, h - ch)
            left = rnd.randint(0, w - cw)
            return left, top, left + cw, top + ch
    aspect = w / h
    if aspect < ratio[0]:
        cw, ch = w, int(round(w / ratio[0]))
    elif aspect > ratio[1]:
        ch, cw = h, int(round(h * ratio[1]))
    else:
        cw, ch = w, h
    left, top = (w - cw) // 2, (h - ch) // 2
    return left, top, left + cw, top + ch


def _crop_resize(t: torch.Tensor, box: tuple[float, float, float, float], size: tuple[int, int]) -> torch.Tensor:
    """The ``box`` (left, top, right, bottom; rounded to pixels) of a CHW uint8 image, resized to ``size``.

    Bilinear with antialiasing (torch's vectorised uint8 kernel, GIL released; within
    rounding of Pillow's BILINEAR resize of the same box, at a quarter of its time).
    """
    _, h, w = t.shape
    left = min(max(0, int(box[0] + 0.5)), w - 1)
    top = min(max(0, int(box[1] + 0.5)), h - 1)
    right = max(left + 1, min(w, int(box[2] + 0.5)))
    bottom = max(top + 1, min(h, int(box[3] + 0.5)))
    t = t[:, top:bottom, left:right]
    if tuple(t.shape[1:]) == tuple(size):
        return t
    # Channels-last in and out: the kernel's vectorised uint8 path, and the result's memory
    # is already HWC (a quarter of the time of a strided NCHW resize plus a transposing copy).
    x = t[None].contiguous(memory_format=torch.channels_last)
    return torch.nn.functional.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)[0]


def resolve_decode(fields: list[Any], decode: Any) -> dict[str, ImageDecode]:
    """The image fields to decode and how (field name -> ``ImageDecode``).

    ``decode`` is None (every image field, defaults), False (none), an ``ImageDecode``
    (every image field) or ``{field name: ImageDecode or None}``.

    Raises ValueError naming a field that is not an image field of the dataset.
    """
    images = [f.name for f in fields if getattr(f, "is_image", False)]
    if decode is False:
        return {}
    if decode is None:
        return {n: ImageDecode() for n in images}
    if isinstance(decode, ImageDecode):
        return {n: decode for n in images}
    if isinstance(decode, dict):
        out: dict[str, ImageDecode] = {}
        for name, spec in decode.items():
            if name not in images:
                raise ValueError(f"decode={{{name!r}: ...}}: {name!r} is not an image field of this dataset "
                                 f"(image fields: {images or 'none'})")
            if spec is None or spec is False:
                continue
            if not isinstance(spec, ImageDecode):
                raise ValueError(f"decode[{name!r}] must be a pyloader.ImageDecode or None, got {spec!r}")
            out[name] = spec
        for n in images:  # image fields not named keep the defaults
            if n not in decode:
                out[n] = ImageDecode()
        return out
    raise ValueError(f"decode must be None, False, a pyloader.ImageDecode or a dict of them, got {decode!r}")


__all__ = ["CROPS", "LAYOUTS", "ON_ERROR", "DEFAULT_MAX_PIXELS", "ImageDecode", "random_resized_crop", "resolve_decode"]
