"""Claude Code- and Codex-shaped workloads: each turn is the request body the agent sends (Anthropic Messages or
OpenAI Responses, with their system blocks, tools and turn structure), converted to the chat form by the server's
own adapters (server/api/messages_input.py, server/api/responses_input.py), the code path `kvserve serve` runs.

- claude_code: a billing header with a per-request `cch=` nonce heading the system blocks, a mid-conversation
  `system` environment message, tool_use / tool_result blocks, a new system message midway (a tool announcement).
  `claude_code_raw` is the same session with the cache-stability rules off (server/cache/normalize.py), so the
  benchmark shows the misses they remove ("billing_nonce", and "system_hoisted" on DeepSeek templates).
- claude_code_screenshots: the same shape, three sessions whose Read tool mostly returns screenshots (PNGs from
  screenshots.py, as `image` blocks inside `tool_result`), for vision-language models.
- codex: developer + user input items, reasoning items echoed back, function_call / function_call_output items,
  function, namespace and hosted tools; the whole history resent every turn.
"""
from __future__ import annotations

import copy
import json

from benchmarks.prefix.screenshots import image_block
from benchmarks.prefix.text import TextGen
from benchmarks.prefix.workloads import ChatRequest, Workload, WorkloadParams, make_head
from server.api.anthropic_protocol import Conversation, MessagesRequest
from server.api.messages_input import chat_messages as anthropic_chat_messages
from server.api.messages_input import to_turn as messages_to_turn
from server.api.responses_input import to_turn as responses_to_turn
from server.api.responses_protocol import ResponsesRequest

_CLAUDE_TOOLS = ("Agent", "Bash", "Edit", "Glob", "Grep", "NotebookEdit", "Read", "TodoWrite", "WebFetch",
                 "WebSearch", "Write", "Skill")
# The adapters read the template family only for the thinking switch, which rendering sets per model (render.py).
_FAMILY = "qwen3"
_CODEX_TOOLS = ("exec_command", "write_stdin", "update_plan", "view_image", "get_goal", "apply_patch_json")


def _schema(gen: TextGen) -> dict:
    props = {name: {"type": "string", "description": gen.sentence(4, 10)} for name in ("path", "command")}
    return {"type": "object", "properties": props, "required": ["path"], "additionalProperties": False}


class _ToolResults:
    """What a Claude Code session's tools are called with and return: plain Claude Code's, text."""

    def __init__(self, p: WorkloadParams) -> None:
        self.p = p

    def task_parts(self, session: int, task: int) -> list[dict]:
        """Content before a task's text (a pasted screenshot)."""
        return []

    def call(self, gen: TextGen) -> tuple[str, dict]:
        return gen.rng.choice(_CLAUDE_TOOLS), {"path": gen.path()}

    def result(self, gen: TextGen, name: str, args: dict) -> list[dict]:
        return [{"type": "text", "text": gen.tool_output(gen.rng.randint(*self.p.result_words))}]


class _Screenshots(_ToolResults):
    """Screenshot-heavy: the first task pastes a mockup (sessions 2k and 2k + 1 paste the same one, so the next
    session's differs in the same place) and most tool calls Read a screenshot: a new one, or one this session read
    before (the same pixels again, at a later place)."""

    def __init__(self, p: WorkloadParams, session: int) -> None:
        super().__init__(p)
        self.session = session
        self.paths: list[str] = []

    def task_parts(self, session: int, task: int) -> list[dict]:
        return [image_block(f"{self.p.seed}/mockup/{session // 2}")] if task == 0 else []

    def call(self, gen: TextGen) -> tuple[str, dict]:
        if gen.rng.random() < 0.3:
            return super().call(gen)
        if self.paths and gen.rng.random() < 0.3:
            return "Read", {"file_path": gen.rng.choice(self.paths)}
        self.paths.append(f"shots/{self.session}-{len(self.paths)}.png")
        return "Read", {"file_path": self.paths[-1]}

    def result(self, gen: TextGen, name: str, args: dict) -> list[dict]:
        if args.get("file_path", "").startswith("shots/"):
            return [image_block(f"{self.p.seed}/{args['file_path']}")]
        return super().result(gen, name, args)


def _claude_setup(p: WorkloadParams) -> tuple[TextGen, list[dict], str, list[dict]]:
    """A Claude Code project's generator, tools, system prompt and opening messages (reminder, environment)."""
    gen = TextGen(p.seed)
    tools = [{"name": n, "description": gen.sentence(20, 40), "input_schema": _schema(gen)} for n in _CLAUDE_TOOLS]
    head = make_head(gen, p.head_words)
    messages: list[dict] = [
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>\n" + gen.prose(80) +
                                      "\n</system-reminder>"}]},
        {"role": "system", "content": [{"type": "text", "text": "# Environment\n" + gen.prose(60)}]},
    ]
    return gen, tools, head, messages


