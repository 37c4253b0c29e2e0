"""The `qwen3.6` family served end to end (real uvicorn, real clients): a local Qwen3.6 checkpoint is recognised by its
template, past reasoning is kept by default so every agent turn extends the cached prompt, and thinking (opened by
the generation prompt) is parsed into reasoning on all three APIs."""
from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings, load_context
from server.rendering import get_renderer, serving_template_kwargs
from tests.server.conftest import LiveServer, serve

QUESTION = {"role": "user", "content": "Which file defines main?"}
REASONING = "The user wants the file that defines main; search for it."
ANSWER = "It is app.py."


@pytest.fixture(scope="module")
def server(qwen36_model_dir) -> Iterator[LiveServer]:
    ctx = load_context(str(qwen36_model_dir), EngineConfig(block_size=16, num_kv_blocks=512, max_model_len=4096),
                       ServerSettings())
    with serve(ctx) as url:
        yield LiveServer(ctx, url)


def _tokens(server: LiveServer, messages: list[dict], **kwargs) -> list[int]:
    body = {"messages": messages, **({"chat_template_kwargs": kwargs} if kwargs else {})}
    response = httpx.post(f"{server.base_url}/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


@pytest.mark.slow
def test_a_local_checkpoint_is_served_with_the_native_renderer(server: LiveServer) -> None:
    assert server.ctx.family == "qwen3.6" and type(server.ctx.lane_tools.renderer) is type(get_renderer("qwen3.6"))


@pytest.mark.slow
def test_the_next_turn_extends_the_previous_prompt_and_reply(server: LiveServer) -> None:
    """Turn N's prompt + the model's raw reply is a token prefix of turn N+1 (after a new user message, where the
    template would otherwise drop the reasoning); `preserve_thinking: false` in a request restores that drop."""
    tokenizer = server.ctx.tokenizer
    first = [QUESTION]
    reply = f"{REASONING}\n</think>\n\n{ANSWER}<|im_end|>"  # after the prompt's own `<think>\n`
    following = first + [{"role": "assistant", "content": ANSWER, "reasoning_content": REASONING},
                         {"role": "user", "content": "And where is it called?"}]
    previous = _tokens(server, first) + tokenizer.encode(reply, add_special_tokens=False)
    assert _tokens(server, following)[: len(previous)] == previous
    dropped = _tokens(server, following, preserve_thinking=False)
    assert dropped[: len(previous)] != previous
    assert tokenizer.decode(dropped).count(REASONING) == 0


@pytest.mark.slow
def test_a_late_system_message_renders_as_a_user_turn(server: LiveServer) -> None:
    """The template refuses a system message after the first (Codex's developer messages, Claude Code's environment
    block); the server renders it in place as a user turn instead of failing the request."""
    messages = [{"role": "system", "content": "Be brief."}, QUESTION, {"role": "assistant", "content": ANSWER},
                {"role": "developer", "content": "Sandbox: read-only."}, {"role": "user", "content": "And tests?"}]
    text = server.ctx.tokenizer.decode(_tokens(server, messages))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert "<|im_start|>user\nSandbox: read-only.<|im_end|>\n<|im_start|>user\nAnd tests?" in text


@pytest.mark.slow
def test_thinking_is_on_by_default_and_parsed_on_every_api(server: LiveServer) -> None:
    common = dict(model=server.ctx.model_name, messages=[QUESTION], max_tokens=12, temperature=0)
    thought = server.client().chat.completions.create(**common).choices[0].message
    # A random model never closes its thinking: everything it writes is reasoning, opened by the prompt.
    assert thought.model_extra["reasoning_content"] and not thought.content
    plain = server.client().chat.completions.create(
        **common, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert plain.content and not plain.model_extra.get("reasoning_content")
    message = server.anthropic().messages.create(
        model=server.ctx.model_name, max_tokens=12, messages=[QUESTION],
        thinking={"type": "enabled", "budget_tokens": 1024})
    assert [block.type for block in message.content] == ["thinking"]
    response = server.client().responses.create(model=server.ctx.model_name, input="Which file defines main?",
                                                max_output_tokens=12, reasoning={"effort": "none"})
    assert response.output_text


def test_serving_default_and_its_switch() -> None:
    renderer = get_renderer("qwen3.6")
    assert serving_template_kwargs(renderer) == {"preserve_thinking": True}
    assert serving_template_kwargs(renderer, preserve_thinking=False) == {}
    assert serving_template_kwargs(get_renderer("qwen3")) == {}  # templates without the kwarg are left alone
