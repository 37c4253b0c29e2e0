"""Gemma 3 with its vision tower (SigLIP + the multimodal projector) on a tiny Gemma3ForConditionalGeneration that
transformers' save_pretrained wrote in the released layout (tests/models/checkpoints/gemma_vision_models.py): greedy
tokens equal transformers' ``generate`` (its Gemma3Processor, the official chat template) with one image, two
images, an image in an earlier turn followed by text turns, and text alone; alone, batched, with the cache hot, and
with prefill chunks that may not end inside an image (its tokens attend to each other both ways, as transformers'
token_type_ids mask has them); top-20 logprobs within 1e-4 in fp32. A second turn carrying the same image reads it
from the cache and gives transformers' tokens; a different image in its place misses from its first block. Over
HTTP (the openai SDK, a data URL) the same, rendered by Gemma 3's template."""
from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import RequestRejected
from tests.hf_oracle import assert_varied
from tests.models.checkpoints.gemma_vision_models import (gemma3_generate, gemma3_hf_model, gemma3_inputs,
                                                          write_gemma3_vlm)
from tests.models.checkpoints.vision_models import png, user_turn
from tests.models.vision.image_checks import (CASES, assert_greedy_with_images, assert_other_image_misses,
                                              chunk_ends_inside_images, conversation, image_prompts,
                                              transformers_cases)
from tests.server.conftest import LiveServer, _live_server

pytestmark = pytest.mark.slow  # every test needs the checkpoint (a 262k-row vocabulary) and transformers' runs

NEW_TOKENS = 6
BLOCK = 4
TOKENS_PER_IMAGE = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3_vlm(tmp_path_factory):
    """(checkpoint, [(prompt text, images, processor inputs, transformers' tokens)] per case)."""
    path = str(write_gemma3_vlm(tmp_path_factory.mktemp("gemma3-vlm")))
    return path, transformers_cases(path, gemma3_inputs, gemma3_generate, NEW_TOKENS)


@pytest.fixture(scope="module")
def llm(gemma3_vlm) -> LLM:
    return LLM(gemma3_vlm[0], block_size=BLOCK, num_kv_blocks=512)


def _hf_next_logprobs(path: str, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(gemma3_hf_model(path)(**inputs).logits[0, -1].float(), -1)


def test_prompts_are_the_processors_and_outputs_depend_on_the_image(gemma3_vlm, llm):
    path, cases = gemma3_vlm
    for prompt, (_, _, inputs, _) in zip(image_prompts(llm, cases), cases):
        ids = prompt.token_ids if hasattr(prompt, "token_ids") else prompt
        assert ids == inputs["input_ids"][0].tolist()
    assert [len(p.images) for p in image_prompts(llm, cases)[:3]] == [1, 2, 1]
    assert all(i.num_tokens == TOKENS_PER_IMAGE for p in image_prompts(llm, cases)[:3] for i in p.images)
    assert_varied([want for *_, want in cases], 3)
    _, other = gemma3_inputs(path, CASES[0][0], [png(70, 50, seed=99)])
    assert (_hf_next_logprobs(path, cases[0][2]) - _hf_next_logprobs(path, other)).abs().max() > 0.5


def test_greedy_alone_batched_and_cache_hot(gemma3_vlm, llm):
    """Each request alone, then all together with the text-only one among them, then all again with the cache hot:
    transformers' tokens, the hot run reading every full block (images included) and encoding no image again."""
    _, cases = gemma3_vlm
    assert_greedy_with_images(llm, cases, BLOCK)


def test_top20_logprobs_within_1e_4(gemma3_vlm, llm):
    """The first token's top-20 alternatives: within 1e-4 of transformers' (causal attention among an image's
    tokens, instead of both ways, moves them by ~0.3 and changes the argmax)."""
    path, cases = gemma3_vlm
    llm.reset_prefix_cache()
    outs = llm.generate(image_prompts(llm, cases), SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    for (_, _, inputs, _), out in zip(cases, outs):
        ref = _hf_next_logprobs(path, inputs)
        top = out.outputs[0].logprobs[0].top
        ids = torch.tensor([t for t, _ in top])
        assert ids.tolist() == ref.topk(20).indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in top]), ref[ids], atol=1e-4, rtol=0)


