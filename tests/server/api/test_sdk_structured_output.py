"""Structured output through client libraries nobody on the project wrote: openai's `responses.parse` (Responses
`text.format`), anthropic's `messages.parse` (`output_config.format`), openai-agents with `output_type` on both of its
APIs (Responses and chat completions), and langchain-openai's `with_structured_output`.

qwen3-tiny has random weights: it never writes JSON that parses into these models by chance, so every parsed answer
here is the grammar's doing. Each library runs several samples at temperature 1 (seeded where the API has a seed),
streamed and not, as one concurrent batch.
"""
from __future__ import annotations

import asyncio
from typing import Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from engine.text.output_processor import CompletionOutput
from engine.outputs import FinishReason
from server.parsing import get_output_parser
from server.pipeline.choices import ChoiceState
from tests.server.conftest import LiveServer

SAMPLES = range(4)
MODEL = "qwen3-tiny"
QUESTION = "What will the weather be in Paris tomorrow?"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # a random model never stops thinking


class Forecast(BaseModel):
    """Bounded everywhere: a random model never closes a free string by choice (a real one does)."""

    city: Literal["Paris", "Oslo", "Lima"]
    sunny: bool
    temperature: int = Field(ge=-40, le=50)
    summary: str = Field(max_length=12)


class Week(BaseModel):
    """For Anthropic, whose SDK moves length bounds into descriptions: no free strings at all."""

    city: Literal["Paris", "Oslo", "Lima"]
    sunny: bool
    days: list[Literal["mon", "tue", "wed"]]


def _check(answers: list[BaseModel], model: type[BaseModel]) -> None:
    assert len(answers) == 2 * len(SAMPLES)
    for answer in answers:
        assert isinstance(answer, model)
        model.model_validate_json(answer.model_dump_json())
    assert len({a.model_dump_json() for a in answers}) > 1, "the samples should differ (temperature 1)"


def _gather(*coroutines):
    async def run():
        return await asyncio.gather(*coroutines)

    return asyncio.run(run())


@pytest.mark.slow
@pytest.mark.slow
def test_openai_responses_parse(qwen_server: LiveServer) -> None:
    client = qwen_server.async_client()
    kwargs = dict(model=MODEL, input=QUESTION, text_format=Forecast, temperature=1.0, max_output_tokens=120,
                  reasoning={"effort": "none"})

    async def parse(stream: bool) -> Forecast:
        if not stream:
            response = await client.responses.parse(**kwargs)
        else:
            async with client.responses.stream(**kwargs) as events:
                response = await events.get_final_response()
        assert response.status == "completed" and response.text.format.type == "json_schema"
        return response.output_parsed

    _check(_gather(*(parse(stream) for stream in (False, True) for _ in SAMPLES)), Forecast)


@pytest.mark.slow
@pytest.mark.slow
def test_anthropic_messages_parse(qwen_server: LiveServer) -> None:
    client = anthropic.AsyncAnthropic(base_url=qwen_server.base_url, api_key=qwen_server.api_key, max_retries=0)
    kwargs = dict(model=MODEL, max_tokens=120, output_format=Week,  # temperature 1: the default
                  messages=[{"role": "user", "content": QUESTION}])

    async def parse(stream: bool) -> Week:
        if not stream:
            message = await client.messages.parse(**kwargs)
        else:
            async with client.messages.stream(**kwargs) as events:
                message = await events.get_final_message()
        assert message.stop_reason == "end_turn"
        return message.parsed_output

    _check(_gather(*(parse(stream) for stream in (False, True) for _ in SAMPLES)), Week)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
@pytest.mark.slow
def test_openai_agents_output_type(qwen_server: LiveServer, api: str) -> None:
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        set_tracing_disabled)
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)  # no traces sent anywhere
    client = qwen_server.async_client()

    def agent(seed: int) -> Agent:
        if api == "responses":
            model = OpenAIResponsesModel(MODEL, client)
            settings = ModelSettings(temperature=1.0, max_tokens=120, reasoning=Reasoning(effort="none"))
        else:
            model = OpenAIChatCompletionsModel(MODEL, client)
            settings = ModelSettings(temperature=1.0, max_tokens=120, extra_body={**NO_THINKING, "seed": seed})
        return Agent(name="forecaster", instructions="Answer with the forecast.", output_type=Forecast, model=model,
                     model_settings=settings)

    async def run(stream: bool, seed: int) -> Forecast:
        if not stream:
            return (await Runner.run(agent(seed), QUESTION)).final_output
        result = Runner.run_streamed(agent(seed), QUESTION)
        async for _ in result.stream_events():
            pass
        return result.final_output

    _check(_gather(*(run(stream, seed) for stream in (False, True) for seed in SAMPLES)), Forecast)


