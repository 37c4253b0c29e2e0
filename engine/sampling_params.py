"""Per-request sampling parameters, validated at construction so bad input fails before it reaches the engine, and
the structured-output constraint one of them carries (plain data: engine/worker/structured_output.py compiles it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from engine.phase_budget import PhaseBudget

Kind = Literal["json_schema", "structural_tag", "regex", "ebnf"]


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What a request's output must match. `value` is the JSON text of a JSON schema (its output is spaced as
    `json.dumps` does: `, ` and `: `) or of an xgrammar structural tag, a regex, or an EBNF grammar with a `root`
    rule. Frozen and hashable, so equal specs share one compiled grammar."""

    kind: Kind
    value: str

    def __post_init__(self) -> None:
        if self.kind not in get_args(Kind):
            raise ValueError(f"structured output kind must be one of {get_args(Kind)}, got {self.kind!r}")


# What a random generator can be seeded with (a signed or unsigned 64-bit integer).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    max_tokens: int = 16  # 0: prefill only (scoring with prompt_logprobs, warming the cache); nothing is generated
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each sampled token's logprob
    # The same for every prompt token (scoring): computed in the prefill, which then reads nothing from the prefix
    # cache for the positions it scores.
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True  # for the text only; the server keeps them to parse tool-call tokens
    structured_output: StructuredOutputSpec | None = None  # a grammar the output must match
    # Speculative decoding for this request: off, ngram, suffix or mtp (None: the engine's --speculative); the suffix
    # proposer drafts from the earlier text of this session (with the cache salt: one tenant's session only)
    speculative: str | None = None
    speculative_session: str | None = None
    # A budget on one phase of the output (a thinking budget): after its budget, the engine forces its closing tokens
    phase_budget: PhaseBudget | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens >= 0, f"max_tokens must be at least 0, got {self.max_tokens}"),
            (self.max_tokens > 0 or self.structured_output is None, "max_tokens 0 (scoring only) takes no grammar"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.top_k >= -1, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.seed is None or SEED_MIN <= self.seed <= SEED_MAX,
             f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (self.speculative in (None, "off", "ngram", "suffix", "mtp"),
             f"speculative must be 'off', 'ngram', 'suffix' or 'mtp', got {self.speculative!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
