"""DeepSeek-V4 (sliding window + compressed sparse / heavily compressed attention, hyper-connections, hash and
sqrt-softplus MoE) equals transformers' ``DeepseekV4ForCausalLM`` on deepseek-v4-tiny (window 16, CSA windows of 4
with the top 4 entries, HCA pools of 16), prompts up to three windows long, with every layer's keys in the window
group's pages (NaN in every page nobody holds during each step) and the compressed entries and pooling state in the
full-attention blocks: one at a time, together, with the prefix cache hot, in chunks with preemption, over two
tensor-parallel ranks, top-20 logprobs within 1e-4, and an agent conversation whose next turn reads the last from the
cache. Released V4-Flash's pages per token, before and after the window group, on the meta device."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models.kv_cache_spec import BlockTensor
from tests.config.config_sweep import MIN_MARGIN, hf_greedy_with_margin, write_v4_of_transformers_defaults
from tests.hf_oracle import (
    assert_greedy_alone_and_together, assert_greedy_cache_hot, assert_greedy_through_preemption,
    assert_top_logprobs_equal_hf, assert_varied, hf_greedy, random_prompts,
)
from tests.models.test_sliding_window_cache import poisoned_llm

NAME = "deepseek-v4-tiny"
BLOCK = 16  # a multiple of the largest compression rate (16 here, 128 in the real models)
LENGTHS = [1, 15, 17, 33, 50]  # one token, under and across the window (16), pools of 4 and 16
NEW = 8


@pytest.fixture(scope="module")
def case():
    prompts = random_prompts(50_000, LENGTHS, seed=5)
    return prompts, [hf_greedy(NAME, p, NEW) for p in prompts]


@pytest.mark.slow
def test_pages_hold_keys_in_the_window_group_entries_and_pooling_state_in_blocks() -> None:
    llm = LLM(NAME, block_size=BLOCK, num_kv_blocks=8, num_window_blocks=12)
    spec, caches = llm.engine.runner.kv_spec, llm.engine.runner.kv_caches
    # sliding layer: keys; CSA (rate 4): keys, entries, index entries, two pooling states; HCA (rate 16): keys,
    # entries, pooling state. The keys in the window group's 12 pages, the rest in the 8 blocks
    assert spec.in_window_group() == [(True,), (True,) + (False,) * 4, (True, False, False), (True,) + (False,) * 4]
    # entries: a row of the head (32, the indexer's too) per pool, block / rate of them a block
    assert [tuple(t.shape) for t in caches[1]] == [(12, 16, 1, 32), (8, 4, 32), (8, 4, 32), (8, 9 * 32), (8, 9 * 32)]
    assert [tuple(t.shape) for t in caches[2]] == [(12, 16, 1, 32), (8, 1, 32), (8, 3 * 32)]
    assert spec.layers[2][2] == BlockTensor((96,), per_block=True, fp32=True, whole_context=True)
    assert spec.window_bytes_per_block(BLOCK, torch.float32) == 4 * BLOCK * 32 * 4
    # the tiers copy the blocks' tensors alone by block id; window page ids index the keys
    assert [len(layer) for layer in spec.block_layers(caches, window_group=True)] == [4, 2, 4]
    assert [(len(layer), layer[0] is keys[0]) for layer, keys in zip(spec.window_layers(caches), caches)] == \
        [(1, True)] * 4
    off = LLM(NAME, block_size=BLOCK, num_kv_blocks=8, sliding_window_cache=False).engine.runner
    assert [tuple(layer[0].shape) for layer in off.kv_caches] == [(8, 16, 1, 32)] * 4
    with pytest.raises(ValueError, match="multiple of 16"):
        LLM(NAME, block_size=8, num_kv_blocks=8)


def test_the_pages_of_v4_flash_for_a_100k_token_session():
    """V4-Flash built on the meta device (bf16, blocks of 128): every token's keys (43 layers x 512) were 44,032 of
    its 55,652 bytes; in the window group a sequence keeps the compressed entries and pooling state of every token
    (11,620 bytes) and three pages of keys (its 128-token window, the block its last boundary's window starts in, the
    block it writes): 4.7x less for a 100k-token session (docs/SLIDING_WINDOW.md, docs/DEEPSEEK.md)."""
    from tests.config.test_model_config import DEEPSEEK_V4_FLASH, _meta_model

    spec, bf16, block, context = _meta_model(DEEPSEEK_V4_FLASH).kv_cache_spec(), torch.bfloat16, 128, 100_000
    page = spec.window_bytes_per_block(block, bf16)
    assert spec.bytes_per_token(bf16, block) == 55_652 and page == 43 * 512 * 2 * block
    full = spec.bytes_per_token(bf16, block) - page // block
    assert full == 11_620
    running = -(-(spec.window - 1) // block) + 2
    session = (context * full + running * page) / context
    retained = session + -(-(spec.window - 1) // block) * page / context
    assert (running, round(session), round(retained)) == (3, 11_789, 11_845)
    assert round(55_652 / session, 1) == 4.7


@pytest.mark.slow
def test_a_configuration_of_transformers_defaults_runs_with_no_flags(tmp_path) -> None:
    """Prompts under, across and well past a pool of 128 and the window, one at a time (in order, cache on),
    together and hot, with the block size the engine picks itself: transformers' tokens, none of them a near-tie."""
    hf = write_v4_of_transformers_defaults(tmp_path)
    prompts = random_prompts(50_000, [3, 17, 64, 140, 300], seed=47)
    prompts.append(prompts[-1] + random_prompts(50_000, [17], seed=51)[0])
    refs = [hf_greedy_with_margin(hf, p, NEW) for p in prompts]
    assert min(margin for _, margin in refs) >= MIN_MARGIN
    expected = [tokens for tokens, _ in refs]

    llm = LLM(str(tmp_path), num_kv_blocks=32)
    assert llm.engine.cfg.block_size == 128  # the least V4's pools of 128 allow, chosen without a flag
    greedy = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    one_by_one = [llm.generate([p], greedy)[0] for p in prompts]
    assert [o.token_ids for o in one_by_one] == expected
    assert one_by_one[-1].num_cached_tokens == 256  # 300 + 17 resumes after the 300's two whole blocks
    together = llm.generate(prompts, greedy)
    assert [o.token_ids for o in together] == expected
    assert [o.num_cached_tokens for o in together] == [(len(p) - 1) // 128 * 128 for p in prompts]


@pytest.mark.slow
def test_outputs_are_varied(case) -> None:
    _, expected = case
    assert_varied(expected, 5)


@pytest.mark.parametrize("block_size", [BLOCK, 2 * BLOCK])
@pytest.mark.fast_cases("16")  # V4's fast parity case (the sweep's V4 draws are slow)
def test_greedy_one_at_a_time_together_and_cache_hot(case, block_size) -> None:
    """Blocks of the window (16) and of two windows (32); the prompts' hits resume on windows retained at their
    prompt ends or still cached. 12 window pages beside 64 blocks: the window pool reuses its pages while blocks are
    fresh, so keys read or written through the blocks' table would miss (V4 reading ``meta`` instead of
    ``meta.window`` fails here)."""
    prompts, expected = case
    llm = poisoned_llm(NAME, block_size, num_kv_blocks=64, num_window_blocks=12, max_num_batched_tokens=256)
    assert_greedy_alone_and_together(llm, prompts, expected)
    assert_greedy_cache_hot(llm, prompts, expected, block_size)


@pytest.mark.slow
def test_chunked_prefill_and_preemption() -> None:
    """7 tokens a step (chunks end mid-window and mid-block), 8 blocks and 6 window pages for 4 requests needing 13
    blocks and, running together, 12 window pages: prefills run in chunks beside decodes, and running requests are
    preempted and recomputed from their cached blocks and windows."""
    prompts = random_prompts(50_000, [40, 29, 51, 18], seed=9)
    llm = poisoned_llm(NAME, BLOCK, num_kv_blocks=8, num_window_blocks=6, max_num_batched_tokens=7)
    assert_greedy_through_preemption(llm, prompts, [hf_greedy(NAME, p, 10) for p in prompts])


@pytest.mark.slow
def test_top20_logprobs_within_1e_4() -> None:
    prompts = random_prompts(50_000, [6, 37, 66], seed=7)
    llm = LLM(NAME, block_size=BLOCK, num_kv_blocks=64, max_num_batched_tokens=24)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    for prompt, out in zip(prompts, outs):
        assert_top_logprobs_equal_hf(NAME, prompt, out.outputs[0].logprobs[0].top, atol=1e-4)


@pytest.mark.slow
def test_agent_turn_reads_the_previous_prompt_and_reply_from_the_cache() -> None:
    """An agent's second turn (the V4 encoder's rendering: the first prompt, the reply, the next user message)
    finds the first prompt and the reply in the cache, up to the last partial block, and continues as
    transformers does."""
    from server.rendering import get_renderer
    from transformers import AutoTokenizer

    from engine.registry import resolve_model

    renderer = get_renderer("deepseek-v4")
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(NAME)))
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                               "parameters": {"type": "object", "properties": {
                                                   "path": {"type": "string"}}, "required": ["path"]}}}]
    first = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the bug."}]
    prompt = renderer.render(first, tools)
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    llm = LLM(NAME, block_size=BLOCK, num_kv_blocks=64)
    assert llm.engine.runner.window_group and len(ids) > 4 * BLOCK  # the keys' windows, many windows back
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reply = llm.generate([ids], greedy)[0]
    text = tokenizer.decode(reply.token_ids)
    second = renderer.render(first + [{"role": "assistant", "content": text},
                                      {"role": "user", "content": "Now run the tests."}], tools)
    assert second.startswith(prompt + text)  # V4's rendering only appends
    follow = ids + reply.token_ids + tokenizer(second[len(prompt + text):], add_special_tokens=False).input_ids
    out = llm.generate([follow], greedy)[0]
    assert out.num_cached_tokens >= len(ids) + len(reply.token_ids) - BLOCK
    assert out.token_ids == hf_greedy(NAME, follow, greedy.max_tokens)


