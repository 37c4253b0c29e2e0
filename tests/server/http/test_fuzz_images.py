"""A fuzz run over the image fields of every API (hypothesis), against the vision-language server (qwen3.6-tiny):
the picture's bytes (valid PNG / JPEG / GIF / WebP / BMP in odd modes and shapes, bit flips, truncations, junk, an empty
file, a decompression bomb's header), how they travel (data URLs with right and wrong media types, broken or unpadded
or URL-safe base64, http / file / relative URLs, no URL at all) and where (an OpenAI chat part in each role's message, a
Responses `input_image`, an Anthropic `image` block in a user turn or inside a `tool_result`), with the field shapes
bent (strings for objects, numbers, nulls, missing keys). No answer is a 5xx, every error is a 400 in its API's shape
naming the field, a well-formed image always generates, and afterwards the server holds no sequence, every KV page is
free or cached, and a bystander is served. KVSERVE_IMAGE_FUZZ_CASES cases (150 unless set)."""
from __future__ import annotations

import base64
import io
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.engine.test_image_inputs import _png_header_only
from tests.server.conftest import LiveServer

pytestmark = pytest.mark.slow  # the vision-language server of its own (~11 s to start) and a few hundred requests

CASES = int(os.environ.get("KVSERVE_IMAGE_FUZZ_CASES", "150"))
FORMATS = {"png": "image/png", "jpeg": "image/jpeg", "gif": "image/gif", "webp": "image/webp", "bmp": "image/bmp"}
MODES = ("RGB", "RGBA", "L", "LA", "P", "1", "I;16")


# the PIL modes each format writes as they are (others are converted to RGB first)
WRITES = {"png": MODES, "gif": ("P", "L", "1"), "bmp": ("RGB", "P", "L", "1"), "jpeg": ("RGB", "L"),
          "webp": ("RGB", "RGBA")}


def encode(fmt: str, mode: str, width: int, height: int, seed: int) -> bytes:
    """A random picture in PIL ``mode``, saved as ``fmt``."""
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    if mode in WRITES[fmt]:
        image = image.convert("I").convert("I;16") if mode == "I;16" else image.convert(mode)
    buf = io.BytesIO()
    image.save(buf, format=fmt.upper())
    return buf.getvalue()


@dataclass(frozen=True)
class Picture:
    data: bytes
    media_type: str
    valid: bool | None  # True: decodes; False: must be refused; None: a damaged file either way


@st.composite
def pictures(draw: st.DrawFn, intact: bool) -> Picture:
    kind = "image" if intact else draw(st.sampled_from(["image", "flipped", "truncated", "junk", "empty", "bomb"]))
    fmt = draw(st.sampled_from(sorted(FORMATS)))
    width, height = draw(st.sampled_from([(1, 1), (32, 32), (96, 64), (300, 7), (7, 300), (48, 160)]))
    image = encode(fmt, draw(st.sampled_from(MODES)), width, height, draw(st.integers(0, 9)))
    if kind == "image":
        return Picture(image, FORMATS[fmt], True)
    if kind == "flipped":
        data = bytearray(image)
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        return Picture(bytes(data), FORMATS[fmt], None)
    if kind == "truncated":
        return Picture(image[: draw(st.integers(0, len(image) - 1))], FORMATS[fmt], None)
    if kind == "junk":
        return Picture(draw(st.binary(min_size=1, max_size=64)), FORMATS[fmt], False)
    if kind == "empty":
        return Picture(b"", FORMATS[fmt], False)
    side = draw(st.sampled_from([20_000, 65_535]))
    return Picture(_png_header_only(side, side), "image/png", False)


@dataclass(frozen=True)
class Link:
    url: Any  # what the client sends where a URL (or base64 data) belongs
    b64: Any  # the bare base64 text for Anthropic's base64 source
    media_type: Any
    exact: bool  # the picture travels intact, in the documented form


