"""Anthropic context editing (`context_management`, server/api/context_edits.py) through the official `anthropic`
SDK's beta client: `clear_tool_uses_20250919` shrinks the prompt by what `applied_edits` reports and `count_tokens`
agrees; with `clear_at_least` it clears in batches, so each turn's prompt extends the last one's (read from the
cache) until the next batch; `exclude_tools`, `clear_tool_inputs` and `clear_thinking_20251015` change what the
model sees; another edit type is a 400 in Anthropic's shape."""
from __future__ import annotations

import anthropic
import pytest

from server.api.context_edits import CLEARED_RESULT, _batch
from tests.server.conftest import LiveServer

BETA = ["context-management-2025-06-27"]
GENERATION_PROMPT_TOKENS = 8  # Qwen3's assistant header and empty think block end a prompt, not the next one's history
TOOLS = [{"name": name, "description": f"{name} a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}} for name in ("read", "pin")]


def _loop(uses: int, names: tuple[str, ...] = ("read",), thinking: bool = False) -> list[dict]:
    """A tool loop: one task, then ``uses`` tool calls and their results."""
    messages: list[dict] = [{"role": "user", "content": "Fix the bug."}]
    for i in range(uses):
        blocks = [{"type": "thinking", "thinking": f"idea{i} " * 3, "signature": "s"}] if thinking else []
        name = names[i % len(names)]
        messages.append({"role": "assistant", "content": [
            *blocks, {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {"path": f"arg{i}.py"}}]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": f"out{i} = " + "1 + " * 6 + "1"}]})
    return messages


def _clear(**edit) -> dict:
    return {"edits": [{"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 1}, **edit}]}


def _send(server: LiveServer, messages: list[dict], management: dict | None, **kwargs):
    extra = {} if management is None else {"context_management": management}
    return server.anthropic().beta.messages.create(model=server.ctx.model_name, max_tokens=1,
                                                   messages=messages, tools=TOOLS, betas=BETA, **extra, **kwargs)


def _count(server: LiveServer, messages: list[dict], management: dict | None = None):
    extra = {} if management is None else {"context_management": management}
    return server.anthropic().beta.messages.count_tokens(model=server.ctx.model_name, messages=messages,
                                                         tools=TOOLS, betas=BETA, **extra)


def _prompt_text(server: LiveServer) -> str:
    return server.ctx.tokenizer.decode(server.last_record()["prompt_token_ids"])


def test_clear_tool_uses_shrinks_input_tokens_by_what_it_reports(qwen_server: LiveServer) -> None:
    messages, management = _loop(5), _clear(keep={"type": "tool_uses", "value": 2})
    original = _count(qwen_server, messages).input_tokens
    counted = _count(qwen_server, messages, management)
    assert counted.context_management.original_input_tokens == original > counted.input_tokens

    reply = _send(qwen_server, messages, management)
    [edit] = reply.context_management.applied_edits
    assert edit.type == "clear_tool_uses_20250919" and edit.cleared_tool_uses == 3
    assert edit.cleared_input_tokens == original - counted.input_tokens
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == counted.input_tokens
    prompt = _prompt_text(qwen_server)
    assert prompt.count(CLEARED_RESULT) == 3 and "out3 =" in prompt and "out2 =" not in prompt

    # Below the trigger nothing is cleared, and the response says so
    untouched = _send(qwen_server, messages, _clear(trigger={"type": "input_tokens", "value": original + 1}))
    assert untouched.context_management.applied_edits == []


def test_clear_at_least_clears_in_batches_that_keep_the_prompt_cached(qwen_server: LiveServer) -> None:
    """One more tool use a turn: the cleared part grows only by whole batches, and between two batches each turn's
    prompt extends the last one's, so it is read from the cache."""
    result_tokens = len(qwen_server.ctx.encode('"out0 = ' + "1 + " * 6 + '1"'))
    management = _clear(keep={"type": "tool_uses", "value": 1},
                        clear_at_least={"type": "input_tokens", "value": 2 * result_tokens})
    cleared, cached, prompts = [], [], []
    for uses in range(2, 7):
        reply = _send(qwen_server, _loop(uses), management)
        edits = reply.context_management.applied_edits
        cleared.append(edits[0].cleared_tool_uses if edits else 0)
        cached.append(reply.usage.cache_read_input_tokens)
        prompts.append(qwen_server.last_record()["prompt_token_ids"])
    assert cleared == sorted(cleared) and set(cleared) <= {0, 2, 4, 6} and cleared[-1] >= 4, cleared
    block = qwen_server.ctx.engine.facts.block_size
    for turn in range(1, len(cleared)):
        if cleared[turn] == cleared[turn - 1]:  # the same batch: this prompt extends the last one, cached
            previous, prompt = prompts[turn - 1], prompts[turn]
            shared = next(i for i, (a, b) in enumerate(zip(previous, prompt)) if a != b)
            assert shared >= len(previous) - GENERATION_PROMPT_TOKENS, (turn, shared, len(previous))
            assert cached[turn] >= shared // block * block, (turn, cached)
    assert cleared.count(cleared[-1]) < len(cleared)  # the prompt was broken by a batch, not on every turn


def test_exclude_tools_and_clear_tool_inputs(qwen_server: LiveServer) -> None:
    messages = _loop(4, names=("read", "pin"))
    _send(qwen_server, messages, _clear(keep={"type": "tool_uses", "value": 0}, exclude_tools=["pin"],
                                        clear_tool_inputs=True))
    prompt = _prompt_text(qwen_server)
    assert "out1 =" in prompt and "out3 =" in prompt and "arg1.py" in prompt  # pin's uses: kept whole
    assert "out0 =" not in prompt and "arg0.py" not in prompt and "arg2.py" not in prompt  # read's: cleared


def test_clear_thinking_keeps_the_last_turns_thinking(qwen_server: LiveServer) -> None:
    messages = _loop(3, thinking=True)
    management = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}
    reply = _send(qwen_server, messages, management, thinking={"type": "enabled", "budget_tokens": 1024})
    [edit] = reply.context_management.applied_edits
    assert edit.type == "clear_thinking_20251015" and edit.cleared_thinking_turns == 2
    prompt = _prompt_text(qwen_server)
    assert "idea2" in prompt and "idea0" not in prompt and "idea1" not in prompt
    kept = _send(qwen_server, messages, {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert kept.context_management.applied_edits == [] and "idea0" in _prompt_text(qwen_server)


def test_another_edit_type_is_a_400(qwen_server: LiveServer) -> None:
    with pytest.raises(anthropic.BadRequestError) as failure:
        _send(qwen_server, _loop(1), {"edits": [{"type": "clear_everything_20990101"}]})
    assert failure.value.body["type"] == "error" and "context_management.edits.0.type" in str(failure.value)


def test_batches_reach_the_largest_multiple_the_candidates_hold() -> None:
    assert _batch([5, 5, 5], 0) == 3  # no batch size: every candidate
    assert _batch([5, 5, 5], 20) == 0  # less than one batch: nothing
    assert _batch([5, 5, 5, 5], 10) == 4 and _batch([5, 5, 5], 10) == 2  # 2 batches, then still 1
    assert _batch([12, 1, 1], 10) == 1  # the shortest run that reaches the batch


@pytest.mark.slow  # the session's vision-language server (tests/server/models/test_image_serving.py starts it too)
def test_edits_over_a_screenshot_in_a_tool_result(hybrid_server: LiveServer) -> None:
    """Claude Code sends context_management with every request, and its Read tool returns a PNG inside a
    tool_result: the edits' token counts read the image as its tokens (it was a 400, 'image_url is not
    supported'), count_tokens counts them, and clearing that tool result clears the image."""
    import base64

    from tests.models.checkpoints.vision_models import png

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(96, 64, seed=7)).decode()}}
    messages = _loop(1)
    messages[-1]["content"][0]["content"] = [image]
    keep = _clear(trigger={"type": "input_tokens", "value": 10_000})
    with_image = _count(hybrid_server, messages, keep).input_tokens
    text = _loop(1)
    text[-1]["content"][0]["content"] = "x"
    without = _count(hybrid_server, text, keep).input_tokens
    assert with_image - without >= 6  # a 96 x 64 picture: 3 x 2 merged patches, in its vision markers
    assert _send(hybrid_server, messages, keep).content is not None
    reply = _send(hybrid_server, messages, _clear(keep={"type": "tool_uses", "value": 0}))
    assert reply.context_management.applied_edits[0].cleared_tool_uses == 1
    assert hybrid_server.ctx.tokenizer.decode(hybrid_server.last_record()["prompt_token_ids"]).count(
        "<|image_pad|>") == 0
