"""Tensor (and expert) parallelism on CPU with gloo: N ranks give exactly the tokens of one, with logprobs within
1e-4, on a mixed batch that chunks prefills, preempts, hits the prefix cache and samples with seeds and penalties;
each rank holds 1/N of the sharded weights; rank 0 reads only its slices of the checkpoint."""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import pytest

from engine import SamplingParams
from engine.sampling_params import StructuredOutputSpec
from engine.outputs import SchedulerStats
from engine.parallel.memory import RankMemory
from engine.weights import _Checkpoint
from tests.hf_oracle import new_llm, random_prompts

LENGTHS = [3, 9, 17, 26, 40, 5, 12, 31]
# 56 blocks of 4 tokens and 16 tokens a step: prefills are chunked, running sequences get preempted, and the second
# round still finds blocks of the first in the cache.
ENGINE = dict(block_size=4, num_kv_blocks=56, max_num_batched_tokens=16)


def _params(turn: int) -> list[SamplingParams]:
    """The mixed batch's parameters; each turn seeds its sampled requests apart, so that the second round's
    continuation of a conversation does not draw with the first round's noise (same-seed draws are coupled: a
    continuation can repeat its first reply token for token)."""
    seed = 100 * turn
    return [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5),
        SamplingParams(max_tokens=9, temperature=1.0, seed=seed + 11, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=seed + 5, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, ignore_eos=True,
                       logprobs=0),
        SamplingParams(max_tokens=7, temperature=1.2, seed=seed + 3, n=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=11, temperature=0.7, seed=seed + 9, presence_penalty=0.4, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0),
    ]


@dataclass
class Run:
    tokens: list  # per request, per sequence: (token ids, finish reason)
    logprobs: list[float]  # every sampled token's logprob, where asked
    cached: list[int]  # prompt tokens served by the prefix cache, per request
    stats: SchedulerStats
    memory: list[RankMemory]


