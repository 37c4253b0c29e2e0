"""An optional grammar (the tool calls of tool_choice auto) never holds its request: an agent's 20+ tools took longer
than --grammar-compile-timeout to compile, so every turn waited the full limit, then ran unconstrained anyway. Now
the turn runs at once while the grammar compiles in the background, and the next turn with the same tools gets it.
Whether a request ran under a grammar is read from the engine (its grammar mask steps), not from timing."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import openai
import pytest

from engine.config import EngineConfig
from server.pipeline.context import ServerSettings, load_context
from server.http.limits import RequestLimits
from tests.server.conftest import KEY_A, KEY_B, LiveServer, serve

HI = [{"role": "user", "content": "List the files, then read the README."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def qwen_server() -> Iterator[LiveServer]:
    """qwen3-tiny with room for an agent's prompt (the session's server holds 512 tokens), two tenants."""
    ctx = load_context("qwen3-tiny", EngineConfig(block_size=16, num_kv_blocks=1024, max_model_len=4096),
                       ServerSettings(api_keys=(KEY_A, KEY_B)))
    with serve(ctx) as url:
        yield LiveServer(ctx, url, api_key=KEY_A)


def _tools(prefix: str, count: int = 24, properties: dict | None = None) -> list[dict]:
    """An agent's tool set: many tools, each with a few arguments (these 24 take about 0.7 s to compile)."""
    properties = properties or {"path": {"type": "string", "maxLength": 16}, "limit": {"type": "integer"},
                                "all": {"type": "boolean"}}
    return [{"type": "function", "function": {"name": f"{prefix}_{i}", "description": f"Tool {i} of the agent.",
                                              "parameters": {"type": "object", "properties": properties,
                                                             "required": [next(iter(properties))]}}}
            for i in range(count)]


def _limits(server: LiveServer, monkeypatch: pytest.MonkeyPatch, **limits: float) -> None:
    settings = server.ctx.settings
    monkeypatch.setattr(server.ctx, "settings", replace(settings, limits=replace(settings.limits, **limits)))


def _mask_steps(server: LiveServer) -> int:
    """Engine steps that applied a grammar's token masks so far."""
    return server.stats().grammar_mask_steps


def _constrained(server: LiveServer, ask: Callable[[], object]) -> bool:
    """Whether the request `ask` makes ran under a grammar in the engine."""
    before = _mask_steps(server)
    ask()
    return _mask_steps(server) > before


def _spy(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[tuple]:
    """Record the arguments of every call of ``owner.name`` (which still runs)."""
    calls: list[tuple] = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def _wait(condition: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.slow
def test_an_optional_tool_grammar_never_holds_its_request_and_guards_the_next_turn(
    qwen_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A request waiting on its grammar would wait up to 10 minutes: the first turn must not.
    _limits(qwen_server, monkeypatch, compile_timeout_s=600.0, background_compile_timeout_s=600.0)
    asked = _spy(monkeypatch, qwen_server.ctx.optional_grammars, "missing")
    tools = _tools("auto")
    turn = dict(messages=HI, tools=tools, tool_choice="auto", max_tokens=4, temperature=0, extra_body=NO_THINKING)
    started = time.monotonic()
    assert not _constrained(qwen_server, lambda: qwen_server.chat(**turn))
    assert time.monotonic() - started < 60
    (spec, tenant, _), = asked
    _wait(lambda: qwen_server.ctx.grammars.is_cached(spec, tenant), "the background compile did not finish")
    assert _constrained(qwen_server, lambda: qwen_server.chat(**turn)), "the next turn ran without its grammar"
    # Another tenant's first turn with the same tools compiles its own (a cache hit would tell it A's tools).
    assert not _constrained(qwen_server, lambda: qwen_server.chat(api_key=KEY_B, **turn))


def test_a_failed_background_compile_is_remembered_not_repeated_every_turn(
    qwen_server: LiveServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _limits(qwen_server, monkeypatch, background_compile_timeout_s=0.001)  # no grammar compiles in a millisecond
    calls = _spy(monkeypatch, qwen_server.ctx.grammars, "compile_isolated")
    compiles = lambda: [spec for spec, *_ in calls if "failing_0" in spec.value]  # noqa: E731 - not another test's
    optional = qwen_server.ctx.optional_grammars
    turn = dict(messages=HI, tools=_tools("failing"), tool_choice="auto", max_tokens=2, extra_body=NO_THINKING)
    qwen_server.chat(**turn)
    _wait(lambda: "did not compile" in caplog.text, "the background compile did not time out")
    for _ in range(2):
        assert not _constrained(qwen_server, lambda: qwen_server.chat(**turn))
    assert len(compiles()) == 1  # remembered: no compile for the later turns
    assert "tried again after 3600 s: compiling the grammar took longer than 0.001 s" in caplog.text
    monkeypatch.setattr(optional, "failure_ttl_s", 0.0)  # the failure expires: the next turn tries again
    qwen_server.chat(**turn)
    _wait(lambda: len(compiles()) == 2, "the expired failure was not compiled again", timeout=30)


@pytest.mark.slow
def test_required_tool_grammars_still_wait_and_fail_past_their_limit(
    qwen_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    required = dict(messages=HI, tool_choice="required", max_tokens=2, extra_body=NO_THINKING)
    assert _constrained(qwen_server, lambda: qwen_server.chat(tools=_tools("required"), **required))
    _limits(qwen_server, monkeypatch, compile_timeout_s=0.001)
    with pytest.raises(openai.BadRequestError) as err:
        qwen_server.chat(tools=_tools("too_slow"), **required)
    assert err.value.body["param"] == "tools" and "longer than 0.001 s" in err.value.body["message"], err.value.body


@pytest.mark.slow
def test_shutdown_does_not_wait_for_a_background_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three strings of up to 256 characters: 13 s to compile on one core (Claude Code's ListAgents tool).
    slow = {name: {"type": "string", "maxLength": 256} for name in ("channel", "query", "cursor")}
    ctx = load_context("qwen3-tiny", EngineConfig(block_size=4, num_kv_blocks=256, max_model_len=512),
                       ServerSettings(limits=RequestLimits(background_compile_timeout_s=3600.0)))
    asked = _spy(monkeypatch, ctx.optional_grammars, "missing")
    others = set(threading.enumerate())  # other servers' background threads (this module's, idle)
    with serve(ctx) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        # A first compile starts a worker and builds the vocabulary's tables (seconds, not cancellable).
        client.chat.completions.create(model="qwen3-tiny", messages=HI, max_tokens=2, response_format={
            "type": "json_object"})
        client.chat.completions.create(model="qwen3-tiny", messages=HI, tools=_tools("slow", 4, slow), max_tokens=2,
                                       extra_body=NO_THINKING)
        compiling = [t for t in set(threading.enumerate()) - others if t.name.startswith("kvserve-grammar-background")]
        assert compiling
    for thread in compiling:
        thread.join(30)
        assert not thread.is_alive(), "the background compile outlived the server"
    (spec, tenant, _), = asked
    assert not ctx.grammars.is_cached(spec, tenant)  # it was stopped, not waited for
