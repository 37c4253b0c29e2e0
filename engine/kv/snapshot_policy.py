"""Where a hybrid model's recurrent state is snapshotted: the block boundaries worth resuming from later.

A snapshot costs as much memory as thousands of tokens of K/V (Qwen3.6-27B: 147 MiB, about 2,300 tokens), so a
sequence keeps only a few, at the boundaries where later requests diverge from it:
  - hints: message boundaries the server passes (the end of the system prompt and tools, where subagents and new
    sessions branch; the start of the last user turn, which clients rewrite; the end of its content when only
    non-reply messages follow it, where a client's retry appends);
  - breakpoints: `cache_control` / named-cache pins (their prefix is meant to be reused);
  - prompt end: the last full block before the prompt's last token (a retry, n > 1, a next turn that drops the
    reply's thinking);
  - reply end: while decoding, the state at each block boundary replaces the sequence's previous one, so that the
    last boundary of prompt + reply stays (the next turn of a conversation resumes there).
Each point is rounded down to a block boundary; prefill chunks end on the prompt's points so that the state there
exists at the end of a step (the scheduler cuts them). The benchmarks' simulator applies the same policy.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SnapshotPolicy:
    hints: bool = True
    breakpoints: bool = True
    prompt_end: bool = True
    reply_end: bool = True

    def prompt_points(self, num_prompt_tokens: int, block_size: int, hints: Iterable[int] = (),
                      breakpoints: Iterable[int] = ()) -> list[int]:
        """The block boundaries (token counts, ascending) inside the prompt where the state is kept."""
        points = set()
        if self.hints:
            points.update(hints)
        if self.breakpoints:
            points.update(breakpoints)
        if self.prompt_end:
            points.add(num_prompt_tokens - 1)
        limit = num_prompt_tokens - 1  # a hit leaves at least the last prompt token to compute
        rounded = {min(p, limit) // block_size * block_size for p in points}
        return sorted(p for p in rounded if p > 0)

    def in_reply(self, num_computed: int, num_prompt_tokens: int, block_size: int) -> bool:
        """Whether the state after ``num_computed`` tokens (past the prompt, decoding) is kept as the reply end."""
        return self.reply_end and num_computed > num_prompt_tokens and num_computed % block_size == 0


DEFAULT_POLICY = SnapshotPolicy()
