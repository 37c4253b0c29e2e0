"""Helpers: run a parser over a split stream, rebuild the message from its deltas, check split independence."""
from __future__ import annotations

import random
from collections.abc import Callable

from server.parsing import Delta, OutputParser, ParsedMessage

ParserFactory = Callable[[], OutputParser]


def run(factory: ParserFactory, chunks: list[str]) -> tuple[list[Delta], ParsedMessage]:
    parser = factory()
    deltas: list[Delta] = []
    for chunk in chunks:
        deltas += parser.feed(chunk)
    deltas += parser.finish()
    return deltas, parser.result()


def assemble(deltas: list[Delta]) -> ParsedMessage:
    """The message a streaming client builds from the deltas (and checks of the delta protocol on the way)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    item = -1
    for delta in deltas:
        assert delta.item in (item, item + 1) and (delta.item == item + 1 or delta.kind != "call"), delta
        item = delta.item
        if delta.kind == "text":
            assert delta.text, "empty content delta"
            content.append(delta.text)
        elif delta.kind == "reasoning":
            assert delta.text, "empty reasoning delta"
            reasoning.append(delta.text)
        elif delta.kind == "call":  # a call starts: id and name come first
            assert delta.call_index == len(calls) and delta.call_id
            calls.append({"id": delta.call_id, "type": "function", "function": {"name": delta.text, "arguments": ""}})
        else:
            assert delta.call_index == len(calls) - 1 and not delta.call_id
            calls[delta.call_index]["function"]["arguments"] += delta.text
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
        if delta.kind == "call":
            fragments.append([])
        elif delta.kind == "arguments":
            fragments[delta.call_index].append(delta.text)
    return fragments