def test_chunked_prefill_never_ends_inside_an_image(gemma3_vlm, llm):
    """A 20-token step budget with 4-token blocks, no encoder cache: chunks end before an image they cannot finish
    (an image's 16 tokens are computed in one step), share steps with decodes, and give transformers' tokens. An
    image larger than the whole budget is refused."""
    path, cases = gemma3_vlm
    small = LLM(path, block_size=BLOCK, num_kv_blocks=512, max_num_batched_tokens=20, encoder_cache_mb=0,
                tokenizer=llm.tokenizer)
    outs, chunk_ends, num_images, inside = chunk_ends_inside_images(small, image_prompts(small, cases), GREEDY)
    assert [o.token_ids for o in outs] == [want for *_, want in cases]
    assert num_images == 4 and not inside, "no chunk ends inside an image"
    assert any(end % 20 for end in chunk_ends), "some chunks end early, before an image"
    tight = LLM(path, block_size=BLOCK, num_kv_blocks=512, max_num_batched_tokens=12, tokenizer=llm.tokenizer)
    with pytest.raises(RequestRejected, match="one step"):
        tight.generate(tight.image_prompt(cases[0][0], cases[0][1]), GREEDY)


def test_next_turn_reads_the_image_from_the_cache(gemma3_vlm, llm):
    """Turn 1 sends a screenshot; turn 2 is turn 1, the reply and a new question: it reads all of turn 1 but its
    last block from the cache (the image's span included), encodes nothing, and equals transformers. The same turn
    with another picture in that place hashes the same up to the block holding the image's first token and misses
    from there on."""
    path, cases = gemma3_vlm
    llm.reset_prefix_cache()
    shot = [png(64, 64, seed=20)]
    first_text, first_inputs = gemma3_inputs(path, user_turn("What is on the screen?", 1), shot)
    first = llm.image_prompt(first_text, shot)
    reply = llm.generate(first, GREEDY)[0]
    assert reply.token_ids == gemma3_generate(path, first_inputs, NEW_TOKENS)
    text, inputs = gemma3_inputs(path, conversation(llm.tokenizer.decode(reply.token_ids)), shot)
    second = llm.image_prompt(text, shot)
    assert second.token_ids[:len(first)] == first.token_ids
    encoded = llm.engine.runner.vision.num_encoded
    out = llm.generate(second, GREEDY)[0]
    assert out.num_cached_tokens >= (len(first) - 1) // BLOCK * BLOCK > second.images[0].end
    assert llm.engine.runner.vision.num_encoded == encoded
    assert out.token_ids == gemma3_generate(path, inputs, NEW_TOKENS)

    other = llm.image_prompt(text, [png(64, 64, seed=21)])
    assert_other_image_misses(llm, second, other, BLOCK, GREEDY)


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def server(tmp_path_factory, gemma3_vlm) -> Iterator[LiveServer]:
    yield from _live_server(tmp_path_factory, gemma3_vlm[0],
                            EngineConfig(block_size=BLOCK, num_kv_blocks=512, max_model_len=1024))


