"""The offline API's contract: sampling reproducibility, stop handling, and clear errors on bad input."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.hf_oracle import random_prompts


def test_same_seed_same_tokens_whatever_the_batch(qwen3_llm: LLM):
    prompts = random_prompts(50_000, [7, 12, 19], seed=31)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = qwen3_llm.generate([prompts[0]], params)[0].token_ids
    together = qwen3_llm.generate(prompts, [params, SamplingParams(max_tokens=3), SamplingParams(max_tokens=9)])
    assert together[0].token_ids == alone
    other_seed = qwen3_llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=1.0, seed=99, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_stop_string_cuts_text_exactly(qwen3_llm: LLM):
    prompt = "Once upon a time"
    full = qwen3_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0]
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    cut = qwen3_llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert cut.text == text[: text.index(stop)]
    assert cut.finish_reason == "stop"


def test_stop_token_ids_end_generation(qwen3_llm: LLM):
    prompt = random_prompts(50_000, [9], seed=32)[0]
    full = qwen3_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    stop_at = full[4]
    out = qwen3_llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == full[: full.index(stop_at) + 1]
    assert out.finish_reason == "stop"


@pytest.mark.parametrize(
    "prompt, make_params, message",
    [
        ([], lambda: SamplingParams(), "empty"),
        ([5, 10**7], lambda: SamplingParams(), "outside the vocabulary"),
        ([7] * 40_960, lambda: SamplingParams(), "too long"),
        ([5, 6], lambda: SamplingParams(max_tokens=-1), "max_tokens"),
        ([5, 6], lambda: SamplingParams(top_p=0.0), "top_p"),
        ([5, 6], lambda: SamplingParams(top_p=1.5), "top_p"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(qwen3_llm: LLM, prompt, make_params, message):
    with pytest.raises(ValueError, match=message):
        qwen3_llm.generate([[1, 2, 3], prompt], make_params())
    assert not qwen3_llm.engine.has_unfinished_requests()  # the good prompt in the same call was not queued either
    out = qwen3_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


@pytest.mark.slow
def test_smollm2_answers_paris():
    llm = LLM("smollm2-135m", block_size=16, num_kv_blocks=256)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    out = llm.generate([list(ids)], SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text, out.text


@pytest.mark.slow
def test_generate_cli_prints_the_greedy_completion(qwen3_llm: LLM):
    import subprocess
    import sys

    expected = qwen3_llm.generate("Hello there", SamplingParams(max_tokens=6, temperature=0))[0].text
    run = subprocess.run(
        [sys.executable, "-m", "server.cli", "generate", "--model", "qwen3-tiny", "--max-tokens", "6",
         "--num-kv-blocks", "64", "Hello there"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == expected + "\n"
    bad = subprocess.run(
        [sys.executable, "-m", "server.cli", "generate", "--model", "qwen3-tiny", "--top-p", "2", "x"],
        capture_output=True, text=True, timeout=300,
    )
    assert bad.returncode == 2 and "top_p" in bad.stderr


@pytest.mark.slow
def test_local_model_directory_runs_like_the_registry_entry(qwen3_llm: LLM, tmp_path):
    """What users with their own checkpoints do: point at an HF-format directory."""
    import shutil

    from engine.registry import get_model_spec, resolve_model

    local = tmp_path / "my-qwen3"
    shutil.copytree(resolve_model("qwen3-tiny"), local)
    spec = get_model_spec(str(local))
    assert (spec.source, spec.template) == ("local", "qwen3")
    prompt = random_prompts(50_000, [11], seed=51)[0]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    from_dir = LLM(str(local), block_size=4, num_kv_blocks=64).generate([prompt], greedy)[0].token_ids
    assert from_dir == qwen3_llm.generate([prompt], greedy)[0].token_ids


@pytest.mark.slow
def test_engine_thread_gives_what_the_calling_thread_gives(qwen3_llm: LLM, monkeypatch):
    """On an accelerator `generate` steps the engine in a thread of its own; on a CPU the caller steps it. Same
    tokens, texts, stop-string cuts and finish reasons either way."""
    prompts = random_prompts(50_000, [6, 15, 23, 9], seed=33)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    text = qwen3_llm.generate(prompts[1], greedy)[0].text
    params = [greedy, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[text[4:7]]),
              SamplingParams(max_tokens=7, temperature=0.9, seed=5, n=2, ignore_eos=True), SamplingParams(max_tokens=5, seed=8)]

    def run() -> list:
        outs = qwen3_llm.generate(prompts, params)
        return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]

    here = run()
    monkeypatch.setattr(LLM, "_engine_thread_pays", lambda self: True)
    assert run() == here
    assert here[1][0][2] == "stop" and len({tuple(o[0][0]) for o in here}) == len(here)
