"""The inspector's page in a real browser (headless Chromium, driven by Playwright; benchmarks/browser.py) against
`kvserve serve --ui` as a user starts it: a recorded agent session (data/agent_session.jsonl) is replayed with one
deliberate divergence, a changed line of its system prompt, and the page must list every request with the cached
share the API reported, and mark the first changed token with the right cause. A second tenant sees none of it.

The screenshots in docs/images/ come from this test: `KVSERVE_UPDATE_SCREENSHOTS=1 python -m pytest -m slow
tests/server/inspector/test_inspector_browser.py` writes them there (else under the test's tmp directory)."""
from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks import browser
from benchmarks.router_procs import Process, free_port
from server.cache.miss_causes import CHANGE_SYSTEM, common_prefix

pytestmark = pytest.mark.slow

SESSION_FILE = Path(__file__).parent / "data" / "agent_session.jsonl"
DOCS_IMAGES = Path(__file__).parents[3] / "docs" / "images"
KEY_A, KEY_B, KEY_OPERATOR = "sk-team-a", "sk-team-b", "sk-operator"
CHANGED_FROM = 4  # requests from this one on carry the changed system prompt line
OLD_LINE, NEW_LINE = "Today's date: 2026-12-01.", "Today's date: 2026-12-02."


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """`kvserve serve --ui` with two tenants and an operator; the recorded session replayed by tenant A (the system
    prompt line changed from request CHANGED_FROM on), one request of tenant B."""
    if (reason := browser.missing()) is not None:
        pytest.fail(f"the browser test cannot run: {reason}")
    tmp = tmp_path_factory.mktemp("inspector-browser")
    port = free_port()
    process = Process("kvserve", [
        sys.executable, "-m", "server.cli", "serve", "--model", "qwen3-tiny", "--port", str(port), "--ui",
        "--api-key", KEY_A, "--api-key", KEY_B, "--operator-key", KEY_OPERATOR, "--block-size", "16",
        "--num-kv-blocks", "1024", "--max-model-len", "8192", "--record", str(tmp / "replay.jsonl")], tmp / "serve.log")
    process.start()
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_http(f"{url}/health", timeout=300)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_A, max_retries=0, timeout=120)
        replies = []
        for i, line in enumerate(SESSION_FILE.read_text().splitlines()):
            body = copy.deepcopy(json.loads(line)["body"])
            system = body["messages"][0]
            assert system["role"] == "system" and OLD_LINE in system["content"]
            if i >= CHANGED_FROM:
                system["content"] = system["content"].replace(OLD_LINE, NEW_LINE)
            model, messages = body.pop("model"), body.pop("messages")
            replies.append(client.chat.completions.create(model=model, messages=messages, extra_body=body))
        other = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_B, max_retries=0, timeout=120)
        other.chat.completions.create(model="qwen3-tiny", messages=[{"role": "user", "content": "hello"}],
                                      max_tokens=4, extra_body={"prompt_cache_key": "team-b-session"})
        records = {r["request_id"]: r for r in map(json.loads, (tmp / "replay.jsonl").read_text().splitlines())}
        with browser.chromium() as context:
            yield {"url": url, "replies": replies, "records": records, "context": context, "tmp": tmp,
                   "log": tmp / "serve.log"}
    finally:
        process.stop()


def screenshot(page, served: dict, name: str, **kwargs) -> None:
    path = served["tmp"] / name
    page.screenshot(path=str(path), **kwargs)
    if os.environ.get("KVSERVE_UPDATE_SCREENSHOTS") == "1":
        DOCS_IMAGES.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, DOCS_IMAGES / name)


