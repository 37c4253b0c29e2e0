"""Deterministic screenshots for the image workloads: small PNGs drawn with Pillow from a seed (an application
window: title bar, sidebar, lines of text, buttons). The same seed gives the same bytes, a different seed a
different picture of the same size, so it takes the same number of tokens and only its content hash tells it apart.
"""
from __future__ import annotations

import base64
import functools
import io
import random

SIZE = (320, 192)  # width, height: 20 x 12 patches of 16 pixels, 60 tokens after Qwen3.5 / 3.6's 2x2 merge


@functools.lru_cache(maxsize=256)
def screenshot_png(seed: str) -> bytes:
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    width, height = SIZE
    shade = lambda lo, hi: tuple(rng.randint(lo, hi) for _ in range(3))  # noqa: E731
    image = Image.new("RGB", SIZE, shade(225, 255))
    draw = ImageDraw.Draw(image)
    draw.rectangle((0, 0, width, 18), fill=shade(40, 120))  # title bar
    sidebar = rng.randint(50, 90)
    draw.rectangle((0, 18, sidebar, height), fill=shade(180, 220))
    for y in range(26, height - 8, 10):  # lines of text, each its own length
        indent = sidebar + 8 + 8 * rng.randint(0, 3)
        draw.rectangle((indent, y, rng.randint(indent + 20, width - 8), y + 4), fill=shade(0, 90))
    for _ in range(rng.randint(1, 3)):  # buttons
        x, y = rng.randint(sidebar + 8, width - 60), rng.randint(30, height - 24)
        draw.rectangle((x, y, x + 50, y + 16), fill=shade(30, 200), outline=(0, 0, 0))
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def image_block(seed: str) -> dict:
    """An Anthropic ``image`` content block carrying the screenshot drawn from ``seed`` (as Claude Code's Read tool
    returns a PNG, and as a pasted screenshot arrives)."""
    data = base64.b64encode(screenshot_png(seed)).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
