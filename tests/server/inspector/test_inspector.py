"""The cache inspector on a real server (`--ui`), read through its JSON API and `kvserve inspect`: sessions and their
requests agree with what the API reported, a changed system prompt is found on the right token, tenants see only
their own, and prompt text never reaches /metrics or the logs. (The page itself: test_inspector_browser.py.)"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest

from benchmarks import browser
from engine.config import EngineConfig
from server.cli import main as kvserve
from server.cli.inspect import format_request
from server.pipeline.context import ServerSettings
from server.cache.miss_causes import CHANGE_SYSTEM, common_prefix
from tests.server.conftest import KEY_A, KEY_B, LiveServer, _live_server
from tests.server.cache.test_agent_cache import session as words

KEY_OPERATOR = "sk-operator"
SYSTEM = "You are a careful coding agent.\nThe repository is /srv/app.\nToday's date: 2026-12-01.\nBe brief."
SECRET = "zebra-secret-4242"
_CLIENT_LOGGERS = ("openai", "anthropic", "httpx", "httpcore")  # the test's own clients log what they send


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """test_agent_cache.py's 96-block pool (16 tokens a block) with a host tier; two tenants and an operator."""
    yield from _live_server(
        tmp_path_factory, "qwen3-tiny", EngineConfig(num_kv_blocks=96, kv_offload_gb=1.0, max_model_len=2048),
        ServerSettings(api_keys=(KEY_A, KEY_B), operator_keys=(KEY_OPERATOR,), ui=True), api_key=KEY_A)


def get(server: LiveServer, path: str, key: str | None = KEY_A) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(f"{server.base_url}{path}", headers=headers, timeout=60)


