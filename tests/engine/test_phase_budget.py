"""Phase budgets (engine/phase_budget.py): "after N tokens of a phase, force token ids Y", enforced by the engine's
sampling. The tracker alone, then the engine on tiny random models forced into thinking (they think forever: the
budget is what ends it): at most the budget of the model's own tokens, then the closing tokens, whatever the
batching, async scheduling, speculative drafts, preemption or a grammar after the thinking."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.phase_budget import PhaseBudget, PhaseTracker
from engine.sampling_params import StructuredOutputSpec

START, END = 7, 9
CLOSE = (11, 12, END)  # a closing phrase, then the end


def track(rule: PhaseBudget, prompt: list[int], output: list[int]) -> list[int | None]:
    """What the tracker forces before each output token (fed one at a time)."""
    tracker, forced = PhaseTracker(rule, len(prompt)), []
    tokens = list(prompt)
    for token in output:
        tracker.advance(tokens)
        forced.append(tracker.forced_token())
        tokens.append(token)
    return forced


def test_the_tracker_forces_after_the_budget_and_only_inside_the_phase():
    rule = PhaseBudget(3, CLOSE, (END,), (START,))
    # before the start nothing counts; 3 tokens inside, then the closing tokens; after the end nothing
    assert track(rule, [1], [2, START, 3, 4, 5, 11, 12, END, 6, 6]) == [
        None, None, None, None, None, 11, 12, END, None, None]
    # the model ends the phase itself within the budget: nothing is forced, and the phase never opens again
    assert track(rule, [1], [START, 3, END, START, 4, 5, 6, 7]) == [None] * 8
    # open at the start (the prompt opened it), and a budget of 0
    assert track(PhaseBudget(0, CLOSE, (END,), open_at_start=True), [1], [11, 12, END, 5]) == [11, 12, END, None]
    assert track(PhaseBudget(2, CLOSE, (END,), open_at_start=True), [START], [3, 4, 11, 12, END]) == [
        None, None, 11, 12, END]


def test_a_multi_token_end_and_the_free_tokens_left():
    rule = PhaseBudget(4, (5, 8, 9), (8, 9), open_at_start=True)
    assert track(rule, [1], [2, 8, 9, 3]) == [None] * 4  # the model's own two-token end closes it
    tracker = PhaseTracker(rule, 1)
    tracker.advance([1, 2, 3])
    assert tracker.free_tokens_left() == 2
    tracker.advance([1, 2, 3, 4, 5])
    assert tracker.free_tokens_left() == 0 and tracker.forced_token() == 5 and tracker.active
    tracker.advance([1, 2, 3, 4, 5, 5, 8, 9])
    assert tracker.free_tokens_left() is None and not tracker.active


@pytest.mark.parametrize("bad", [dict(budget=-1), dict(forced_token_ids=(11,)), dict(start_token_ids=())])
def test_bad_budgets_are_refused(bad: dict):
    with pytest.raises(ValueError):
        PhaseBudget(**{"budget": 2, "forced_token_ids": CLOSE, "end_token_ids": (END,), "start_token_ids": (START,),
                       **bad})


def think_rule(llm: LLM, budget: int) -> tuple[PhaseBudget, list[int]]:
    """A thinking budget as the server makes it (the model's own <think> / </think>), and a prompt that opens it."""
    tok = llm.tokenizer
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    forced = tuple(tok.encode("\n\nTime to answer.\n", add_special_tokens=False)) + end
    prompt = tok.encode("<|im_start|>user\nThink about it.<|im_end|>\n<|im_start|>assistant\n<think>\n",
                        add_special_tokens=False)
    return PhaseBudget(budget, forced, end, tuple(tok.encode("<think>", add_special_tokens=False)), True), prompt


def assert_thought_within(tokens: list[int], rule: PhaseBudget) -> int:
    """The output's thinking: the model's own tokens, at most the budget, then the forced closing tokens; returns
    how many the model wrote."""
    forced = list(rule.forced_token_ids)
    for end in range(len(tokens) - len(forced) + 1):
        if tokens[end : end + len(forced)] == forced:
            assert end <= rule.budget, f"{end} thinking tokens before the closing ones, budget {rule.budget}"
            return end
    raise AssertionError("the closing tokens were never written: the random model thinks on")


def test_a_budget_of_64_ends_thinking_in_every_batch_shape(qwen3_llm: LLM):
    rule, prompt = think_rule(qwen3_llm, 64)
    free = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    unbudgeted = qwen3_llm.generate([prompt], free)[0].token_ids
    with pytest.raises(AssertionError, match="thinks on"):
        assert_thought_within(unbudgeted, rule)  # without a budget, the random model never ends its thinking
    budgeted = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, phase_budget=rule)
    sampled = SamplingParams(max_tokens=100, temperature=0.8, seed=5, ignore_eos=True, phase_budget=rule, n=2)
    outs = qwen3_llm.generate([prompt, prompt[:-3] + prompt[-2:], prompt], [budgeted, budgeted, sampled])
    assert assert_thought_within(outs[0].token_ids, rule) == 64
    assert outs[0].token_ids[:64] == unbudgeted[:64]  # the model's own tokens until the budget
    for out in outs[1:]:
        for choice in out.outputs:
            assert assert_thought_within(choice.token_ids, rule) == 64
    assert outs[2].outputs[0].token_ids != outs[2].outputs[1].token_ids


