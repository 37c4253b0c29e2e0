"""Kimi-K3's format served end to end (kimi-k3-format-tiny: the Kimi Linear hybrid with Kimi-K3's XTML template and a
stand-in tokenizer with K3's special tokens) through the real clients against uvicorn. The generation prompt opens the
think channel, which the server bounds (--reasoning-budget: its close is three tokens here); then tool_choice required
makes the model close an empty response channel and write a valid call in the tools channel, each argument tagged
with its type, and close the message. The tool result goes back as a `role="tool"` message, and the next turn reads
the first prompt from the cache. A named tool comes back the same through chat completions (streamed as returned
whole), Anthropic Messages (a tool_use block) and Responses (a function_call item)."""
from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.server.conftest import LiveServer
from tests.server.models.test_glm_serving import FORECAST, QUESTION
from tests.server.models.test_minimax_serving import (
    BLOCK_SIZE, decode, named_call_in_all_three_apis, required_forecast, thinking_server,
)

pytestmark = pytest.mark.slow  # the module's server, and grammars over a 152k vocabulary
# A random model under the grammar spells XTML's markers in pieces ("<", "|", "se", "p"...): ~200 tokens for a call
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from thinking_server("kimi-k3-format-tiny", tmp_path_factory)


def test_a_required_call_round_trip_renders_the_reply_back_and_reads_the_prompt_cached(server: LiveServer) -> None:
    message, call = required_forecast(server, MAX_TOKENS)
    first_record = server.last_record()
    prompt = decode(server, first_record["prompt_token_ids"])
    assert prompt.startswith('<|open|>message role="system" type="tool-declare"<|sep|># Tools\n') and prompt.endswith(
        '<|open|>message role="user"<|sep|>Plan Rome.<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    assert "Now the system is invoked with `thinking_effort=max`." in prompt
    raw = decode(server, first_record["output_token_ids"][:-1])  # the reply up to the token that ended it
    assert re.fullmatch(r'.*<\|close\|>think<\|sep\|><\|open\|>response<\|sep\|><\|close\|>response<\|sep\|>'
                        r'<\|open\|>tools<\|sep\|><\|open\|>call tool="forecast" index="[0-9]+"<\|sep\|>'
                        r'<\|open\|>argument key="city" type="string"<\|sep\|>.*<\|close\|>call<\|sep\|>'
                        r'<\|close\|>tools<\|sep\|><\|close\|>message<\|sep\|>', raw, re.DOTALL), raw
    assert message.model_extra["reasoning_content"]  # the thinking comes back for the client to send again

    history = QUESTION + [message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny all week."}]
    second = server.client().chat.completions.create(model=server.ctx.model_name, messages=history, tools=[FORECAST],
                                                     max_tokens=4)
    next_prompt = decode(server, server.last_record()["prompt_token_ids"])
    # The history renders the first prompt, then the model's turn as it wrote it (K3 keeps every turn's thinking) up to
    # the call's index: the template numbers calls by position, where the grammar lets a random model write any index
    # (and a whitespace character around a JSON value), then the result.
    assert next_prompt.startswith(prompt + raw[:raw.index(' index="')])
    assert '<|open|>message role="tool" tool="forecast" index="1"<|sep|>Sunny all week.<|close|>message' in next_prompt
    # A random model under the grammar does not spell its reply the tokenizer's way, so the hybrid resumes at its last
    # KDA snapshot before (the first prompt's end) at least.
    assert second.usage.prompt_tokens_details.cached_tokens >= len(first_record["prompt_token_ids"]) - BLOCK_SIZE


def test_a_named_call_in_all_three_apis(server: LiveServer) -> None:
    named_call_in_all_three_apis(server, MAX_TOKENS)
