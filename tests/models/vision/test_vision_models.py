"""Qwen3.5 / 3.5-MoE with their vision tower, on checkpoints transformers' save_pretrained wrote in the released
layout: greedy tokens equal transformers' ``generate`` (its processor, its chat template) with 1, 2 and 3 images of
different sizes, alone and batched with text-only requests, with chunked prefill, with the tower inside a small
step budget through preemption and with the cache hot; top-20 logprobs within 1e-4 in fp32. The prefix cache
hashes the images: the same image hits and is not encoded again, a different one in the same place misses from its
first block and gives a cold engine's tokens."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import RequestRejected
from engine.requests import EngineRequest
from tests.hf_oracle import assert_greedy_through_preemption, new_llm
from tests.models.checkpoints.vision_models import (hf_generate, hf_inputs, hf_next_logprobs, png, user_turn,
                                        vlm_checkpoint)

NEW_TOKENS = 6
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
# (text, image sizes): 1, 2 and 3 images of different sizes and aspect ratios, and text alone
CASES = [
    ("Describe the picture.", [(70, 50)]),
    ("Compare these two.", [(40, 90), (100, 36)]),
    ("Which of the three differs?", [(33, 33), (64, 128), (90, 60)]),
    ("No picture this time, just text.", []),
]
KINDS = ["qwen3_5", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=KINDS)
def vlm(request):
    """(checkpoint, prompts with their images, transformers' tokens and its processor's inputs per case)."""
    path = vlm_checkpoint(request.param)
    cases = []
    for i, (text, sizes) in enumerate(CASES):
        images = [png(w, h, seed=10 * i + j) for j, (w, h) in enumerate(sizes)]
        prompt, inputs = hf_inputs(path, user_turn(text, len(images)), images)
        cases.append((prompt, images, inputs, hf_generate(path, inputs, NEW_TOKENS)))
    return path, cases


@pytest.fixture(scope="module")
def llm(vlm) -> LLM:
    return new_llm(vlm[0], block_size=4, num_kv_blocks=512)


def _prompts(llm: LLM, cases) -> list:
    return [llm.image_prompt(prompt, images) for prompt, images, _, _ in cases]


@pytest.mark.slow  # two more checkpoints' greedy runs
def test_the_image_changes_the_output(vlm):
    path, cases = vlm
    prompt, images, inputs, _ = cases[0]
    _, other = hf_inputs(path, user_turn(CASES[0][0], 1), [png(70, 50, seed=99)])
    assert (hf_next_logprobs(path, inputs) - hf_next_logprobs(path, other)).abs().max() > 0.5
    assert len({tuple(want) for *_, want in cases}) == len(cases)


def test_prompt_ids_are_the_processors(vlm, llm):
    path, cases = vlm
    for prompt, (_, _, inputs, _) in zip(_prompts(llm, cases), cases):
        assert prompt.token_ids == inputs["input_ids"][0].tolist()


def test_greedy_alone_batched_and_hot(vlm, llm):
    """Each request alone, then all together (text-only among them), then all again with the cache hot: the
    same tokens as transformers, the hot run reading the images' blocks from the cache and encoding none."""
    path, cases = vlm
    llm.reset_prefix_cache()
    prompts, expected = _prompts(llm, cases), [want for *_, want in cases]
    for prompt, want in zip(prompts, expected):
        assert llm.generate(prompt, GREEDY)[0].token_ids == want
    llm.reset_prefix_cache()
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    vision = llm.engine.runner.vision
    encoded = vision.num_encoded
    hot = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in hot] == expected
    assert vision.num_encoded == encoded, "a cached image is not encoded again"
    for prompt, out in zip(prompts, hot):
        assert out.num_cached_tokens >= len(prompt.token_ids) - 4 - 1
    llm.engine.scheduler.kv.check_invariants()


def test_chunked_prefill_cuts_images(vlm, llm):
    """A 7-token budget with 4-token blocks: prefill chunks end inside images (each chunk takes its slice of the
    image's embeddings) and share steps with decodes."""
    path, cases = vlm
    llm = LLM(path, block_size=4, num_kv_blocks=512, max_num_batched_tokens=7, encoder_cache_mb=0,
              tokenizer=llm.tokenizer)
    assert [o.token_ids for o in llm.generate(_prompts(llm, cases), GREEDY)] == [want for *_, want in cases]


