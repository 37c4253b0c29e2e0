"""Devstral Small 2 served end to end (devstral-small-tiny: the ministral3 architecture, the real tekken v13
tokenizer, Mistral's v13 format) through the real `openai` client against uvicorn: the prompt's tokens are exactly
mistral-common's, a required call comes back as a valid call written `[TOOL_CALLS]NAME[ARGS]{...}` (streamed and
not), the tool result goes back, and the next turn reads the first turn's prompt from the cache but at most one
block."""
from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from engine.config import EngineConfig
from tests.server.conftest import LiveServer, _live_server
from tests.server.models.test_glm_serving import FORECAST, QUESTION, assert_named_call_streams_as_returned_whole

pytest.importorskip("mistral_common")
from tests.rendering import mistral_reference  # noqa: E402

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from _live_server(tmp_path_factory, "devstral-small-tiny",
                            EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=1024, max_model_len=4096))


@pytest.mark.slow  # the module's server takes a while to start (the tekken tokenizer is converted on first use)
def test_the_prompt_is_mistral_commons_tokens(server: LiveServer) -> None:
    response = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION, "tools": [FORECAST]}, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == mistral_reference.encode(QUESTION, [FORECAST])[1]


@pytest.mark.slow  # the grammar's compile over a 131k vocabulary and sampled tokens
def test_a_required_call_round_trip_reads_the_first_turn_from_the_cache(server: LiveServer) -> None:
    client = server.client()
    first = client.chat.completions.create(model=server.ctx.model_name, messages=QUESTION, tools=[FORECAST],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                           temperature=1.0, seed=3)
    [call] = first.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "forecast" and set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 7
    assert first.choices[0].finish_reason == "tool_calls"
    first_record = server.last_record()
    assert first_record["output_token_ids"][:1] == [9]  # [TOOL_CALLS], the control token
    raw = server.ctx.tokenizer.decode(first_record["output_token_ids"], skip_special_tokens=False)
    assert raw.startswith("[TOOL_CALLS]forecast[ARGS]{")

    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny all week."}]
    second = client.chat.completions.create(model=server.ctx.model_name, messages=history, tools=[FORECAST],
                                            max_tokens=4)
    second_record = server.last_record()
    # The next prompt is mistral-common's for the whole history (the call's arguments re-serialized as json.dumps
    # writes them, which a grammar-constrained random model need not have; kvserve's call ids are not the 9
    # characters the library's validator wants, and v13 renders no id) and extends the first prompt...
    assert second_record["prompt_token_ids"] == mistral_reference.encode(history, [FORECAST], validate=False)[1]
    first_prompt = first_record["prompt_token_ids"]
    assert second_record["prompt_token_ids"][:len(first_prompt)] == first_prompt
    # ... so the cache serves the first prompt but the last partial block (and the reply as far as it is the same)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= len(first_prompt) - BLOCK_SIZE


@pytest.mark.slow
def test_a_named_call_streams_as_it_is_returned_whole(server: LiveServer) -> None:
    assert_named_call_streams_as_returned_whole(server, max_tokens=100)
