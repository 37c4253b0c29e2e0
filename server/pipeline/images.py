"""Images in a turn, the server's side: every API's image content becomes chat's image part in the turn
(`image_url` with a URL: OpenAI chat as sent, Responses' `input_image`, Anthropic's `image` blocks as data URLs, in
user messages and in tool results alike); here each image part is taken out of the messages, read (a data URL, or
an http(s) URL where the operator allowed fetching: `--allow-image-urls`), preprocessed by the model's own image
processor, and replaced by the text the official template renders for an image
(``<|vision_start|><|image_pad|><|vision_end|>``, after ``Picture n: `` with ``add_vision_id``; Gemma 3's
``<start_of_image>``, which becomes its processor's text for the image before tokenizing). After tokenizing,
each placeholder token is expanded to the image's run of tokens (`engine.multimodal.expand_placeholders`), so the
prompt is byte for byte the template's and token for token the processor's.

Every problem is a 400 naming the part: a model that reads text only, too many images (`--max-images`), a URL while
fetching is off or to a host not allowed, a corrupt, truncated or oversized image, an image in a system message.
"""
from __future__ import annotations

import base64
import binascii
import urllib.parse
import urllib.request
from dataclasses import dataclass, replace
from typing import Any

from engine.errors import RequestRejected
from engine.models.vision.preprocess import MAX_IMAGE_BYTES, QWEN_PLACEHOLDER, ImagePreprocessor
from engine.multimodal import ImageInput, ImagePrompt, expand_placeholders
from server.api.protocol import APIError
from server.pipeline.turn import Turn

# chat's image part, Responses' input_image (as the Responses adapter passes it through)
IMAGE_PART_TYPES = ("image_url", "input_image")


@dataclass(frozen=True)
class ImageFetch:
    """Whether and how image URLs are fetched (off by default: a server that fetches URLs a client names can be
    made to reach hosts the client cannot)."""

    allow_urls: bool = False
    hosts: tuple[str, ...] = ()  # allowed hosts (empty: any, once fetching is on)
    timeout_s: float = 10.0
    max_bytes: int = MAX_IMAGE_BYTES


def _bad(message: str, where: str, code: str | None = "invalid_image") -> APIError:
    return APIError(400, message, param=where, code=code)


def image_url(part: Any) -> str | None:
    """The URL of an image part (None: not an image part)."""
    if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
        return None
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    return url if isinstance(url, str) else ""


def split_images(messages: list[dict], add_vision_id: bool = False, placeholder: str = QWEN_PLACEHOLDER,
                 glued: bool = False) -> tuple[list[dict], list[tuple[str, str]]]:
    """The messages with each image part replaced by the template's text for it (``placeholder``: Qwen's
    vision markers, Gemma 3's ``<start_of_image>``), and each image's (URL, where) in prompt order. Messages without
    images are kept as they are. ``glued`` (Gemma 3): the template writes a list's parts one after another, so the
    placeholder joins the text parts on either side of it into one (text parts alone are still flattened a line
    apart, as for every template that takes strings)."""
    out: list[dict] = []
    found: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(image_url(p) is not None for p in content):
            out.append(message)
            continue
        if message.get("role") in ("system", "developer", "assistant"):
            raise _bad(f"a{'n' if message['role'] == 'assistant' else ''} {message['role']} message cannot contain "
                       "images", f"messages.{i}.content")
        parts = []
        for j, part in enumerate(content):
            url = image_url(part)
            if url is None:
                parts.append(part)
                continue
            found.append((url, part.get("where") or f"messages.{i}.content.{j}"))  # an adapter's own field path
            prefix = f"Picture {len(found)}: " if add_vision_id else ""
            parts.append({"type": "text", "text": prefix + placeholder, "image": True})
        out.append({**message, "content": _glue(parts) if glued else [_text_part(p) for p in parts]})
    return out, found


def _text_part(part: Any) -> Any:
    return {"type": "text", "text": part["text"]} if isinstance(part, dict) and "image" in part else part


def _glue(parts: list) -> list:
    """Each image's text joined to the text parts next to it (`split_images`)."""
    out: list = []
    for part in parts:
        is_text = isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        joins = out and is_text and (part.get("image") or out[-1].get("image"))
        if joins:
            out[-1] = {"type": "text", "text": out[-1]["text"] + part["text"], "image": bool(part.get("image"))}
        else:
            out.append(part)
    return [_text_part(p) for p in out]