def test_openai_sdk_image_url_and_the_next_turn_from_the_cache(server, gemma3_vlm):
    """A PNG as a data URL through the openai SDK: rendered by Gemma 3's template (family gemma3), prefilled as
    transformers' processor tokenizes it, answered with transformers' greedy tokens; the next turn (the reply and a
    question after it) reads the first turn, image included, from the cache and equals transformers too."""
    path, _ = gemma3_vlm
    assert server.ctx.family == "gemma3"
    shot = png(96, 64, seed=30)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(shot)}},
                                             {"type": "text", "text": "What is on the screen?"}]}]
    reply = server.chat(messages=messages, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    _, inputs = gemma3_inputs(path, user_turn("What is on the screen?", 1), [shot])
    record = server.last_record()
    assert record["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    assert record["output_token_ids"] == gemma3_generate(path, inputs, NEW_TOKENS)
    first_len = reply.usage.prompt_tokens

    answer = reply.choices[0].message.content
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And in the top left corner?"}]
    again = server.chat(messages=messages, max_tokens=NEW_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    _, inputs = gemma3_inputs(path, conversation(answer), [shot])
    record = server.last_record()
    assert record["prompt_token_ids"] == inputs["input_ids"][0].tolist()
    assert record["output_token_ids"] == gemma3_generate(path, inputs, NEW_TOKENS)
    assert again.usage.prompt_tokens_details.cached_tokens >= (first_len - 1) // BLOCK * BLOCK


def test_registry_tiny_model_reads_images():
    """The registry's gemma3-vision-tiny (Gemma3ForConditionalGeneration's released layout, built by the tiny
    builder) gives transformers' tokens for two images."""
    from engine.registry import resolve_model

    path = str(resolve_model("gemma3-vision-tiny"))
    images = [png(80, 48, seed=3), png(36, 100, seed=4)]
    prompt, inputs = gemma3_inputs(path, user_turn("Which one is taller?", 2), images)
    llm = LLM("gemma3-vision-tiny", block_size=BLOCK, num_kv_blocks=256)
    assert llm.generate(llm.image_prompt(prompt, images), GREEDY)[0].token_ids == gemma3_generate(path, inputs,
                                                                                                   NEW_TOKENS)


def test_anthropic_screenshot_in_a_tool_result_is_read_from_the_cache(server):
    """Claude Code's Read tool returns a PNG inside a tool_result: Gemma 3 reads it (its 16 soft tokens in the
    prompt, count_tokens counting them), and the next turn reads the whole earlier conversation, image included,
    from the cache (at most a block short), encoding the image once."""
    client = server.anthropic()
    shot = png(120, 80, seed=31)
    vision = server.in_engine(lambda engine: engine.runner.vision)
    encoded = vision.num_encoded
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
    counted = client.messages.count_tokens(model=server.ctx.model_name, messages=messages, tools=tools)
    first = client.messages.create(model=server.ctx.model_name, messages=messages, tools=tools, max_tokens=NEW_TOKENS)
    prompt = server.last_record()["prompt_token_ids"]
    assert prompt.count(262144) == TOKENS_PER_IMAGE and counted.input_tokens == len(prompt)
    messages += [{"role": "assistant", "content": "".join(b.text for b in first.content if b.type == "text") or "ok"},
                 {"role": "user", "content": "And now?"}]
    again = client.messages.create(model=server.ctx.model_name, messages=messages, tools=tools, max_tokens=NEW_TOKENS)
    assert again.usage.cache_read_input_tokens >= len(prompt) - BLOCK
    assert vision.num_encoded - encoded == 1


def test_prompt_logprobs_score_an_image_whole(gemma3_vlm, llm):
    """Prompt logprobs with a scoring budget (10 a step) smaller than an image (16 tokens): the image is scored
    alone in its step rather than cut, and every position's logprob equals the unchunked run's."""
    path, cases = gemma3_vlm
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    llm.reset_prefix_cache()
    want = llm.generate(llm.image_prompt(cases[1][0], cases[1][1]), params)[0]
    small = LLM(path, block_size=BLOCK, num_kv_blocks=512, max_num_batched_tokens=24, max_scored_tokens_per_step=10,
                tokenizer=llm.tokenizer)
    got = small.generate(small.image_prompt(cases[1][0], cases[1][1]), params)[0]
    assert got.token_ids == want.token_ids
    pairs = list(zip(want.outputs[0].prompt_logprobs[1:], got.outputs[0].prompt_logprobs[1:]))
    assert len(pairs) == len(want.prompt_token_ids) - 1
    assert max(abs(a.logprob - b.logprob) for a, b in pairs) < 1e-4
