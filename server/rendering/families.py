"""The native renderer of each chat template family."""
from __future__ import annotations

from server.rendering.base import Renderer
from server.rendering.native.deepseek import (
    DeepSeekR1DistillRenderer,
    DeepSeekR1Renderer,
    DeepSeekR10528Renderer,
    DeepSeekV3Renderer,
    DeepSeekV30324Renderer,
    DeepSeekV31Renderer,
)
from server.rendering.native.deepseek_dsml import DeepSeekV4Renderer, DeepSeekV32Renderer
from server.rendering.native.devstral import DevstralRenderer
from server.rendering.native.gemma3 import Gemma3Renderer
from server.rendering.native.gemma4 import Gemma4Renderer
from server.rendering.native.glm import GlmRenderer
from server.rendering.native.harmony import HarmonyRenderer
from server.rendering.native.kimi import KimiRenderer
from server.rendering.native.kimi_k3 import KimiK3Renderer
from server.rendering.native.minimax import MinimaxRenderer
from server.rendering.native.qwen import Qwen3CoderRenderer, Qwen3Renderer, Qwen25Renderer
from server.rendering.native.qwen35 import Qwen36Renderer

_RENDERERS: dict[str, type[Renderer]] = {
    cls.family: cls
    for cls in (
        Qwen25Renderer,
        Qwen3Renderer,
        Qwen3CoderRenderer,
        Qwen36Renderer,
        DeepSeekV3Renderer,
        DeepSeekV30324Renderer,
        DeepSeekV31Renderer,
        DeepSeekV32Renderer,
        DeepSeekV4Renderer,
        DeepSeekR1Renderer,
        DeepSeekR10528Renderer,
        DeepSeekR1DistillRenderer,
        GlmRenderer,
        HarmonyRenderer,
        DevstralRenderer,
        MinimaxRenderer,
        KimiRenderer,
        KimiK3Renderer,
        Gemma3Renderer,
        Gemma4Renderer,
    )
}
FAMILIES: tuple[str, ...] = tuple(_RENDERERS)


def get_renderer(family: str) -> Renderer:
    """The native renderer of ``family`` (one of ``FAMILIES``); ``ValueError`` for an unknown name."""
    try:
        return _RENDERERS[family]()
    except KeyError:
        raise ValueError(f"unknown chat template family {family!r}; known: {', '.join(FAMILIES)}") from None
