"""The CUDA-graph decode path, run eagerly on CPU: decode batches padded to a capture size give the unpadded path's
greedy tokens on both backends, and padding rows never write a KV page (nor, in a hybrid model, a state row)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker.cuda_graphs import capture_sizes
from tests.hf_oracle import new_llm, random_prompts

BLOCK_SIZE = 4
# max_num_seqs 8 gives the sizes 1, 2, 4, 8: decode batches of 3, 5, 6 and 7 sequences are padded.
ENGINE = {"block_size": BLOCK_SIZE, "num_kv_blocks": 256, "max_num_seqs": 8}


def make_llm(backend: str, padded: bool, max_model_len: int = 64, model: str = "qwen3-tiny",
             **options) -> tuple[LLM, list[int]]:
    """An engine whose decode batches take the padded static-shape path when ``padded``; the returned list records
    the batch size of every call into that path."""
    llm = new_llm(model, attention_backend=backend, max_model_len=max_model_len, **ENGINE, **options)
    sizes: list[int] = []
    if padded:
        runner = llm.engine.runner
        graphs = runner.make_decode_graphs(runner.kv_caches, use_graphs=False)
        run = graphs.run

        def recording_run(size):
            sizes.append(runner.batch.num_rows)
            return run(size)

        graphs.run = recording_run
        runner.decode_graphs = graphs
    return llm, sizes


@pytest.mark.slow
def test_capture_sizes_and_padding_targets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64]
    llm, _ = make_llm("torch", padded=True)
    assert [llm.engine.runner.decode_graphs.padded_size(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]


@pytest.mark.parametrize(
    "backend, split_k, num_seqs, prompt_len, max_model_len, model",
    [
        ("torch", None, 7, 6, 64, "qwen3-tiny"),
        ("triton", None, 5, 6, 64, "qwen3-tiny"),  # interpreted: 5 rows are padded to 8, then 3 to 4
        # Forced split-K with contexts over one 64-position partition: the padded path's fixed max_context_len
        # (max_model_len) launches partitions past every context, which must contribute nothing.
        ("triton", "1", 3, 70, 160, "qwen3-tiny"),
        # A hybrid model: the recurrent kernels read each row's state row on the device, padding rows slot -1
        # (three rows, padded to four: the recurrent kernels interpreted are the slowest part of the suite)
        pytest.param("torch", None, 3, 6, 64, "qwen3.6-tiny", marks=pytest.mark.slow),
        pytest.param("triton", None, 3, 6, 64, "qwen3.6-tiny", marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_padded_decode_matches_unpadded_greedy_tokens(
    backend, split_k, num_seqs, prompt_len, max_model_len, model, monkeypatch
):
    if split_k is not None:
        monkeypatch.setenv("KVSERVE_SPLIT_K", split_k)
    prompts = random_prompts(50_000, [prompt_len + i for i in range(num_seqs)], seed=7)
    # Requests finish one step apart, so the decode batches shrink through num_seqs, ..., 1 sequences.
    max_tokens = list(range(2, num_seqs + 2))
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    tokens = {}
    for padded in (False, True):
        llm, sizes = make_llm(backend, padded, max_model_len, model)
        tokens[padded] = [o.token_ids for o in llm.generate(prompts, params)]
    assert sorted(set(sizes)) == list(range(1, num_seqs + 1))
    assert tokens[True] == tokens[False]
    assert [len(t) for t in tokens[True]] == max_tokens


@pytest.mark.slow
@pytest.mark.slow
def test_mtp_drafts_from_a_padded_decode_step():
    """--speculative mtp after a padded decode step (the CUDA-graph path: DeepSeek-V3 runs it, the hybrids do not):
    the MTP layer catches up on the real rows of the padded hidden states. With a draft budget of 4, batches of 7, 6
    and 5 sequences decode without drafts (padded), smaller ones verify the MTP drafts (eager); the drafts and the
    tokens equal the unpadded engine's."""
    prompts = random_prompts(50_000, [6 + i for i in range(7)], seed=7)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in range(3, 10)]
    runs = []
    for padded in (False, True):
        llm, sizes = make_llm("torch", padded, model="deepseek-v3-tiny", speculative="mtp", speculative_draft_budget=4)
        drafter = llm.engine.scheduler.drafter
        offers: list[tuple[int, list[int]]] = []
        drafter.offer = lambda seq_id, n, drafts, offer=drafter.offer: (offers.append((n, drafts)),
                                                                         offer(seq_id, n, drafts))
        runs.append(([o.token_ids for o in llm.generate(prompts, params)], sorted(offers)))
        assert drafter.stats["mtp"].verifications > 0
    assert {7, 6, 5} <= set(sizes)
    assert runs[1] == runs[0]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.slow