@pytest.fixture(scope="module")
def session(ui_server: LiveServer) -> dict:
    """Three turns of one session (prompt_cache_key); the third edits a line of the system prompt."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"List the files. {SECRET}"}]
    replies = []
    for turn in range(3):
        if turn == 2:
            messages[0] = {"role": "system", "content": SYSTEM.replace("2026-12-01", "2026-12-02")}
        reply = ui_server.chat(messages=messages, max_tokens=6, temperature=0, prompt_cache_key="sess-ui")
        replies.append(reply)
        messages = [*messages, {"role": "assistant", "content": reply.choices[0].message.content},
                    {"role": "user", "content": f"Now step {turn}."}]
    records = {json.loads(line)["request_id"]: json.loads(line) for line in
               ui_server.record_path.read_text().splitlines()}
    [listed] = [s for s in get(ui_server, "/ui/api/sessions").json()["sessions"] if s["client_id"] == "sess-ui"]
    return {"replies": replies, "records": records, "id": listed["id"]}


@pytest.mark.slow
def test_a_session_lists_every_request_with_the_apis_usage(ui_server: LiveServer, session: dict) -> None:
    view = get(ui_server, f"/ui/api/sessions/{session['id']}").json()
    requests = view["requests"]
    assert [r["id"] for r in requests] == [reply.id for reply in session["replies"]]
    for r, reply in zip(requests, session["replies"]):
        usage = reply.usage
        assert (r["prompt_tokens"], r["cached_tokens"], r["output_tokens"]) == (
            usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens)
        assert sum(r["cached"].values()) == r["cached_tokens"] and r["ttft_s"] > 0
        assert sum(r["misses"].values()) == r["prompt_tokens"] - r["cached_tokens"]
    assert requests[1]["cached_tokens"] > 0 and view["session"]["tenant"]


@pytest.mark.slow
def test_a_changed_system_prompt_line_is_found_on_its_token(ui_server: LiveServer, session: dict) -> None:
    second, third = (session["records"][reply.id] for reply in session["replies"][1:])
    expected = common_prefix(third["prompt_token_ids"], second["prompt_token_ids"] + second["output_token_ids"])
    view = get(ui_server, f"/ui/api/requests/{third['request_id']}").json()
    divergence = view["request"]["divergence"]
    assert (divergence["index"], divergence["cause"], divergence["in_reply"]) == (expected, CHANGE_SYSTEM, False)
    assert view["token_ids"] == third["prompt_token_ids"]
    before = "".join(view["pieces"][:expected])
    assert before.endswith("Today's date: 2026-12-0") or before.endswith("Today's date: 2026-12-")
    assert view["request"]["misses"][CHANGE_SYSTEM] > 0
    assert len(view["blocks_now"]) == len(third["prompt_token_ids"]) // view["block_size"]
    sides = view["side_by_side"]
    assert sides["previous"]["id"] == second["request_id"] and sides["current"]["start"] == sides["previous"]["start"]


@pytest.mark.slow
def test_a_tenant_sees_only_its_own_and_an_operator_sees_all(ui_server: LiveServer, session: dict) -> None:
    ui_server.chat(api_key=KEY_B, messages=[{"role": "user", "content": "hello from b " * 20}], max_tokens=2)
    request_id = session["replies"][0].id
    theirs = get(ui_server, "/ui/api/sessions", KEY_B).json()
    assert theirs["sessions"] and session["id"] not in [s["id"] for s in theirs["sessions"]]
    for path in (f"/ui/api/sessions/{session['id']}", f"/ui/api/requests/{request_id}"):
        response = get(ui_server, path, KEY_B)
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
        assert SECRET not in response.text
    assert get(ui_server, "/ui/api/sessions", None).status_code == 401
    everyone = get(ui_server, "/ui/api/sessions", KEY_OPERATOR).json()
    assert everyone["viewer"]["operator"] and {s["id"] for s in theirs["sessions"]} | {session["id"]} <= {
        s["id"] for s in everyone["sessions"]}
    assert get(ui_server, f"/ui/api/requests/{request_id}", KEY_OPERATOR).status_code == 200
    holders = [p["holder"] for p in get(ui_server, "/ui/api/cache", KEY_B).json()["largest_prefixes"]]
    assert holders and all(h["tenant"] == theirs["viewer"]["tenant"] for h in holders)


def test_prompt_text_never_reaches_metrics_or_logs(ui_server: LiveServer, session: dict, caplog) -> None:
    with caplog.at_level(logging.DEBUG):
        ui_server.chat(messages=[{"role": "user", "content": f"again {SECRET}"}], max_tokens=2)
        get(ui_server, f"/ui/api/requests/{session['replies'][0].id}")
    assert SECRET not in httpx.get(f"{ui_server.base_url}/metrics").text
    server_logs = [r.getMessage() for r in caplog.records if not r.name.startswith(_CLIENT_LOGGERS)]
    assert not any(SECRET in line for line in server_logs)  # the browser test reads a real process's log too
    view = get(ui_server, f"/ui/api/requests/{session['replies'][0].id}").json()  # the text is there, behind a key
    assert SECRET in "".join(view["pieces"])


def test_the_page_is_static_and_holds_no_data(ui_server: LiveServer, session: dict) -> None:
    page = get(ui_server, "/ui", None)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"] and SECRET not in page.text
    assert get(ui_server, "/ui/static/inspector.js", None).status_code == 200
    assert get(ui_server, "/ui/static/..%2Fstore.py", None).status_code == 404
    updates = get(ui_server, "/ui/api/updates?after=0").json()
    assert session["id"] in updates["sessions"] and updates["seq"] >= 3


def test_cache_view(ui_server: LiveServer, session: dict) -> None:
    view = get(ui_server, "/ui/api/cache", KEY_OPERATOR).json()
    assert view["timeline"]["device_total"][-1] == 96
    assert set(view["evictions"]) == {"pressure", "pressure_retained", "reset", "host_full", "disk_full"}
    largest = view["largest_prefixes"]
    assert largest and largest[0]["tokens"] >= largest[-1]["tokens"]
    assert view["inspector"]["memory_bytes"] > 0 and view["inspector"]["requests"] >= 3


def test_a_tenant_sees_nothing_that_another_tenants_requests_move(ui_server: LiveServer, session: dict) -> None:
    """Issue 41: tenant B's views (its sessions, the cache, the update cursor) are the same before and after tenant
    A's requests. Before, the global request count (updates' seq, requests_kept, session numbers), the cache's use
    and evictions over time, and different_salt (test_inspector_store.py) all moved with A's traffic."""
    b = ui_server.client(KEY_B)
    b.chat.completions.create(model=ui_server.ctx.model_name, messages=[{"role": "user", "content": "b's own"}],
                              max_tokens=2)

    def b_views() -> list:
        cache = get(ui_server, "/ui/api/cache", KEY_B).json()
        return [get(ui_server, "/ui/api/sessions", KEY_B).json(), get(ui_server, "/ui/api/updates?after=0", KEY_B).json(),
                {k: v for k, v in cache.items() if k != "largest_prefixes"}]

    before = b_views()
    for i in range(3):
        ui_server.chat(messages=[{"role": "user", "content": f"a's request {i}"}], max_tokens=2)
    ui_server.ctx.inspector.sample(ui_server.ctx.metrics.snapshot())
    assert b_views() == before
    b.chat.completions.create(model=ui_server.ctx.model_name, messages=[{"role": "user", "content": "b's next"}],
                              max_tokens=2)
    after = b_views()  # B's own count moves with B's one request, not with A's three
    assert (after[1]["seq"], after[0]["requests_kept"]) == (before[1]["seq"] + 1, before[0]["requests_kept"] + 1)


