"""Prefill with Gemma 4 E2B's shared KV layers run on the rows read alone, against the same engine running them on
every row, side by side in one run.

E2B's layout (35 layers, a global layer every 5th, the last 20 reading layers 13 and 14's K/V, per-layer
embeddings) at a width that fits a CPU (``--hidden``), dummy weights; one prompt of ``--prompt`` tokens prefilled in
chunks of ``--chunk`` and one token sampled, timed end to end (``LLM.generate``). The baseline is the same engine
with `ModelRunner._reads_sampled_rows_only` answering no: the shared layers then see every row, as before.

Usage: ``python -m benchmarks.shared_kv_prefill [--prompt 2048] [--chunk 512] [--hidden 256] [--repeat 3]``; prints
one JSON line.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from unittest import mock

from engine import LLM, SamplingParams
from engine.registry import resolve_model
from engine.worker.model_runner import ModelRunner

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_e2b_layout(out: Path, hidden: int) -> None:
    """config.json of E2B's text model at width ``hidden`` (heads of hidden / 8, one KV head), the Qwen3 tokenizer."""
    from transformers import Gemma4TextConfig

    head = hidden // 8
    kinds = (["sliding_attention"] * 4 + ["full_attention"]) * 7
    Gemma4TextConfig(vocab_size=151936, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=35,
                     num_attention_heads=8, num_key_value_heads=1, head_dim=head, global_head_dim=2 * head,
                     layer_types=kinds, sliding_window=512, hidden_size_per_layer_input=hidden // 6,
                     vocab_size_per_layer_input=151936, num_kv_shared_layers=20, use_double_wide_mlp=True,
                     final_logit_softcapping=30.0, eos_token_id=151645, pad_token_id=0,
                     bos_token_id=151643).save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(resolve_model("qwen3-tiny") / name, out / name)


def prefill_seconds(path: Path, prompt: list[int], chunk: int, repeat: int) -> float:
    """The best of ``repeat`` prefills (each a fresh prompt: the prefix cache off)."""
    llm = LLM(str(path), load_format="dummy", block_size=16, num_kv_blocks=len(prompt) // 16 + 8,
              max_num_batched_tokens=chunk, enable_prefix_caching=False)
    best = float("inf")
    for _ in range(repeat + 1):  # the first one warms up
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        best = min(best, time.perf_counter() - start)
    llm.close()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    prompt = [100 + (7 * i) % 50_000 for i in range(args.prompt)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        write_e2b_layout(path, args.hidden)
        narrowed = prefill_seconds(path, prompt, args.chunk, args.repeat)
        with mock.patch.object(ModelRunner, "_reads_sampled_rows_only", lambda *_: False):
            every_row = prefill_seconds(path, prompt, args.chunk, args.repeat)
    print(json.dumps({"prompt": args.prompt, "chunk": args.chunk, "hidden": args.hidden,
                      "shared_layers_on_read_rows_s": round(narrowed, 3), "every_row_s": round(every_row, 3),
                      "speedup": round(every_row / narrowed, 2)}))


if __name__ == "__main__":
    main()
