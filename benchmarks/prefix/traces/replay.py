"""Requests recorded by ``kvserve serve --record FILE.jsonl``: one JSON line per request with at least
``{"body": <request json>, "prompt_token_ids": [...], "output_token_ids": [...], "cached_tokens": int}`` and,
from server/pipeline/recorder.py, ``cache_salt`` (the effective salt, e.g. a tenant hash; else the body's ``cache_salt``).

Recorded requests carry no session ids, so each request's parent is inferred: the earlier request whose context
(prompt + output) shares the longest prefix with it, if that is at least one block.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks.prefix.traces.trace import TokenRequest, read_jsonl
from server.cache.miss_causes import common_prefix, message_change


@dataclass
class RecordedRequest:
    body: dict
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    cached_tokens: int
    timings: dict
    cache_salt: str | None = None


def _parse_record(row: dict) -> RecordedRequest:
    body = dict(row.get("body") or {})
    return RecordedRequest(
        body=body,
        prompt_token_ids=[int(t) for t in row["prompt_token_ids"]],
        output_token_ids=[int(t) for t in row.get("output_token_ids") or []],
        cached_tokens=int(row.get("cached_tokens") or 0),
        timings=dict(row.get("timings") or {}),
        cache_salt=row.get("cache_salt") or _body_salt(body),
    )


def read_records(path: str | Path) -> list[RecordedRequest]:
    return list(read_jsonl(path, _parse_record, "a recorded request"))


def _body_salt(body: dict) -> str | None:
    return body.get("cache_salt") or (body.get("extra_body") or {}).get("cache_salt")


def _conversation(body: dict) -> list | None:
    """The messages of a recorded body, Anthropic's top-level system prompt first."""
    messages = body.get("messages")
    if "system" in body and isinstance(messages, list):
        return [{"role": "system", "content": body["system"]}, *messages]
    return messages


def _change(parent: RecordedRequest, rec: RecordedRequest) -> str | None:
    return message_change(_conversation(parent.body), parent.body.get("tools"), _conversation(rec.body),
                          rec.body.get("tools"))


def records_to_requests(records: list[RecordedRequest], block_size: int = 16) -> list[TokenRequest]:
    requests: list[TokenRequest] = []
    for i, rec in enumerate(records):
        best, parent = block_size - 1, None
        for j in range(i):
            prev = records[j]
            shared = common_prefix(rec.prompt_token_ids, prev.prompt_token_ids + prev.output_token_ids)
            if shared > best:
                best, parent = shared, j
        requests.append(TokenRequest(
            request_id=f"r{i}",
            session=requests[parent].session if parent is not None else f"s{i}",
            prompt=rec.prompt_token_ids,
            output=rec.output_token_ids,
            salt=rec.cache_salt,
            parent=f"r{parent}" if parent is not None else None,
            turn=requests[parent].turn + 1 if parent is not None else 0,
            change=_change(records[parent], rec) if parent is not None else None,
            arrival=i,  # one request per step, in recorded order
        ))
    return requests