@pytest.mark.slow  # a third engine for the case (the scheduler alone: tests/sched/test_image_encoding.py)
def test_images_encoded_within_the_step_budget_through_preemption(vlm, llm):
    """The tower inside a 12-token step budget, at most 6 image tokens encoded a step (larger images alone in
    theirs, most ahead of their tokens), in a pool too small for every prompt at once: transformers' tokens."""
    path, cases = vlm
    small = LLM(path, block_size=4, num_kv_blocks=16, max_num_batched_tokens=12, max_image_tokens_per_step=6,
                tokenizer=llm.tokenizer)
    assert_greedy_through_preemption(small, _prompts(small, cases), [want for *_, want in cases])


@pytest.mark.slow  # two gloo ranks
@pytest.mark.parametrize("vlm", ["qwen3_5"], indirect=True)  # the MoE's split is tests/models/test_hybrid_models.py's
def test_tensor_parallel_2(vlm):
    """Two ranks on CPU, each with the whole tower (the language model split): transformers' tokens, images in
    chunks that share steps with text-only requests."""
    path, cases = vlm
    with new_llm(path, block_size=4, num_kv_blocks=256, max_num_batched_tokens=16, tensor_parallel_size=2) as llm:
        outs = llm.generate(_prompts(llm, cases), GREEDY)
    assert [o.token_ids for o in outs] == [want for *_, want in cases]


def test_top20_logprobs_within_1e_4(vlm, llm):
    path, cases = vlm
    llm.reset_prefix_cache()
    outs = llm.generate(_prompts(llm, cases), SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    for (_, _, inputs, _), out in zip(cases, outs):
        ref = hf_next_logprobs(path, inputs)
        top = out.outputs[0].logprobs[0].top
        ids = torch.tensor([t for t, _ in top])
        assert ids.tolist() == ref.topk(20).indices.tolist()
        torch.testing.assert_close(torch.tensor([lp for _, lp in top]), ref[ids], atol=1e-4, rtol=0)


def test_a_different_image_in_the_same_place_misses_from_its_first_block(vlm, llm):
    """Two prompts equal token for token (the same placeholders), the second image different: their block hashes
    agree up to the block holding that image's first token and differ from it on, so the second request reads
    nothing of it from the cache, and gives transformers' tokens."""
    path, cases = vlm
    prompt, images, _, want = cases[1]
    llm.reset_prefix_cache()
    first = llm.image_prompt(prompt, images)
    assert llm.generate(first, GREEDY)[0].token_ids == want
    changed = [images[0], png(100, 36, seed=1234)]
    again = llm.image_prompt(prompt, changed)
    assert again.token_ids == first.token_ids
    cut = again.images[1].offset // 4
    hashes = [llm.engine.prepare(EngineRequest(f"h{i}", p.token_ids, GREEDY, images=p.images)).block_hashes
              for i, p in enumerate((first, again))]
    assert hashes[0][:cut] == hashes[1][:cut]
    assert all(a != b for a, b in zip(hashes[0][cut:], hashes[1][cut:]))
    out = llm.generate(again, GREEDY)[0]
    assert out.num_cached_tokens <= cut * 4
    _, inputs = hf_inputs(path, user_turn(CASES[1][0], 2), changed)
    assert out.token_ids == hf_generate(path, inputs, NEW_TOKENS)


def test_language_model_only(vlm, llm):
    """--language-model-only: no tower in memory, text as before, images refused."""
    path, cases = vlm
    llm = LLM(path, block_size=4, num_kv_blocks=256, language_model_only=True, tokenizer=llm.tokenizer)
    assert llm.engine.runner.vision is None and llm.engine.image_token_id is None
    prompt, _, _, want = cases[-1]
    assert llm.generate(prompt, GREEDY)[0].token_ids == want
    with pytest.raises(RequestRejected, match="text only"):
        llm.image_prompt(cases[0][0], cases[0][1])


@pytest.mark.parametrize("name", ["qwen3.6-tiny", pytest.param("qwen3.6-moe-tiny", marks=pytest.mark.slow)])
@pytest.mark.slow  # builds the registry's tiny VLMs
def test_registry_tiny_models_read_images(name):
    """The registry's qwen3.6-tiny / qwen3.6-moe-tiny carry their tower in the released layout (with an MTP layer and
    a preprocessor_config.json): two images of different sizes give transformers' tokens."""
    from engine.registry import resolve_model

    path = str(resolve_model(name))
    images = [png(80, 48, seed=3), png(36, 100, seed=4)]
    prompt, inputs = hf_inputs(path, user_turn("Which one is taller?", 2), images)
    llm = new_llm(name, block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
    assert llm.generate(llm.image_prompt(prompt, images), GREEDY)[0].token_ids == hf_generate(path, inputs, NEW_TOKENS)
