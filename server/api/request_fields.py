"""Every request field of the three APIs and what kvserve does with it: `honoured`; `refused`, a 400 in the API's
error shape, because serving the request without it would change the result; or `ignored`, accepted because it would
not (a billing, storage or routing hint). docs/SERVER.md's field table is made from this registry
(`markdown_table`), and the tests check that every field the official SDKs can send is here and that each refused
field gets its 400. Fields no SDK sends and this registry does not list are ignored as unknown.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from server.api.protocol import APIError

Status = Literal["honoured", "refused", "ignored"]


@dataclass(frozen=True)
class RequestField:
    status: Status
    note: str = ""
    neutral: tuple[Any, ...] = ()  # refused fields: values that ask for nothing (served as if absent)
    example: Any = None  # refused fields: a value that is refused (for the tests)


def _honoured(note: str = "") -> RequestField:
    return RequestField("honoured", note)


def _ignored(note: str) -> RequestField:
    return RequestField("ignored", note)


def _refused(note: str, example: Any, *neutral: Any) -> RequestField:
    return RequestField("refused", note, neutral, example)


_SAMPLING = {
    "model": _honoured("the served model's name or alias; any other is a 404"),
    "temperature": _honoured(), "top_p": _honoured(), "seed": _honoured(), "stop": _honoured(), "n": _honoured(),
    "presence_penalty": _honoured(), "frequency_penalty": _honoured(), "stream": _honoured(),
    "stream_options": _honoured("`include_usage`; `include_obfuscation` is ignored"),
    "logit_bias": _refused("token biases are not applied", {"42": -100}, {}),
    "user": _ignored("an end-user id for abuse monitoring"),
    # vLLM's extensions kvserve serves
    "top_k": _honoured("vLLM's"), "min_p": _honoured("vLLM's"), "repetition_penalty": _honoured("vLLM's"),
    "ignore_eos": _honoured("vLLM's"), "stop_token_ids": _honoured("vLLM's"),
    "structured_outputs": _honoured("vLLM's: `regex`, `grammar`, `json`, `choice`"),
    "prompt_logprobs": _honoured("vLLM's; chat: not streamed"),
    "cache_salt": _honoured("with --allow-request-cache-salt, else a 400"),
    # kvserve's own
    "speculative": _honoured("kvserve's: `off`, `ngram`, `suffix` or `mtp` speculative decoding for this request"),
    # vLLM's extensions that would change the result
    "guided_json": _refused("vLLM's older name: send structured_outputs", {"type": "object"}),
    "guided_regex": _refused("vLLM's older name: send structured_outputs", "a+"),
    "guided_choice": _refused("vLLM's older name: send structured_outputs", ["a"]),
    "guided_grammar": _refused("vLLM's older name: send structured_outputs", "root ::= \"a\""),
    "min_tokens": _refused("a minimum length is not enforced", 4, 0),
    "best_of": _refused("only n independent samples are drawn", 3, 1),
    "use_beam_search": _refused("beam search is not implemented", True, False),
    "include_stop_str_in_output": _refused("stop strings are never sent", True, False),
    "skip_special_tokens": _refused("special tokens are always skipped in the text", False, True),
    "bad_words": _refused("banned words are not enforced", ["no"]),
    "logits_processors": _refused("custom logits processors are not supported", ["x"]),
    "truncate_prompt_tokens": _refused("prompts are never truncated: a prompt too long is a 400", 8),
    "return_tokens_as_token_ids": _refused("tokens are returned as text", True, False),
}

CHAT: dict[str, RequestField] = {
    **_SAMPLING,
    "messages": _honoured(), "tools": _honoured(), "tool_choice": _honoured(), "parallel_tool_calls": _honoured(),
    "response_format": _honoured("`text`, `json_object`, `json_schema`"),
    "max_tokens": _honoured(), "max_completion_tokens": _honoured(),
    "logprobs": _honoured(), "top_logprobs": _honoured(),
    "reasoning_effort": _honoured("`none`/`minimal` turn thinking off, other efforts on (chat_template_kwargs "
                                  "win); `low`/`medium`/`high` also bound the thinking tokens"),
    "prompt_cache_key": _honoured("the agent session (recorded; its blocks held across tool calls)"),
    "chat_template_kwargs": _honoured("kvserve's and vLLM's"), "add_generation_prompt": _honoured("vLLM's"),
    "cached_content": _honoured("kvserve's named caches"),
    "audio": _refused("audio output is not supported: the served models write text", {"voice": "alloy"}),
    "modalities": _refused("only text output", ["text", "audio"], ["text"]),
    "functions": _refused("the deprecated functions API: send tools", [{"name": "f"}]),
    "function_call": _refused("the deprecated functions API: send tool_choice", "auto"),
    "web_search_options": _refused("no web search here", {"search_context_size": "low"}),
    "continue_final_message": _refused("vLLM's: the last assistant message is not continued", True, False),
    "echo": _refused("vLLM's: the prompt is not echoed in chat", True, False),
    "chat_template": _refused("the model's own template always renders", "{{ messages }}"),
    "documents": _refused("retrieval documents are not rendered", [{"text": "x"}]),
    "metadata": _ignored("stored with the completion at OpenAI; nothing is stored here"),
    "store": _ignored("nothing is stored"),
    "service_tier": _ignored("one tier"),
    "safety_identifier": _ignored("an end-user id for abuse monitoring"),
    "moderation": _ignored("no moderation"),
    "prediction": _ignored("predicted outputs only speed generation up"),
    "prompt_cache_options": _ignored("a caching hint: kvserve caches every request's blocks"),
    "prompt_cache_retention": _ignored("a caching hint: kvserve caches every request's blocks"),
    "verbosity": _ignored("a hint; the served models have no verbosity control"),
}

COMPLETIONS: dict[str, RequestField] = {
    **_SAMPLING,
    "prompt": _honoured("text, token ids, or a batch of either"),
    "max_tokens": _honoured("0 scores without generating"),
    "logprobs": _honoured(), "echo": _honoured("with logprobs: the prompt's too"),
    "response_format": _honoured("kvserve's: a JSON schema for the completion"),
    "suffix": _refused("insertion (text after the completion) is not supported", " end", ""),
}

RESPONSES: dict[str, RequestField] = {
    "model": _honoured("the served model's name or alias; any other is a 404"),
    "input": _honoured(), "instructions": _honoured(), "tools": _honoured("function and namespace tools; hosted "
                                                                          "tools are left out of the prompt"),
    "tool_choice": _honoured(), "parallel_tool_calls": _honoured(), "max_output_tokens": _honoured(),
    "temperature": _honoured(), "top_p": _honoured(), "stream": _honoured(),
    "reasoning": _honoured("`effort` turns thinking on or off and bounds it; `summary` is ignored"),
    "text": _honoured("`format`; `verbosity` is ignored"),
    "include": _honoured("`reasoning.encrypted_content`; others are ignored"),
    "previous_response_id": _honoured("store: true responses, kept in memory"), "store": _honoured(),
    "prompt_cache_key": _honoured("the agent session"), "metadata": _honoured("echoed back"),
    "truncation": _refused("the context is never truncated: a prompt too long is a 400", "auto", "disabled"),
    "background": _refused("responses run in the foreground only", True, False),
    "conversation": _refused("no server-side conversations: send previous_response_id or the input", "conv_1"),
    "prompt": _refused("reusable prompt templates are not stored here", {"id": "pmpt_1"}),
    "max_tool_calls": _refused("a limit on tool calls is not enforced", 2),
    "top_logprobs": _refused("Responses logprobs are not returned", 2, 0),
    "image": _refused("image generation is not supported", {"size": "1024x1024"}),
    "access_programs": _ignored("an access hint"),
    "background_options": _ignored("applies to background responses only"),
    "context_management": _honoured("`compaction` entries: past `compact_threshold` input tokens the input is "
                                    "compacted first, in the same response"),
    "stream_options": _ignored("`include_obfuscation` only"),
    "user": _ignored("an end-user id for abuse monitoring"),
    "safety_identifier": _ignored("an end-user id for abuse monitoring"),
    "service_tier": _ignored("one tier"), "moderation": _ignored("no moderation"),
    "prompt_cache_options": _ignored("a caching hint: kvserve caches every request's blocks"),
    "prompt_cache_retention": _ignored("a caching hint: kvserve caches every request's blocks"),
}

MESSAGES: dict[str, RequestField] = {
    "model": _honoured("the served model's name or alias; any other is a 404"),
    "messages": _honoured("text, image (also inside tool_result), tool_use, tool_result, thinking blocks; documents "
                          "are a 400"),
    "system": _honoured(), "tools": _honoured("client tools; server tools are left out of the prompt"),
    "tool_choice": _honoured(), "max_tokens": _honoured("optional here"), "stop_sequences": _honoured(),
    "temperature": _honoured(), "top_p": _honoured(), "top_k": _honoured(), "stream": _honoured(),
    "thinking": _honoured("`enabled`/`adaptive` think, `disabled` does not; `budget_tokens` bounds the thinking"),
    "output_config": _honoured("`format`; `effort` with thinking on (DeepSeek-V4's effort)"),
    "output_format": _honoured("the beta's name for output_config.format"),
    "metadata": _honoured("`user_id`'s session id"), "cached_content": _honoured("kvserve's named caches"),
    "cache_control": _ignored("automatic caching: kvserve caches every request's blocks anyway"),
    "container": _refused("no code-execution containers here", "container_1"),
    "mcp_servers": _refused("no MCP connector here", [{"type": "url", "url": "http://127.0.0.1:1", "name": "x"}]),
    "context_management": _honoured("`clear_tool_uses_20250919`, `clear_thinking_20251015`, `compact_20260112`; "
                                    "other edits are a 400"),
    "service_tier": _ignored("one tier"), "inference_geo": _ignored("one place"), "speed": _ignored("one speed"),
    "diagnostics": _ignored("no diagnostics"), "user_profile_id": _ignored("no profiles"),
    "workspace_id": _ignored("no workspaces"),
}

FIELDS: dict[str, dict[str, RequestField]] = {
    "chat": CHAT, "completions": COMPLETIONS, "responses": RESPONSES, "messages": MESSAGES,
}


def refuse_unsupported(api: str, body: Mapping[str, Any]) -> None:
    """A 400 naming the first field of `body` that `api` refuses (a neutral value passes)."""
    for name, field in FIELDS[api].items():
        value = body.get(name)
        if field.status == "refused" and value is not None and value not in field.neutral:
            raise APIError(400, f"'{name}' is not supported: {field.note}", param=name,
                           code="unsupported_parameter")


def markdown_table(api: str) -> str:
    """SERVER.md's table of `api`'s fields."""
    rows = [f"| `{name}` | {field.status} | {field.note} |" for name, field in sorted(FIELDS[api].items())]
    return "\n".join(["| field | kvserve | note |", "|---|---|---|", *rows])
