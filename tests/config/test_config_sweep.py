"""Every architecture, over configurations drawn at random (tests/config/config_sweep.py), equals transformers greedy
token for token in every cache scenario: cold one at a time, together with the cache hot, a hit extended by the reply
and a new message (an agent's next turn), a hit ending mid-block, and chunked prefill off block boundaries with
preemption in a small pool. Prompt lengths straddle the block size and every window and compression rate of the
configuration. A configuration whose reference has a near-tie (a top-2 logit gap under `MIN_MARGIN`) is drawn again,
so equality is never a coin flip. Seeded: a failure names its architecture and index, and reproduces."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.config.config_sweep import (DRAWS, MIN_MARGIN, VOCAB, Drawn, covering_draws, draw, features,
                                       hf_greedy_with_margin, shared_tokenizer, write_checkpoint)

# of the first 5 draws of each architecture, the 3 that cover all 5's layer kinds, RoPE types, switches and block
# sizes (and the most of their sizes): the other two repeated them (`covering_draws`)
CANDIDATES, CONFIGS_PER_ARCHITECTURE = 5, 3
FAST = {"qwen3", "deepseek_v4", "qwen3_5"}  # their first configuration runs in the fast tier; everything else is slow
NEW = 6  # tokens generated in the cache scenarios
LONG = 12  # tokens generated in the small pool, so that running sequences outgrow it and are preempted
CHUNK = 7  # prefill tokens per step in the small pool: chunks end off every block boundary
ATTEMPTS = 6  # draws per case before giving up on a tie-free one


@dataclass
class Case:
    drawn: Drawn
    path: Path
    prompts: list[list[int]]
    expected: list[list[int]]  # transformers' LONG greedy tokens per prompt
    turns: list[list[int]]  # a hit extended: prompt + its reply + a new message; and a prompt sharing a mid-block prefix
    turn_expected: list[list[int]]

    @property
    def block(self) -> int:
        return self.drawn.block_size

    def llm(self, **engine_config) -> LLM:
        tokenizer = shared_tokenizer(self.drawn.tokenizer, self.path)
        return LLM(str(self.path), tokenizer=tokenizer, block_size=self.block, **engine_config)


def prompt_lengths(drawn: Drawn) -> list[int]:
    """Below and above the block size and every boundary of the configuration, plus one token and a longer one."""
    b = drawn.block_size
    around = {1, b - 1, b + 1, 2 * b + 3} | {n for edge in drawn.boundaries for n in (edge - 1, edge + 1)}
    longest = max(around) + b + 5
    return sorted(n for n in around | {longest} if n > 0)


def build_case(architecture: str, index: int, root: Path) -> Case:
    """The index-th tie-free case of ``architecture``: drawn, written, and run by transformers."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    margins = []
    for attempt in range(ATTEMPTS):
        seed = index + 1000 * attempt
        drawn = draw(architecture, seed)
        path = write_checkpoint(drawn, root / f"{architecture}-{seed}", seed)
        # transformers runs a Mistral3 VLM (Devstral Small 2's layout) and Muse-Glimmer only as the image-text
        # models they are
        auto = AutoModelForImageTextToText if architecture in ("mistral3", "muse_glimmer") else AutoModelForCausalLM
        hf = auto.from_pretrained(str(path), dtype=torch.float32).eval()
        rng = random.Random(seed)
        prompts = [[rng.randrange(100, VOCAB) for _ in range(n)] for n in prompt_lengths(drawn)]
        refs = [hf_greedy_with_margin(hf, p, LONG) for p in prompts]
        longest, reply = prompts[-1], refs[-1][0][:NEW]
        mid = 2 * drawn.block_size + drawn.block_size // 2  # a shared prefix that ends mid-block
        turns = [longest + reply + [rng.randrange(100, VOCAB) for _ in range(5)],
                 longest[:mid] + [rng.randrange(100, VOCAB) for _ in range(drawn.block_size + 3)]]
        turn_refs = [hf_greedy_with_margin(hf, t, NEW) for t in turns]
        margin = min(m for _, m in refs + turn_refs)
        if margin >= MIN_MARGIN:
            return Case(drawn, path, prompts, [r for r, _ in refs], turns, [r for r, _ in turn_refs])
        margins.append(margin)
    raise AssertionError(f"{architecture} #{index}: no tie-free draw in {ATTEMPTS} attempts (margins {margins})")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def check_cache_scenarios(case: Case) -> None:
    llm = case.llm(num_kv_blocks=512)
    try:
        want = [e[:NEW] for e in case.expected]
        cold = [llm.generate([p], greedy(NEW))[0] for p in case.prompts]  # distinct prompts: each one cold
        assert [o.token_ids for o in cold] == want, "cold, one at a time"
        assert all(o.num_cached_tokens == 0 for o in cold)

        hot = llm.generate(case.prompts, [greedy(1 + i % NEW) for i in range(len(case.prompts))])  # finishing apart
        assert [o.token_ids for o in hot] == [w[: 1 + i % NEW] for i, w in enumerate(want)], "together, cache hot"
        assert sum(o.num_cached_tokens for o in hot) > 0

        extended, mid_block = (llm.generate([t], greedy(NEW))[0] for t in case.turns)
        assert extended.token_ids == case.turn_expected[0], "a hit extended by the reply and a new message"
        assert mid_block.token_ids == case.turn_expected[1], "a hit ending mid-block"
        longest = len(case.prompts[-1])
        assert extended.num_cached_tokens >= longest // case.block * case.block - case.block
        # a hybrid resumes only where it kept a recurrent-state snapshot (prompt and reply ends), not mid-prompt; a
        # sliding-window model wherever its window's pages are still cached, as a dense one (docs/SLIDING_WINDOW.md)
        assert (mid_block.num_cached_tokens > 0) != ("linear_attention" in str(case.drawn.config))
        assert mid_block.num_cached_tokens <= 2 * case.block
    finally:
        llm.close()


