"""Images in a prompt, as the engine carries them: torch-free data that crosses from the preparer to the runner.

A prompt holds an image as a run of placeholder tokens (Qwen3.5 / 3.6: ``<|image_pad|>``, one per merged patch,
between ``<|vision_start|>`` and ``<|vision_end|>``); the `ImageInput` beside it says where that run starts, what the
vision tower reads for it (the processor's patches) and a hash of what the model sees (the pixels and the
preprocessing that shaped them). The hash is what the prefix cache and the encoder cache key on; the placeholder
tokens alone would make every image the same.

Multimodal RoPE (Qwen2-VL's mRoPE, as Qwen3.5 / 3.6 use it): every token has a (t, h, w) position. A text token's
three are equal; an image's tokens sit on their grid, all starting at the position the image starts at, and the
text after an image resumes ``max(h, w)`` positions later (not ``h * w``). So a text token's position is its index
plus a shift that each earlier image changes by ``max(h, w) - h * w`` (`position_shift`); text-only prompts keep
their indices exactly.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class ImageInput:
    """One preprocessed image of a prompt. ``pixel_values`` ``[patches, channels * temporal * patch * patch]``
    (float32, in the processor's order: merge blocks of ``merge_size``²); ``grid_thw`` the patch grid; ``offset``
    the prompt index of its first placeholder token; ``content_hash`` 16+ bytes naming the pixels and the
    preprocessing (equal hashes: equal embeddings).

    Gemma 3 reads an image as a fixed square of soft tokens (``grid_thw`` (1, side, side), ``merge_size`` 1, the
    pixels ``[channels, height, width]``) at plain 1-D positions (``mrope`` False: the text after it resumes where
    its tokens end), and its tokens attend to each other both ways (``bidirectional``: a prefill chunk that computes
    any of them reaches the image's end, engine/sched/image_encoding.py)."""

    content_hash: bytes
    grid_thw: tuple[int, int, int]
    merge_size: int
    offset: int
    pixel_values: np.ndarray = field(repr=False, compare=False)
    mrope: bool = True
    bidirectional: bool = False

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        """The grid the language model sees: (t, h / merge, w / merge)."""
        t, h, w = self.grid_thw
        return t, h // self.merge_size, w // self.merge_size

    @property
    def num_tokens(self) -> int:
        t, h, w = self.llm_grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def position_span(self) -> int:
        """How far the positions after the image are from its first one: ``max(h, w)`` under mRoPE (videos aside:
        t = 1), else its token count."""
        _, h, w = self.llm_grid
        return max(h, w) if self.mrope else self.num_tokens

    def at_offset(self, offset: int) -> "ImageInput":
        """The same image placed at another prompt index."""
        return dataclasses.replace(self, offset=offset)


def check_layout(images: Sequence[ImageInput], prompt_token_ids: Sequence[int], image_token_id: int) -> str | None:
    """Why ``images`` do not fit the prompt (None: they do): in order, not overlapping, each over a run of
    ``image_token_id`` exactly as long as its token count, and no placeholder token outside them."""
    expected = 0
    last = 0
    for image in images:
        if image.offset < last:
            return "images overlap or are out of order"
        if image.end > len(prompt_token_ids):
            return f"an image's {image.num_tokens} tokens run past the prompt's end"
        if any(t != image_token_id for t in prompt_token_ids[image.offset:image.end]):
            return f"an image's span at {image.offset} is not {image.num_tokens} placeholder tokens"
        last, expected = image.end, expected + image.num_tokens
    if sum(1 for t in prompt_token_ids if t == image_token_id) != expected:
        return "the prompt holds image placeholder tokens that no image fills"
    return None


def position_shift(images: Sequence[ImageInput], index: np.ndarray) -> np.ndarray:
    """The mRoPE shift of a text token at each prompt (or reply) ``index``: the sum of ``position_span - num_tokens``
    over the images that end at or before it."""
    shift = np.zeros(len(index), dtype=np.int64)
    done = 0
    for image in images:
        done += image.position_span - image.num_tokens
        shift[index >= image.end] = done
    return shift


def image_positions(images: Sequence[ImageInput], index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For the tokens at ``index`` (one sequence's, ascending): which of them are image tokens (a boolean mask) and
    their (t, h, w) positions ``[3, count]``, in the mask's order."""
    mask = np.zeros(len(index), dtype=bool)
    parts: list[np.ndarray] = []
    before = 0  # the shift of the tokens before the current image
    for image in images:
        inside = (index >= image.offset) & (index < image.end)
        if inside.any():
            k = index[inside] - image.offset
            _, h, w = image.llm_grid
            start = image.offset + before
            parts.append(np.stack([start + k // (h * w), start + (k // w) % h, start + k % w]))
            mask |= inside
        before += image.position_span - image.num_tokens
    return mask, (np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), dtype=np.int64))


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt's token ids with its images, each over its run of placeholder tokens (`expand_placeholders` makes
    one from a prompt with one placeholder per image)."""

    token_ids: list[int]
    images: tuple[ImageInput, ...] = ()

    def __len__(self) -> int:
        return len(self.token_ids)


def expand_placeholders(token_ids: Sequence[int], images: Sequence[ImageInput], image_token_id: int) -> ImagePrompt:
    """The prompt as the model reads it: the i-th ``image_token_id`` of ``token_ids`` (a template renders one per
    image) repeated ``images[i].num_tokens`` times, and the images placed on those runs. `ValueError` if the counts
    differ."""
    found = sum(1 for t in token_ids if t == image_token_id)
    if found != len(images):
        raise ValueError(f"the prompt has {found} image placeholders for {len(images)} images")
    out: list[int] = []
    placed: list[ImageInput] = []
    pending = iter(images)
    for token in token_ids:
        if token != image_token_id:
            out.append(token)
            continue
        image = next(pending)
        placed.append(image.at_offset(len(out)))
        out.extend([image_token_id] * image.num_tokens)
    return ImagePrompt(out, tuple(placed))


def expanded_count(prompt: ImagePrompt, count: int) -> int:
    """What the first ``count`` tokens of a prompt with one placeholder per image (as rendered and tokenized)
    become in ``prompt``, its expansion: each placeholder among them grows by its image's tokens less one."""
    grown = 0
    for image in prompt.images:
        if image.offset - grown >= count:
            break
        grown += image.num_tokens - 1
    return count + grown
