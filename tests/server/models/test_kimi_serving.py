"""Kimi served end to end (kimi-linear-tiny: the Kimi Linear hybrid, Kimi-K2's template, a stand-in tokenizer with
Kimi's special tokens) through the real clients against uvicorn. Kimi's template writes `<think>...</think>` in every
assistant turn, so the grammar has the model open its thinking, which the server bounds (--reasoning-budget); then
tool_choice required makes it write a valid call in Kimi's `<|tool_calls_section_begin|>` section, whose
`functions.NAME:IDX` header comes back as the call's id. The tool result goes back, and the next turn (a hybrid: KDA
state snapshots beside the MLA pages) reads from the cache the first turn's prompt and reply but at most one block. A
named tool comes back the same through chat completions (streamed as returned whole), Anthropic Messages (a tool_use
block) and Responses (a function_call item)."""
from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.server.conftest import LiveServer
from tests.server.models.test_glm_serving import FORECAST, QUESTION
from tests.server.models.test_minimax_serving import (
    BLOCK_SIZE, decode, named_call_in_all_three_apis, required_forecast, thinking_server,
)

pytestmark = pytest.mark.slow  # the module's server, and grammars over a 164k vocabulary


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from thinking_server("kimi-linear-tiny", tmp_path_factory)


def test_a_required_call_round_trip_renders_the_reply_back_and_reads_the_prompt_cached(server: LiveServer) -> None:
    client = server.client()
    message, call = required_forecast(server)
    assert re.fullmatch(r"functions\.forecast:[0-9]{1,3}", call.id)  # the model's header
    first_record = server.last_record()
    prompt = decode(server, first_record["prompt_token_ids"])
    assert prompt.startswith("<|im_system|>tool_declare<|im_middle|>[") and prompt.endswith(
        "<|im_system|>system<|im_middle|>You are a travel agent.<|im_end|><|im_user|>user<|im_middle|>Plan Rome."
        "<|im_end|><|im_assistant|>assistant<|im_middle|>")
    raw = decode(server, first_record["output_token_ids"][:-1])  # the reply up to the token that ended it
    assert re.match(r"<think>.*</think>\n{0,2}<\|tool_calls_section_begin\|><\|tool_call_begin\|>"
                    + re.escape(call.id) + "<\\|tool_call_argument_begin\\|>", raw, re.DOTALL), raw

    history = QUESTION + [message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny all week."}]
    second = client.chat.completions.create(model=server.ctx.model_name, messages=history, tools=[FORECAST],
                                            max_tokens=4)
    second_record = server.last_record()
    # The history re-renders the first prompt and the model's whole reply, byte for byte (Kimi keeps a tool loop's
    # thinking, and the call's id is the model's header; the template ends the turn with <|im_end|> whichever stop
    # token the model wrote).
    assert decode(server, second_record["prompt_token_ids"]).startswith(prompt + raw)
    # Token for token the random model's reply is not the tokenizer's spelling of it (under the grammar it writes
    # "func" "tion" "s" for "functions"), so the next prompt's tokens leave it there, and the hybrid resumes at the
    # last KDA snapshot before: the first prompt's end. (A reply re-read token for token: test_kimi_linear.py.)
    assert second.usage.prompt_tokens_details.cached_tokens >= len(first_record["prompt_token_ids"]) - BLOCK_SIZE


def test_a_named_call_in_all_three_apis(server: LiveServer) -> None:
    use, item = named_call_in_all_three_apis(server)
    assert use.id.startswith("functions.forecast:") and item.call_id.startswith("functions.forecast:")
