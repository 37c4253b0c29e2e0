"""``kvserve bench spec``: speculative decoding at batch 1, each proposer against no speculation, in one run.

Two workloads, greedy, one request at a time (an agent's own loop):

- edit: a source file and an instruction to change one name in it ("reply with the whole file"): the reply echoes
  most of the prompt, the case prompt lookup and suffix decoding are for.
- agent: Claude Code-shaped sessions (benchmarks/prefix/agent_workloads.py: system blocks, tool calls, tool results
  of code, logs and listings), flattened into the model's own chat template; turn after turn of one session, so the
  suffix proposer drafts from the session's earlier prompts and replies.

Every request runs once per method in turn (the order rotating), each method with a cache salt of its own, so no
method reads another's prefix cache or session text, and the load of a shared machine falls on all alike. The
outputs must be identical across methods (greedy); the figures are each method's output tokens/s end to end
(prefill included) and while decoding (after the first token, where speculation acts), their ratios to `off`, the
process's CPU seconds (robust to other processes' load), the drafts' acceptance rate and the mean accepted length
(tokens per verification step).

On CPU torch runs on ``--threads`` threads (default 1): on a shared machine a second OpenMP thread spins while its
core runs someone else's work, and a step of small matrix products then costs tens of times its compute.
"""
from __future__ import annotations

import argparse
import os
import time

from benchmarks.prefix.report import markdown_table
from benchmarks.prefix.text import TextGen

METHODS = ("off", "ngram", "suffix")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="registry model (default: smollm2-135m, real weights)")
    parser.add_argument("--workload", choices=("edit", "agent", "all"), default="all")
    parser.add_argument("--requests", type=int, default=4, help="edit tasks / agent turns per workload (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per reply at most (default: 128)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per step (default: 4)")
    parser.add_argument("--code-lines", type=int, default=24, help="lines of the edited file (default: 24)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU: torch threads (default 1: robust on a shared machine, see the module docstring)")


def edit_prompts(n: int, lines: int, seed: int) -> list[tuple[str, list[dict]]]:
    gen = TextGen(seed)
    prompts = []
    for i in range(n):
        code = gen.code(lines)
        name = code.split("def ", 1)[1].split("(", 1)[0]
        instruction = (f"Here is a Python file:\n```python\n{code}\n```\nRename the function `{name}` to "
                       f"`{name}_v2`. Reply with the whole updated file only.")
        prompts.append((f"edit{i}", [{"role": "user", "content": instruction}]))
    return prompts


def _flatten(message: dict) -> dict:
    """One chat message as plain text (small models' templates know no tool calls or content parts)."""
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        content += f"\n<tool_call>{fn.get('name')} {fn.get('arguments')}</tool_call>"
    role = message.get("role", "user")
    if role == "tool":
        role, content = "user", f"Tool result:\n{content}"
    elif role not in ("user", "assistant", "system"):
        role = "user"
    return {"role": role, "content": content}


def agent_prompts(n: int, seed: int) -> list[tuple[str, list[dict]]]:
    from benchmarks.prefix.agent_workloads import claude_code
    from benchmarks.prefix.workloads import WorkloadParams

    params = WorkloadParams(seed=seed, head_words=150, tasks=2, steps_per_task=max(1, n // 2), result_words=(40, 160),
                            reasoning_words=(5, 15))
    requests = claude_code(params).requests[:n]
    return [(r.session, [_flatten(m) for m in r.messages]) for r in requests]


def run(args: argparse.Namespace) -> dict:
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, num_kv_blocks=1024, block_size=16, num_speculative_tokens=args.num_speculative_tokens)
    workloads = {"edit": lambda: edit_prompts(args.requests, args.code_lines, args.seed),
                 "agent": lambda: agent_prompts(args.requests, args.seed)}
    names = list(workloads) if args.workload == "all" else [args.workload]
    load_before = os.getloadavg()
    report: dict = {"model": args.model, "max_tokens": args.max_tokens, "k": args.num_speculative_tokens,
                    "threads": args.threads, "workloads": {}}
    for name in names:
        report["workloads"][name] = _run_workload(llm, workloads[name](), args.max_tokens, SamplingParams)
    report["load_average"] = [round(x, 2) for x in (*load_before, *os.getloadavg())]
    print(_markdown(report))
    return report


def _run_workload(llm, prompts: list[tuple[str, list[dict]]], max_tokens: int, SamplingParams) -> dict:
    figures = {m: {"seconds": 0.0, "tokens": 0, "decode_seconds": 0.0, "cpu_seconds": 0.0} for m in METHODS}
    outputs: dict[str, list[list[int]]] = {m: [] for m in METHODS}
    spec = llm.engine.scheduler.drafter
    for i, (session, messages) in enumerate(prompts):
        text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = llm.encode(text)
        for method in METHODS[i % 3:] + METHODS[: i % 3]:  # the order rotates: no method always runs first
            params = SamplingParams(max_tokens=max_tokens, temperature=0, speculative=method,
                                    speculative_session=session)
            start, start_cpu = time.perf_counter(), time.process_time()
            request = llm.generate([ids], params, cache_salt=f"{method}")[0]
            seconds = time.perf_counter() - start
            out, timings = request.outputs[0], request.metrics
            f = figures[method]
            f["seconds"] += seconds
            f["cpu_seconds"] += time.process_time() - start_cpu
            f["tokens"] += len(out.token_ids)
            f["decode_seconds"] += timings.finished - timings.first_token  # the tokens after the first
            print(f"  {session} {method}: {len(out.token_ids)} tokens in {seconds:.1f} s "
                  f"(first token after {timings.ttft_s:.1f} s)", flush=True)
            outputs[method].append(out.token_ids)
    for f in figures.values():
        f["tokens_per_s"] = f["tokens"] / f["seconds"]
        f["decode_tokens_per_s"] = (f["tokens"] - len(prompts)) / f["decode_seconds"]
    off = figures["off"]
    for method in METHODS:
        f = figures[method]
        f["speedup"] = f["tokens_per_s"] / off["tokens_per_s"]
        f["decode_speedup"] = f["decode_tokens_per_s"] / off["decode_tokens_per_s"]
        f["identical_outputs"] = outputs[method] == outputs["off"]
        if method != "off":
            stats = spec.stats[method]
            f["acceptance_rate"] = stats.acceptance_rate
            f["mean_accepted_length"] = stats.mean_accepted_length
            f["verifications"] = stats.verifications
            f["draft_tokens"] = stats.draft_tokens
    for stats in spec.stats.values():  # the next workload counts afresh
        stats.__init__()
    return figures


def _markdown(report: dict) -> str:
    rows = []
    for name, figures in report["workloads"].items():
        for method, f in figures.items():
            rows.append([name, method, f["tokens"], f"{f['seconds']:.1f}", f"{f['cpu_seconds']:.1f}",
                         f"{f['tokens_per_s']:.2f}", f"{f['speedup']:.2f}x", f"{f['decode_tokens_per_s']:.2f}",
                         f"{f['decode_speedup']:.2f}x",
                         f"{f.get('acceptance_rate', 0):.2f}" if method != "off" else "-",
                         f"{f.get('mean_accepted_length', 1):.2f}" if method != "off" else "1",
                         "yes" if f["identical_outputs"] else "NO"])
    table = markdown_table(["workload", "method", "output tokens", "s", "CPU s", "tokens/s", "vs off",
                            "decode tokens/s", "vs off", "acceptance", "mean accepted length", "same tokens as off"],
                           rows)
    return (f"{table}\n\ntorch threads: {report['threads']}; load average (1, 5, 15 min) before / after: "
            f"{report['load_average']}\n")
