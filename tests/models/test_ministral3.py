"""Ministral 3 / Devstral Small 2 (``mistral3``: the released VLM layout, its language model served text only, the
Pixtral tower left on disk): greedy tokens and top-20 logprobs within 1e-4 of transformers'
``Mistral3ForConditionalGeneration`` in fp32, with prompts past the trained length so that Llama 4's query
temperature (``llama_4_scaling_beta``) takes part, which the test shows decides tokens. The config sweep (tests/config)
covers the cache scenarios over drawn ``ministral3`` and ``mistral3`` configurations."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.config.config_sweep import Drawn, write_checkpoint
from tests.hf_oracle import random_prompts
from tests.models.test_minimax_m2 import _hf_greedy

TEXT = dict(model_type="ministral3", vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
            tie_word_embeddings=False, sliding_window=None,
            rope_parameters=dict(type="yarn", rope_theta=1_000_000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                 mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=8,
                                 llama_4_scaling_beta=0.5))
CONFIG = dict(text_config=TEXT, tie_word_embeddings=False,
              vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=16, image_size=32, patch_size=8))
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(Drawn("mistral3", CONFIG, 4, ()), tmp_path_factory.mktemp("mistral3"), seed=5)


def test_greedy_and_top20_logprobs_equal_transformers(checkpoint: Path) -> None:
    from transformers import AutoModelForImageTextToText

    reference = AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    prompts = random_prompts(2000, [3, 11, 27, 40], seed=13)
    llm = LLM(str(checkpoint), block_size=4, num_kv_blocks=128, max_num_batched_tokens=7)
    expected = [_hf_greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert len({tuple(e) for e in expected}) == len(expected)
    llm.reset_prefix_cache()
    for prompt, out in zip(prompts, llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))):
        with torch.no_grad():
            ref = torch.log_softmax(reference(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
        top = out.outputs[0].logprobs[0].top
        ids = torch.tensor([t for t, _ in top])
        torch.testing.assert_close(torch.tensor([lp for _, lp in top]), ref[ids], atol=1e-4, rtol=0)


@pytest.mark.slow
def test_the_query_temperature_decides_tokens_past_the_trained_length(checkpoint: Path, tmp_path: Path) -> None:
    """The same weights without the temperature (beta 0) continue the long prompts differently: equality above
    therefore checks it."""
    plain = tmp_path / "plain"
    plain.mkdir()
    for source in checkpoint.iterdir():
        (plain / source.name).symlink_to(source)
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"]["rope_parameters"]["llama_4_scaling_beta"] = 0.0
    (plain / "config.json").unlink()
    (plain / "config.json").write_text(json.dumps(config))
    prompts = random_prompts(2000, [27, 40], seed=13)
    engine = dict(block_size=4, num_kv_blocks=128)
    scaled = [o.token_ids for o in LLM(str(checkpoint), **engine).generate(prompts, GREEDY)]
    unscaled = [o.token_ids for o in LLM(str(plain), **engine).generate(prompts, GREEDY)]
    assert all(a != b for a, b in zip(scaled, unscaled))