def test_breakpoints_of_an_anthropic_session(ui_server: LiveServer) -> None:
    client = ui_server.anthropic(default_headers={"X-Claude-Code-Session-Id": "claude-sess"})
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    reply = client.messages.create(model=ui_server.ctx.model_name, max_tokens=4, system=system,
                                   messages=[{"role": "user", "content": "hi"}])
    [listed] = [s for s in get(ui_server, "/ui/api/sessions").json()["sessions"] if s["client_id"] == "claude-sess"]
    [request] = get(ui_server, f"/ui/api/sessions/{listed['id']}").json()["requests"]
    assert request["endpoint"] == "messages" and request["id"] == reply.id
    [breakpoint] = request["breakpoints"]
    assert breakpoint["ttl_s"] == 300.0 and 0 < breakpoint["tokens"] < request["prompt_tokens"]


def test_kvserve_inspect_prints_the_same(ui_server: LiveServer, session: dict, capsys) -> None:
    base = ["inspect", "--url", ui_server.base_url, "--api-key", KEY_A, "--color", "never"]
    assert kvserve(base) == 0
    assert "sess-ui" in capsys.readouterr().out
    assert kvserve([*base, "sess-ui"]) == 0
    out = capsys.readouterr().out
    third = session["replies"][2].id
    assert all(reply.id in out for reply in session["replies"]) and f"{CHANGE_SYSTEM} @" in out
    assert "2026-12-0│1" in out and "2026-12-0│2" in out  # both prompts, split where they first differ
    assert kvserve([*base, "--request", third]) == 0
    assert f"⟦!{CHANGE_SYSTEM}⟧" in capsys.readouterr().out
    assert kvserve([*base, "--cache"]) == 0
    assert "largest cached prefixes" in capsys.readouterr().out
    assert kvserve(["inspect", "--url", ui_server.base_url, "--api-key", KEY_B, "sess-ui"]) == 1
    assert "no session 'sess-ui'" in capsys.readouterr().err


def test_off_without_ui(qwen_server: LiveServer) -> None:
    assert get(qwen_server, "/ui", None).status_code == 404
    assert get(qwen_server, "/ui/api/sessions").status_code == 404


def test_tiers_and_evictions_a_b_a(ui_server: LiveServer) -> None:
    """Session A, then B (its blocks push A's to the host tier), then A again: the inspector shows A's third request
    served from the host tier, and why blocks left the device. (Last: it evicts what the tests above cached.)"""
    server = ui_server
    replies = []
    for name, (system, user) in (("a", words(10, 300, 650)), ("b", words(20, 500, 930)), ("a", words(10, 300, 650))):
        replies.append(server.chat(messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                                   max_tokens=4, temperature=0, prompt_cache_key=name))
    third = get(server, f"/ui/api/requests/{replies[2].id}").json()["request"]
    assert third["cached_tokens"] == replies[2].usage.prompt_tokens_details.cached_tokens
    assert third["cached"]["host"] > 0 and sum(third["cached"].values()) == third["cached_tokens"]
    assert third["divergence"] is None and third["parent"] == replies[0].id
    cache = get(server, "/ui/api/cache", KEY_OPERATOR).json()  # cache-wide figures: an operator's
    assert cache["evictions"]["pressure"] > 0 and cache["timeline"]["host_total"][-1] > 0