@pytest.mark.slow
def test_the_session_lists_every_request_with_the_apis_cached_share(served: dict) -> None:
    page, load_ms = browser.open_inspector(served["context"], served["url"], KEY_A)
    page.wait_for_selector("#requests")
    rows = page.locator("#requests tbody tr")
    assert rows.count() == len(served["replies"])
    for i, reply in enumerate(served["replies"]):
        row = rows.nth(i)
        usage = reply.usage
        cached, prompt = usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens
        assert row.get_attribute("data-request-id") == reply.id
        assert (int(row.get_attribute("data-cached-tokens")), int(row.get_attribute("data-prompt-tokens"))) == (
            cached, prompt)
        cells = row.locator("td").all_inner_texts()
        device, host, disk = (int(c.replace(",", "")) for c in cells[5:8])
        assert device + host + disk == cached
        assert row.locator(".hit").inner_text() == f"{100 * cached / prompt:.0f}%"
    changed = rows.nth(CHANGED_FROM)
    assert changed.locator(".badge").inner_text() == CHANGE_SYSTEM
    assert changed.get_attribute("data-divergence-cause") == CHANGE_SYSTEM
    screenshot(page, served, "inspector_session.png", full_page=True)


@pytest.mark.slow
def test_the_divergence_marker_sits_on_the_changed_token(served: dict) -> None:
    before, changed = (served["records"][r.id] for r in served["replies"][CHANGED_FROM - 1 : CHANGED_FROM + 1])
    expected = common_prefix(changed["prompt_token_ids"], before["prompt_token_ids"] + before["output_token_ids"])
    page, _ = browser.open_inspector(served["context"], served["url"], KEY_A, f"/requests/{changed['request_id']}")
    marker = page.locator("#prompt #divergence")
    assert int(marker.get_attribute("data-i")) == expected
    assert marker.get_attribute("data-cause") == CHANGE_SYSTEM
    assert page.locator("#divergence-summary").get_attribute("data-cause") == CHANGE_SYSTEM
    text_before = page.evaluate(
        "(n) => Array.from(document.querySelectorAll('#prompt span')).slice(0, n).map(s => s.textContent).join('')",
        expected)
    assert text_before.endswith(OLD_LINE[: OLD_LINE.index("01")] + "0") or text_before.endswith(
        OLD_LINE[: OLD_LINE.index("01")])
    # Side by side: both prompts around the change, each with the marker on the same token.
    assert int(page.locator("#divergence-previous").get_attribute("data-i")) == expected
    assert int(page.locator("#divergence-current").get_attribute("data-i")) == expected
    screenshot(page, served, "inspector_request.png", full_page=True, clip={"x": 0, "y": 0, "width": 1400,
                                                                           "height": 1400})


@pytest.mark.slow
def test_a_second_tenant_sees_nothing_of_the_first(served: dict) -> None:
    first = served["replies"][0].id
    headers = {"Authorization": f"Bearer {KEY_A}"}
    [theirs] = httpx.get(f"{served['url']}/ui/api/sessions", headers=headers).json()["sessions"]
    page, _ = browser.open_inspector(served["context"], served["url"], KEY_B)
    page.wait_for_selector("#requests")
    listed = page.locator(".side [data-session-id]")
    assert listed.count() == 1 and listed.get_attribute("data-session-id") != theirs["id"]
    assert page.locator(f'[data-request-id="{first}"]').count() == 0
    for route in (f"/sessions/{theirs['id']}", f"/requests/{first}"):
        page.evaluate("(route) => { location.hash = route; }", route)
        page.wait_for_selector(".empty")
        assert "no " in page.locator(".empty").inner_text()
    other = {"Authorization": f"Bearer {KEY_B}"}
    assert httpx.get(f"{served['url']}/ui/api/sessions/{theirs['id']}", headers=other).status_code == 404
    assert httpx.get(f"{served['url']}/ui/api/requests/{first}", headers=other).status_code == 404
    operator = {"Authorization": f"Bearer {KEY_OPERATOR}"}
    assert len(httpx.get(f"{served['url']}/ui/api/sessions", headers=operator).json()["sessions"]) == 2


@pytest.mark.slow
def test_the_cache_view_and_the_servers_log(served: dict) -> None:
    page, _ = browser.open_inspector(served["context"], served["url"], KEY_OPERATOR, "/cache")
    page.wait_for_selector("#prefixes")
    assert page.locator("#prefixes tbody tr").count() >= 1
    screenshot(page, served, "inspector_cache.png", full_page=True)
    log = served["log"].read_text()
    assert "GET /ui/api/sessions" in log  # the access log is there, and no prompt text in it
    assert "2026-12-0" not in log and "test_nested" not in log