def check_chunked_prefill_with_preemption(case: Case) -> None:
    """Longest first, in a pool that holds the longest request and one block more: the shorter ones join it while it
    decodes, and all outgrow the pool."""
    longest = max(len(p) for p in case.prompts) + LONG
    llm = case.llm(num_kv_blocks=math.ceil(longest / case.block) + 1, max_num_batched_tokens=CHUNK)
    try:
        outs = llm.generate(case.prompts[::-1], greedy(LONG))
        assert [o.token_ids for o in outs[::-1]] == case.expected, "chunked prefill off block boundaries, preempted"
        assert llm.stats.preemptions > 0
    finally:
        llm.close()


def test_every_served_architecture_is_swept() -> None:
    from engine.config import SUPPORTED_ARCHITECTURES

    assert set(DRAWS) == set(SUPPORTED_ARCHITECTURES)


def test_the_kept_draws_exercise_every_kind_the_candidates_do() -> None:
    for arch in DRAWS:
        kept = covering_draws(arch, CANDIDATES, CONFIGS_PER_ARCHITECTURE)
        assert kept[0] == 0 and len(set(kept)) == CONFIGS_PER_ARCHITECTURE
        kinds = [features(draw(arch, i))[0] for i in range(CANDIDATES)]
        assert set().union(*(kinds[i] for i in kept)) == set().union(*kinds), arch


CASES = [pytest.param(arch, i, id=f"{arch}-{i}", marks=() if arch in FAST and i == 0 else pytest.mark.slow)
         for arch in DRAWS for i in covering_draws(arch, CANDIDATES, CONFIGS_PER_ARCHITECTURE)]


@pytest.mark.parametrize("architecture,index", CASES)
@pytest.mark.fast_cases("qwen3-0", "qwen3_5-0")  # V4 keeps fast cases in tests/models/test_deepseek_v4.py
def test_drawn_configuration_equals_transformers_in_every_cache_scenario(architecture: str, index: int,
                                                                          tmp_path: Path) -> None:
    case = build_case(architecture, index, tmp_path)
    assert len({tuple(e) for e in case.expected}) == len(case.expected), "outputs must be varied to prove anything"
    check_cache_scenarios(case)
    check_chunked_prefill_with_preemption(case)
