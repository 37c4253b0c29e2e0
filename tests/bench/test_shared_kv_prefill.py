"""benchmarks/shared_kv_prefill.py: the layout it times is E2B's (35 layers, the last 20 reading layers 13 and 14's
K/V), and both engines it compares give the same token."""
from __future__ import annotations

from unittest import mock

import pytest

from benchmarks.shared_kv_prefill import write_e2b_layout
from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.worker.model_runner import ModelRunner


@pytest.mark.slow  # transformers' config class and a tokenizer copied
def test_the_timed_layout_is_e2bs(tmp_path):
    write_e2b_layout(tmp_path, hidden=64)
    cfg = ModelConfig.from_dir(tmp_path).gemma4
    assert cfg.num_kv_layers == 15 and cfg.double_wide_mlp and cfg.per_layer_inputs is not None
    assert cfg.kv_sources[15:] == tuple(14 if i % 5 == 4 else 13 for i in range(15, 35))


@pytest.mark.slow  # two engines
def test_the_baseline_computes_the_same_token(tmp_path):
    """With dummy weights the shared layers on the sampled rows alone and on every row sample the same token."""
    write_e2b_layout(tmp_path, hidden=64)
    prompt, greedy = list(range(100, 164)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)

    def run() -> list[int]:
        with LLM(str(tmp_path), load_format="dummy", block_size=16, num_kv_blocks=16,
                 max_num_batched_tokens=24) as llm:
            return llm.generate([prompt], greedy)[0].token_ids

    narrowed = run()
    with mock.patch.object(ModelRunner, "_reads_sampled_rows_only", lambda *_: False):
        assert run() == narrowed
