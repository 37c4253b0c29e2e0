"""The vision tower inside the step budget: which images a step encodes, so that a request with many images cannot
stall the batch.

The tower encodes an image whole (its patches attend to each other), so the unit of work is an image, costed at its
token count and charged against the step's token budget like the tokens a prefill chunk computes. A step encodes
at most ``max_image_tokens_per_step`` image tokens (``EngineConfig``; default: the token budget), or one image
larger than that alone. A prefill chunk that reaches an image the step has no room to encode ends just before it
(the next steps encode it, then compute it); room left at the end of a step encodes the next images of sequences
still in their prompt, before their prefill reaches them. The encodings go to the runner as
``SchedulerOutput.encode_images`` and land in its encoder cache; a chunk then takes its slice of them, so where
chunks end never changes what the model reads. Gemma 3's images are stricter: a chunk never ends inside one
(`whole_images`), since its tokens attend to the tokens after them in the same image.

This is the scheduler's cost model, not the runner's correctness: the runner encodes any image a step needs that
its cache lacks (its cache evicted it, or a preempted sequence came back after that), and an image the cache holds
already (another request's) costs no tower time when it is asked for again.

`ImageEncoding` is a part of `engine.sched.scheduler.Scheduler`, as `ResumePoints` is.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.multimodal import ImageInput
from engine.outputs import SchedulerOutput
from engine.sched.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine.sched.scheduler import Scheduler


def whole_images(images: tuple[ImageInput, ...], start: int, n: int) -> int:
    """A prefill chunk of ``n`` tokens from ``start``, shortened so that it does not end inside an image whose tokens
    attend to each other both ways (Gemma 3's: each needs all of its image's keys in the step that computes it,
    kernels/reference/image_attention.py); 0 when it starts inside one it cannot finish (a later step with room
    will: no image is larger than the token budget, `engine.requests`)."""
    end = start + n
    for image in images:
        if image.bidirectional and image.offset < end < image.end:
            return max(image.offset - start, 0)
    return n


class ImageEncoding:
    """Mixed into `Scheduler` (its config; ``_image_room``: image tokens the step being scheduled may still encode;
    ``_image_seqs``: the step's sequences with images still to encode, in scheduling order)."""

    def _image_budget(self: Scheduler) -> int:
        """Image tokens a step may encode; 0: no bound (each image is encoded in the step that first needs it)."""
        bound = self.cfg.max_image_tokens_per_step
        budget = self.cfg.max_num_batched_tokens
        return budget if bound is None else min(bound, budget)

    def _fit_images(self: Scheduler, seq: Sequence, start: int, n: int, budget: int,
                    out: SchedulerOutput) -> tuple[int, int]:
        """A prefill chunk of at most ``n`` tokens of ``seq`` from ``start`` with ``budget`` tokens left in the step:
        the images it reaches that are not encoded yet are encoded this step if there is room, else the chunk ends
        before the first that has none. Returns the chunk's length (0: none this step) and the budget the encodings
        take."""
        if not self._image_room_total:
            return whole_images(seq.images, start, n), 0
        spent = 0
        for image in seq.images[seq.num_encoded_images:]:
            if image.end <= start:  # computed already (read from the prefix cache): nothing to encode
                seq.num_encoded_images += 1
                continue
            before = max(image.offset - start, 0)  # the chunk's tokens ahead of the image
            if image.offset >= start + min(n, budget - spent):
                break
            charge = self._encode(image, budget - spent - before, out)
            if charge is None:
                n = before
                break
            seq.num_encoded_images += 1
            spent += charge
        if seq.num_encoded_images < len(seq.images):
            self._image_seqs.append(seq)
        return whole_images(seq.images, start, max(min(n, budget - spent), 0)), spent

    def _encode_ahead(self: Scheduler, budget: int, out: SchedulerOutput) -> None:
        """Room left in the step: the next images of the step's sequences still in their prompt, in scheduling
        order, before their prefill reaches them."""
        for seq in self._image_seqs:
            if budget <= 0 or not self._image_room:
                break
            while seq.status is SequenceStatus.RUNNING and seq.num_encoded_images < len(seq.images):
                charge = self._encode(seq.images[seq.num_encoded_images], budget, out)
                if charge is None:
                    break
                seq.num_encoded_images += 1
                budget -= charge

    def _encode(self: Scheduler, image: ImageInput, room: int, out: SchedulerOutput) -> int | None:
        """Encode ``image`` this step if it fits ``room`` tokens and the step's image budget (or, larger than that
        budget, as the step's only image); returns the tokens charged, or None."""
        cost = image.num_tokens
        alone = cost > self._image_room_total and self._image_room == self._image_room_total
        if room <= 0 or not (cost <= min(room, self._image_room) or alone):
            return None
        out.encode_images.append(image)
        self._image_room = max(self._image_room - cost, 0)
        return min(cost, room)