@pytest.mark.slow
def test_tensor_parallel_2_equals_one_rank() -> None:
    """Experts and the vocabulary split over two ranks (gloo), attention replicated: the same tokens, logprobs
    within 1e-4, on a batch with chunked prefills and prefix hits."""
    prompts = random_prompts(50_000, [20, 45, 9], seed=13)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    runs = []
    for size in (1, 2):
        with LLM(NAME, block_size=BLOCK, num_kv_blocks=32, max_num_batched_tokens=24,
                 tensor_parallel_size=size) as llm:
            llm.generate(prompts[:1], SamplingParams(max_tokens=1))
            runs.append(llm.generate(prompts, params))
    single, parallel = runs
    assert [o.num_cached_tokens for o in parallel] == [o.num_cached_tokens for o in single]
    assert parallel[0].num_cached_tokens == 16
    assert [o.token_ids for o in parallel] == [o.token_ids for o in single]
    lp = [(a.logprob, b.logprob) for x, y in zip(single, parallel)
          for a, b in zip(x.outputs[0].logprobs, y.outputs[0].logprobs)]
    assert max(abs(a - b) for a, b in lp) < 1e-4


@pytest.mark.slow
def test_fp4_experts_and_fp8_projections_load_dequantized(tmp_path) -> None:
    """DeepSeek's release format: FP4 routed experts (UE8M0 scales per row and 32 columns) and FP8 block-scaled
    projections, dequantized on load on a CPU, give exactly the tokens and logprobs of the same values stored in
    fp32, and the quantization really changed the weights."""
    from engine.registry import resolve_model
    from tests.models.checkpoints.fp8_checkpoint import write_v4_fp8_fp4_checkpoint

    quantized, plain = tmp_path / "fp4", tmp_path / "plain"
    write_v4_fp8_fp4_checkpoint(resolve_model(NAME), quantized, plain, (16, 16))
    prompts = random_prompts(50_000, [30], seed=17)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)
    runs = [LLM(str(d), block_size=BLOCK, num_kv_blocks=16).generate(prompts, params)[0] for d in (quantized, plain)]
    assert runs[0].token_ids == runs[1].token_ids
    assert [lp.top for lp in runs[0].outputs[0].logprobs] == [lp.top for lp in runs[1].outputs[0].logprobs]
    original = LLM(NAME, block_size=BLOCK, num_kv_blocks=16).generate(prompts, params)[0]
    assert original.outputs[0].logprobs[0].top != runs[0].outputs[0].logprobs[0].top
    # Where the FP8 GEMM runs (Triton; here its interpreter) projections keep their FP8 bytes, but the grouped
    # output projection, which has a GEMM of its own, is dequantized.
    from engine.models.deepseek_v4 import GroupedLinear
    from engine.models.layers.quant import Fp8Linear

    attn = LLM(str(quantized), block_size=BLOCK, num_kv_blocks=16, attention_backend="triton").engine.runner.model \
        .layers[1].self_attn
    assert isinstance(attn.q_a_proj, Fp8Linear) and type(attn.o_a_proj) is GroupedLinear


