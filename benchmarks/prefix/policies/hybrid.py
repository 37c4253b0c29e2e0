"""Hybrid models' prefix cache on the agent workloads: hit rate against snapshot memory for kvserve's snapshot policy,
vLLM's align mode and llama.cpp's checkpoints, simulated on the same token requests with the engine's own KV manager
(pages + recurrent-state slots holding snapshots; engine/kv/).

A hybrid model resumes a cached prefix only where a snapshot of its recurrent state exists, so each policy is
"where are states kept" plus the block size it hashes with:
  - kvserve: 16-token blocks; snapshots at the server's message-boundary hints (end of system + tools, start of the
    last user turn, end of its content before non-reply messages), the prompt's last full block, and the reply's last block boundary (engine/kv/snapshot_policy.py);
  - vLLM align mode: blocks of as many tokens as one layer's state takes in attention K/V (784 for Qwen3.6-27B), a
    state at every block boundary a step ends on: the prompt's last one (its prefill is aligned to it) and each one
    decoding crosses;
  - llama.cpp: a slot per session (sessions never share a cache), a checkpoint at each prompt's end, the last
    ``checkpoints`` of a slot kept.
Snapshots of the first two live in one pool of ``slots`` states, least recently used first (kvserve first drops a
snapshot that a deeper one on the same unbranched path supersedes, and a new snapshot never evicts one at a branch
point; llama.cpp's memory is what its slots keep). Pages are not the bound here: hits are limited only by where states exist and how many are
kept. Requests run one at a time in arrival order (a parent before its children), each in its own step.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.kv.block_hashing import BlockHasher
from engine.config import ModelConfig
from engine.kv.snapshot_policy import SnapshotPolicy
from engine.kv.manager import KVCacheManager

from benchmarks.gpu.models import QWEN36_27B, QWEN36_35B_A3B
from benchmarks.prefix.traces.trace import TokenRequest

HYBRID_SHAPES = {"Qwen3.6-27B": QWEN36_27B, "Qwen3.6-35B-A3B": QWEN36_35B_A3B}
MIB = 2**20


@dataclass(frozen=True)
class StateCost:
    """What a model's cache costs, in bf16 pages and states (the delta-rule state in fp32, as kvserve keeps it)."""

    kv_bytes_per_token: int  # every full-attention layer's K and V (an MLA layer's latent: Kimi Linear)
    state_bytes: int  # one sequence's state (or one snapshot) over every linear-attention layer
    state_bytes_per_layer: int
    kv_bytes_per_token_per_layer: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> "StateCost":
        cfg = ModelConfig.from_dict(config)
        lin = cfg.linear
        assert lin is not None
        linear_layers = sum(lin.is_linear(i) for i in range(cfg.num_layers))
        mla = cfg.mla
        per_layer_kv = (mla.kv_lora_rank + mla.qk_rope_head_dim) * 2 if mla else 2 * cfg.num_kv_heads * cfg.head_dim * 2
        per_layer_state = lin.conv_dim * (lin.conv_kernel - 1) * 2 + lin.num_value_heads * lin.key_head_dim * \
            lin.value_head_dim * 4
        return cls((cfg.num_layers - linear_layers) * per_layer_kv, linear_layers * per_layer_state,
                   per_layer_state, per_layer_kv)

    @property
    def tokens_per_state(self) -> float:
        """A snapshot's memory in tokens of K/V."""
        return self.state_bytes / self.kv_bytes_per_token

    @property
    def vllm_align_block(self) -> int:
        """vLLM's align mode sizes an attention page like one layer's state: this many tokens (a multiple of 16)."""
        return math.ceil(self.state_bytes_per_layer / self.kv_bytes_per_token_per_layer / 16) * 16


@dataclass(frozen=True)
class HybridPolicy:
    name: str
    block_size: int
    snapshots: SnapshotPolicy | None = None  # kvserve's points
    hints: bool = True
    every_decode_block: bool = False  # vLLM: a state at each block boundary a step ends on
    checkpoints_per_session: int = 0  # llama.cpp: a slot per session keeping its last N prompt-end checkpoints
    weigh_snapshots: bool = False  # kvserve's eviction (KVCacheManager): dominated snapshots first, branch points kept


