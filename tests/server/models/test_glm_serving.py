"""GLM-4.7-Flash served end to end (glm4.7-flash-tiny: the architecture, the official template, a stand-in tokenizer
with GLM's special tokens) through the real `openai` client against uvicorn: a required call comes back as a valid
call in GLM's own `<arg_key>`/`<arg_value>` format (streamed and not), the tool result goes back, and the next turn
reads from the cache everything it shares with the first turn's prompt and reply but at most one block; thinking
reaches the prompt as the template writes it."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings, load_context
from tests.server.conftest import LiveServer, serve

BLOCK_SIZE = 4
QUESTION = [{"role": "system", "content": "You are a travel agent."}, {"role": "user", "content": "Plan Rome."}]
FORECAST = {"type": "function", "function": {"name": "forecast", "description": "The weather, day by day.",
                                             "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
THINKING_OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    record = tmp_path_factory.mktemp("record") / "requests.jsonl"
    ctx = load_context("glm4.7-flash-tiny", EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=1024,
                                                         max_model_len=4096), ServerSettings(), record_path=str(record))
    with serve(ctx) as url:
        yield LiveServer(ctx, url, record)


def _prompt(server: LiveServer, **body) -> str:
    response = httpx.post(f"{server.base_url}/tokenize", json={"messages": QUESTION, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return server.ctx.tokenizer.decode(response.json()["tokens"], skip_special_tokens=False)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.slow  # the module's server takes ~12 s to start
def test_thinking_reaches_the_prompt(server: LiveServer) -> None:
    assert _prompt(server).startswith("[gMASK]<sop><|system|>You are a travel agent.<|user|>Plan Rome.")
    assert _prompt(server).endswith("<|assistant|><think>")  # GLM-4.7 thinks unless told not to
    assert _prompt(server, **THINKING_OFF).endswith("<|assistant|></think>")


@pytest.mark.slow  # ~25 s: the grammar's compile over a 155k vocabulary and 200 sampled tokens
def test_a_required_call_round_trip_reads_the_first_turn_from_the_cache(server: LiveServer) -> None:
    client = server.client()
    first = client.chat.completions.create(model=server.ctx.model_name, messages=QUESTION, tools=[FORECAST],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                           temperature=1.0, seed=3, extra_body=THINKING_OFF)
    [call] = first.choices[0].message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "forecast" and set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 7
    assert first.choices[0].finish_reason == "tool_calls"
    first_record = server.last_record()
    raw = server.ctx.tokenizer.decode(first_record["output_token_ids"], skip_special_tokens=False)
    assert raw.startswith("<tool_call>forecast<arg_key>city</arg_key><arg_value>")  # GLM's own format

    history = QUESTION + [first.choices[0].message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "Sunny all week."}]
    second = client.chat.completions.create(model=server.ctx.model_name, messages=history, tools=[FORECAST],
                                            max_tokens=4, extra_body=THINKING_OFF)
    second_record = server.last_record()
    # The history re-renders the first prompt and the model's call byte for byte (up to its stop token), but for the
    # layout the grammar lets a random model put around the tags (xgrammar's glm_xml allows a whitespace character
    # there; the parser reads it as layout, the template writes none)...
    decode = lambda ids: server.ctx.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    reply = re.sub(r"\s*(</?arg_(?:key|value)>|</tool_call>)\s*", r"\1", raw)
    reply = reply.removesuffix("<|observation|>").removesuffix("<|endoftext|>")
    assert decode(second_record["prompt_token_ids"]).startswith(decode(first_record["prompt_token_ids"]) + reply)
    # ... and the cache serves all the tokens the two turns share but the last partial block. (A random model under
    # a grammar may spell `<tool_call>` in plain-text tokens where the template has GLM's one token, so the shared
    # tokens may end at the reply: the text above is what the template guarantees.)
    first_tokens = first_record["prompt_token_ids"] + first_record["output_token_ids"]
    shared = _shared_prefix(first_tokens, second_record["prompt_token_ids"])
    assert shared >= len(first_record["prompt_token_ids"])
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert shared - BLOCK_SIZE <= cached <= shared


@pytest.mark.slow
def test_a_named_call_streams_as_it_is_returned_whole(server: LiveServer) -> None:
    assert_named_call_streams_as_returned_whole(server, max_tokens=200, extra_body=THINKING_OFF)


def assert_named_call_streams_as_returned_whole(server: LiveServer, **extra) -> None:
    """tool_choice naming `forecast`: the streamed call's name and arguments are those of the call returned whole."""
    kwargs = dict(model=server.ctx.model_name, messages=QUESTION, tools=[FORECAST], temperature=1.0, seed=5,
                  tool_choice={"type": "function", "function": {"name": "forecast"}}, **extra)
    client = server.client()
    [call] = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    parts = ["", ""]
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert delta.index == 0
            parts[0] += delta.function.name or ""
            parts[1] += delta.function.arguments or ""
    assert parts[0] == call.function.name == "forecast"
    assert json.loads(parts[1]) == json.loads(call.function.arguments)
