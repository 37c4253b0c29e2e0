"""Images on every API against a real server (127.0.0.1, the real openai and anthropic SDKs) running qwen3.6-tiny
(the released vision-language layout): OpenAI chat `image_url` data URLs, Responses `input_image`, Anthropic `image`
blocks in user turns and inside `tool_result`. The prompt renders byte for byte as the official template (each image
expanded to its tokens, as transformers' processor does), greedy tokens equal transformers', count_tokens counts
image tokens (and /tokenize), a screenshot carried through a conversation is read from the cache and encoded once,
another screenshot in its place is named "image_changed" by the cache inspector, and bad inputs are 400s in each
API's shape with a bystander unaffected."""
from __future__ import annotations

import asyncio
import base64

import anthropic
import openai
import pytest

from engine.registry import resolve_model
from server.cache.miss_causes import CHANGE_IMAGE
from server.inspector.hook import inspect_finished
from server.inspector.store import Inspector
from server.pipeline.images import turn_images
from server.pipeline.plan import render_turn
from server.pipeline.turn import Turn
from tests.models.checkpoints.vision_models import hf_generate, hf_inputs, hf_processor, png
from tests.server.conftest import LiveServer

NEW_TOKENS = 5
SHOT = png(96, 64, seed=7)  # the screenshot of these tests

# A vision-language server of its own (~11 s to start): the images' fast cases are tests/models/vision/test_vision_models.py
# and tests/engine/test_image_inputs.py.
pytestmark = pytest.mark.slow


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_dir() -> str:
    return str(resolve_model("qwen3.6-tiny"))


@pytest.fixture(scope="module")
def vlm_server(hybrid_server) -> LiveServer:
    """qwen3.6-tiny (the hybrid architecture in the released layout, its vision tower included), the session's."""
    return hybrid_server


def _chat_messages(text: str, images: list[bytes]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def test_rendering_is_the_official_templates(vlm_server, vlm_dir):
    """Images in a user message and in a tool result render as the official template renders them."""
    ctx = vlm_server.ctx
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(SHOT)}},
                                     {"type": "text", "text": "Open the file."}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{\"path\": \"a.png\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [
            {"type": "text", "text": "a.png:"}, {"type": "image_url", "image_url": {"url": data_url(SHOT)}}]},
    ]
    turn, images = turn_images(ctx.images, Turn(messages=messages))
    ours = asyncio.run(ctx.prepare(render_turn, ctx, turn))
    official = [{**m, "content": [{"type": "image"} if p.get("type") == "image_url" else p for p in m["content"]]}
                if isinstance(m["content"], list) else m for m in messages]
    official[1]["tool_calls"] = [{**official[1]["tool_calls"][0], "function": {"name": "read",
                                                                               "arguments": {"path": "a.png"}}}]
    tools = None
    want = hf_processor(vlm_dir).apply_chat_template(official, tools=tools, add_generation_prompt=True, tokenize=False)
    assert ours == want and len(images) == 2


def test_openai_chat_with_images_equals_transformers(vlm_server, vlm_dir):
    """The prompt the engine prefilled is the processor's token for token, and the reply transformers' greedy
    tokens (as --record has them)."""
    images = [SHOT, png(40, 90, seed=8)]
    text = "What changed between these?"
    reply = vlm_server.chat(messages=_chat_messages(text, images), max_tokens=NEW_TOKENS, temperature=0,
                            extra_body={"ignore_eos": True})
    _, inputs = hf_inputs(vlm_dir, [{"role": "user", "content": [{"type": "image"}] * 2 + [
        {"type": "text", "text": text}]}], images)
    record = vlm_server.last_record()
    assert record["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    assert reply.usage.prompt_tokens == inputs["input_ids"].shape[1]
    assert record["output_token_ids"] == hf_generate(vlm_dir, inputs, NEW_TOKENS)


def test_a_screenshot_through_three_turns_is_read_from_the_cache_and_encoded_once(vlm_server):
    """An Anthropic conversation whose first tool result is a screenshot (Claude Code's Read tool): each later turn
    reads all earlier turns, the image span included, from the cache (at most a block short), and the image is
    encoded once."""
    client = vlm_server.anthropic()
    vlm_server.reset_prefix_cache()
    vision = vlm_server.in_engine(lambda engine: engine.runner.vision)
    encoded, shot = vision.num_encoded, png(120, 80, seed=70)  # a screenshot no other test sent
    tools = [{"name": "Read", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}]
    messages = [
        {"role": "user", "content": "Look at shot.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                           "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(shot).decode()}}]}]},
    ]
    previous = 0
    for turn in range(3):
        counted = client.messages.count_tokens(model=vlm_server.ctx.model_name, messages=messages, tools=tools)
        reply = client.messages.create(model=vlm_server.ctx.model_name, messages=messages, tools=tools,
                                       max_tokens=NEW_TOKENS)
        assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
        cached = reply.usage.cache_read_input_tokens
        if turn:
            assert cached >= previous - 4, f"turn {turn} read {cached} of the previous prompt's {previous} tokens"
        previous = reply.usage.input_tokens + cached
        text = "".join(b.text for b in reply.content if b.type == "text") or "ok"
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And now step {turn}?"}]
    assert vision.num_encoded - encoded == 1


