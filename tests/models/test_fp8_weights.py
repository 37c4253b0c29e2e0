"""FP8 block-scaled checkpoints: a tiny model quantized here (DeepSeek-V3 / Qwen3-FP8 layout) loads, matches
transformers on the same directory, and stays within a stated logprob distance of the fp32 original.

Stated distances (tests/models/checkpoints/logprob_drift.py: teacher-forced, 10 prompts x 10 tokens, top-20 logprobs), measured
with 32 x 32 blocks (the tiny models' 64/128-wide projections in whole blocks; real checkpoints use 128 x 128):

    model           mean |dlogprob|  max |dlogprob|  same argmax   (the same model in bf16: mean, max, argmax)
    qwen3-tiny      0.083            0.93            72%           (0.017, 0.11, 92%)
    deepseek-tiny   0.47             2.95            62%           (0.11, 0.94, 91%)

The bounds below leave about 1.5x of room. Random tiny models have a flat top over a 150k vocabulary, so their
greedy choice flips easily; the logprob distance is the measure that carries over to real models.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from engine import LLM, SamplingParams
from engine.models.layers.quant import Fp8Format, Fp8Linear
from engine.registry import resolve_model
from kernels.cpu.linear import PackedLinear
from kernels.reference import dequantize_fp8_blocks, quantize_fp8_blocks
from tests.hf_oracle import hf_greedy, hf_model, random_prompts
from tests.models.checkpoints.fp8_checkpoint import write_fp8_checkpoint
from tests.models.checkpoints.logprob_drift import logprob_drift

BLOCK = (32, 32)
LENGTHS = [1, 3, 4, 5, 8, 15, 16, 17, 33, 64]
NEW_TOKENS = 10


@dataclass(frozen=True)
class Bound:
    mean: float
    max: float
    argmax_agreement: float


STATED = {"qwen3-tiny": Bound(0.15, 1.5, 0.6), "deepseek-tiny": Bound(0.75, 4.5, 0.5)}


@pytest.fixture(scope="module", params=sorted(STATED))
def fp8_case(request, tmp_path_factory):
    name = request.param
    fp8_dir = tmp_path_factory.mktemp("fp8") / f"{name}-fp8"
    write_fp8_checkpoint(resolve_model(name), fp8_dir, BLOCK)
    original = LLM(name, block_size=4, num_kv_blocks=1024)
    prompts = random_prompts(original.engine.model_cfg.vocab_size, LENGTHS, seed=1)
    return name, fp8_dir, original, prompts


def _linears(llm: LLM) -> dict[str, nn.Module]:
    return {n: m for n, m in llm.engine.runner.model.named_modules() if n.endswith("_proj")}


@pytest.mark.slow
def test_fp8_checkpoint_stays_within_the_stated_logprob_distance(fp8_case):
    name, fp8_dir, original, prompts = fp8_case
    fp8 = LLM(str(fp8_dir), block_size=4, num_kv_blocks=1024)
    # On a CPU every quantized projection was dequantized on load into a dense layer of the engine dtype (which the
    # "cpu" op set then packs for oneDNN).
    dense = (nn.Linear, PackedLinear)
    assert all(type(m) in dense and m.weight.dtype == torch.float32 for m in _linears(fp8).values())
    drift = logprob_drift(original, fp8, prompts, NEW_TOKENS)
    bound = STATED[name]
    assert drift.mean_abs <= bound.mean and drift.max_abs <= bound.max, drift
    assert drift.argmax_agreement >= bound.argmax_agreement, drift
    assert drift.max_abs > 0  # it is a different model: the weights did lose precision


@pytest.mark.slow
def test_fp8_checkpoint_matches_transformers_loading_the_same_directory(fp8_case):
    """transformers (with accelerate) loads these directories on CPU by dequantizing them, as kvserve does there:
    greedy tokens equal and final-position top-20 logprobs within 2e-4, as for unquantized models."""
    _, fp8_dir, _, prompts = fp8_case
    llm = LLM(str(fp8_dir), block_size=4, num_kv_blocks=1024)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == [hf_greedy(str(fp8_dir), p, NEW_TOKENS) for p in prompts]
    model = hf_model(str(fp8_dir))
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        ids = torch.tensor([t for t, _ in out.outputs[0].logprobs[0].top])
        got = torch.tensor([lp for _, lp in out.outputs[0].logprobs[0].top])
        torch.testing.assert_close(got, ref[ids], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("block, generate", [(BLOCK, True), ((48, 48), False)])
@pytest.mark.slow
def test_triton_backend_keeps_fp8_weights_and_runs_the_fp8_gemm(block, generate, tmp_path):
    """With the Triton kernels (the interpreter here, a GPU in production) quantized projections stay e4m3 and
    hold exactly the values the dequantizing loader produces. 48 x 48 blocks leave partial edge blocks and put block
    edges inside the fused q/k/v and gate/up shards, so those keep one scale row per output row (the kernel tests
    run the GEMM that way; one interpreted generation here is enough)."""
    fp8_dir = tmp_path / "fp8"
    write_fp8_checkpoint(resolve_model("qwen3-tiny"), fp8_dir, block)
    dequantized = _linears(LLM(str(fp8_dir), block_size=4, num_kv_blocks=64))
    llm = LLM(str(fp8_dir), block_size=4, num_kv_blocks=64, attention_backend="triton")
    kept = _linears(llm)
    assert set(kept) == set(dequantized) and len(kept) == 8  # qkv, o, gate_up, down in two layers
    for name, module in kept.items():
        assert isinstance(module, Fp8Linear) and module.weight.dtype == torch.float8_e4m3fn
        fused = name.endswith(("qkv_proj", "gate_up_proj"))
        assert (module.scale_rows, module.block_k) == ((1 if fused and block == (48, 48) else block[0]), block[1])
        values = dequantize_fp8_blocks(module.weight, module.weight_scale_inv, (module.scale_rows, module.block_k))
        assert torch.equal(values, dequantized[name].weight), name
    if generate:  # the GEMM quantizes activations too; greedy decoding runs end to end, prompt-dependent
        prompts = random_prompts(50_000, [3, 17], seed=2)
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert all(len(o.token_ids) == 4 for o in outs) and outs[0].token_ids != outs[1].token_ids


@pytest.mark.slow
def test_transformers_rejects_partial_edge_blocks_that_kvserve_loads(tmp_path):
    """What we found: transformers 5.x dequantizes only weights whose shape the scale grid divides evenly, while
    real checkpoints have partial edge blocks (DeepSeek-V3's 576-row kv_a_proj_with_mqa has 5 scale rows of 128)."""
    from transformers import AutoModelForCausalLM

    fp8_dir = tmp_path / "fp8"
    write_fp8_checkpoint(resolve_model("qwen3-tiny"), fp8_dir, (48, 48))
    with pytest.raises(Exception, match="conversion"):
        AutoModelForCausalLM.from_pretrained(str(fp8_dir), dtype=torch.float32)
    assert LLM(str(fp8_dir), block_size=4, num_kv_blocks=64).generate([[1, 2, 3]])[0].token_ids


@pytest.mark.parametrize("quant, message", [
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "only e4m3"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static FP8"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
])
def test_unsupported_quantization_configs_are_refused_clearly(quant, message):
    with pytest.raises(ValueError, match=message):
        Fp8Format.from_config({"quantization_config": quant})
    assert Fp8Format.from_config({}) is None
    assert Fp8Format.from_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}) \
        == Fp8Format(128, 64)


