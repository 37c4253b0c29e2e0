"""Shared engine fixtures: one LLM per model and configuration, and an HF transformers oracle on the same weights."""
from __future__ import annotations

import functools
import hashlib
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.registry import resolve_model


@functools.lru_cache(maxsize=2)  # the sweeps go model by model; every model kept would hold GBs to the session's end
def hf_model(name: str):
    """transformers' model of ``name``: its causal LM, or, for a family released only as a vision-language model
    (Muse-Glimmer), that model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    path = str(resolve_model(name))
    causal = type(AutoConfig.from_pretrained(path)) in AutoModelForCausalLM._model_mapping
    auto = AutoModelForCausalLM if causal else AutoModelForImageTextToText
    return auto.from_pretrained(path, dtype=torch.float32).eval()


_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "vocab*", "merges.txt")


@functools.lru_cache(maxsize=4)
def _tokenizer(digest: str, model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def tokenizer_of(model: str):
    """The tokenizer of ``model`` (a registry name or a directory), loaded once for every checkpoint with the same
    tokenizer files: a Qwen tokenizer takes 1-5 s to load, ten times the rest of a tiny engine's build."""
    model_dir = resolve_model(model)
    digest = hashlib.sha256()
    for path in sorted(p for pattern in _TOKENIZER_FILES for p in model_dir.glob(pattern)):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return _tokenizer(digest.hexdigest(), str(model_dir))


def new_llm(model: str, **engine_config) -> LLM:
    """``LLM(model, **engine_config)`` with the tokenizer `tokenizer_of` keeps (the engine only reads it)."""
    return LLM(model, tokenizer=tokenizer_of(model), **engine_config)


def hf_greedy(name: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    model = hf_model(name)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def assert_top_logprobs_equal_hf(name: str, prompt: list[int], top: list[tuple[int, float]], atol: float) -> None:
    """The engine's top logprobs after ``prompt`` are transformers' top tokens, in order, within ``atol``: its i-th
    token is one whose reference logprob is the reference's i-th best within ``atol`` (two tokens closer than that
    may come in either order: fp32 rounding decides a near-tie), and its logprobs are the reference's."""
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(name)(torch.tensor([prompt])).logits[0, -1].float(), -1)
    assert_top_logprobs_equal(ref, top, atol)


def assert_top_logprobs_equal(ref: torch.Tensor, top: list[tuple[int, float]], atol: float) -> None:
    """`assert_top_logprobs_equal_hf` against the reference's next-token logprobs ``ref`` (a multimodal model's, run
    on its processor's inputs)."""
    ids = torch.tensor([t for t, _ in top])
    assert len(set(ids.tolist())) == len(top)
    torch.testing.assert_close(ref[ids], ref.topk(len(top)).values, atol=atol, rtol=0)
    torch.testing.assert_close(torch.tensor([lp for _, lp in top]), ref[ids], atol=atol, rtol=0)


def logit_shift(name: str, prompt: list[int], back: int) -> float:
    """How far transformers' next-token logits after ``prompt`` move when the token ``back`` places from its end
    changes: a model whose outputs are to prove anything must move for tokens inside its windows and beyond them."""
    changed = prompt[:-back] + [prompt[-back] + 7] + prompt[len(prompt) - back + 1:]
    with torch.no_grad():
        logits = [hf_model(name)(torch.tensor([p])).logits[0, -1] for p in (prompt, changed)]
    return float((logits[1] - logits[0]).abs().max())


def assert_varied(expected: list[list[int]], min_distinct_per_output: int) -> None:
    """Different prompts continue differently, and no continuation repeats one token."""
    assert len({tuple(e) for e in expected}) == len(expected), "different prompts continue differently"
    assert sum(len(set(e)) for e in expected) > min_distinct_per_output * len(expected), "continuations repeat"


def assert_greedy_alone_and_together(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """The engine's greedy tokens are transformers' (``expected``), one prompt at a time, then all together with
    mixed finish times (each its own max_tokens)."""
    new_tokens = len(expected[0])
    for prompt, want in zip(prompts, expected):
        assert llm.generate([prompt], SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
                            )[0].token_ids == want
    params = [SamplingParams(max_tokens=1 + (3 * i) % new_tokens, temperature=0, ignore_eos=True)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [want[: p.max_tokens] for want, p in zip(expected, params)]


def assert_greedy_cache_hot(llm: LLM, prompts: list[list[int]], expected: list[list[int]], block_size: int) -> None:
    """Again after `assert_greedy_alone_and_together`: the same tokens, every prompt's full blocks (all but its last
    token's) from the prefix cache."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=len(expected[0]), temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    cached = [o.num_cached_tokens for o in outs]
    assert cached == [(len(p) - 1) // block_size * block_size for p in prompts] and sum(cached) > 0
    llm.engine.scheduler.kv.check_invariants()


def assert_greedy_through_preemption(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """In a pool too small for every prompt at once: sequences are preempted and recomputed, and the greedy tokens
    are still transformers' (``expected``)."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=len(expected[0]), temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    llm.engine.scheduler.kv.check_invariants()


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, min(vocab, 50_000)) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="session")
def qwen3_llm() -> LLM:
    return LLM("qwen3-tiny", block_size=4, num_kv_blocks=2048)


class CheckpointDirs(dict):
    """kind -> a checkpoint directory, written on first use by ``write(kind, directory)``: a module's or session's
    tiny checkpoints in several layouts, each built only when a test asks for it."""

    def __init__(self, root: Path, write: Callable[[str, Path], object]) -> None:
        super().__init__()
        self.root, self.write = root, write

    def __missing__(self, kind: str) -> str:
        self.write(kind, self.root / kind)
        self[kind] = str(self.root / kind)
        return self[kind]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def saved_with_tokenizer(model_of: Callable[[str], object], tokenizer_from: str = "qwen3-tiny"
                         ) -> Callable[[str, Path], None]:
    """A writer for `CheckpointDirs`: transformers' ``save_pretrained`` of ``model_of(kind)`` beside the tokenizer
    files of the registry's ``tokenizer_from``."""
    def write(kind: str, out: Path) -> None:
        model_of(kind).save_pretrained(out)
        for name in TOKENIZER_FILES:
            shutil.copyfile(resolve_model(tokenizer_from) / name, out / name)
    return write


def _write_hybrid_checkpoint(kind: str, out: Path) -> None:
    from tests.models.checkpoints.hybrid_models import write_hybrid_checkpoint

    write_hybrid_checkpoint(kind, out)


@pytest.fixture(scope="session")
def hybrid_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny hybrid checkpoints (Qwen3.5 dense with its vision tower, Qwen3.5-MoE, Qwen3-Next) by kind, written
    once per session, on first use, by transformers' save_pretrained (tests/models/checkpoints/hybrid_models.py)."""
    return CheckpointDirs(tmp_path_factory.mktemp("hybrid"), _write_hybrid_checkpoint)