def test_tokenize_counts_image_tokens_and_hashes_the_image_into_its_blocks(vlm_server):
    """`/tokenize` with images: the count chat prefills (each image expanded to its tokens), and cached_tokens as
    the engine would serve them: the prompt once prefilled is cached; the same tokens with another image of the same
    size are cached only up to that image."""
    http, block = vlm_server.http(), vlm_server.ctx.engine.facts.block_size
    vlm_server.reset_prefix_cache()
    messages = _chat_messages("Describe it.", [png(96, 64, seed=71)])
    counted = http.post("/tokenize", json={"messages": messages}).json()
    reply = vlm_server.chat(messages=messages, max_tokens=1, temperature=0)
    assert counted["count"] == reply.usage.prompt_tokens == len(counted["tokens"]) and counted["cached_tokens"] == 0
    again = http.post("/tokenize", json={"messages": messages}).json()
    other = http.post("/tokenize", json={"messages": _chat_messages("Describe it.", [png(96, 64, seed=72)])}).json()
    start = counted["tokens"].index(vlm_server.ctx.images.image_token_id)
    assert other["tokens"] == counted["tokens"] and counted["count"] - start > 2 * block  # same tokens, other pixels
    assert again["cached_tokens"] > start >= other["cached_tokens"]


def test_the_inspector_names_an_image_changed_at_the_same_place(vlm_server, monkeypatch):
    """A session's second turn with another screenshot of the same size where its first had one: the same tokens,
    a miss from the image's first block, which the cache inspector (as `--ui` wires it) names "image_changed"."""
    ctx = vlm_server.ctx
    inspector = Inspector(ctx.engine.facts.block_hasher, ctx.model_name, 10,
                          lambda ids: ctx.tokenizer.decode(ids, skip_special_tokens=False))
    monkeypatch.setattr(ctx, "inspector", inspector)
    monkeypatch.setattr(ctx, "on_finished", inspect_finished)
    ids = [vlm_server.chat(messages=_chat_messages("What is on it?", [png(64, 64, seed=seed)]), max_tokens=1,
                           temperature=0, prompt_cache_key="image-session").id for seed in (73, 74)]
    first, second = (inspector.by_id[i] for i in ids)
    assert second.parent_id == first.request_id and second.divergence.cause == CHANGE_IMAGE
    block = ctx.engine.facts.block_size
    # all of the prompt from the image's block on was the previous context: lost to the image, not to an eviction
    assert second.misses[CHANGE_IMAGE] == second.prompt_tokens - second.divergence.index // block * block > 0
    assert second.cached_tokens <= second.divergence.index


def test_responses_input_image(vlm_server):
    response = vlm_server.client().responses.create(
        model=vlm_server.ctx.model_name, max_output_tokens=NEW_TOKENS, temperature=0,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": data_url(SHOT)},
                                            {"type": "input_text", "text": "Describe it."}]}])
    assert response.status in ("completed", "incomplete") and response.usage.output_tokens == NEW_TOKENS
    image_tokens = 96 * 64 // (32 * 32)  # the screenshot's merged patches
    assert response.usage.input_tokens > image_tokens


def _truncated() -> bytes:
    return SHOT[: len(SHOT) // 2]


BAD_IMAGES = {
    "corrupt": {"url": "data:image/png;base64," + base64.b64encode(b"not a picture").decode()},
    "truncated": {"url": data_url(_truncated())},
    "bad base64": {"url": "data:image/png;base64,@@@"},
    "url fetching off": {"url": "https://example.com/a.png"},
    "bomb": {"url": data_url(__import__("tests.engine.test_image_inputs", fromlist=["x"])._png_header_only(
        40_000, 40_000))},
}


@pytest.mark.parametrize("case", sorted(BAD_IMAGES))
def test_bad_images_are_400s_in_each_apis_shape(vlm_server, case):
    image = BAD_IMAGES[case]
    with pytest.raises(openai.BadRequestError) as chat_error:
        vlm_server.chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": image},
                                                               {"type": "text", "text": "hi"}]}], max_tokens=2)
    assert chat_error.value.body["param"] == "messages.0.content.0"
    url = image["url"]
    source = ({"type": "url", "url": url} if not url.startswith("data:") else
              {"type": "base64", "media_type": "image/png", "data": url.split(",", 1)[1]})
    with pytest.raises(anthropic.BadRequestError) as messages_error:
        vlm_server.anthropic().messages.create(model=vlm_server.ctx.model_name, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "image", "source": source}]}]}])
    assert messages_error.value.body["type"] == "error"
    # a bystander is unaffected
    assert vlm_server.chat(messages=[{"role": "user", "content": "hello"}], max_tokens=2).choices[0].message


def test_too_many_images_and_an_image_in_the_system_prompt(vlm_server):
    limit = vlm_server.ctx.images.max_images
    with pytest.raises(openai.BadRequestError, match="--max-images"):
        vlm_server.chat(messages=_chat_messages("too many", [png(32, 32, seed=i) for i in range(limit + 1)]),
                        max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="system message cannot contain images"):
        vlm_server.chat(messages=[{"role": "system", "content": [{"type": "image_url",
                                                                   "image_url": {"url": data_url(SHOT)}}]},
                                  {"role": "user", "content": "hi"}], max_tokens=2)


def test_an_image_to_a_text_only_model_is_a_400(qwen_server):
    with pytest.raises(openai.BadRequestError, match="text only"):
        qwen_server.chat(messages=_chat_messages("what is it?", [SHOT]), max_tokens=2)