def run_workload(name: str, **options) -> Run:
    """Two rounds: the second continues each conversation of the first (prompt + reply + new tokens), so its
    prompts hit the prefix cache, while the pool is small enough to preempt."""
    with new_llm(name, **ENGINE, **options) as llm:
        first = random_prompts(llm.engine.model_cfg.vocab_size, LENGTHS, seed=41)
        outs = llm.generate(first, _params(0))
        follow = random_prompts(llm.engine.model_cfg.vocab_size, [5] * len(LENGTHS), seed=42)
        second = [p + o.token_ids + f for p, o, f in zip(first, outs, follow)]
        outs += llm.generate(second, _params(1))
        llm.engine.scheduler.kv.check_invariants()
        return Run(
            tokens=[[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs],
            logprobs=[lp.logprob for o in outs for c in o.outputs for lp in c.logprobs if lp is not None],
            cached=[o.num_cached_tokens for o in outs], stats=llm.stats, memory=llm.engine.rank_memory,
        )


@functools.lru_cache(maxsize=None)
def single_rank(name: str, async_scheduling: bool = False) -> Run:
    return run_workload(name, async_scheduling=async_scheduling)


@dataclass(frozen=True)
class Case:
    model: str
    size: int
    expert_parallel: bool = False
    async_scheduling: bool = False

    @property
    def id(self) -> str:
        return f"{self.model}-tp{self.size}" + ("-ep" if self.expert_parallel else "") + \
            ("-async" if self.async_scheduling else "")


CASES = [
    Case("qwen3-tiny", 2, async_scheduling=True),
    Case("qwen3-tiny", 4),  # 2 KV heads on 4 ranks: each KV head replicated on two
    Case("deepseek-tiny", 2),
    Case("smollm2-135m", 3),  # 9 heads and 3 KV heads: 3 is the size that splits them
    Case("qwen3-moe-tiny", 2),
    Case("qwen3-moe-tiny", 2, expert_parallel=True, async_scheduling=True),
    Case("deepseek-v3-tiny", 2),
    Case("deepseek-v3-tiny", 2, expert_parallel=True),
    # the indexer and its index keys replicated, as the latent
    pytest.param(Case("deepseek-v3.2-tiny", 2), marks=pytest.mark.slow, id="deepseek-v3.2-tiny-tp2"),
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.id)
def runs(request) -> tuple[Case, Run, Run]:
    case = request.param
    parallel = run_workload(case.model, tensor_parallel_size=case.size, enable_expert_parallel=case.expert_parallel,
                            async_scheduling=case.async_scheduling)
    return case, single_rank(case.model, case.async_scheduling), parallel


@pytest.mark.fast_cases("qwen3-moe-tiny-tp2-ep-async")
def test_tokens_equal_one_rank(runs):
    _, single, parallel = runs
    assert parallel.tokens == single.tokens
    assert len({tuple(r[0][0]) for r in single.tokens}) == len(single.tokens)  # varied: not one repeated token


@pytest.mark.fast_cases("qwen3-moe-tiny-tp2-ep-async")
def test_logprobs_within_1e_4(runs):
    _, single, parallel = runs
    assert len(parallel.logprobs) == len(single.logprobs) > 50
    assert max(abs(a - b) for a, b in zip(parallel.logprobs, single.logprobs)) < 1e-4


@pytest.mark.fast_cases("qwen3-moe-tiny-tp2-ep-async")
def test_same_schedule_with_preemption_and_prefix_hits(runs):
    _, single, parallel = runs
    assert parallel.cached == single.cached
    assert sum(single.cached[len(LENGTHS):]) > 0  # the second round hit the first round's blocks
    assert single.stats.preemptions > 0
    assert parallel.stats == single.stats


@pytest.mark.fast_cases("qwen3-moe-tiny-tp2-ep-async")
def test_each_rank_holds_its_share(runs):
    case, single, parallel = runs
    (whole,) = single.memory
    assert [m.rank for m in parallel.memory] == list(range(case.size))
    assert len({m.pid for m in parallel.memory}) == case.size  # one process per rank
    replicated_kv_heads = case.model == "qwen3-tiny" and case.size == 4
    mla = case.model.startswith("deepseek-v3")
    for rank in parallel.memory:
        assert rank.replicated_weight_bytes == whole.replicated_weight_bytes
        if replicated_kv_heads:  # the KV part of qkv_proj and the pages: 1/2 each, the rest 1/4
            assert whole.sharded_weight_bytes / 4 < rank.sharded_weight_bytes < whole.sharded_weight_bytes / 2
            assert rank.kv_cache_bytes * 2 == whole.kv_cache_bytes
        else:
            assert rank.sharded_weight_bytes * case.size == whole.sharded_weight_bytes
            # GQA pages hold the rank's KV heads; MLA's latent cache is replicated
            assert rank.kv_cache_bytes * (1 if mla else case.size) == whole.kv_cache_bytes


@pytest.mark.slow
def test_rank_zero_reads_only_its_slices(monkeypatch):
    """Every tensor rank 0 reads from the checkpoint is exactly what it keeps: never a whole sharded tensor."""
    read: list[int] = []
    original = _Checkpoint.get

    def spy(self, name, index=None):
        tensor = original(self, name, index)
        read.append(tensor.numel() * tensor.element_size())
        return tensor

    monkeypatch.setattr(_Checkpoint, "get", spy)
    with new_llm("qwen3-tiny", tensor_parallel_size=2, num_kv_blocks=16) as llm:
        rank0 = llm.engine.rank_memory[0]
    assert sum(read) == rank0.weight_bytes
    assert rank0.sharded_weight_bytes * 2 == single_rank("qwen3-tiny").memory[0].sharded_weight_bytes


def _tiers_and_grammar(size: int) -> tuple:
    """A prompt evicted to the host pool and hit again, then a regex-constrained request, then a prompt asked twice
    in a speculating session (the second drafts the first's reply: suffix decoding, proposed on rank 0)."""
    with new_llm("qwen3-tiny", tensor_parallel_size=size, block_size=4, num_kv_blocks=16, kv_offload_gb=0.01,
             async_scheduling=True) as llm:
        a, b = random_prompts(llm.engine.model_cfg.vocab_size, [44, 44], seed=17)
        greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        first = llm.generate(a, greedy)[0]
        llm.generate(b, greedy)  # the pool holds one prompt: a's blocks move to the host pool
        again = llm.generate(a, greedy)[0]
        pattern = StructuredOutputSpec("regex", r"(yes|no), [0-9]{2}")
        constrained = llm.generate(b[:20], SamplingParams(max_tokens=12, temperature=0, structured_output=pattern))[0]
        speculating = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, speculative="suffix",
                                     speculative_session="s")
        plain = llm.generate(a[:24], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids
        drafted = [plain] + [llm.generate(a[:24], speculating)[0].token_ids for _ in range(2)]
        return (first.token_ids, again.token_ids, again.num_cached_tokens, llm.stats.kv_restore_bytes, constrained.text,
                drafted, llm.stats.spec_accepted_tokens)


@pytest.mark.slow
def test_host_tier_grammars_and_speculation_on_every_rank():
    """Transfers ride the SchedulerOutput to every rank (each holds its shard of a block); masks apply on rank 0;
    drafts are verified on rank 0, which broadcasts the emitted tokens."""
    single, parallel = _tiers_and_grammar(1), _tiers_and_grammar(2)
    first, again, cached, restored, text, drafted, accepted = parallel
    assert first == again and cached >= 40 and restored > 0  # the restored blocks gave the same tokens
    assert re.fullmatch(r"(yes|no), [0-9]{2}", text)
    assert drafted[0] == drafted[1] == drafted[2] and accepted >= 10  # the second request's drafts were accepted
    assert parallel[:3] + parallel[4:] == single[:3] + single[4:]
    assert restored * 2 == single[3]  # each rank restores its half of every block
