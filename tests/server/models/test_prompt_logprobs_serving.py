"""Scoring through the OpenAI endpoints: `echo` with `logprobs` and vLLM's `prompt_logprobs` on smollm2-135m (real
weights), equal to transformers' log-probabilities, whether the prompt was cached or not, with `max_tokens: 0`."""
from __future__ import annotations

import json
import math

import pytest

from tests.worker.test_prompt_logprobs import hf_prompt_logprobs
from tests.server.conftest import LiveServer

TEXT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


def _expected(server: LiveServer, ids: list[int]) -> list[float]:
    rows = hf_prompt_logprobs("smollm2-135m", ids)
    return [rows[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


@pytest.mark.slow
def test_echo_logprobs_score_the_prompt_as_transformers_does_cached_or_not(smol_server: LiveServer) -> None:
    client = smol_server.client()
    ids = smol_server.ctx.encode(TEXT)
    expected = _expected(smol_server, ids)
    for attempt in range(2):  # the second time the prompt's blocks are cached: they are recomputed
        for max_tokens in (0, 1):
            out = client.completions.create(model="smollm2-135m", prompt=TEXT, echo=True, logprobs=1,
                                            max_tokens=max_tokens, temperature=0)
            choice = out.choices[0]
            scored = choice.logprobs.token_logprobs
            assert choice.text.startswith(TEXT) and len(scored) == len(ids) + max_tokens
            assert scored[0] is None and choice.logprobs.top_logprobs[0] is None
            assert all(abs(a - b) < 1e-4 for a, b in zip(scored[1 : len(ids)], expected))
            assert out.usage.completion_tokens == max_tokens and out.usage.prompt_tokens_details.cached_tokens == 0
            assert choice.finish_reason == "length" and "".join(choice.logprobs.tokens).startswith(TEXT)
            assert choice.logprobs.text_offset[0] == 0
            if max_tokens:
                assert choice.logprobs.text_offset[len(ids)] == len(TEXT)  # the completion starts after the echo
            # The top alternative is at least as likely as the prompt token (lm-eval's is_greedy reads this).
            assert all(max(top.values()) >= lp - 1e-6 for lp, top in zip(scored[1:], choice.logprobs.top_logprobs[1:]))


@pytest.mark.slow
def test_vllm_prompt_logprobs_on_both_openai_endpoints(smol_server: LiveServer) -> None:
    http = smol_server.http()
    ids = smol_server.ctx.encode(TEXT)
    expected = _expected(smol_server, ids)
    completion = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "prompt_logprobs": 2}).json()
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": TEXT}], "max_tokens": 1,
                                                   "prompt_logprobs": 0}).json()
    scored = completion["choices"][0]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(ids)
    for position, token, logprob in zip(scored[1:], ids[1:], expected):
        mine = position[str(token)]
        assert abs(mine["logprob"] - logprob) < 1e-4
        assert {1, 2, mine["rank"]} == {v["rank"] for v in position.values()}  # the two best, and the token
    prompt_ids = smol_server.ctx.encode(smol_server.ctx.lane_tools.renderer.render([{"role": "user", "content": TEXT}]))
    assert len(chat["prompt_logprobs"]) == len(prompt_ids) and chat["prompt_logprobs"][0] is None
    assert all(len(p) == 1 for p in chat["prompt_logprobs"][1:])  # prompt_logprobs 0: the prompt token alone


def test_streamed_echo_sends_the_prompt_with_its_logprobs_first(smol_server: LiveServer) -> None:
    with smol_server.http().stream("POST", "/v1/completions", json={
            "prompt": TEXT, "echo": True, "logprobs": 0, "max_tokens": 2, "stream": True, "temperature": 0}) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == TEXT and first["logprobs"]["token_logprobs"][0] is None
    assert all(math.isfinite(lp) for lp in first["logprobs"]["token_logprobs"][1:])
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(TEXT)


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
])
def test_bad_scoring_requests_are_400s(smol_server: LiveServer, route: str, body: dict, param: str) -> None:
    response = smol_server.http().post(route, json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param