def test_padding_rows_write_no_kv_page(backend):
    llm, sizes = make_llm(backend, padded=True)
    engine, runner = llm.engine, llm.engine.runner
    for i, prompt in enumerate(random_prompts(50_000, [5, 9, 3], seed=11)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # prefill (eager): every request samples its first token
    assert sizes == []
    sequences = [engine.scheduler.sequences[f"r{i}"] for i in range(3)]
    expected = set()
    for seq in sequences:
        pos = seq.num_computed_tokens  # where this decode step's token goes
        table = engine.scheduler.kv.block_table(seq.seq_id)
        expected.add(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]

    engine.step()  # one decode step: 3 sequences padded to 4

    assert sizes == [3]
    changed = set()
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        for new, old in ((k, k0), (v, v0)):
            slot_changed = (new != old).flatten(2).any(-1).flatten()  # [num_blocks * block_size]
            changed |= set(slot_changed.nonzero().flatten().tolist())
    assert changed == expected


@pytest.mark.slow
def test_memory_profile_step_fits_contexts_shorter_than_the_token_budget(monkeypatch):
    # The profiled step splits its token budget into sequences no longer than max_model_len: RoPE covers only
    # max_model_len positions (one 40-token sequence would index past the 16-row table).
    llm = new_llm("qwen3-tiny", block_size=BLOCK_SIZE, num_kv_blocks=8, max_model_len=16, max_num_batched_tokens=40)
    runner = llm.engine.runner
    forward, seen = runner.model.forward, []

    def recording_forward(input_ids, positions, *args, **kwargs):
        seen.append(positions.tolist())
        return forward(input_ids, positions, *args, **kwargs)

    monkeypatch.setattr(runner.model, "forward", recording_forward)
    runner._profile_run()
    assert seen == [list(range(16)) * 2 + list(range(8))]  # the whole budget, as sequences of at most 16


@pytest.mark.slow
def test_padding_rows_write_no_state_row(monkeypatch):
    """A hybrid model's padded decode step changes the state rows of its three sequences (and the snapshots it
    takes) and no other. (The Triton kernels' padding rows: tests/kernels/test_recurrent.py.)"""
    llm, sizes = make_llm("torch", padded=True, model="qwen3.6-tiny")
    engine, runner = llm.engine, llm.engine.runner
    for i, prompt in enumerate(random_prompts(50_000, [5, 9, 3], seed=11)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()  # prefill (eager)
    expected = {engine.scheduler.kv.state_row(f"r{i}") for i in range(3)}
    copy_states = runner._copy_states
    monkeypatch.setattr(runner, "_copy_states", lambda copies: (expected.update(c.dst for c in copies),
                                                                 copy_states(copies)))
    layers = runner.kv_spec.state_layers(runner.kv_caches)
    before = [[s.clone() for s in layer] for layer in layers]
    engine.step()  # one decode step: 3 sequences padded to 4
    assert sizes == [3]
    changed = set()
    for layer, old in zip(layers, before):
        for new, was in zip(layer, old):
            changed |= set((new != was).flatten(1).any(-1).nonzero().flatten().tolist())
    assert changed == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model, options", [
    ("qwen3-tiny", {}),
    ("qwen3.6-tiny", {}),
    # MTP drafts after graph-replayed decode steps (a draft budget of 4: batches of 5 to 7 decode without drafts)
    ("deepseek-v3-tiny", {"speculative": "mtp", "speculative_draft_budget": 4}),
], ids=["qwen3-tiny", "qwen3.6-tiny", "deepseek-v3-tiny-mtp"])
def test_cuda_graph_decode_matches_eager(model, options):
    prompts = random_prompts(50_000, [5 + 3 * i for i in range(7)], seed=5)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in range(2, 9)]
    tokens = {}
    for eager in (True, False):
        llm = new_llm(model, device="cuda", attention_backend="triton", enforce_eager=eager, max_model_len=2048,
                  **ENGINE, **options)
        assert (llm.engine.runner.decode_graphs is None) == eager
        tokens[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        if options:
            assert llm.engine.scheduler.drafter.stats["mtp"].verifications > 0
    assert tokens[False] == tokens[True]
