"""The parity scenarios of the sliding-window families (Gemma 3, Gemma 4, Muse-Glimmer, gpt-oss): each family's test
file is a table of its checkpoints and calls these on a `ParityCase`, so that every family is held to the same
scenarios. Windows of 8-12 tokens and prompts of up to 70: all but the two shortest reach past the window, and the
engine's greedy tokens must equal transformers' one prompt at a time, all together, with the prefix cache hot, with
chunked prefills ending off block boundaries, under preemption, on another op set and over two tensor-parallel
ranks; its top-20 logprobs within 1e-4 in fp32.

Every engine of a case shares the checkpoint's tokenizer (`new_llm`) and the oracle is computed once per case."""
from __future__ import annotations

from dataclasses import dataclass

from engine import SamplingParams
from tests.hf_oracle import (
    assert_greedy_alone_and_together, assert_greedy_cache_hot, assert_greedy_through_preemption,
    assert_top_logprobs_equal_hf, assert_varied, hf_greedy, logit_shift, new_llm, random_prompts,
)

LENGTHS = [1, 4, 9, 17, 40, 70]
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@dataclass(frozen=True)
class ParityCase:
    path: str
    prompts: list[list[int]]
    expected: list[list[int]]  # transformers' NEW_TOKENS greedy tokens per prompt

    @classmethod
    def of(cls, path: str, vocab: int, seed: int) -> "ParityCase":
        prompts = random_prompts(vocab, LENGTHS, seed=seed)
        return cls(path, prompts, [hf_greedy(path, p, NEW_TOKENS) for p in prompts])


def check_varied_and_context(case: ParityCase, what_reaches_back: str) -> None:
    """Different prompts continue differently; a token far outside every window still moves the longest prompt's
    next-token logits (through ``what_reaches_back``), while the last few tokens move them a lot."""
    assert_varied(case.expected, 5)
    assert logit_shift(case.path, case.prompts[-1], 3) > 0.5, "a token inside the window moves the logits"
    far = len(case.prompts[-1]) - 1
    assert logit_shift(case.path, case.prompts[-1], far) > 0.05, f"so does the first one, through {what_reaches_back}"


def check_greedy_alone_together_and_hot(case: ParityCase, block_size: int) -> None:
    llm = new_llm(case.path, block_size=block_size, num_kv_blocks=512)
    assert_greedy_alone_and_together(llm, case.prompts, case.expected)
    assert_greedy_cache_hot(llm, case.prompts, case.expected, block_size)


def check_chunked_prefill(case: ParityCase) -> None:
    """A 7-token budget with 4-token blocks: chunks end mid-block and mid-window, decodes and prefill chunks share
    steps, and each chunk's window layers see the window's part of the earlier chunks through the pages."""
    llm = new_llm(case.path, block_size=4, num_kv_blocks=512, max_num_batched_tokens=7)
    assert [o.token_ids for o in llm.generate(case.prompts, GREEDY)] == case.expected


def check_preemption(case: ParityCase) -> None:
    llm = new_llm(case.path, block_size=4, num_kv_blocks=32, max_num_batched_tokens=32)
    assert_greedy_through_preemption(llm, case.prompts, case.expected)


def check_top20_logprobs(case: ParityCase) -> None:
    llm = new_llm(case.path, block_size=4, num_kv_blocks=512, max_num_batched_tokens=32)
    outs = llm.generate(case.prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    for prompt, out in zip(case.prompts, outs):
        assert_top_logprobs_equal_hf(case.path, prompt, out.outputs[0].logprobs[0].top, atol=1e-4)


def check_op_set(case: ParityCase, backend: str) -> None:
    """The ``backend`` op set in steps that mix chunked prefills with decodes. Triton runs under its interpreter on
    CPU, minutes for the whole case, so it gets the 9-, 17- and 40-token prompts (past the window, chunked off block
    boundaries) and their first 4 tokens."""
    chosen, tokens = (slice(2, 5), 4) if backend == "triton" else (slice(None), NEW_TOKENS)
    llm = new_llm(case.path, attention_backend=backend, block_size=4, num_kv_blocks=512, max_num_batched_tokens=13)
    outs = llm.generate(case.prompts[chosen], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [e[:tokens] for e in case.expected[chosen]]


def check_tensor_parallel(case: ParityCase, chosen: slice = slice(None), **engine_config) -> None:
    """Two gloo ranks on CPU, ``chosen`` prompts, the tokens of transformers."""
    with new_llm(case.path, tensor_parallel_size=2, block_size=4, num_kv_blocks=256, max_num_batched_tokens=16,
                 **engine_config) as llm:
        outs = llm.generate(case.prompts[chosen], GREEDY)
    assert [o.token_ids for o in outs] == case.expected[chosen]


def check_registry_model(name: str, vocab: int):
    """The registry's tiny model of a family: greedy tokens of varied continuations equal transformers' in steps that
    mix chunked prefills with decodes. Returns the engine, for the family's own checks of its config."""
    prompts = random_prompts(vocab, [3, 17, 45], seed=1)
    llm = new_llm(name, block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
    want = [hf_greedy(name, p, NEW_TOKENS) for p in prompts]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert len({tuple(w) for w in want}) == len(want) and sum(len(set(w)) for w in want) > 4 * len(want)
    return llm
