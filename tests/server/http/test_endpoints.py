"""Text completions, models, health, tokenize/detokenize and the Prometheus metrics page."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.server.conftest import LiveServer


def test_text_completion_streamed_and_not_agree(qwen_server: LiveServer) -> None:
    client = qwen_server.client()
    kwargs = dict(model="qwen3-tiny", prompt="The quick brown fox", max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    assert full.id.startswith("cmpl-") and full.object == "text_completion" and full.model == "qwen3-tiny"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 6
    assert full.usage.prompt_tokens == len(qwen_server.ctx.encode("The quick brown fox"))
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"


def test_text_completion_of_token_ids_batch_n_echo_and_logprobs(qwen_server: LiveServer) -> None:
    client = qwen_server.client()
    ids = qwen_server.ctx.encode("Hello there")
    by_text = client.completions.create(model="qwen3-tiny", prompt="Hello there", max_tokens=4, temperature=0)
    by_ids = client.completions.create(model="qwen3-tiny", prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text

    batch = client.completions.create(model="qwen3-tiny", prompt=["one", "two"], n=2, max_tokens=3, seed=1,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.usage.completion_tokens == 12
    assert batch.usage.prompt_tokens == len(qwen_server.ctx.encode("one")) + len(qwen_server.ctx.encode("two"))

    echoed = client.completions.create(model="qwen3-tiny", prompt="Hello there", max_tokens=4, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "Hello there" + by_text.choices[0].text

    scored = client.completions.create(model="qwen3-tiny", prompt="Hello there", max_tokens=3, temperature=0,
                                       logprobs=2, extra_body={"ignore_eos": True})
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[1] == len(logprobs.tokens[0])
    # Greedy: the chosen token is the most likely one.
    assert all(max(top.values()) == lp for top, lp in zip(logprobs.top_logprobs, logprobs.token_logprobs, strict=True))


def test_models_and_health(qwen_server: LiveServer) -> None:
    client = qwen_server.client()
    [model] = client.models.list().data
    assert model.id == "qwen3-tiny" and model.owned_by == "kvserve"
    assert client.models.retrieve("qwen3-tiny").id == "qwen3-tiny"
    # Probes need no key; the API does.
    assert httpx.get(qwen_server.base_url + "/health").json() == {"status": "ok", "model": "qwen3-tiny"}
    assert httpx.get(qwen_server.base_url + "/v1/models").status_code == 401


def test_tokenize_detokenize_round_trip(qwen_server: LiveServer) -> None:
    with qwen_server.http() as http:
        text = http.post("/tokenize", json={"prompt": "Hello, wörld"}).json()
        assert text["tokens"] == qwen_server.ctx.encode("Hello, wörld") and text["count"] == len(text["tokens"])
        assert text["max_model_len"] == 512
        assert http.post("/detokenize", json={"tokens": text["tokens"]}).json() == {"prompt": "Hello, wörld"}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                            "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert chat["prompt"].startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>")
    assert chat["tokens"] == qwen_server.ctx.encode(chat["prompt"])


def test_metrics_page_is_prometheus_text(qwen_server: LiveServer) -> None:
    qwen_server.chat(messages=[{"role": "user", "content": "metrics please"}], max_tokens=2)
    response = httpx.get(qwen_server.base_url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    for name, kind in [
        ("kvserve_prefix_cache_queries_tokens_total", "counter"), ("kvserve_prefix_cache_hits_tokens_total", "counter"),
        ("kvserve_kv_blocks_total", "gauge"), ("kvserve_kv_blocks_free", "gauge"), ("kvserve_kv_blocks_cached", "gauge"),
        ("kvserve_requests_running", "gauge"), ("kvserve_requests_waiting", "gauge"),
        ("kvserve_prompt_tokens_total", "counter"), ("kvserve_generation_tokens_total", "counter"),
        ("kvserve_time_to_first_token_seconds", "histogram"), ("kvserve_e2e_request_latency_seconds", "histogram"),
    ]:
        assert f"# TYPE {name} {kind}\n" in text, name
    sample = re.compile(r'^[a-z_][a-z0-9_]*(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.]+(e[+-]?[0-9]+)?$|^#.*$')
    assert all(sample.match(line) for line in text.splitlines()), "every line is a sample or a comment"
    metrics = qwen_server.metrics()
    count = metrics['kvserve_time_to_first_token_seconds_count{model="qwen3-tiny"}']
    assert count >= 1 and metrics['kvserve_time_to_first_token_seconds_bucket{model="qwen3-tiny",le="+Inf"}'] == count
    assert metrics['kvserve_kv_blocks_total{model="qwen3-tiny"}'] == qwen_server.ctx.engine.facts.num_blocks
    assert metrics['kvserve_generation_tokens_total{model="qwen3-tiny"}'] >= 2


@pytest.mark.slow
def test_streamed_text_never_splits_a_character(smol_server: LiveServer) -> None:
    """SmolLM2 writes each CJK character as three byte-level tokens. No chunk may carry a part of one (it would show
    as U+FFFD), and the chunks join to exactly the decoded output."""
    chunks = list(smol_server.client().completions.create(
        model="smollm2-135m", prompt="Japanese words: 日本語, 東京, 日本語, 東京, 日本語, 東京,", max_tokens=8,
        temperature=0, stream=True,
    ))
    ids = json.loads(smol_server.record_path.read_text().splitlines()[-1])["output_token_ids"]
    tokenizer = smol_server.ctx.tokenizer
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the output has tokens that split a character"
    texts = [c.choices[0].text for c in chunks]
    assert not any("\ufffd" in text for text in texts)
    assert "".join(texts) == tokenizer.decode(ids) and "日本" in "".join(texts)