@pytest.mark.slow
@pytest.mark.slow
def test_langchain_with_structured_output(qwen_server: LiveServer) -> None:
    from langchain_openai import ChatOpenAI

    def llm(seed: int):
        return ChatOpenAI(model=MODEL, base_url=f"{qwen_server.base_url}/v1", api_key=qwen_server.api_key,
                          temperature=1.0, max_tokens=120, seed=seed, max_retries=0,
                          extra_body=NO_THINKING).with_structured_output(Forecast)

    async def run(stream: bool, seed: int) -> Forecast:
        if not stream:
            return await llm(seed).ainvoke(QUESTION)
        return [chunk async for chunk in llm(seed).astream(QUESTION)][-1]

    _check(_gather(*(run(stream, seed) for stream in (False, True) for seed in SAMPLES)), Forecast)


@pytest.mark.slow
def test_responses_text_format_is_enforced_and_echoed(qwen_server: LiveServer) -> None:
    """The quick check of the tier without the SDK sweeps: one parse per API, and the format echoed as sent."""
    client = qwen_server.client()
    parsed = client.responses.parse(model=MODEL, input=QUESTION, text_format=Forecast, temperature=1.0,
                                    max_output_tokens=120, reasoning={"effort": "none"})
    assert isinstance(parsed.output_parsed, Forecast)
    sent = {"type": "json_schema", "name": "forecast", "strict": True, "schema": Forecast.model_json_schema()}
    raw = client.responses.create(model=MODEL, input=QUESTION, text={"format": sent}, temperature=1.0,
                                  max_output_tokens=120, reasoning={"effort": "none"})
    assert raw.text.format.model_dump(by_alias=True, exclude_none=True) == {**sent}
    Forecast.model_validate_json(raw.output_text)
    json_object = client.responses.create(model=MODEL, input=QUESTION, text={"format": {"type": "json_object"}},
                                          temperature=1.0, max_output_tokens=60, reasoning={"effort": "none"})
    assert json_object.output_text.startswith("{") and json_object.text.format.type == "json_object"


@pytest.mark.slow
def test_messages_output_config_format_is_enforced(qwen_server: LiveServer) -> None:
    client = qwen_server.anthropic()
    message = client.messages.parse(model=MODEL, max_tokens=120, output_format=Week,
                                    messages=[{"role": "user", "content": QUESTION}])
    assert message.stop_reason == "end_turn" and isinstance(message.parsed_output, Week)


@pytest.mark.parametrize("api, body, param", [
    ("responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"not": {}}}}},
     "text.format.schema"),
    ("responses", {"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ("messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                  "output_config": {"format": {"type": "json_schema", "schema": {"not": {}}}}},
     "output_config.format.schema"),
    ("messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
                  "output_config": {"format": {"type": "regex"}}}, "output_config.format.type"),
])
def test_a_format_that_cannot_be_enforced_is_a_400_naming_the_field(qwen_server: LiveServer, api: str, body: dict,
                                                                    param: str) -> None:
    response = qwen_server.http().post(f"/v1/{api}", json={"model": MODEL, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    if api == "responses":
        assert error["param"] == param and param in error["message"]
    else:
        assert param in error["message"]


@pytest.mark.slow
def test_a_cut_structured_answer_is_never_reported_complete(qwen_server: LiveServer) -> None:
    """A cut reply is reported as finished to the agent APIs when the server's limits cut it, but never a structured
    one, whose text does not parse."""
    parser = get_output_parser("qwen3", None, reasoning=False, id_prefix="cut")
    parser.finish(cut=True)
    cut = ChoiceState(parser, CompletionOutput(token_ids=[1, 2], finish_reason=FinishReason.LENGTH))
    assert [cut.finish(requested).cut_by_request for requested in (None, 100, 2)] == [False, False, True]
    cut.structured = True
    assert cut.finish(None).cut_by_request and cut.finish(100).cut_by_request
    client = qwen_server.anthropic()
    message = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": QUESTION}],
                                     output_config={"format": {"type": "json_schema",
                                                               "schema": Week.model_json_schema()}})
    assert message.stop_reason == "max_tokens"
    with pytest.raises(openai.LengthFinishReasonError):
        qwen_server.client().chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                                    response_format=Forecast, max_tokens=2, extra_body=NO_THINKING)
