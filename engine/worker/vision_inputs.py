"""The runner's side of images: which of a step's tokens are image tokens, their embeddings (from the encoder cache,
or the vision tower when the image is not there) and their multimodal positions.

On the host, after flattening (`VisionInputs.plan`): the positions of the text tokens of sequences with images are
shifted (engine/multimodal.py: text after an image resumes ``max(h, w)`` positions on), and the image tokens the
step computes are listed with their (t, h, w) positions and which slice of which image they are. A prefill chunk may
end inside an image: the next chunk takes the rest of the same embeddings, so chunking never changes what the model
reads. On the device (`VisionInputs.device_inputs`): each image is encoded at most once while it stays in the
encoder cache, and the rows are gathered into a `MultimodalStep` the model applies. The scheduler has most images
encoded in steps before their tokens (`VisionInputs.encode`); one the cache lacks when its tokens come is encoded
then.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.models.vision.encoder_cache import EncoderCache
from engine.models.vision.mrope import MultimodalStep, mrope_axes
from engine.models.vision.towers import VisionTower
from engine.multimodal import ImageInput, image_positions, position_shift
from engine.worker.input_batch import InputBatch
from kernels.ops import ImageSpans
from engine.worker.step_inputs import HostInputs


@dataclass
class StepImages:
    """The host's plan of one step's image tokens."""

    rows: list[np.ndarray] = field(default_factory=list)  # token rows, per slice
    positions: list[np.ndarray] = field(default_factory=list)  # [3, n] per slice
    slices: list[tuple[ImageInput, int, int]] = field(default_factory=list)  # image, first and end token in it
    # images whose tokens attend to each other (Gemma 3 and 4): (batch row, first query row, its position, image start, end)
    spans: list[tuple[int, int, int, int, int]] = field(default_factory=list)


class VisionInputs:
    """A vision tower, its encoder cache and the images of the sequences the runner knows."""

    def __init__(self, tower: VisionTower, cache_bytes: int, rotary_dim: int, device: torch.device) -> None:
        self.tower = tower
        self.cache = EncoderCache(cache_bytes)
        self.device = device
        section = tower.cfg.mrope_section
        self.axes = None if section is None else mrope_axes(rotary_dim, section).to(device)
        self.images: dict[str, tuple[ImageInput, ...]] = {}  # seq id -> its prompt's images (those that have any)
        self.num_encoded = 0  # images the tower encoded (the rest came from the cache)

    @property
    def image_token_id(self) -> int:
        return self.tower.cfg.image_token_id

    def track(self, new: list[tuple[str, tuple[ImageInput, ...]]], finished: list[str]) -> None:
        for seq_id in finished:
            self.images.pop(seq_id, None)
        for seq_id, images in new:
            if images:
                self.images[seq_id] = images

    def computes_images(self, batch: InputBatch) -> bool:
        """Whether a scheduled row computes image tokens this step (then it runs eagerly, not as a decode graph)."""
        if not self.images:
            return False
        for row, seq_id in enumerate(batch.seq_ids):
            images = self.images.get(seq_id)
            if images:
                start, end = int(batch.num_computed[row]), int(batch.num_computed[row] + batch.num_new[row])
                if any(image.offset < end and image.end > start for image in images):
                    return True
        return False

    def plan(self, batch: InputBatch, host: HostInputs) -> StepImages | None:
        """Shift the text positions of rows with images in ``host`` (in place) and list the step's image tokens;
        None when no scheduled row has images."""
        if not self.images:
            return None
        plan, any_row = StepImages(), False
        for row, seq_id in enumerate(batch.seq_ids):
            images = self.images.get(seq_id)
            if not images:
                continue
            any_row = True
            first, end = int(host.query_start_loc[row]), int(host.query_start_loc[row + 1])
            index = host.positions[first:end].astype(np.int64)
            host.positions[first:end] = index + position_shift(images, index)
            mask, positions = image_positions(images, index)
            if not mask.any():
                continue
            rows = first + np.flatnonzero(mask)
            done = 0
            for image in images:
                lo, hi = max(image.offset, int(index[0])), min(image.end, int(index[-1]) + 1)
                if lo >= hi:
                    continue
                n = hi - lo
                plan.rows.append(rows[done:done + n])
                plan.positions.append(positions[:, done:done + n])
                plan.slices.append((image, lo - image.offset, hi - image.offset))
                if image.bidirectional:
                    assert hi == image.end, "a prefill chunk ends inside an image whose tokens attend both ways"
                    plan.spans.append((row, int(plan.rows[-1][0]), lo, image.offset, image.end))
                done += n
        return plan if any_row and plan.slices else None

    def _encode(self, image: ImageInput) -> torch.Tensor:
        self.num_encoded += 1
        pixels = torch.from_numpy(image.pixel_values).to(self.device)
        return self.tower(pixels, [image.grid_thw])

    def encode(self, images: list[ImageInput]) -> None:
        """Encode ``images`` into the encoder cache ahead of their tokens (the scheduler spreads the tower's work over
        steps, engine/sched/image_encoding.py); those it holds already cost nothing."""
        for image in images:
            self.cache.get(image.content_hash, lambda image=image: self._encode(image))

    def device_inputs(self, plan: StepImages) -> MultimodalStep:
        """The step's image rows on the device: embeddings from the cache (or encoded now) and positions."""
        embeds = [self.cache.get(image.content_hash, lambda image=image: self._encode(image))[lo:hi]
                  for image, lo, hi in plan.slices]
        rows = torch.from_numpy(np.concatenate(plan.rows)).to(self.device).long()
        positions = torch.from_numpy(np.concatenate(plan.positions, axis=1)).to(self.device).long()
        spans = (ImageSpans(*(tuple(column) for column in zip(*plan.spans)),
                            window_layers_only=self.tower.cfg.image_attention_window_only) if plan.spans else None)
        return MultimodalStep(rows, torch.cat(embeds), positions, self.axes, spans)
