"""`kvserve render`, run as a real subprocess (`python -m server.cli render ...`), and `render_request`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from server.rendering import FAMILIES, get_renderer, render_request
from tests.rendering.corpus import CASES
from tests.rendering.test_goldens import load_golden

REPO = Path(__file__).resolve().parents[2]
CASE = next(c for c in CASES if c.name == "parallel_calls_three_with_text")


def request_body(case, **extra) -> dict:
    return {"model": "any", "messages": case.messages, "tools": case.tools, "temperature": 0.2, **extra}


def run_cli(*args: str, stdin: bytes | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "render", *args],
        cwd=REPO, input=stdin, capture_output=True, timeout=300, env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_render_request_matches_goldens(family: str) -> None:
    case = next(c for c in CASES if c.name == "thinking_off_with_tools")
    body = request_body(case, chat_template_kwargs=case.kwargs)
    assert render_request(get_renderer(family), body) == load_golden(family)["cases"][case.name]["prompt"]


def test_render_request_add_generation_prompt_and_validation() -> None:
    renderer = get_renderer("qwen2.5")
    body = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    assert render_request(renderer, body).endswith("<|im_start|>assistant\n")
    assert render_request(renderer, {**body, "add_generation_prompt": False}).endswith("Hello<|im_end|>\n")
    for bad in ([], {"messages": []}, {**body, "chat_template_kwargs": [1]}, {**body, "add_generation_prompt": "yes"}):
        with pytest.raises(ValueError):
            render_request(renderer, bad)


@pytest.mark.slow
def test_cli_prints_exact_prompt_bytes(tmp_path: Path) -> None:
    request = tmp_path / "request.json"
    request.write_text(json.dumps(request_body(CASE), ensure_ascii=False), encoding="utf-8")
    result = run_cli("--template", "deepseek-v3-0324", "--request", str(request))
    assert result.returncode == 0, result.stderr.decode()
    want = load_golden("deepseek-v3-0324")["cases"][CASE.name]["prompt"]
    assert result.stdout == want.encode("utf-8")  # no trailing newline added, UTF-8 whatever the locale


@pytest.mark.slow
def test_cli_reads_stdin_and_passes_template_kwargs() -> None:
    body = {"messages": [{"role": "user", "content": "Hi ✓"}], "chat_template_kwargs": {"enable_thinking": False}}
    result = run_cli("--template", "qwen3", "--request", "-", stdin=json.dumps(body).encode(), env={"LC_ALL": "C"})
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode("utf-8") == "<|im_start|>user\nHi ✓<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.slow
def test_cli_keeps_qwen36_reasoning_as_the_server_does() -> None:
    body = {"messages": [{"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4", "reasoning_content": "Add."},
                         {"role": "user", "content": "3+3?"}]}
    kept = run_cli("--template", "qwen3.6", "--request", "-", stdin=json.dumps(body).encode())
    dropped = run_cli("--template", "qwen3.6", "--no-preserve-thinking", "--request", "-", stdin=json.dumps(body).encode())
    assert kept.returncode == dropped.returncode == 0, kept.stderr.decode() + dropped.stderr.decode()
    assert b"<|im_start|>assistant\n<think>\nAdd.\n</think>\n\n4<|im_end|>" in kept.stdout
    assert b"<|im_start|>assistant\n4<|im_end|>" in dropped.stdout


@pytest.mark.slow
def test_cli_rejects_invalid_requests_with_a_message() -> None:
    bad = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    result = run_cli("--template", "deepseek-r1", "--request", "-", stdin=json.dumps(bad).encode())
    assert result.returncode == 2 and result.stdout == b""
    assert b"image_url" in result.stderr
    result = run_cli("--template", "qwen3", "--tokens", "--request", "-", stdin=b"{}")
    assert result.returncode == 2 and b"--tokens needs --model" in result.stderr


@pytest.mark.slow
def test_cli_model_prints_prompt_and_token_ids(tmp_path: Path) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": CASE.tools}
    result = run_cli("--model", "qwen3-tiny", "--tokens", "--request", "-", stdin=json.dumps(body).encode(),
                     env={"KVSERVE_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr.decode()
    out = json.loads(result.stdout)
    assert out["prompt"] == get_renderer("qwen3").render(body["messages"], body["tools"])
    assert out["num_tokens"] == len(out["token_ids"])
    # ChatML markers are single special tokens (151644 = <|im_start|>, 151645 = <|im_end|>), never split text.
    assert out["token_ids"][0] == 151644 and out["token_ids"].count(151645) == out["prompt"].count("<|im_end|>")
