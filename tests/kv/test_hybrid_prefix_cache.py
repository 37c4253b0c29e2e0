"""The prefix cache of hybrid models: a prefix is resumable where a snapshot of the recurrent state exists
(engine/kv/), so hits end at snapshot points: the prompt end, the reply end, message boundaries the server hints
(the end of the system prompt and tools), breakpoints. Outputs equal transformers with the cache hot, on the next
turn of a conversation, under preemption and when the snapshot pool is too small for everything."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv.snapshot_policy import SnapshotPolicy
from engine.retention import CachePin, Retention
from tests.hf_oracle import hf_greedy, new_llm, random_prompts
from tests.models.checkpoints.hybrid_models import KINDS

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LENGTHS = [5, 16, 17, 40, 70]
SWEEP = [pytest.param(kind, marks=() if kind == "qwen3_5" else pytest.mark.slow) for kind in KINDS]


def _llm(path: str, **options) -> LLM:
    return new_llm(path, **{"block_size": 4, "num_kv_blocks": 512, "num_state_snapshots": 64,
                        "max_num_batched_tokens": 32, **options})


def test_policy_points_are_block_boundaries_inside_the_prompt():
    policy = SnapshotPolicy()
    assert policy.prompt_points(17, 4, hints=[5, 30]) == [4, 16]  # hint 5 -> block 4; 30 is past the prompt
    assert policy.prompt_points(16, 4) == [12]  # a hit leaves the last prompt token to compute
    assert policy.prompt_points(3, 4, hints=[2]) == []
    assert policy.prompt_points(40, 4, breakpoints=[22]) == [20, 36]
    assert SnapshotPolicy(prompt_end=False).prompt_points(40, 4, hints=[9]) == [8]
    assert policy.in_reply(44, 40, 4) and not policy.in_reply(40, 40, 4) and not policy.in_reply(45, 40, 4)


@pytest.mark.parametrize("kind", SWEEP)
@pytest.mark.slow
def test_greedy_with_the_cache_hot(kind, hybrid_dirs):
    path = hybrid_dirs[kind]
    prompts = random_prompts(151_000, LENGTHS, seed=4)
    llm = _llm(path)
    llm.generate(prompts, SamplingParams(max_tokens=1))  # snapshots every prompt's last full block
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [(len(p) - 1) // 4 * 4 for p in prompts]
    assert [o.token_ids for o in outs] == [hf_greedy(path, p, 8) for p in prompts]
    llm.engine.scheduler.kv.check_invariants()


@pytest.mark.parametrize("kind", SWEEP)
@pytest.mark.slow
def test_next_turn_reads_all_but_one_block_of_prompt_and_reply(kind, hybrid_dirs):
    """The reply-end snapshot (the last block boundary the reply reached) lets the next turn (prompt + reply + a
    new message) resume there; with async scheduling too (the boundary's last token still on the device when
    the step is scheduled)."""
    path = hybrid_dirs[kind]
    prompts = random_prompts(151_000, LENGTHS, seed=5)
    for async_scheduling in (False, True):
        llm = _llm(path, async_scheduling=async_scheduling)
        first = llm.generate(prompts, GREEDY)
        follow = random_prompts(151_000, [6] * len(prompts), seed=6)
        second = [p + o.token_ids + f for p, o, f in zip(prompts, first, follow)]
        outs = llm.generate(second, GREEDY)
        for prev, out in zip(prompts, outs):
            assert len(prev) + 8 - 4 <= out.num_cached_tokens <= len(prev) + 8
        assert [o.token_ids for o in outs] == [hf_greedy(path, p, 8) for p in second]
        llm.engine.scheduler.kv.check_invariants()


@pytest.mark.slow
def test_shared_system_prompt_is_read_whole_with_a_hint(hybrid_dirs):
    """Subagents share only the system prompt and tools: with the server's hint (its end) the first request keeps
    a snapshot there (its prefill chunk ends on that boundary), so the second reads the whole shared part,
    block-aligned. Without the hint the prompt-end and reply-end snapshots lie past the branch point: no hit."""
    path = hybrid_dirs["qwen3_5"]
    system, task_a, task_b = random_prompts(151_000, [39, 20, 15], seed=8)
    for hinted in (True, False):
        llm = _llm(path, max_num_batched_tokens=256)
        hint = Retention(snapshot_hints=(len(system),)) if hinted else None
        llm.generate([system + task_a], GREEDY, retention=hint)
        out = llm.generate([system + task_b], GREEDY, retention=hint)[0]
        assert out.num_cached_tokens == (36 if hinted else 0)
        assert out.token_ids == hf_greedy(path, system + task_b, 8)


@pytest.mark.slow
def test_breakpoint_pins_keep_their_snapshot(hybrid_dirs):
    """A cache_control breakpoint is a snapshot point, and its pinned block's snapshot outlives ordinary ones in a
    full pool (one running slot and three for snapshots: a snapshot may also sit in an idle running slot)."""
    path = hybrid_dirs["qwen3_5"]
    pinned, *others = random_prompts(151_000, [30, 21, 22, 23, 24], seed=9)
    llm = _llm(path, num_state_snapshots=3, max_num_seqs=1, max_num_batched_tokens=256)
    llm.generate([pinned + [5, 6, 7]], SamplingParams(max_tokens=1),
                 retention=Retention(pins=(CachePin(len(pinned), 300.0),)))
    for prompt in others:  # each brings a prompt-end and a reply-end snapshot: the pool evicts
        llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    assert llm.stats.state_snapshot_evictions > 0
    out = llm.generate([pinned + [9, 9]], GREEDY)[0]
    assert out.num_cached_tokens == 28
    assert out.token_ids == hf_greedy(path, pinned + [9, 9], 8)
    llm.engine.scheduler.kv.check_invariants()


@pytest.mark.parametrize("kind", SWEEP)
@pytest.mark.slow
def test_preemption_and_a_small_snapshot_pool(kind, hybrid_dirs):
    """40 blocks and 8 state rows (5 running, 3 snapshots) for 5 conversations: sequences are preempted
    (re-admitted from a snapshot where one is left), snapshots are evicted least recently used first, and every
    token is still transformers'."""
    path = hybrid_dirs[kind]
    prompts = random_prompts(151_000, LENGTHS, seed=10)
    llm = _llm(path, num_kv_blocks=40, num_state_snapshots=3, max_num_seqs=5)
    first = llm.generate(prompts, GREEDY)
    second = [p + o.token_ids + [7, 8, 9] for p, o in zip(prompts, first)]
    outs = llm.generate(second, GREEDY)
    stats = llm.stats
    assert stats.preemptions > 0 and stats.state_snapshot_evictions > 0
    assert [o.token_ids for o in first + outs] == [hf_greedy(path, p, 8) for p in prompts + second]
    llm.engine.scheduler.kv.check_invariants()


