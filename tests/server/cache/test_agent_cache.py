"""Agent-session caching through the server, with the official Anthropic client: the A / B / A case on a 96-block
pool (host tier: A comes back cached and answers the same; without it A is recomputed), a cache_control breakpoint
that outlives newer sessions, the disk tier across a restart, and a session held across a tool call."""
from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings, load_context
from tests.server.conftest import LiveServer, serve
from tests.server.api.test_tools import FEW_SHOT, NAMED, WEATHER

WORDS = "alpha beta gamma delta river stone cloud paper light green table seven north quiet metal bread".split()


def text(words: int, seed: int) -> str:
    """About one token per word with the Qwen tokenizer."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@contextmanager
def tiered_server(**engine) -> Iterator[LiveServer]:
    """qwen3-tiny on the issue's 96-block pool (blocks of 16 tokens)."""
    ctx = load_context("qwen3-tiny", EngineConfig(num_kv_blocks=96, **engine), ServerSettings())
    with serve(ctx) as url:
        yield LiveServer(ctx, url)


@pytest.fixture(scope="module")
def offload_server() -> Iterator[LiveServer]:
    with tiered_server(kv_offload_gb=1.0) as server:
        yield server


@pytest.fixture(scope="module")
def plain_server() -> Iterator[LiveServer]:
    with tiered_server() as server:
        yield server


def ask(server: LiveServer, system, user: str):
    message = server.anthropic().messages.create(model="qwen3-tiny", max_tokens=8, extra_body={"temperature": 0},
                                                 system=system, messages=[{"role": "user", "content": user}])
    usage = message.usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    return message, usage, prompt


def session(seed: int, system_words: int, user_words: int) -> tuple[str, str]:
    return text(system_words, seed), text(user_words, seed + 1)


@pytest.mark.parametrize("tier", ["offload", "plain"])
@pytest.mark.slow
def test_a_b_a(request, tier):
    server = request.getfixturevalue(f"{tier}_server")
    server.reset_prefix_cache()
    a, b = session(10, 300, 650), session(20, 500, 930)  # A ~60 blocks, B ~90 blocks of the 96
    first, _, _ = ask(server, *a)
    ask(server, *b)
    third, usage, prompt = ask(server, *a)
    assert third.content == first.content  # the restored blocks give the same greedy answer
    if tier == "offload":
        assert usage.cache_read_input_tokens >= 0.8 * prompt
        assert server.metric("kvserve_prefix_cache_host_hits_tokens_total") > 0
        assert server.metric("kvserve_kv_restore_bytes_total") > 0
    else:
        assert usage.cache_read_input_tokens <= 0.1 * prompt  # recomputed


@pytest.mark.parametrize("pinned", [True, False])
@pytest.mark.slow
def test_breakpoint_on_the_system_prompt_survives_newer_sessions(plain_server, pinned):
    server = plain_server
    server.reset_prefix_cache()
    system_text, user = session(30 + pinned, 400, 560)
    system = [{"type": "text", "text": system_text, **({"cache_control": {"type": "ephemeral"}} if pinned else {})}]
    _, first, _ = ask(server, system, user)
    if pinned:  # the system prompt is written to the cache at the breakpoint
        assert 400 <= first.cache_creation_input_tokens < 440 and first.cache_read_input_tokens == 0
    ask(server, *session(40, 300, 500))  # newer sessions push A out of the pool, oldest first
    ask(server, *session(50, 300, 660))
    _, usage, _ = ask(server, system, user)
    if pinned:
        # Anthropic's accounting: the whole prefix up to the breakpoint is read (kvserve recomputes the part in its
        # last, partial block, but that is no cache write).
        assert usage.cache_read_input_tokens == first.cache_creation_input_tokens
        assert usage.cache_creation_input_tokens == 0
        assert server.metric("kvserve_kv_blocks_retained") >= 25
    else:
        assert usage.cache_read_input_tokens == 0


@pytest.mark.slow
def test_disk_tier_survives_a_restart(tmp_path):
    settings = dict(kv_offload_gb=0.01, kv_disk_dir=str(tmp_path))
    a = session(60, 200, 500)
    with tiered_server(**settings) as server:
        first, usage, _ = ask(server, *a)
        assert usage.cache_read_input_tokens == 0
    with tiered_server(**settings) as server:  # a new process would see the same files
        again, usage, prompt = ask(server, *a)
        assert usage.cache_read_input_tokens == (prompt - 1) // 16 * 16
        assert again.content == first.content
        assert server.metric("kvserve_prefix_cache_disk_hits_tokens_total") == usage.cache_read_input_tokens


def _retained_for(server: LiveServer) -> float:
    """Seconds the cache's retained blocks stay retained from now (0 or less: none retained), as the engine's named
    query shows them. The server settled the reply's hold before it answered: the query comes after it."""
    prefixes, now = server.ctx.engine.core.largest_prefixes(10_000).result(timeout=60)
    return max((p.retained_until for p in prefixes if p.num_retained), default=now) - now


@pytest.mark.parametrize("session_id", ["agent-7", None])
@pytest.mark.slow
def test_a_reply_ending_in_tool_calls_holds_its_session(smol_server: LiveServer, session_id):
    smol_server.reset_prefix_cache()
    headers = {"X-Session-Id": session_id} if session_id else {}
    response = smol_server.client().chat.completions.create(
        model="smollm2-135m", messages=FEW_SHOT, tools=[WEATHER], tool_choice=NAMED, max_tokens=60, temperature=0,
        extra_headers=headers)
    assert response.choices[0].finish_reason == "tool_calls"
    held = _retained_for(smol_server)
    if session_id:
        tool_call_ttl = smol_server.ctx.engine.facts.tool_call_ttl
        assert tool_call_ttl - 5 < held <= tool_call_ttl  # the hold kept for --tool-call-ttl
    else:
        assert held == 0


def test_a_session_reply_without_tool_calls_is_released_when_it_closes(smol_server: LiveServer):
    smol_server.reset_prefix_cache()
    response = smol_server.client().chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        extra_headers={"X-Session-Id": "agent-8"})
    assert response.choices[0].finish_reason != "tool_calls"
    assert _retained_for(smol_server) <= 0  # released by the server's word, not after a timeout