@pytest.mark.slow
def test_directory_written_by_transformers_save_pretrained(tmp_path) -> None:
    """transformers writes DeepSeek's own tensor names (``attn.wq_a``, ``ffn.experts.0.w1``, ``hc_attn_fn``); the
    engine reads them into its modules."""
    from engine.registry import resolve_model
    from tests.hf_oracle import hf_model
    from tests.models.test_moe_mla_models import _save_pretrained_copy

    model_dir = _save_pretrained_copy(hf_model(NAME), resolve_model(NAME), tmp_path / NAME)
    prompts = random_prompts(50_000, [7, 35], seed=31)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = LLM(str(model_dir), block_size=BLOCK, num_kv_blocks=32).generate(prompts, params)
    assert [o.token_ids for o in outs] == [hf_greedy(NAME, p, params.max_tokens) for p in prompts]


@pytest.mark.slow
def test_checkpoint_with_an_mtp_layer_loads(tmp_path) -> None:
    """Released V4 checkpoints carry one multi-token-prediction layer (``mtp.0.*``), which decoding does not use:
    the checkpoint loads as it is and generates as without it."""
    import json
    import os

    from safetensors import safe_open
    from safetensors.torch import save_file

    from engine.registry import resolve_model

    src, dst = resolve_model(NAME), tmp_path / "with-mtp"
    dst.mkdir()
    for f in src.iterdir():
        os.symlink(f, dst / f.name)
    mtp = {"mtp.0.attn.wq_a.weight": torch.ones(48, 64), "mtp.0.enorm.weight": torch.ones(64),
           "mtp.0.ffn.experts.0.w1.weight": torch.ones(32, 64), "mtp.0.hc_head_fn": torch.ones(4, 256)}
    save_file(mtp, str(dst / "mtp.safetensors"))
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = {"model.safetensors": list(f.keys()), "mtp.safetensors": list(mtp)}
    index = {"metadata": {}, "weight_map": {name: file for file, keys in names.items() for name in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    prompt = random_prompts(50_000, [20], seed=23)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = [LLM(str(d), block_size=BLOCK, num_kv_blocks=8).generate(prompt, greedy)[0].token_ids for d in (src, dst)]
    assert outs[0] == outs[1]


@pytest.mark.slow
def test_triton_backend_matches_torch() -> None:
    """The Triton op set (under the interpreter on CPU: sink attention, MoE, norms, stores) gives the torch
    backend's tokens on a mixed batch with chunked prefills and a prefix hit."""
    prompts = random_prompts(50_000, [35, 6, 20], seed=29)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(NAME, block_size=BLOCK, num_kv_blocks=32, max_num_batched_tokens=12, attention_backend=backend)
        llm.generate(prompts[:1], SamplingParams(max_tokens=1))
        outs = llm.generate(prompts, params)
        assert outs[0].num_cached_tokens == 32
        results[backend] = [o.token_ids for o in outs]
    assert results["triton"] == results["torch"]


@pytest.mark.slow
def test_fp8_kv_pages() -> None:
    """--kv-cache-dtype fp8: keys and compressed entries in e4m3 pages, the pooling state kept in fp32."""
    llm = LLM(NAME, block_size=BLOCK, num_kv_blocks=16, kv_cache_dtype="fp8")
    assert [t.dtype for t in llm.engine.runner.kv_caches[2]] == [torch.float8_e4m3fn] * 2 + [torch.float32]
    prompts = random_prompts(50_000, [40, 23], seed=37)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert all(len(set(o.token_ids)) > 3 for o in outs)
    assert llm.engine.runner.kv_caches[2][1].float().abs().sum() > 0  # entries were written


@pytest.mark.parametrize("window_group", [pytest.param(False, id="keys-in-blocks"),
                                          pytest.param(True, id="window-group", marks=pytest.mark.slow)])
def test_host_tier_carries_entries_and_pooling_state(window_group: bool) -> None:
    """A prompt evicted to the host pool and hit again: its blocks come back with their keys, compressed entries
    and pooling state, and it continues exactly as when computed. With the window group (the default) the keys are
    in window pages, which the host tier carries as retained windows (docs/SLIDING_WINDOW.md): the same hit."""
    llm = LLM(NAME, block_size=BLOCK, num_kv_blocks=6, kv_offload_gb=0.01, sliding_window_cache=window_group)
    a, b = random_prompts(50_000, [70, 70], seed=41)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = llm.generate([a], greedy)[0]
    llm.generate([b], greedy)  # the pool holds one prompt: a's blocks move to the host pool
    again = llm.generate([a], greedy)[0]
    assert again.token_ids == first.token_ids == hf_greedy(NAME, a, greedy.max_tokens)
    assert again.num_cached_tokens == 64 and llm.stats.kv_restore_bytes > 0
