"""Where a request finishes: hand it to the inspector, if the server runs one. `inspect_finished` is the serving
context's ``on_finished`` callback when the server runs with ``--ui`` (server/pipeline/context.py), called by
`server.pipeline.generation.record`, which itself knows nothing of the inspector."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from server.cache.cache_salt import salt_tenant
from server.inspector.attribution import Conversation
from server.inspector.store import Inspector, Observation
from server.cache.normalize import normalize_for_cache
from server.pipeline.turn import Turn

if TYPE_CHECKING:
    from server.pipeline.context import ServingContext
    from server.pipeline.generation import Generation

log = logging.getLogger("kvserve.inspector")


def inspect_finished(ctx: ServingContext, endpoint: str, prompts: list[Generation], session: str | None,
                     turn: Turn | None) -> None:
    inspector = ctx.inspector
    if inspector is None:
        return
    # As rendered: the cache rules applied, so a change they remove (a billing nonce) is no change here either. The
    # rules read only the renderer's flags, never its tokenizer: any lane's renderer does, on the event loop.
    conversation = Conversation() if turn is None else Conversation(
        normalize_for_cache(turn.messages, ctx.lane_tools.renderer), turn.tools, turn.compaction_epoch,
        bool(turn.context_edits))
    for p in prompts:
        try:
            _observe(inspector, endpoint, p, session, conversation)
        except Exception as exc:  # the inspector never fails a request; the log names no prompt text
            log.error("the inspector could not record request %s: %s", p.request.request_id, type(exc).__name__)


def _observe(inspector: Inspector, endpoint: str, p: Generation, session: str | None, conversation: Conversation) -> None:
    request, choice, timings = p.request, p.first_choice, p.timings
    pins = request.retention.pins if request.retention is not None else ()
    inspector.observe(Observation(
        request_id=request.request_id, endpoint=endpoint, salt=request.cache_salt, session=session,
        prompt_token_ids=request.prompt_token_ids, output_token_ids=choice.token_ids,
        cached_tokens=p.num_cached_tokens, host_cached_tokens=p.num_host_cached_tokens,
        disk_cached_tokens=p.num_disk_cached_tokens,
        queue_s=timings.queue_s if timings else None, ttft_s=timings.ttft_s if timings else None,
        e2e_s=timings.e2e_s if timings else None, finish_reason=choice.finish_reason or "abort",
        breakpoints=tuple((pin.num_tokens, pin.ttl_s) for pin in pins), conversation=conversation,
        images=tuple((image.offset, image.content_hash) for image in request.images),
    ), salt_tenant(request.cache_salt))