def _claude_session(p: WorkloadParams, gen: TextGen, tools: list[dict], head: str, messages: list[dict],
                    session: str, index: int, results: _ToolResults, normalize: bool) -> list[ChatRequest]:
    """One session's requests: ``p.tasks`` tasks of ``p.steps_per_task`` tool calls, each turn the /v1/messages
    body Claude Code sends, through the server's adapter; session ``index`` starts at scheduler step ``index`` (after
    the sessions before it began, so it can read their shared head from the cache)."""
    requests: list[ChatRequest] = []
    parent = None
    for task in range(p.tasks):
        if task == p.tasks // 2:
            messages.append({"role": "system", "content": [{"type": "text", "text": "Deferred tools now "
                                                            "available:\n" + gen.sentence()}]})
        messages.append({"role": "user", "content": [*results.task_parts(index, task),
                                                     {"type": "text", "text": "Task: " + gen.sentence(8, 20)}]})
        for step in range(p.steps_per_task + 1):
            last = step == p.steps_per_task
            call_id = f"toolu_{task}_{step}"
            reply_blocks = [{"type": "thinking", "thinking": gen.prose(gen.rng.randint(*p.reasoning_words)),
                             "signature": "sig"}]
            if last:
                reply_blocks.append({"type": "text", "text": gen.prose(gen.rng.randint(20, 80))})
            else:
                name, args = results.call(gen)
                reply_blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": args})
            system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.661; "
                                               f"cc_entrypoint=cli; cch={gen.rng.getrandbits(20):05x};"},
                      {"type": "text", "text": head, "cache_control": {"type": "ephemeral"}}]
            body = {"model": "m", "max_tokens": 32000, "system": system, "tools": tools,
                    "thinking": {"type": "adaptive"}, "messages": copy.deepcopy(messages)}
            chat = messages_to_turn(MessagesRequest.model_validate(body), _FAMILY)
            [reply] = anthropic_chat_messages(Conversation(model="m", messages=[
                {"role": "assistant", "content": reply_blocks}]))
            request_id = f"{session}/{len(requests)}"
            requests.append(ChatRequest(request_id, session, chat.messages, chat.tools, reply, parent=parent,
                                        turn=len(requests), arrival=index, normalize=normalize))
            parent = request_id
            messages.append({"role": "assistant", "content": reply_blocks})
            if not last:
                result = {"type": "tool_result", "tool_use_id": call_id,
                          "content": results.result(gen, name, args)}
                messages.append({"role": "user", "content": [result]})
    return requests


def claude_code(p: WorkloadParams, normalize: bool = True) -> Workload:
    gen, tools, head, messages = _claude_setup(p)
    requests = _claude_session(p, gen, tools, head, messages, "cc", 0, _ToolResults(p), normalize)
    name = "claude_code" if normalize else "claude_code_raw"
    rules = "cache-stability rules on" if normalize else "rules off (raw billing nonce, hoisted system messages)"
    return Workload(name, f"Claude Code-shaped session through the /v1/messages adapter, {rules}", requests, True)


SCREENSHOT_SESSIONS = 3


def claude_code_screenshots(p: WorkloadParams) -> Workload:
    """Three Claude Code sessions in one project (same system prompt, tools and opening messages) whose Read tool
    returns screenshots; vision-language models only (the images render as the template's image tokens)."""
    _, tools, head, messages = _claude_setup(p)
    requests = [r for s in range(SCREENSHOT_SESSIONS)
                for r in _claude_session(p, TextGen(p.seed * 1000 + 1 + s), tools, head, copy.deepcopy(messages),
                                         f"shots{s}", s, _Screenshots(p, s), True)]
    return Workload("claude_code_screenshots", "Claude Code-shaped sessions whose Read tool returns screenshots "
                    "(some read again later, a pasted mockup shared by two sessions, another in the third)",
                    requests, True)


def codex(p: WorkloadParams) -> Workload:
    gen = TextGen(p.seed)
    functions = [{"type": "function", "name": n, "description": gen.sentence(15, 30), "strict": False,
                  "parameters": _schema(gen)} for n in _CODEX_TOOLS]
    tools = [*functions, {"type": "namespace", "name": "multi_agent_v1", "description": gen.sentence(),
                          "tools": [{"type": "function", "name": "spawn_agent", "parameters": _schema(gen)}]},
             {"type": "web_search", "external_web_access": False}]
    items: list[dict] = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": make_head(gen, p.head_words)}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>\n"
                                                         + gen.prose(40) + "\n</environment_context>"}]},
    ]
    requests: list[ChatRequest] = []
    parent = None
    for task in range(p.tasks):
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                       "text": gen.sentence(8, 20)}]})
        for step in range(p.steps_per_task + 1):
            last = step == p.steps_per_task
            reasoning = gen.prose(gen.rng.randint(*p.reasoning_words))
            output = [{"type": "reasoning", "summary": [], "encrypted_content": reasoning}]
            if last:
                output.append({"type": "message", "role": "assistant",
                               "content": [{"type": "output_text", "text": gen.prose(gen.rng.randint(20, 80))}]})
            else:
                output.append({"type": "function_call", "call_id": f"call_{task}_{step}", "name": "exec_command",
                               "arguments": json.dumps({"path": gen.path()})})
            body = {"model": "m", "input": copy.deepcopy(items), "tools": tools, "tool_choice": "auto",
                    "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
                    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "thread"}
            chat, _ = responses_to_turn(ResponsesRequest.model_validate(body), _FAMILY, history=[], session=None)
            reply_chat, _ = responses_to_turn(ResponsesRequest.model_validate({"input": output, "tools": tools}),
                                              _FAMILY, history=[], session=None)
            request_id = f"codex/{len(requests)}"
            requests.append(ChatRequest(request_id, "codex", chat.messages, chat.tools, reply_chat.messages[0],
                                        parent=parent, turn=len(requests)))
            parent = request_id
            items += output
            if not last:
                items.append({"type": "function_call_output", "call_id": f"call_{task}_{step}",
                              "output": gen.tool_output(gen.rng.randint(*p.result_words))})
    return Workload("codex", "Codex-shaped session through the /v1/responses adapter (history resent each turn)",
                    requests, True)
