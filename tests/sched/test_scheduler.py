"""The scheduler on its own, driven without a model: the deltas it hands the runner, the out-of-blocks path,
which request preemption picks, the longest-prefix admission order, async placeholders, and that it imports no
torch, model runner or kernels."""
from __future__ import annotations

import subprocess
import sys

from engine.config import EngineConfig, SchedulingPolicy
from engine.outputs import FinishReason, ModelRunnerOutput, SchedulerOutput, SequenceOutput
from engine.sched.sequence import SequenceStatus
from engine.sampling_params import SamplingParams
from engine.kv.block_hashing import BlockHasher
from engine.kv.layout import KVLayout
from engine.sched.scheduler import Scheduler

EOS = 2


def make(num_blocks: int, **cfg) -> Scheduler:
    config = EngineConfig(block_size=4, device="cpu", **{"max_num_batched_tokens": 64, **cfg})
    return Scheduler(config, KVLayout(num_blocks), BlockHasher(config.block_size, "m"), max_model_len=1024, eos_token_ids={EOS})


def params(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


def step(s: Scheduler, token: int = 5) -> tuple[SchedulerOutput, list[SequenceOutput]]:
    """One synchronous step: every sequence whose chunk reaches its end samples ``token``."""
    out = s.schedule()
    sampled = [x.seq_id for x in out.scheduled if x.samples]
    s.update(ModelRunnerOutput(sampled, [token] * len(sampled)))
    return out, list(s.take_outputs())


def test_deltas_new_request_then_appended_blocks_then_finished():
    s = make(32)
    s.add_request("a", list(range(10, 17)), params(max_tokens=3))  # 7 tokens: 2 blocks
    out, outs = step(s)
    assert [n.seq_id for n in out.new_sequences] == ["a"]
    (first,) = out.scheduled
    assert (first.num_computed_tokens, first.num_new_tokens, first.samples) == (0, 7, True)
    assert first.new_block_ids == s.kv.block_table("a") and len(first.new_block_ids) == 2
    assert [o.new_token_ids for o in outs] == [[5]]
    out, _ = step(s)  # computes position 7, the second block's last slot: no new block yet
    assert out.new_sequences == [] and out.scheduled[0].new_block_ids == []
    out, outs = step(s)  # position 8 starts a third block; max_tokens 3 reached
    assert len(out.scheduled[0].new_block_ids) == 1 and outs[0].finish_reason is FinishReason.LENGTH
    out = s.schedule()
    assert out.finished_seq_ids == ["a"] and out.scheduled == []  # the runner forgets it
    assert not s.has_unfinished_requests() and s.kv.num_sequences == 0
    s.kv.check_invariants()


def test_a_sequence_alone_that_outgrows_the_pool_ends_with_an_error():
    s = make(3)  # 12 token slots
    s.add_request("a", list(range(10, 18)), params(max_tokens=100))
    outputs = []
    while s.has_unfinished_requests():
        outputs += step(s)[1]
    last = outputs[-1]
    assert last.finish_reason is FinishReason.LENGTH and last.error == "out of KV blocks"
    # Every slot was used before giving up: slots 8..11 hold the first 4 generated tokens, which gave 5 tokens.
    assert sum(len(o.new_token_ids) for o in outputs) == 12 - 8 + 1
    s.kv.check_invariants()


def test_preemption_takes_the_newest_running_request_and_counts_its_lookup_apart():
    s = make(5)
    for name in ("a", "b", "c", "d"):  # 4 tokens each: one block now, a second one at the first decode
        s.add_request(name, [ord(name)] * 3 + [1], params(max_tokens=8))
    out, _ = step(s)
    assert [x.seq_id for x in out.scheduled] == ["a", "b", "c", "d"]
    queries_before = s.kv.stats.queries
    # Each needs a second block and one is free: a takes it; b preempts the newest other request (d) and takes its
    # block; c finds nobody left to preempt but itself.
    out, _ = step(s)
    assert out.preempted_seq_ids == ["d", "c"]
    assert [x.seq_id for x in out.scheduled] == ["a", "b"]
    c, d = s.sequences["c"], s.sequences["d"]
    assert c.status is d.status is SequenceStatus.PREEMPTED and list(s.waiting) == [c, d]
    resumed_tokens = 0  # counted independently: each re-admission looks up the sequence's tokens so far
    while s.has_unfinished_requests():
        out = s.schedule()
        resumed_tokens += sum(len(s.sequences[x.seq_id].token_ids) for x in out.scheduled if x.resumed)
        sampled = [x.seq_id for x in out.scheduled if x.samples]
        s.update(ModelRunnerOutput(sampled, [5] * len(sampled)))
    assert s.kv.stats.queries == queries_before  # re-admissions are not new queries ...
    assert s.kv.stats.preempted_queries == resumed_tokens > 0  # ... they are counted apart
    assert s.num_preemptions >= 2
    s.kv.check_invariants()


def test_longest_prefix_admits_the_request_with_the_most_cached_tokens_first():
    shared = list(range(100, 116))
    for policy, first in ((SchedulingPolicy.FCFS, "cold"), (SchedulingPolicy.LONGEST_PREFIX, "warm")):
        s = make(64, max_num_seqs=1, scheduling_policy=policy)
        s.add_request("seed", shared + [1], params(max_tokens=1))
        while s.has_unfinished_requests():
            step(s)
        s.add_request("cold", list(range(300, 317)), params(max_tokens=1))
        s.add_request("warm", shared + [7], params(max_tokens=1))
        out, outs = step(s)
        assert [n.seq_id for n in out.new_sequences] == [first], policy
        assert [o.num_cached_tokens for o in outs] == [16 if first == "warm" else 0]


def test_async_placeholders_let_the_next_step_be_scheduled_before_the_tokens_are_back():
    s = make(32)
    s.add_request("a", list(range(10, 15)), params(max_tokens=2))
    first = s.schedule()  # step N: prefill, samples
    second = s.schedule()  # step N + 1, before N's token is known: decodes the placeholder
    assert first.scheduled[0].samples and second.scheduled[0].samples
    assert second.scheduled[0].num_computed_tokens == 5 and s.sequences["a"].num_output_placeholders == 2
    assert s.schedule().scheduled == []  # max_tokens 2 is reached by the tokens in flight: nothing more
    s.update(ModelRunnerOutput(["a"], [EOS]))  # N's token is a stop token: N + 1's token will be dropped
    assert [o.finish_reason for o in s.take_outputs()] == [FinishReason.STOP]
    s.update(ModelRunnerOutput(["a"], [9]))
    assert not len(s.take_outputs()) and not s.has_unfinished_requests()


def test_the_scheduler_imports_no_torch_runner_or_kernels():
    code = ("import sys, engine.sched.scheduler; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('kernels', 'engine.worker.model_runner'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_constrained_sequences_are_counted_while_they_live():
    """The engine skips grammar work while `num_constrained` is 0: it must count every live constrained sequence
    (n > 1 siblings included) and drop to 0 however they end (finished, aborted while waiting or running)."""
    from engine.sampling_params import StructuredOutputSpec

    s = make(64)
    spec = StructuredOutputSpec("regex", "[ab]+")
    constrained = SamplingParams(max_tokens=2, temperature=0, n=2, structured_output=spec)
    s.add_request("plain", [10, 11, 12], params(max_tokens=2))
    s.add_request("json", [10, 11, 13], constrained)
    s.add_request("waiting", [10, 11, 14], SamplingParams(max_tokens=2, structured_output=spec))
    assert s.num_constrained == 2  # the siblings are queued once the leader's prompt is scheduled
    s.abort("waiting")
    assert s.num_constrained == 1
    step(s)
    assert s.num_constrained == 2  # "json" and its sibling
    while s.has_unfinished_requests():
        step(s)
    assert s.num_constrained == 0


def test_a_prompt_to_score_is_spread_over_steps_with_other_requests_between():
    """--max-scored-tokens-per-step: prompts with prompt_logprobs score at most that many positions a step between
    them, while the other requests decode every step; a prompt that scores nothing prefills in one step as before."""
    s = make(256, max_num_batched_tokens=512, max_scored_tokens_per_step=16)
    s.add_request("bystander", list(range(10, 15)), params(max_tokens=64))
    step(s)
    prompts = {"score": list(range(100, 200)), "other": list(range(300, 340)), "plain": list(range(400, 480))}
    s.add_request("score", prompts["score"], SamplingParams(max_tokens=1, prompt_logprobs=2))
    s.add_request("other", prompts["other"], SamplingParams(max_tokens=1, prompt_logprobs=0))
    s.add_request("plain", prompts["plain"], params(max_tokens=1))
    chunks: dict[str, list[int]] = {seq_id: [] for seq_id in prompts}
    while any(seq_id in s.sequences for seq_id in prompts):
        out, _ = step(s)
        scheduled = {x.seq_id: x for x in out.scheduled}
        assert "bystander" in scheduled  # it decodes every step
        scored = 0  # positions that predict a prompt token (all but the last), of the scoring prompts
        for seq_id in ("score", "other"):
            if seq_id in scheduled:
                x, last = scheduled[seq_id], len(prompts[seq_id]) - 1
                chunks[seq_id].append(x.num_new_tokens)
                scored += max(0, min(x.num_computed_tokens + x.num_new_tokens, last) - x.num_computed_tokens)
        assert scored <= 16
        if "plain" in scheduled:
            chunks["plain"].append(scheduled["plain"].num_new_tokens)
    assert sum(chunks["score"]) == 100 and len(chunks["score"]) >= 99 // 16
    assert sum(chunks["other"]) == 40 and max(chunks["other"]) <= 16
    assert chunks["plain"] == [80]  # its prompt in one step (which samples its one token)
    s.kv.check_invariants()
