"""Helpers: run a parser over a split stream, rebuild the message from its deltas, check split independence."""
from __future__ import annotations

import random
from collections.abc import Callable

from server.parsing import OutputParser, ParsedMessage

ParserFactory = Callable[[], OutputParser]


def run(factory: ParserFactory, chunks: list[str]) -> tuple[list[dict], ParsedMessage]:
    parser = factory()
    deltas: list[dict] = []
    for chunk in chunks:
        deltas += parser.feed(chunk)
    deltas += parser.finish()
    return deltas, parser.result()


def assemble(deltas: list[dict]) -> ParsedMessage:
    """The message a streaming client builds from the deltas (and checks of the delta protocol on the way)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    for delta in deltas:
        assert len(delta) == 1, delta
        if "content" in delta:
            assert delta["content"], "empty content delta"
            content.append(delta["content"])
        elif "reasoning_content" in delta:
            assert delta["reasoning_content"], "empty reasoning delta"
            reasoning.append(delta["reasoning_content"])
        else:
            (entry,) = delta["tool_calls"]
            index = entry["index"]
            if "id" in entry:  # a call starts: id, type and name come first, with empty arguments
                assert index == len(calls)
                assert entry["type"] == "function" and entry["function"]["arguments"] == ""
                calls.append({"id": entry["id"], "type": "function", "function": dict(entry["function"])})
            else:
                assert index == len(calls) - 1 and set(entry) == {"index", "function"}
                calls[index]["function"]["arguments"] += entry["function"]["arguments"]
    text = "".join(content)
    return ParsedMessage(
        content=text if text or not calls else None,
        reasoning_content="".join(reasoning) or None,
        tool_calls=calls,
        finish_reason_override="tool_calls" if calls else None,
    )


def splits(text: str, seed: int = 0, random_count: int = 20) -> list[list[str]]:
    """Whole, one char at a time, every two-piece split, and random multi-piece splits."""
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(random_count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:])])
    return out


def parse_checked(factory: ParserFactory, text: str, seed: int = 0) -> ParsedMessage:
    """Parses `text` under many splits; asserts that every split gives the same result and that the deltas of each
    rebuild it exactly. Returns the result."""
    _, expected = run(factory, [text])
    for chunks in splits(text, seed):
        deltas, result = run(factory, chunks)
        assert result == expected, f"split {chunks!r} changed the result"
        assert assemble(deltas) == result, f"deltas of split {chunks!r} do not rebuild the result"
    return expected


def argument_fragments(factory: ParserFactory, text: str) -> list[list[str]]:
    """Per call, the argument fragments a client gets when the text arrives one character at a time."""
    parser = factory()
    fragments: list[list[str]] = []
    for delta in [d for char in text for d in parser.feed(char)] + parser.finish():
        for entry in delta.get("tool_calls", []):
            if "id" in entry:
                fragments.append([])
            else:
                fragments[entry["index"]].append(entry["function"]["arguments"])
    return fragments