def policies(cost: StateCost, checkpoints: int = 3) -> list[HybridPolicy]:
    return [
        HybridPolicy("kvserve", 16, SnapshotPolicy(), weigh_snapshots=True),
        HybridPolicy("kvserve, no server hints", 16, SnapshotPolicy(), hints=False, weigh_snapshots=True),
        HybridPolicy("vLLM align", cost.vllm_align_block, every_decode_block=True),
        HybridPolicy(f"llama.cpp ({checkpoints} checkpoints)", 16, checkpoints_per_session=checkpoints),
    ]


@dataclass
class PolicyRun:
    policy: str
    slots: int  # snapshot slots the pool had (llama.cpp: what its slots kept at most)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    peak_snapshots: int = 0
    per_request: list[int] = field(default_factory=list)  # cached tokens, request by request

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_policy(requests: Sequence[TokenRequest], policy: HybridPolicy, slots: int,
               include_output: bool = True) -> PolicyRun:
    """Replay ``requests`` through a hybrid KV manager with ``slots`` snapshot slots (llama.cpp: unbounded, its own
    per-session limit applies) and ``policy``'s snapshot points. ``include_output=False``: the replies are not
    cached (an engine run whose own replies differ from the scripted ones)."""
    bs = policy.block_size
    llama = policy.checkpoints_per_session > 0
    pages = sum(-(-len(r.committed_ids(include_output)) // bs) for r in requests) + 1
    kv = KVCacheManager(pages, bs, state_rows=1 + (len(requests) * 64 if llama else slots),
                        weigh_snapshots=policy.weigh_snapshots)
    hasher = BlockHasher(bs, "hybrid-sim")
    kept: dict[str, deque[int]] = {}  # llama.cpp: each session's checkpoint slots, oldest first
    run = PolicyRun(policy.name, slots)
    for r in requests:
        kv.begin_step()
        salt = r.session if llama else r.salt  # llama.cpp: a slot per session, nothing shared across slots
        ids = r.committed_ids(include_output)
        hashes = hasher.hashes(ids, salt, r.images)
        cached = kv.admit(r.request_id, hashes, r.prompt, len(r.prompt))
        assert cached is not None, "the simulated pool holds every block"
        run.prompt_tokens += len(r.prompt)
        run.cached_tokens += cached
        run.per_request.append(cached)
        computed = len(ids) - 1  # the last token is never computed
        kv.allocate(r.request_id, len(ids))
        kv.commit(r.request_id, hashes, ids, computed)
        for point in _points(r, policy, computed):
            if point > cached and kv.take_snapshot(r.request_id, point) and llama:
                session = kept.setdefault(r.session, deque())
                session.append(hashes[point // bs - 1])
                while len(session) > policy.checkpoints_per_session:
                    node = kv.by_hash.get(session.popleft())
                    if node is not None and node.snapshot_row >= 0:
                        kv.states.drop(node.snapshot_row)
        kv.free(r.request_id)
        run.peak_snapshots = max(run.peak_snapshots, len(kv.states.snapshots))
    return run


def _points(r: TokenRequest, policy: HybridPolicy, computed: int) -> list[int]:
    bs, prompt = policy.block_size, len(r.prompt)
    if policy.checkpoints_per_session:
        return [prompt // bs * bs] if prompt >= bs else []
    if policy.snapshots is None:  # vLLM align: the prompt's last boundary, then every boundary decoding crosses
        return [p for p in range(bs, computed + 1, bs) if p >= prompt // bs * bs]
    points = policy.snapshots.prompt_points(prompt, bs, r.snapshot_hints if policy.hints else (),
                                            [p.num_tokens for p in r.pins])
    reply_end = computed // bs * bs
    if policy.snapshots.in_reply(reply_end, prompt, bs):
        points.append(reply_end)
    return points


def compare(requests: Sequence[TokenRequest], cost: StateCost, slot_counts: Sequence[int],
            checkpoints: int = 3) -> list[PolicyRun]:
    """Every policy at every pool size (llama.cpp once: its memory is its slots' checkpoints)."""
    runs = []
    for policy in policies(cost, checkpoints):
        counts = [0] if policy.checkpoints_per_session else slot_counts
        runs += [run_policy(requests, policy, n) for n in counts]
    return runs
