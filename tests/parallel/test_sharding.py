"""The arithmetic of tensor-parallel layers, rank by rank in one process: each rank's slices of the checkpoint put
back together give the unsplit layer (vocabulary padding, replicated KV heads, a row-parallel bias added once,
experts split by slices or held whole)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.parallel.linear import (
    ExpertSharding,
    VocabParallelEmbedding,
    lm_head_parallel,
    qkv_parallel,
    row_parallel,
)
from engine.parallel.state import TensorParallel


def ranks(size: int, expert_parallel: bool = False) -> list[TensorParallel]:
    return [TensorParallel(rank, size, expert_parallel) for rank in range(size)]


def test_units_split_evenly_or_repeat_when_fewer_than_ranks():
    assert [list(tp.units(8)) for tp in ranks(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [list(tp.units(2)) for tp in ranks(4)] == [[0], [0], [1], [1]]  # GQA: 2 KV heads on 4 ranks
    with pytest.raises(AssertionError):
        TensorParallel(0, 3).units(4)


def test_vocab_blocks_with_padding_reassemble_embedding_and_logits():
    vocab, hidden = 10, 6  # 3 ranks: blocks of 4 rows, the last holding 2 real rows and 2 of padding
    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 3, 4, 7, 8, 9])
    hidden_states = torch.randn(5, hidden)
    embedded, logits = torch.zeros(len(ids), hidden), []
    for tp in ranks(3):
        embedding = VocabParallelEmbedding(vocab, hidden, tp)
        head = lm_head_parallel(hidden, vocab, tp)
        (rows,) = embedding.sharding.checkpoint_index("weight", 0)
        with torch.no_grad():
            for weight in (embedding.weight, head.weight):
                weight.zero_()
                weight[embedding.sharding.local_rows(0, rows.stop - rows.start)] = table[rows]
        assert embedding.weight.shape == (4, hidden)
        embedded += embedding(ids)  # what the decoder loop's all-reduce adds up
        logits.append(head(hidden_states))
    torch.testing.assert_close(embedded, table[ids])
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], hidden_states @ table.T)


def test_qkv_rows_per_rank_with_replicated_kv_heads():
    heads, kv_heads, head_dim = 4, 2, 3
    parts = []
    for tp in ranks(4):
        qkv = qkv_parallel(8, heads, kv_heads, head_dim, tp, bias=True)
        assert qkv.weight.shape == (3 * head_dim, 8)  # one query head and the KV head it reads
        parts.append([qkv.sharding.checkpoint_index("weight", part)[0] for part in range(3)])
    q_rows = [p[0] for p in parts]
    k_rows = [p[1] for p in parts]
    assert [(r.start, r.stop) for r in q_rows] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [(r.start, r.stop) for r in k_rows] == [(0, 3), (0, 3), (3, 6), (3, 6)]  # KV head h // 2 of query head h


def test_row_parallel_partial_sums_add_the_bias_once():
    full = torch.nn.Linear(8, 5)
    x = torch.randn(3, 8)
    total = torch.zeros(3, 5)
    for tp in ranks(2):
        layer = row_parallel(8, 5, tp, bias=True, unit_size=2)
        index = layer.sharding.checkpoint_index("weight", 0)
        bias = layer.sharding.checkpoint_index("bias", 0)
        with torch.no_grad():
            layer.weight.copy_(full.weight[index])
            layer.bias.copy_(full.bias if bias is not None else torch.zeros(5))
        assert (bias is not None) == tp.is_first
        total += layer(x[:, index[1]])
    torch.testing.assert_close(total, full(x))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_experts_sliced_or_whole_reassemble_the_moe_sum(expert_parallel):
    num_experts, inter, hidden = 4, 6, 5
    gate, up = torch.randn(num_experts, inter, hidden), torch.randn(num_experts, inter, hidden)
    down = torch.randn(num_experts, hidden, inter)
    x = torch.randn(hidden)
    ids = torch.tensor([[1, 3]])

    def expert_out(g, u, d):
        return d @ (F.silu(g @ x) * (u @ x))

    expected = sum(expert_out(gate[e], up[e], down[e]) for e in ids[0].tolist())
    total = torch.zeros(hidden)
    for tp in ranks(2, expert_parallel):
        sharding = ExpertSharding(tp, num_experts, inter)
        gate_up_index, down_index = sharding.checkpoint_index("gate_proj"), sharding.checkpoint_index("down_proj")
        local = sharding.localize(ids)[0].tolist()
        for expert in ids[0].tolist():
            index = sharding.local_index(expert)
            assert (index if index is not None else -1) in local
            if index is not None:
                total += expert_out(gate[expert][gate_up_index], up[expert][gate_up_index], down[expert][down_index])
        assert len(sharding.local_experts) == (2 if expert_parallel else 4)
        assert sharding.local_intermediate == (6 if expert_parallel else 3)
    torch.testing.assert_close(total, expected)
