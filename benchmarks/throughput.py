"""Offline throughput: the nano-vllm workload on kvserve and, in the same run, on HF transformers ``generate``.

The workload (nano-vllm's bench.py): random token prompts, input and output lengths drawn uniformly from a range,
``ignore_eos`` so every sequence produces exactly its output length. HF runs the same prompts the way a transformers
user would batch them: left-padded batches of ``--hf-batch-size`` in arrival order, ``max_new_tokens`` the batch's
longest (``--hf-order output-length`` sorts by output length first: an oracle no real user has, which minimizes
HF's padding waste). Both sides count only the tokens each sequence asked for, so waste shows as lower throughput.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm


@dataclass
class ThroughputWorkload:
    prompts: list[list[int]]
    output_lens: list[int]

    @classmethod
    def random(cls, num_seqs: int, min_len: int, max_len: int, vocab: int, seed: int) -> "ThroughputWorkload":
        rng = random.Random(seed)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_seqs)]
        return cls(prompts, [rng.randint(min_len, max_len) for _ in range(num_seqs)])

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class ThroughputResult:
    model: str
    hf_order: str
    tensor_parallel_size: int
    threads: int
    num_seqs: int
    input_tokens: int
    output_tokens: int
    kvserve_s: float
    hf_s: float | None
    kvserve_tokens_per_s: float
    hf_tokens_per_s: float | None
    ratio: float | None


def run_kvserve(model: str, work: ThroughputWorkload, args: argparse.Namespace) -> float:
    from engine import LLM, SamplingParams

    with LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
             max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_gb=args.kv_cache_memory_gb,
             tensor_parallel_size=args.tensor_parallel_size) as llm:
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in work.output_lens]
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up: first-call allocations off the clock
        start = time.perf_counter()
        outs = llm.generate(work.prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == work.output_lens
    return elapsed


@torch.inference_mode()
def run_hf(model: str, work: ThroughputWorkload, args: argparse.Namespace) -> float:
    from transformers import AutoModelForCausalLM

    from engine.registry import resolve_model

    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model(model)), dtype=getattr(torch, args.dtype))
    hf = hf.to(args.device).eval()
    order = list(range(len(work.prompts)))
    if args.hf_order == "output-length":
        order.sort(key=lambda i: work.output_lens[i])
    batches = [order[i : i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]
    start = time.perf_counter()
    for batch in tqdm(batches, desc="HF generate", unit="batch"):
        width = max(len(work.prompts[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, i in enumerate(batch):  # left padding, as decoder-only generation needs
            prompt = work.prompts[i]
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        new = max(work.output_lens[i] for i in batch)
        hf.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device), max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, pad_token_id=0)
    return time.perf_counter() - start


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registry name or model directory")
    parser.add_argument("--num-seqs", type=int, default=64, help="sequences in the workload (nano-vllm: 256)")
    parser.add_argument("--min-len", type=int, default=32, help="shortest input and output length (nano-vllm: 100)")
    parser.add_argument("--max-len", type=int, default=256, help="longest input and output length (nano-vllm: 1024)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="kvserve ranks (one process each)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="HF generate batch size")
    parser.add_argument("--hf-order", choices=("arrival", "output-length"), default="arrival",
                        help="how HF batches are formed: in arrival order, or sorted by output length (an oracle)")
    parser.add_argument("--skip-hf", action="store_true", help="measure kvserve only")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both sides (default: torch's, one per core; on a machine "
                             "shared with other work, 1 avoids threads waiting at every op for a preempted partner)")


def run(args: argparse.Namespace) -> dict:
    from engine.config import ModelConfig
    from engine.registry import resolve_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)  # process-wide: kvserve and HF run on the same pool
    vocab = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    work = ThroughputWorkload.random(args.num_seqs, args.min_len, args.max_len, vocab, args.seed)
    kv_s = run_kvserve(args.model, work, args)
    hf_s = None if args.skip_hf else run_hf(args.model, work, args)
    out = work.num_output_tokens
    result = ThroughputResult(
        model=args.model,
        hf_order=args.hf_order,
        tensor_parallel_size=args.tensor_parallel_size,
        threads=torch.get_num_threads(),
        num_seqs=args.num_seqs,
        input_tokens=sum(len(p) for p in work.prompts),
        output_tokens=out,
        kvserve_s=kv_s,
        hf_s=hf_s,
        kvserve_tokens_per_s=out / kv_s,
        hf_tokens_per_s=None if hf_s is None else out / hf_s,
        ratio=None if hf_s is None else hf_s / kv_s,
    )
    table = markdown_table(result)
    print("\n" + table)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "throughput.md").write_text(table)
    return asdict(result)


def markdown_table(r: ThroughputResult) -> str:
    lines = [
        f"{r.model}: {r.num_seqs} sequences, {r.input_tokens} input / {r.output_tokens} output tokens, "
        f"{r.threads} torch thread{'s' if r.threads > 1 else ''}",
        "",
        "| engine | time (s) | output tokens/s |",
        "|---|---:|---:|",
        f"| kvserve{f', {r.tensor_parallel_size} ranks' if r.tensor_parallel_size > 1 else ''} | {r.kvserve_s:.1f} | "
        f"{r.kvserve_tokens_per_s:.1f} |",
    ]
    if r.hf_s is not None:
        lines.append(f"| HF transformers generate (batches in {r.hf_order} order) | {r.hf_s:.1f} | {r.hf_tokens_per_s:.1f} |")
        lines += ["", f"kvserve / HF: {r.ratio:.2f}x"]
    return "\n".join(lines) + "\n"