def test_power_of_two_scales_stored_as_e8m0_read_like_float32():
    """DeepSeek-V3.1 (scale_fmt ue8m0) keeps power-of-two weight scales; some checkpoints store them as e8m0."""
    values, scale_inv = quantize_fp8_blocks(torch.randn(40, 24), (16, 16))
    pow2 = 2.0 ** scale_inv.log2().ceil()
    fmt = Fp8Format(16, 16)
    as_e8m0 = fmt.dequantize("w_scale_inv", values, pow2.to(torch.float8_e8m0fnu), torch.float32)
    assert torch.equal(as_e8m0, fmt.dequantize("w_scale_inv", values, pow2, torch.float32))


@pytest.mark.slow
def test_broken_fp8_checkpoints_fail_with_the_tensor_named(tmp_path):
    from safetensors.torch import load_file, save_file

    fp8_dir = tmp_path / "fp8"
    write_fp8_checkpoint(resolve_model("qwen3-tiny"), fp8_dir, BLOCK)
    scales_file = fp8_dir / "model-00002-of-00002.safetensors"
    scales = load_file(str(scales_file))
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    scales[name] = scales[name][:, :1].contiguous()  # wrong grid
    save_file(scales, str(scales_file))
    for backend in ("torch", "triton"):  # dequantized on load, or kept in FP8
        with pytest.raises(ValueError, match=r"down_proj.weight_scale_inv: shape \(2, 1\) does not block"):
            LLM(str(fp8_dir), block_size=4, num_kv_blocks=64, attention_backend=backend)
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="float8_e4m3fn but .* no FP8 quantization_config"):
        LLM(str(fp8_dir), block_size=4, num_kv_blocks=64)