@st.composite
def links(draw: st.DrawFn, picture: Picture, intact: bool) -> Link:
    b64 = base64.b64encode(picture.data).decode()
    how = "exact" if intact else draw(st.sampled_from(["exact", "wrong type", "no type", "newlines", "unpadded", "urlsafe",
                                "bad chars", "not base64", "http", "file", "path", "empty", "number", "none"]))
    media = picture.media_type
    if how == "wrong type":
        media = draw(st.sampled_from(["text/plain", "application/octet-stream", "image/svg+xml", "image/jpeg"]))
    if how in ("exact", "wrong type"):
        return Link(f"data:{media};base64,{b64}", b64, media, how == "exact")
    if how == "no type":
        return Link(f"data:;base64,{b64}", b64, "", False)
    if how == "newlines":
        wrapped = "\n".join(b64[i:i + 76] for i in range(0, len(b64), 76))
        return Link(f"data:{media};base64,{wrapped}", wrapped, media, False)
    if how == "unpadded":
        return Link(f"data:{media};base64,{b64.rstrip('=')}", b64.rstrip("="), media, False)
    if how == "urlsafe":
        safe = base64.urlsafe_b64encode(picture.data).decode()
        return Link(f"data:{media};base64,{safe}", safe, media, False)
    if how == "bad chars":
        return Link(f"data:{media};base64,@@{b64}!!", f"@@{b64}!!", media, False)
    if how == "not base64":
        return Link(f"data:{media},{picture.data[:40].decode('latin-1')}", "", media, False)
    if how == "http":
        return Link("http://127.0.0.1:9/a.png", "", media, False)
    if how == "file":
        return Link("file:///etc/passwd", "", media, False)
    if how == "path":
        return Link("../images/a.png", "", media, False)
    if how == "empty":
        return Link("", "", media, False)
    return Link(draw(st.integers()) if how == "number" else None, None, None, False)


@dataclass(frozen=True)
class Case:
    path: str
    body: dict
    must_generate: bool  # well-formed: a 200 with a generated token is the only right answer
    label: str


def _text(text: str = "What is it?") -> dict:
    return {"type": "text", "text": text}


@st.composite
def chat_cases(draw: st.DrawFn, model: str, picture: Picture, link: Link, intact: bool) -> Case:
    shape = "object" if intact else draw(st.sampled_from(["object", "string", "no url", "null", "list", "extra keys", "as input_image"]))
    detail = draw(st.sampled_from([None, "auto", "low", "high", "ultra", 3]))
    field: Any = {"url": link.url} if detail is None else {"url": link.url, "detail": detail}
    part: dict = {"type": "image_url", "image_url": field}
    if shape == "string":
        part["image_url"] = link.url
    elif shape == "no url":
        part["image_url"] = {"detail": "auto"}
    elif shape == "null":
        part["image_url"] = None
    elif shape == "list":
        part["image_url"] = [field]
    elif shape == "extra keys":
        field = {**field, "cache": True}
        part = {**part, "image_url": field, "name": "shot.png"}
    elif shape == "as input_image":
        part = {"type": "input_image", "image_url": link.url}
    role = "user" if intact else draw(st.sampled_from(["user", "system", "assistant", "tool"]))
    message: dict = {"role": role, "content": [part, _text()]}
    messages = [message] if role == "user" else (
        [{"role": "user", "content": "hi"},
         {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
             "name": "shot", "arguments": "{}"}}]}, {**message, "tool_call_id": "c1"}] if role == "tool" else
        [message, {"role": "user", "content": "hi"}])
    well_formed = (picture.valid is True and link.exact and shape in ("object", "extra keys") and role == "user"
                   and detail in (None, "auto", "low", "high"))
    return Case("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1}, well_formed,
                f"chat {shape} in {role}, detail {detail!r}")


@st.composite
def responses_cases(draw: st.DrawFn, model: str, picture: Picture, link: Link, intact: bool) -> Case:
    shape = "url" if intact else draw(st.sampled_from(["url", "file id", "nothing", "object url", "detail"]))
    part: dict = {"type": "input_image"}
    if shape == "url":
        part["image_url"] = link.url
    elif shape == "file id":
        part["file_id"] = "file-abc123"
    elif shape == "object url":
        part["image_url"] = {"url": link.url}
    elif shape == "detail":
        part.update(image_url=link.url, detail=draw(st.sampled_from(["auto", "low", "high", "", "huge"])))
    body = {"model": model, "input": [{"type": "message", "role": "user", "content": [
        part, {"type": "input_text", "text": "What is it?"}]}], "max_output_tokens": 1}
    well_formed = picture.valid is True and link.exact and (
        shape == "url" or (shape == "detail" and part["detail"] in ("auto", "low", "high")))
    return Case("/v1/responses", body, well_formed, f"responses {shape}")


