"""Tensor parallelism when things go wrong: sizes the model or the machine cannot take fail before any process
starts, with what to choose instead; a worker that dies (at start-up, mid-generation, or while the engine idles)
ends the engine with the worker's error within seconds, never a hang, and leaves the process able to start again."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.core.loop import EngineLoop
from engine.errors import EngineDeadError, ParallelConfigError, WorkerDiedError
from engine.parallel.sizes import check_sizes
from engine.registry import resolve_model
from tests.hf_oracle import random_prompts

DEATH_SECONDS = 10  # a death is reported within this, start-up of the test engine excluded


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_dir(resolve_model(name))


def test_heads_that_do_not_split_fail_before_any_process_starts():
    with pytest.raises(ParallelConfigError, match=r"9 attention heads do not split over 2 ranks.*Sizes that fit: 1, 3"):
        LLM("smollm2-135m", tensor_parallel_size=2)
    assert not multiprocessing.active_children()


def test_more_ranks_than_gpus_says_how_many_are_visible():
    cfg = EngineConfig(device="cuda", tensor_parallel_size=2)
    with pytest.raises(ParallelConfigError, match=r"needs 2 GPUs \(cuda:0..cuda:1\).*but 1 is visible"):
        check_sizes(_config("qwen3-tiny"), cfg, num_gpus=1)
    check_sizes(_config("qwen3-tiny"), cfg, num_gpus=2)


def test_expert_parallel_needs_experts_and_splits_them():
    with pytest.raises(ParallelConfigError, match="needs a mixture-of-experts model"):
        check_sizes(_config("qwen3-tiny"), EngineConfig(tensor_parallel_size=2, enable_expert_parallel=True), 0)
    with pytest.raises(ParallelConfigError, match=r"8 experts do not split over 3 ranks"):
        check_sizes(_config("qwen3-moe-tiny"), EngineConfig(tensor_parallel_size=3, enable_expert_parallel=True), 0)


def _kill_first_worker_when_it_appears(deadline: float) -> None:
    while time.monotonic() < deadline:
        workers = [p for p in multiprocessing.active_children() if p.name.startswith("kvserve-tp-rank")]
        if workers:
            workers[0].kill()
            return
        time.sleep(0.01)


def test_disk_tier_under_tensor_parallelism_is_refused_with_what_works(tmp_path):
    with pytest.raises(ValueError, match="use the host tier"):
        EngineConfig(tensor_parallel_size=2, kv_offload_gb=0.01, kv_disk_dir=str(tmp_path))
    EngineConfig(tensor_parallel_size=2, kv_offload_gb=0.01)


@pytest.mark.slow
def test_worker_dying_at_start_up_fails_the_start():
    killer = threading.Thread(target=_kill_first_worker_when_it_appears, args=(time.monotonic() + 60,))
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        LLM("qwen3-tiny", tensor_parallel_size=2, num_kv_blocks=64)
    killer.join()
    assert time.monotonic() - start < DEATH_SECONDS
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_worker_killed_mid_generation_ends_it_with_the_workers_error():
    llm = LLM("qwen3-tiny", tensor_parallel_size=2, block_size=4, num_kv_blocks=512)
    worker = llm.engine.workers.processes[0]
    prompts = random_prompts(llm.engine.model_cfg.vocab_size, [7, 19, 30], seed=5)
    threading.Timer(1.0, worker.kill).start()  # generating 3 x 400 tokens takes far longer
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1 .* was killed by SIGKILL"):
        llm.generate(prompts, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    assert time.monotonic() - start < 1.0 + DEATH_SECONDS
    with pytest.raises(EngineDeadError, match="killed by SIGKILL"):  # and it stays dead: fails at once
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))
    llm.close()
    assert not multiprocessing.active_children()
    with LLM("qwen3-tiny", tensor_parallel_size=2, num_kv_blocks=64) as again:  # the process group was released
        assert again.generate(prompts[:1], SamplingParams(max_tokens=3, temperature=0))[0].token_ids


@pytest.mark.slow
def test_worker_dying_while_idle_turns_the_engine_unhealthy():
    with LLM("qwen3-tiny", tensor_parallel_size=2, num_kv_blocks=64) as llm:
        died: list[BaseException] = []
        loop = EngineLoop(llm.engine, on_death=died.append)
        loop.start()
        assert loop.alive
        llm.engine.workers.processes[0].kill()
        deadline = time.monotonic() + DEATH_SECONDS
        while loop.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not loop.alive
        assert isinstance(loop.error, WorkerDiedError) and died == [loop.error]
        with pytest.raises(EngineDeadError):
            loop.submit([], sink=None).result(timeout=1)
        loop.shutdown(timeout=DEATH_SECONDS)


@pytest.mark.slow
def test_a_script_without_a_main_guard_starts_its_workers(tmp_path):
    """Workers never import the caller's script: `LLM(tensor_parallel_size=2)` at a script's top level (no
    `if __name__ == "__main__":`) generates, instead of every worker building its own LLM and dying with
    multiprocessing's bootstrapping error."""
    script = tmp_path / "no_main_guard.py"
    script.write_text(
        "from engine import LLM, SamplingParams\n"
        "llm = LLM('qwen3-tiny', tensor_parallel_size=2, num_kv_blocks=64)\n"
        "[out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))\n"
        "print('generated', len(out.token_ids))\n"
        "llm.close()\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0 and "bootstrapping" not in result.stderr, result.stderr[-3000:]
    assert "generated 3" in result.stdout