def test_a_grammar_after_thinking_still_holds(qwen3_llm: LLM):
    """The forced closing tokens end the free thinking the grammar allows (as tool_choice required's grammar allows
    it, server/parsing/constraint.py); what follows matches the grammar."""
    rule, prompt = think_rule(qwen3_llm, 16)
    spec = StructuredOutputSpec("ebnf", 'root ::= [^<]* "</think>" "{\\"a\\": " [0-9] "}"')
    out = qwen3_llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0, phase_budget=rule,
                                                      structured_output=spec))[0]
    assert assert_thought_within(out.token_ids, rule) == 16
    assert out.finish_reason == "stop" and out.text.split("</think>")[-1].startswith('{"a": ')


@pytest.mark.slow
@pytest.mark.parametrize("engine_args", [
    dict(speculative="ngram", num_speculative_tokens=4),
    dict(async_scheduling=True),
    dict(num_kv_blocks=40, max_num_batched_tokens=16),  # preempted while it thinks
], ids=["ngram-drafts", "async", "preemption"])
def test_the_budget_holds_with_drafts_overlap_and_preemption(engine_args: dict):
    llm = LLM("qwen3-tiny", block_size=4, **{"num_kv_blocks": 512, **engine_args})
    rule, prompt = think_rule(llm, 24)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, phase_budget=rule)
    outs = llm.generate([prompt, prompt, prompt[:-1] + prompt[-1:]], params)
    if "num_kv_blocks" in engine_args:
        assert llm.stats.preemptions > 0
    for out in outs:
        assert assert_thought_within(out.token_ids, rule) == 24
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["deepseek-tiny", "deepseek-v3.2-tiny", "deepseek-v4-tiny", "qwen3.6-tiny",
                                   "glm4.7-flash-tiny", "minimax-m2-tiny"])
def test_every_family_that_thinks_stops_at_its_budget(model: str):
    """The same rule on each thinking family's tokenizer (its <think> / </think> tokens): 64 of the model's own
    tokens, then the closing ones (the templates' prompts: tests/server/api/test_reasoning_budget.py)."""
    llm = LLM(model, block_size=16, num_kv_blocks=64)  # (V4's compressed cache keeps its entries per 16)
    rule, prompt = think_rule(llm, 64)
    out = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True, phase_budget=rule))
    assert assert_thought_within(out[0].token_ids, rule) == 64
    llm.close()