@pytest.mark.slow
def test_no_snapshots_no_hits(hybrid_dirs):
    """Without a state row to spare (one sequence at a time, no snapshot memory) a hybrid model never takes a
    prefix from the cache (its pages alone cannot resume the recurrent layers), and its outputs stay right."""
    path = hybrid_dirs["qwen3_5"]
    prompt = random_prompts(151_000, [30], seed=11)[0]
    llm = _llm(path, num_state_snapshots=0, max_num_seqs=1)
    llm.generate([prompt], GREEDY)
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == hf_greedy(path, prompt, 8)


@pytest.mark.slow
def test_snapshots_ride_the_host_and_disk_tiers(hybrid_dirs, tmp_path):
    """A small device pool: a prompt's blocks, and its prompt-end snapshot with them, evicted by other prompts come
    back from the host pool; after a restart, from the disk tier (the snapshot in its block's file). Transformers'
    tokens every time."""
    path = hybrid_dirs["qwen3_5"]
    a, b, c = random_prompts(151_000, [70, 70, 70], seed=12)
    want = hf_greedy(path, a, 8)
    settings = dict(num_kv_blocks=24, max_num_seqs=2, max_num_batched_tokens=256, kv_offload_gb=0.002,
                    kv_disk_dir=str(tmp_path))
    llm = _llm(path, **settings)
    for prompt in (a, b, c):
        llm.generate([prompt], GREEDY)
    assert not any(n.snapshot_row >= 0 for n in llm.engine.scheduler.kv.by_hash.values()
                   if n.block_hash in set(llm.engine.scheduler.hasher.hashes(a, None)))  # a's state left the device
    warm = llm.generate([a], GREEDY)[0]
    assert warm.num_cached_tokens == 68 and warm.token_ids == want
    assert llm.stats.prefix_cache_host_hits_tokens > 0
    llm.engine.scheduler.kv.check_invariants()
    llm.close()  # writes the device's blocks and snapshots through to disk
    llm = _llm(path, **settings)
    try:
        cold_start = llm.generate([a], GREEDY)[0]
        assert cold_start.num_cached_tokens == 68 and cold_start.token_ids == want
        assert llm.stats.prefix_cache_disk_hits_tokens == 68
    finally:
        llm.close()


@pytest.mark.slow
def test_n_siblings_resume_from_the_prompts_snapshot(hybrid_dirs):
    """n > 1: the siblings are admitted once the leader's prompt is scheduled, after the step that snapshotted the
    prompt's last full block (its chunk ends there), so each resumes from it; every sibling equals transformers."""
    path = hybrid_dirs["qwen3_5"]
    prompt = random_prompts(151_000, [70], seed=21)[0]
    llm = _llm(path)
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert llm.stats.prefix_cache_hits_tokens == 2 * 68
    assert [o.token_ids for o in out.outputs] == [hf_greedy(path, prompt, 6)] * 3
    llm.engine.scheduler.kv.check_invariants()