@pytest.fixture(scope="module")
def hybrid_ui_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """qwen3.6-tiny: the hybrid architecture (Gated DeltaNet + attention), whose prefix resumes at snapshots."""
    yield from _live_server(tmp_path_factory, "qwen3.6-tiny", EngineConfig(block_size=16, num_kv_blocks=256,
                                                                           max_model_len=2048), ServerSettings(ui=True))


@pytest.mark.slow
@pytest.mark.slow
def test_snapshot_points_of_a_hybrid_model(hybrid_ui_server: LiveServer) -> None:
    """The request view, the page (headless Chromium) and `kvserve inspect --request` mark where a hybrid model's
    prompt can resume (blocks holding a recurrent-state snapshot): the next turn's hit ends on one of them."""
    server = hybrid_ui_server
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files. " * 8}]
    first = server.chat(messages=messages, max_tokens=8, temperature=0, prompt_cache_key="hybrid")
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the tests?"}]
    second = server.chat(messages=messages, max_tokens=8, temperature=0, prompt_cache_key="hybrid")
    view = get(server, f"/ui/api/requests/{second.id}", None).json()
    points = view["snapshot_points"]
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert points and all(p % view["block_size"] == 0 and p <= len(view["token_ids"]) for p in points)
    assert cached > 0 and cached in points
    assert len(points) < len(view["blocks_now"])  # snapshots sit where the policy took them, not on every block
    assert format_request(view, color=False).count("⟦snap⟧") == len(points) + 1  # and once in the legend
    if (reason := browser.missing()) is not None:
        pytest.fail(f"the page cannot be checked: {reason}")
    with browser.chromium() as context:
        page, _ = browser.open_inspector(context, server.base_url, None, f"/requests/{second.id}")
        marked = page.locator("#prompt .snap")
        assert [int(marked.nth(i).get_attribute("data-snapshot")) for i in range(marked.count())] == points


def _last_request(server: LiveServer, client_id: str) -> dict:
    [listed] = [s for s in get(server, "/ui/api/sessions").json()["sessions"] if s["client_id"] == client_id]
    return get(server, f"/ui/api/sessions/{listed['id']}").json()["requests"][-1]


def test_a_compaction_and_a_context_edit_are_named_with_the_epoch(ui_server: LiveServer) -> None:
    """The request after a remote compaction breaks the prefix as "compaction" in epoch 1; a request whose old tool
    results the server cleared (Anthropic context_management) breaks it as "context_edit"."""
    client, model = ui_server.client(), ui_server.ctx.model_name
    history = [{"type": "message", "role": "user", "content": f"List the files. {SECRET}"},
               {"type": "message", "role": "assistant", "content": "README.md and src/."},
               {"type": "message", "role": "user", "content": "Now read the README."}]
    common = dict(model=model, instructions=SYSTEM, prompt_cache_key="sess-compact", max_output_tokens=4)
    client.responses.create(input=history, **common)
    compacted = json.loads(client.responses.with_raw_response.compact(
        model=model, instructions=SYSTEM, input=history, prompt_cache_key="sess-compact",
        extra_body={"max_output_tokens": 4}).text)["output"]
    client.responses.create(input=[*compacted, {"type": "message", "role": "user", "content": "Go on."}], **common)
    after = _last_request(ui_server, "sess-compact")
    assert after["divergence"]["cause"] == "compaction" and after["epoch"] == 1

    anthropic = ui_server.anthropic(default_headers={"X-Claude-Code-Session-Id": "claude-edit"})
    turns = [{"role": "user", "content": "Fix the bug."}]
    for i in range(3):
        turns += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{i}", "name": "read",
                                                      "input": {"path": f"f{i}.py"}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}",
                                                "content": f"line {i} " * 20}]}]
    tools = [{"name": "read", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    for trigger in (10**6, 1):
        anthropic.beta.messages.create(
            model=model, max_tokens=2, messages=turns, tools=tools, betas=["context-management-2025-06-27"],
            context_management={"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 1},
                                           "trigger": {"type": "input_tokens", "value": trigger}}]})
    assert _last_request(ui_server, "claude-edit")["divergence"]["cause"] == "context_edit"
