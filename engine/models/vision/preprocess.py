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
import re
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


# Qwen3.5 / 3.6's template renders an image as its one placeholder token between the vision markers
QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
# Gemma 3's renders <start_of_image>, which its processor replaces by the image's soft tokens between blank lines
GEMMA3_PLACEHOLDER = "<start_of_image>"
GEMMA3_EXPANSION = "\n\n<start_of_image><image_soft_token><end_of_image>\n\n"
# Gemma 4's renders \n\n<|image|>\n\n; its processor puts the soft tokens between the begin and end markers
GEMMA4_PLACEHOLDER = "<|image|>"
GEMMA4_EXPANSION = "<|image><|image|><image|>"
GEMMA4_MARGIN = "\n\n"


@dataclass
class ImagePreprocessor:
    """One model's image processor (its directory's preprocessor_config.json) and the limits on what it decodes."""

    processor: object
    merge_size: int
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    # Gemma 3: every image is this square of soft tokens (1, side, side), read by 1-D positions
    soft_tokens: tuple[int, int, int] | None = None
    # Gemma 4: an image's soft tokens are its patch grid pooled this many patches a side (a count per image), read
    # by 1-D positions
    pooling: int | None = None
    # an image's tokens attend to each other both ways (Gemma 3; Gemma 4 with use_bidirectional_attention "vision")
    bidirectional: bool = False
    # what the chat template renders for an image, and the text the model's processor puts in its place before
    # tokenizing (None: the same; each placeholder token then grows to the image's tokens, `expand_placeholders`)
    placeholder: str = QWEN_PLACEHOLDER
    expansion: str | None = None
    # what the template writes on both sides of the placeholder (Gemma 4: a blank line), put there once by
    # `prompt_text` whether the text came from the template or from the server, which glues the bare placeholder to
    # the text parts beside it (server/pipeline/images.py) before the template trims the message's text
    margin: str = ""

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ImagePreprocessor":
        from transformers import AutoImageProcessor

        processor = AutoImageProcessor.from_pretrained(str(model_dir))
        config_file = Path(model_dir) / "config.json"
        config = json.loads(config_file.read_text()) if config_file.exists() else {}
        if config.get("model_type") == "gemma3":
            side = int(config.get("mm_tokens_per_image", 256) ** 0.5)
            return cls(processor, 1, soft_tokens=(1, side, side), bidirectional=True, placeholder=GEMMA3_PLACEHOLDER,
                       expansion=GEMMA3_EXPANSION)
        if config.get("model_type") == "gemma4":
            both_ways = (config.get("text_config") or {}).get("use_bidirectional_attention") == "vision"
            return cls(processor, 1, pooling=int(processor.pooling_kernel_size), bidirectional=both_ways,
                       placeholder=GEMMA4_PLACEHOLDER, expansion=GEMMA4_EXPANSION, margin=GEMMA4_MARGIN)
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

    def prompt_text(self, rendered: str) -> str:
        """A rendered prompt as the processor tokenizes it: each image's placeholder text in its expansion (with
        its margin on both sides, once)."""
        if self.expansion is None:
            return rendered
        margin = f"(?:{re.escape(self.margin)})?" if self.margin else ""
        expanded = self.margin + self.expansion + self.margin
        return re.sub(margin + re.escape(self.placeholder) + margin, lambda _: expanded, rendered)

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """The processor's settings: part of every content hash it makes."""
        return json.dumps(self.processor.to_dict(), sort_keys=True, default=str).encode()

    def preprocess(self, data: bytes, offset: int = 0) -> ImageInput:
        """``data`` (an encoded image) as an `ImageInput` at prompt index ``offset``."""
        image = self.decode(data)
        gemma3 = self.soft_tokens is not None
        try:  # Gemma 3: the whole image resized to the tower's square, no pan-and-scan crops
            out = self.processor(images=[image], return_tensors="np", **({"do_pan_and_scan": False} if gemma3 else {}))
        except ValueError as e:  # e.g. an aspect ratio beyond the processor's bounds
            raise ImageError(f"the image cannot be preprocessed: {e}") from None
        if self.pooling is not None:
            pixels, grid = self._pooled_patches(out)
        else:
            pixels = out["pixel_values"][0] if gemma3 else out["pixel_values"]
            grid = self.soft_tokens or tuple(int(v) for v in out["image_grid_thw"][0])
        pixels = np.ascontiguousarray(pixels, dtype=np.float32)
        digest = blake2b(digest_size=16)
        digest.update(self.fingerprint)
        digest.update(np.asarray(grid, dtype=np.int64).tobytes())
        digest.update(pixels.tobytes())
        return ImageInput(digest.digest(), grid, self.merge_size, offset, pixels,
                          mrope=not gemma3 and self.pooling is None, bidirectional=self.bidirectional)

    def _pooled_patches(self, out) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Gemma 4: the image's patches without the processor's padding (row by row) and its soft-token grid."""
        positions = out["image_position_ids"][0]  # (column, row) per patch; (-1, -1) pads
        real = (positions >= 0).all(-1)
        width, height = (int(v) + 1 for v in positions[real].max(0))
        k = self.pooling
        grid = (1, height // k, width // k)
        assert grid[1] * grid[2] == int(out["num_soft_tokens_per_image"][0]), "the processor's soft-token count"
        return out["pixel_values"][0][real], grid
