"""Checks the Gemma vision tests share (tests/models/vision/test_gemma_vision.py, test_gemma4_vision.py): their
cases and transformers' answers to them, the engine's prompts of the cases, greedy tokens alone, batched and cache
hot, where chunked prefill ended, and a different image in the same place missing the prefix cache from its first
block."""
from __future__ import annotations

from collections.abc import Callable

from engine import LLM, SamplingParams
from engine.multimodal import ImagePrompt
from engine.requests import EngineRequest
from tests.hf_oracle import assert_greedy_alone_and_together, assert_greedy_cache_hot
from tests.models.checkpoints.vision_models import png, user_turn


def conversation(reply: str) -> list[dict]:
    """An image in the first user turn, the model's reply, then a text turn: the image sits in the cached prefix."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is on the screen?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": reply}]},
            {"role": "user", "content": [{"type": "text", "text": "And in the top left corner?"}]}]


# (messages, image sizes): one image, two of different sizes, an image then text turns, text alone
CASES = [
    (user_turn("Describe the picture.", 1), [(70, 50)]),
    (user_turn("Compare these two.", 2), [(40, 90), (100, 36)]),
    (conversation("A terminal with a failing test."), [(64, 64)]),
    (user_turn("No picture this time, just text.", 0), []),
]


def transformers_cases(path: str, inputs: Callable, generate: Callable, new_tokens: int) -> list[tuple]:
    """`CASES` as ``(prompt text, images, processor inputs, transformers' tokens)``: ``inputs(path, messages,
    images)`` gives the first and third, ``generate(path, inputs, new_tokens)`` the last."""
    cases = []
    for i, (messages, sizes) in enumerate(CASES):
        images = [png(w, h, seed=10 * i + j) for j, (w, h) in enumerate(sizes)]
        prompt, encoded = inputs(path, messages, images)
        cases.append((prompt, images, encoded, generate(path, encoded, new_tokens)))
    return cases


def image_prompts(llm: LLM, cases) -> list:
    """The engine's prompt of each ``(prompt text, images, ...)`` case: an `ImagePrompt`, or token ids."""
    return [llm.image_prompt(prompt, images) if images else llm.encode(prompt) for prompt, images, *_ in cases]


def assert_greedy_with_images(llm: LLM, cases, block: int) -> None:
    """Each case alone, then all together with the text-only one among them, then all again with the cache hot:
    transformers' tokens, the hot run reading every full block (images included) and encoding no image again."""
    llm.reset_prefix_cache()
    prompts, expected = image_prompts(llm, cases), [want for *_, want in cases]
    assert_greedy_alone_and_together(llm, prompts, expected)
    vision = llm.engine.runner.vision
    encoded = vision.num_encoded
    assert_greedy_cache_hot(llm, prompts, expected, block)
    assert vision.num_encoded == encoded, "a cached image is not encoded again"


def chunk_ends_inside_images(llm: LLM, prompts: list,
                             params: SamplingParams) -> tuple[list, list[int], int, list[int]]:
    """Generate ``prompts`` recording each step: ``(outputs, where chunks ended, how many images, the chunk ends
    that fall inside an image)`` (none where an image's tokens attend to each other both ways)."""
    images, chunk_ends = {}, []  # seq id -> its images; (seq id, where a chunk ended)
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        images.update((new.seq_id, new.images) for new in out.new_sequences)
        chunk_ends.extend((i, c + n) for i, c, n in zip(out.seq_ids, out.num_computed_tokens, out.num_new_tokens))
        return out

    llm.engine.scheduler.schedule = recording
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.scheduler.schedule = schedule
    inside = [end for seq_id, end in chunk_ends for i in images[seq_id] if i.offset < end < i.end]
    return outs, [end for _, end in chunk_ends], sum(map(len, images.values())), inside


def assert_other_image_misses(llm: LLM, prompt: ImagePrompt, other: ImagePrompt, block: int,
                              params: SamplingParams) -> None:
    """``other`` is ``prompt`` (already cached) with another picture in its first image's place: the same block
    hashes up to the block holding that image's first token, none from there on, and no cache hit past it."""
    cut = other.images[0].offset // block
    hashes = [llm.engine.prepare(EngineRequest(f"h{i}", p.token_ids, params, images=p.images)).block_hashes
              for i, p in enumerate((prompt, other))]
    assert hashes[0][:cut] == hashes[1][:cut] and all(a != b for a, b in zip(hashes[0][cut:], hashes[1][cut:]))
    assert llm.generate(other, params)[0].num_cached_tokens <= cut * block