@st.composite
def anthropic_cases(draw: st.DrawFn, model: str, picture: Picture, link: Link, intact: bool) -> Case:
    shape = "base64" if intact else draw(st.sampled_from(["base64", "url", "file", "no source", "source string", "no media type"]))
    if shape == "base64":
        source: Any = {"type": "base64", "media_type": link.media_type, "data": link.b64}
    elif shape == "url":
        source = {"type": "url", "url": link.url}
    elif shape == "file":
        source = {"type": "file", "file_id": "file_011"}
    elif shape == "source string":
        source = link.url
    elif shape == "no media type":
        source = {"type": "base64", "data": link.b64}
    else:
        source = None
    block: dict = {"type": "image"} if source is None else {"type": "image", "source": source}
    in_tool_result = draw(st.booleans())
    if in_tool_result:
        messages = [{"role": "user", "content": "look"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [block]}]}]
    else:
        messages = [{"role": "user", "content": [block, _text()]}]
    body = {"model": model, "max_tokens": 1, "messages": messages}
    if in_tool_result:
        body["tools"] = [{"name": "shot", "description": "take a screenshot", "input_schema": {"type": "object"}}]
    well_formed = (picture.valid is True and shape == "base64" and link.exact
                   and link.media_type in ("image/png", "image/jpeg", "image/gif", "image/webp"))
    return Case("/v1/messages", body, well_formed, f"messages {shape}{' in tool_result' if in_tool_result else ''}")


@st.composite
def cases(draw: st.DrawFn, model: str) -> tuple[Case, Picture]:
    intact = draw(st.integers(0, 3)) == 0  # a quarter well-formed: every image field's variant, the rest bent
    picture = draw(pictures(intact))
    link = draw(links(picture, intact))
    api = draw(st.sampled_from([chat_cases, responses_cases, anthropic_cases]))
    return draw(api(model, picture, link, intact)), picture


def _error_is_in_shape(path: str, payload: dict) -> bool:
    if path == "/v1/messages":
        return payload.get("type") == "error" and payload["error"]["type"] == "invalid_request_error" \
            and isinstance(payload["error"]["message"], str)
    error = payload.get("error") or {}
    return set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


def test_image_fields_fuzzed_on_every_api(hybrid_server: LiveServer) -> None:
    model = hybrid_server.ctx.model_name
    outcomes: dict[tuple[str, int], int] = {}
    generated_well_formed = 0

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(cases(model))
    def run(case_and_picture: tuple[Case, Picture]) -> None:
        nonlocal generated_well_formed
        case, picture = case_and_picture
        with hybrid_server.http() as http:
            response = http.post(case.path, json=case.body)
        outcomes[(case.label.split()[0], response.status_code)] = \
            outcomes.get((case.label.split()[0], response.status_code), 0) + 1
        context = (case.label, picture.media_type, len(picture.data), response.text[:400])
        assert response.status_code in (200, 400), context
        if response.status_code == 400:
            assert not case.must_generate, context
            assert _error_is_in_shape(case.path, response.json()), context
        elif case.must_generate:
            generated_well_formed += 1
        # a picture that cannot be read is never skipped silently: the request that carries it is refused
        assert not (picture.valid is False and response.status_code == 200), context

    run()
    assert generated_well_formed >= CASES // 10, outcomes  # the run reached the vision tower, not only refusals
    assert any(status == 400 for _, status in outcomes), outcomes
    hybrid_server.wait_until_idle()
    stats = hybrid_server.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, "every block is free or cached-and-evictable"
    hybrid_server.in_engine(lambda engine: engine.scheduler.kv.check_invariants())
    assert hybrid_server.chat(messages=[{"role": "user", "content": "still there?"}], max_tokens=2).choices
    print(f"\nimage fuzz: {sum(outcomes.values())} requests, {generated_well_formed} well-formed generated; "
          + ", ".join(f"{api} {status}: {n}" for (api, status), n in sorted(outcomes.items())))