def _data_url_bytes(url: str, where: str) -> bytes:
    header, sep, data = url.partition(",")
    if not sep or not header.startswith("data:"):
        raise _bad("a data URL needs the form data:<media type>;base64,<data>", where)
    if not header.endswith(";base64"):
        return urllib.parse.unquote_to_bytes(data)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad("the image's base64 data is not valid base64", where) from None


def _fetch(url: str, where: str, fetch: ImageFetch) -> bytes:
    if not fetch.allow_urls:
        raise _bad("fetching image URLs is off on this server (--allow-image-urls); send the image as a data URL "
                   "(data:image/png;base64,...)", where, code="image_url_fetching_disabled")
    host = urllib.parse.urlsplit(url).hostname or ""
    if fetch.hosts and host not in fetch.hosts:
        raise _bad(f"images from {host!r} are not fetched (--image-url-hosts)", where)
    try:
        with urllib.request.urlopen(url, timeout=fetch.timeout_s) as response:
            data = response.read(fetch.max_bytes + 1)
    except OSError as exc:
        raise _bad(f"the image could not be fetched: {exc}", where) from None
    if len(data) > fetch.max_bytes:
        raise _bad(f"the image at the URL has more than {fetch.max_bytes} bytes", where)
    return data


def image_bytes(url: str, where: str, fetch: ImageFetch) -> bytes:
    """The encoded image a URL names: a data URL's own bytes, or an http(s) URL's (if fetching is allowed)."""
    if url.startswith("data:"):
        return _data_url_bytes(url, where)
    if url.startswith(("http://", "https://")):
        return _fetch(url, where, fetch)
    raise _bad("an image URL must be a data: URL (or http(s), where the server fetches them)", where)


@dataclass(frozen=True)
class ImageReader:
    """What a served vision-language model reads images with: its processor, its placeholder token, the limits."""

    preprocessor: ImagePreprocessor
    image_token_id: int
    max_images: int = 16
    fetch: ImageFetch = ImageFetch()

    def read(self, url: str, where: str) -> ImageInput:
        try:
            return self.preprocessor.preprocess(image_bytes(url, where, self.fetch))
        except RequestRejected as exc:
            raise _bad(str(exc), where) from None


def turn_images(reader: ImageReader | None, turn: Turn) -> tuple[Turn, tuple[ImageInput, ...]]:
    """The turn with its images replaced by the template's text, and the images, read and preprocessed (a turn
    without images comes back as it is)."""
    messages, found = split_images(turn.messages, bool(turn.template_kwargs.get("add_vision_id")),
                                   reader.preprocessor.placeholder if reader is not None else QWEN_PLACEHOLDER,
                                   reader is not None and reader.preprocessor.expansion is not None)
    if not found:
        return turn, ()
    if reader is None:
        raise _bad("this model reads text only (no vision tower is loaded: a text-only model, or the server runs "
                   "with --language-model-only); send the request without images", found[0][1],
                   code="images_unsupported")
    if len(found) > reader.max_images:
        raise _bad(f"the request has {len(found)} images; at most {reader.max_images} are accepted (--max-images)",
                   found[reader.max_images][1], code="limit_exceeded")
    return replace(turn, messages=messages), tuple(reader.read(url, where) for url, where in found)


def prompt_text(reader: ImageReader | None, text: str, images: tuple[ImageInput, ...]) -> str:
    """The rendered prompt as the model's processor tokenizes it: Gemma 3's ``<start_of_image>`` becomes the
    image's soft-token run between blank lines (after the template, which trims the text around it)."""
    return reader.preprocessor.prompt_text(text) if images and reader is not None else text


def expand(reader: ImageReader | None, prompt_ids: list[int], images: tuple[ImageInput, ...]) -> ImagePrompt:
    """The prompt with each placeholder token expanded to its image's tokens (a 400 if the prompt's placeholders
    are not the images': the text itself held the placeholder token)."""
    if not images or reader is None:
        return ImagePrompt(prompt_ids)
    try:
        return expand_placeholders(prompt_ids, images, reader.image_token_id)
    except ValueError as exc:
        raise _bad(f"the prompt's image placeholders do not match its images ({exc})", "messages") from None
