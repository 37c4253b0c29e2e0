"""Image bytes -> what the vision tower reads, through the model's own image processor in transformers (resize to a
multiple of the patch grid within its pixel bounds, normalise, cut into patches in merge-block order) and Pillow.

Decoding is guarded before it happens: at most ``max_image_bytes`` of input, and the pixel count read from the
header (Pillow reads no pixels to open a file) at most ``max_image_pixels``, so a decompression bomb is refused
before it is expanded; a corrupt or truncated file is refused when its pixels are read. Every refusal is a
`RequestRejected` (a 400 on the APIs).

The content hash covers what the model sees: the patches after preprocessing and their grid, so the same picture
in another encoding hits the caches and a different one never does.
"""
from __future__ import annotations

import functools
import io
import json
import warnings
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path

import numpy as np

from engine.errors import RequestRejected
from engine.multimodal import ImageInput

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 50_000_000  # before decoding; a 7,000 x 7,000 screenshot fits


class ImageError(RequestRejected):
    """An image that cannot be read (corrupt, truncated, too large, not an image)."""

    code = "invalid_image"


@dataclass
class ImagePreprocessor:
    """One model's image processor (its directory's preprocessor_config.json) and the limits on what it decodes."""

    processor: object
    merge_size: int
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ImagePreprocessor":
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(str(model_dir))
        return cls(processor, int(getattr(processor, "merge_size", 2)))

    def decode(self, data: bytes):
        """A ``PIL.Image`` in RGB, or `ImageError`."""
        from PIL import Image

        if len(data) > self.max_image_bytes:
            raise ImageError(f"the image has {len(data)} bytes; at most {self.max_image_bytes} are accepted")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
                width, height = image.size
                if width * height > self.max_image_pixels:
                    raise ImageError(f"the image is {width}x{height} pixels; at most {self.max_image_pixels} pixels "
                                     "are accepted")
                image.load()
        except ImageError:
            raise
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageError(f"the image cannot be read: {e}") from None
        if min(width, height) < 1:
            raise ImageError("the image is empty")
        return image.convert("RGB")

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """The processor's settings: part of every content hash it makes."""
        return json.dumps(self.processor.to_dict(), sort_keys=True, default=str).encode()

    def preprocess(self, data: bytes, offset: int = 0) -> ImageInput:
        """``data`` (an encoded image) as an `ImageInput` at prompt index ``offset``."""
        image = self.decode(data)
        try:
            out = self.processor(images=[image], return_tensors="np")
        except ValueError as e:  # e.g. an aspect ratio beyond the processor's bounds
            raise ImageError(f"the image cannot be preprocessed: {e}") from None
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        grid = tuple(int(v) for v in out["image_grid_thw"][0])
        digest = blake2b(digest_size=16)
        digest.update(self.fingerprint)
        digest.update(np.asarray(grid, dtype=np.int64).tobytes())
        digest.update(pixels.tobytes())
        return ImageInput(digest.digest(), grid, self.merge_size, offset, pixels)
