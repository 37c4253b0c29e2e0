"""The vision tower inside the step budget (engine/sched/image_encoding.py), on the scheduler alone: a request with
many images beside a decoding bystander. Each step encodes at most the image budget's tokens (or one larger image
alone), encodings and prefill tokens together stay within the token budget, no chunk reaches an image that is not
encoded in that step or an earlier one, images are encoded before the prefill reaches them where a step has room,
and the bystander decodes in every step. Greedy parity with images under these budgets is in
tests/models/vision/test_vision_models.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine.errors import RequestRejected
from engine.multimodal import ImageInput
from engine.outputs import SchedulerOutput
from engine.sched.scheduler import Scheduler
from tests.sched.test_scheduler import make, params, step

IMAGE_TOKEN = 99


def image_prompt(sizes: list[int], text: int = 5) -> tuple[list[int], tuple[ImageInput, ...]]:
    """``text`` tokens before each image of ``sizes`` tokens (grids of 1 x 2 x 2n patches: n merged tokens), and
    after the last."""
    tokens: list[int] = []
    images = []
    for i, size in enumerate(sizes):
        tokens += list(range(10, 10 + text))
        images.append(ImageInput(bytes([i]) * 16, (1, 2, 2 * size), 2, len(tokens), np.zeros((0, 0), np.float32)))
        tokens += [IMAGE_TOKEN] * size
    return tokens + list(range(10, 10 + text)), tuple(images)


def run_with_bystander(s: Scheduler, sizes: list[int]) -> tuple[list[SchedulerOutput], tuple[ImageInput, ...]]:
    """A bystander decoding, then a request with images of ``sizes`` tokens; the steps until its prompt is done."""
    s.add_request("bystander", list(range(10, 15)), params(max_tokens=200))
    step(s)
    prompt, images = image_prompt(sizes)
    s.add_request("images", prompt, params(max_tokens=1), images=images)
    steps = []
    while "images" in s.requests:
        out, _ = step(s)
        steps.append(out)
        assert "bystander" in out.seq_ids, "the bystander decodes in every step"
        assert len(steps) < 100
    return steps, images


@pytest.mark.parametrize("bound", [None, 12])
def test_images_are_encoded_within_the_step_budget_and_before_their_tokens(bound):
    budget = 32
    s = make(256, max_num_batched_tokens=budget, max_image_tokens_per_step=bound)
    steps, images = run_with_bystander(s, [10, 12, 20, 48, 6, 6, 6])
    image_budget = bound or budget
    encoded: set[bytes] = set()
    for out in steps:
        costs = [image.num_tokens for image in out.encode_images]
        assert sum(costs) <= image_budget or len(costs) == 1, costs
        tokens = sum(out.num_new_tokens)
        assert tokens + sum(costs) <= budget or len(costs) == 1 and costs[0] > image_budget
        encoded |= {image.content_hash for image in out.encode_images}
        if "images" in out.seq_ids:
            row = out.seq_ids.index("images")
            start, end = out.num_computed_tokens[row], out.num_computed_tokens[row] + out.num_new_tokens[row]
            reached = [image for image in images if image.offset < end and image.end > start]
            assert all(image.content_hash in encoded for image in reached), "a chunk reaches an unencoded image"
    assert [image for out in steps for image in out.encode_images] == list(images), "each image once, in order"
    # the 48-token image, larger than either budget, was encoded alone in its step
    assert any([image.num_tokens for image in out.encode_images] == [48] for out in steps)
    # room left in a step encodes ahead: some image is encoded in a step whose chunk does not reach it yet
    ahead = [out for out in steps if out.encode_images and "images" in out.seq_ids
             and out.encode_images[-1].offset >= out.num_computed_tokens[out.seq_ids.index("images")]
             + out.num_new_tokens[out.seq_ids.index("images")]]
    assert ahead
    s.kv.check_invariants()


def test_unbounded_leaves_encoding_to_the_step_that_needs_it():
    """--max-image-tokens-per-step 0: as before the budget, nothing is encoded ahead and chunks are as long as the
    token budget allows."""
    s = make(256, max_num_batched_tokens=32, max_image_tokens_per_step=0)
    steps, _ = run_with_bystander(s, [10, 12, 20, 48])
    assert not any(out.encode_images for out in steps)
    assert all(sum(out.num_new_tokens) == 32 for out in steps[:-1])


def test_a_cached_prefix_is_not_encoded_again():
    """The same prompt again: its images up to the cached prefix are read from the cache, not encoded; those the
    last (recomputed) block reaches, if any, only."""
    s = make(256, max_num_batched_tokens=32)
    prompt, images = image_prompt([10, 12])
    for request_id in ("first", "again"):
        s.add_request(request_id, prompt, params(max_tokens=1), images=images)
        encoded = []
        while request_id in s.requests:
            out, _ = step(s)
            encoded += out.encode_images
        if request_id == "first":
            assert encoded == list(images)
    assert encoded == [image for image in images if image.end > (len(prompt) - 1) // 4 * 4]


def _both_ways(images: tuple[ImageInput, ...]) -> tuple[ImageInput, ...]:
    """The images as Gemma 3 reads them: tokens at 1-D positions that attend to each other both ways."""
    return tuple(dataclasses.replace(image, mrope=False, bidirectional=True) for image in images)


@pytest.mark.parametrize("bound", [None, 0])
def test_a_chunk_never_ends_inside_an_image_read_both_ways(bound):
    """Gemma 3's images (engine/sched/image_encoding.py::whole_images): beside a decoding bystander, with or without
    the tower's budget, every chunk that computes an image's tokens reaches its end, some chunk ends early to keep
    an image whole, and every token is computed; an image larger than the step budget is refused."""
    s = make(256, max_num_batched_tokens=20, max_image_tokens_per_step=bound)
    s.add_request("bystander", list(range(10, 15)), params(max_tokens=200))
    step(s)
    prompt, images = image_prompt([6, 16, 12, 16])
    images = _both_ways(images)
    s.add_request("images", prompt, params(max_tokens=1), images=images)
    ends, lengths = [], []
    while "images" in s.requests:
        out, _ = step(s)
        assert len(ends) < 100
        if "images" in out.seq_ids:
            row = out.seq_ids.index("images")
            assert not ends or out.num_computed_tokens[row] == ends[-1]  # (the first chunk after a 4-token hit)
            ends.append(out.num_computed_tokens[row] + out.num_new_tokens[row])
            lengths.append(out.num_new_tokens[row])
    assert ends[-1] == len(prompt) and not [e for e in ends for i in images if i.offset < e < i.end]
    # the room a step leaves the prompt is 19 (the bystander decodes one): a chunk stopped short of an image
    assert any(n < 19 for n in lengths[:-1]), lengths
    large, large_images = image_prompt([24])
    with pytest.raises(RequestRejected, match="one step"):
        s.add_request("large", large, params(max_tokens=1), images=_both_ways(large_images))
    s.kv.check_invariants()
