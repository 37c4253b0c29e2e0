"""Chat requests -> token requests, through the model's real chat template and tokenizer.

The reply is tokenized as the model would have generated it: the text the rendered conversation gains when the
reply is appended, up to the end-of-turn token. The next turn re-renders the whole history, so whatever the
template does to earlier turns (Qwen3 drops their reasoning) shows up as changed tokens, as in production.

Images go the server's way (server/pipeline/images.py): each image part becomes the template's placeholder text,
the model's own image processor reads it, and each placeholder token becomes the image's run of tokens, so a
request's token count and block hashes are the engine's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from tokenizers import Tokenizer

from server.cache.cache_control import snapshot_hints
from server.cache.normalize import normalize_for_cache, strip_billing_nonces
from server.pipeline.images import ImageReader, expand, split_images
from server.rendering import Renderer, get_renderer
from server.rendering.request import serving_template_kwargs

from server.cache.miss_causes import CHANGE_BILLING_NONCE, CHANGE_SYSTEM_HOISTED, message_change, template_change

from engine.multimodal import ImageInput, expanded_count

from benchmarks.prefix.catalog import NeedsVisionModel
from benchmarks.prefix.traces.trace import TokenRequest
from benchmarks.prefix.workloads import ChatRequest, Workload

# Which template kwarg switches thinking on, per template family (families without one ignore the setting).
_THINKING_KWARG = {"qwen3": "enable_thinking", "qwen3.6": "enable_thinking", "deepseek-v3.1": "thinking"}


@dataclass
class ModelText:
    """A model's chat template and tokenizer: everything needed to turn messages into prompt token ids."""

    name: str
    template: str
    renderer: Renderer
    tokenizer: Tokenizer
    images: ImageReader | None = None  # a vision-language model's processor and placeholder token (None: text only)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def template_kwargs(self, enable_thinking: bool) -> dict:
        """As the server renders (its defaults, e.g. Qwen3.6's preserve_thinking), with thinking switched."""
        key = _THINKING_KWARG.get(self.template)
        return {**serving_template_kwargs(self.renderer), **({key: enable_thinking} if key else {})}


def load_model_text(model: str) -> ModelText:
    from engine.models.vision.preprocess import ImagePreprocessor
    from engine.models.vision.qwen3_vl import VisionConfig
    from engine.registry import get_model_spec, resolve_model

    spec = get_model_spec(model)
    if spec.template == "jinja":
        raise ValueError(f"{model}: the prefix benchmark needs a natively rendered template family, not 'jinja'")
    model_dir = Path(resolve_model(model))
    # The tower the engine loads (engine/models/vision/qwen3_vl.py::load_vision_tower) decides whether it reads images
    vision = VisionConfig.from_model_config(json.loads((model_dir / "config.json").read_text()))
    images = None if vision is None else ImageReader(ImagePreprocessor.from_model_dir(model_dir), vision.image_token_id)
    return ModelText(model, spec.template, get_renderer(spec.template),
                     Tokenizer.from_file(str(model_dir / "tokenizer.json")), images)


def render_texts(req: ChatRequest, mt: ModelText, enable_thinking: bool) -> tuple[str, str]:
    """(prompt text, reply text as generated)."""
    kwargs = mt.template_kwargs(enable_thinking)
    prompt = mt.renderer.render(req.messages, req.tools, add_generation_prompt=True, **kwargs)
    full = mt.renderer.render([*req.messages, req.reply], req.tools, add_generation_prompt=False, **kwargs)
    if not full.startswith(prompt):
        raise ValueError(f"{req.request_id}: the rendered reply does not extend the rendered prompt")
    return prompt, full[len(prompt) :].rstrip("\n")  # the model stops at its end-of-turn token, before the newline


def request_change(parent: ChatRequest | None, req: ChatRequest) -> str | None:
    """What the caller changed since ``parent`` at the message level (None: append-only, tools unchanged)."""
    if parent is None:
        return None
    return message_change([*parent.messages, parent.reply], parent.tools, req.messages, req.tools)


def normalization_change(parent: ChatRequest, req: ChatRequest, renderer: Renderer) -> str | None:
    """With the cache-stability rules off: the rule that would have kept this turn's prefix (None: no rule)."""
    history = [*parent.messages, parent.reply]
    head = req.messages[: len(history)]
    if head != history and strip_billing_nonces(head) == strip_billing_nonces(history):
        return CHANGE_BILLING_NONCE
    new = req.messages[len(history) :]
    if renderer.hoists_system_messages and any(m.get("role") == "system" for m in new):
        return CHANGE_SYSTEM_HOISTED
    return None


def normalized(req: ChatRequest, renderer: Renderer) -> ChatRequest:
    """The request as the server renders it: with the cache-stability rules applied, unless they are off."""
    return replace(req, messages=normalize_for_cache(req.messages, renderer)) if req.normalize else req


class ImageParts:
    """A workload's image parts, read once each: a session resends every earlier screenshot on each turn."""

    def __init__(self, workload: Workload, mt: ModelText) -> None:
        self.workload, self.mt = workload, mt
        self.read: dict[str, ImageInput] = {}

    def split(self, req: ChatRequest) -> tuple[ChatRequest, tuple[ImageInput, ...]]:
        """The request with each image part replaced by the template's placeholder text, and its images."""
        add_vision_id = bool(self.mt.template_kwargs(self.workload.enable_thinking).get("add_vision_id"))
        messages, found = split_images(req.messages, add_vision_id)
        if not found:
            return req, ()
        if self.mt.images is None:
            raise NeedsVisionModel(f"{self.mt.name} reads text only, and the {self.workload.name} workload sends images: "
                             "give a vision-language model (e.g. --model qwen3.6-tiny)")
        for url, where in found:
            if url not in self.read:
                self.read[url] = self.mt.images.read(url, where)
        return replace(req, messages=messages), tuple(self.read[url] for url, _ in found)


def tokenize_workload(workload: Workload, mt: ModelText) -> list[TokenRequest]:
    by_id = {r.request_id: normalized(r, mt.renderer) for r in workload.requests}
    parts = ImageParts(workload, mt)
    texts: dict[str, tuple[str, str]] = {}
    out = []
    for req in by_id.values():
        rendered, images = parts.split(req)
        prompt, reply = texts[req.request_id] = render_texts(rendered, mt, workload.enable_thinking)
        parent = by_id.get(req.parent) if req.parent else None
        change = request_change(parent, req)
        if parent is not None and not req.normalize:
            change = normalization_change(parent, req, mt.renderer) or change
        if parent is not None and change is None:
            change = template_change("".join(texts[parent.request_id]), prompt)
        prompt_ids = mt.encode(prompt)
        expanded = expand(mt.images, prompt_ids, images)  # each placeholder token -> its image's tokens
        cut = lambda m, t: mt.renderer.render(m, t, add_generation_prompt=False,  # noqa: E731
                                              **mt.template_kwargs(workload.enable_thinking))
        hints = snapshot_hints(rendered.messages, rendered.tools, prompt, prompt_ids, cut, mt.encode)
        out.append(
            TokenRequest(
                request_id=req.request_id,
                session=req.session,
                prompt=expanded.token_ids,
                output=mt.encode(reply),
                salt=req.salt,
                parent=req.parent,
                turn=req.turn,
                change=change,
                arrival=req.arrival,
                snapshot_hints=tuple(expanded_count(expanded, n) for n in hints),
                images=expanded.images,
            )
        )
    return out
