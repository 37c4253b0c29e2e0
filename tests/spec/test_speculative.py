"""Speculative decoding through the engine: drafts verified in one forward over the paged cache.

Tiny random models rarely repeat themselves, so most tests draft with an *oracle* proposer: the reference (non-
speculative) continuation with deliberate mistakes, which exercises acceptance, rejection and the roll-back of
rejected drafts' K/V slots on every step. The real proposers are covered by tests/spec/test_proposers.py and, end to
end, by the suffix test below (a session that asks the same thing twice) and `kvserve bench spec` on real weights.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chi2_contingency

from engine import LLM, SamplingParams
from engine.registry import resolve_model
from engine.sampling_params import StructuredOutputSpec
from tests.hf_oracle import hf_model, new_llm, random_prompts

P_VALUE_THRESHOLD = 1e-3  # the two-sample chi-square test passes above this


class OracleDrafts:
    """Proposes the next tokens of the reference continuation that the context is a prefix of, with the draft at
    position ``step % k`` of every step replaced by a wrong token (so every step rejects somewhere, or not at all)."""

    def __init__(self, references: list[list[int]], wrong_every: int = 3) -> None:
        self.references = references
        self.wrong_every = wrong_every
        self.calls = 0

    def __call__(self, seq_id, method, tokens, k, session) -> list[int]:
        if method == "off":
            return []
        self.calls += 1
        for ref in self.references:
            if len(tokens) < len(ref) and ref[: len(tokens)] == list(tokens):
                drafts = ref[len(tokens) : len(tokens) + k]
                if drafts and self.calls % self.wrong_every == 0:
                    wrong = self.calls % len(drafts)
                    drafts[wrong] = (drafts[wrong] + 1) % 1000 + 100
                return drafts
        return []


def _speculating(llm: LLM, references: list[list[int]], **kwargs) -> OracleDrafts:
    oracle = OracleDrafts(references, **kwargs)
    llm.engine.scheduler.drafter.propose = oracle
    return oracle


@pytest.fixture(scope="module")
def dense() -> LLM:
    return new_llm("qwen3-tiny", block_size=4, num_kv_blocks=512, speculative_draft_budget=64)


def _greedy_equal(llm: LLM, prompts: list[list[int]], max_tokens: int = 16, **params) -> list:
    base = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, **params))
    refs = [p + o.token_ids for p, o in zip(prompts, base)]
    oracle = _speculating(llm, refs)
    spec = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, speculative="ngram", **params))
    del llm.engine.scheduler.drafter.propose
    assert oracle.calls > 0
    for b, s in zip(base, spec):
        assert [(c.token_ids, c.text) for c in s.outputs] == [(c.token_ids, c.text) for c in b.outputs]
        assert [c.finish_reason for c in s.outputs] == [c.finish_reason for c in b.outputs]
    llm.engine.scheduler.kv.check_invariants()
    return spec


@pytest.mark.slow
def test_greedy_tokens_identical_dense_with_hot_prefix_cache(dense):
    prompts = random_prompts(1000, [9, 30], seed=1)
    before = dense.engine.scheduler.drafter.stats["ngram"].verifications
    _greedy_equal(dense, prompts)
    _greedy_equal(dense, prompts)  # the same prompts again: prompts and replies now come from the prefix cache
    stats = dense.engine.scheduler.drafter.stats["ngram"]
    assert stats.verifications > before and 0 < stats.accepted_tokens < stats.draft_tokens  # accepted and rejected
    assert dense.stats.spec_draft_tokens == stats.draft_tokens


@pytest.mark.slow
def test_max_tokens_stop_tokens_and_n_behave_as_without_speculation(dense):
    prompts = random_prompts(1000, [11, 6], seed=2)
    _greedy_equal(dense, prompts, max_tokens=7)  # drafts must not run past max_tokens
    ref = dense.generate(prompts[:1], SamplingParams(max_tokens=20, temperature=0))[0].token_ids
    _greedy_equal(dense, prompts[:1], max_tokens=20, stop_token_ids=[ref[6]])  # a stop token among the accepted
    _greedy_equal(dense, prompts, max_tokens=12, n=2)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer", "minimum": 0,
                         "maximum": 999}, "ok": {"type": "boolean"}}}


@pytest.mark.parametrize("model", ["qwen3-tiny", "deepseek-v3-tiny"])
@pytest.mark.slow
def test_greedy_tokens_identical_under_a_grammar(dense, model):
    """Each verified position is masked by the grammar's state after the drafts before it: without those masks the
    random model's argmax after a draft is never JSON, and the outputs would differ."""
    llm = dense if model == "qwen3-tiny" else new_llm(model, block_size=4, num_kv_blocks=256,
                                                      speculative_draft_budget=64)
    spec = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))
    stats = llm.engine.scheduler.drafter.stats["ngram"]
    accepted = stats.accepted_tokens
    prompts = random_prompts(1000, [9, 17], seed=6)
    outs = _greedy_equal(llm, prompts, max_tokens=60, structured_output=spec)
    assert stats.accepted_tokens > accepted
    # Sampled, the same drafts go through the rejection rule on the masked distributions: every output is valid.
    refs = [p + o.token_ids for p, o in zip(prompts, outs)]
    _speculating(llm, refs, wrong_every=10**9)
    sampled = llm.generate(prompts * 2, [SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_output=spec,
                                                        speculative="ngram") for s in range(4)])
    del llm.engine.scheduler.drafter.propose
    for out in outs + sampled:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert llm.engine.structured_outputs.num_active == 0


@pytest.mark.slow
def test_speculation_is_refused_where_it_cannot_be_exact(dense, tmp_path):
    with pytest.raises(ValueError, match="speculative"):
        SamplingParams(speculative="eagle")
    # Penalties and logprobs decode one token a step (their state would have to follow the drafts).
    sched = dense.engine.scheduler
    from engine.sched.sequence import Sequence
    for params in (SamplingParams(speculative="ngram", logprobs=2),
                   SamplingParams(speculative="ngram", presence_penalty=0.5)):
        assert sched.speculation(Sequence("x", [1], 1, params)) == "off"


@pytest.mark.parametrize("model", [pytest.param("qwen3-moe-tiny", marks=pytest.mark.slow), "deepseek-v3-tiny"])
@pytest.mark.slow
def test_greedy_tokens_identical_moe_and_mla(model):
    llm = new_llm(model, block_size=4, num_kv_blocks=256, speculative_draft_budget=64)
    _greedy_equal(llm, random_prompts(1000, [13, 22], seed=3), max_tokens=16)


@pytest.mark.slow
def test_suffix_drafts_from_the_sessions_earlier_replies(dense):
    prompts = random_prompts(1000, [10, 15], seed=4)
    base = dense.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    params = SamplingParams(max_tokens=24, temperature=0, speculative="suffix", speculative_session="s1")
    first = dense.generate(prompts, params, cache_salt="tenant")
    stats = dense.engine.scheduler.drafter.stats["suffix"]
    accepted_before = stats.accepted_tokens
    second = dense.generate(prompts, params, cache_salt="tenant")  # the session has seen these replies
    assert [o.token_ids for o in first] == [o.token_ids for o in second] == [o.token_ids for o in base]
    assert stats.accepted_tokens - accepted_before >= 30
    other = dense.engine.scheduler.drafter.session_tree(("other tenant", "s1"))
    assert other is None  # another tenant's session with the same id shares nothing


@pytest.mark.parametrize("model", ["qwen3.6-tiny", pytest.param("qwen3.6-moe-tiny", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_greedy_tokens_identical_hybrid(model):
    """Hybrids: a rejected draft leaves the recurrent state at the last accepted token (the state after each verified
    position is kept, kernels/reference/recurrent.py), and steps with drafts stop short of the block boundaries where
    snapshots are taken; the prefix cache hot (the second round resumes from snapshots), n = 2."""
    llm = new_llm(model, block_size=4, num_kv_blocks=256, speculative_draft_budget=64)
    prompts = random_prompts(1000, [13, 6], seed=6)
    _greedy_equal(llm, prompts, max_tokens=18)
    _greedy_equal(llm, prompts, max_tokens=18, n=2)  # prompts and replies from the cache now, two siblings each
    stats = llm.engine.scheduler.drafter.stats["ngram"]
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # drafts were accepted and rejected
    assert llm.stats.prefix_cache_hits_tokens > 0


@pytest.mark.slow
@pytest.mark.slow
def test_sampled_tokens_keep_the_target_distribution(dense):
    """Temperature 1 (top-k 3, so 800 seeds fill every cell): the joint distribution of the first two
    sampled tokens and the marginal of the third, with drafts verified by rejection sampling, against plain
    sampling; two-sample chi-square, p > 1e-3."""
    prompt = random_prompts(1000, [12], seed=5)[0]
    seeds = 800
    params = dict(max_tokens=3, temperature=1.0, top_k=3)
    plain = dense.generate([prompt] * seeds, [SamplingParams(seed=s, **params) for s in range(seeds)])
    # Drafts: for each possible first token, the greedy continuation after it (often, not always, accepted).
    firsts = sorted({o.token_ids[0] for o in plain})
    greedy = dense.generate([prompt + [t] for t in firsts], SamplingParams(max_tokens=2, temperature=0))
    refs = [prompt + [t] + g.token_ids for t, g in zip(firsts, greedy)]
    oracle = _speculating(dense, refs, wrong_every=10**9)
    spec = dense.generate([prompt] * seeds, [SamplingParams(seed=10**6 + s, speculative="ngram", **params)
                                             for s in range(seeds)])
    del dense.engine.scheduler.drafter.propose
    assert oracle.calls >= seeds // 2
    for key in (lambda t: tuple(t[:2]), lambda t: t[2]):
        cells = sorted({key(o.token_ids) for o in plain + spec})
        table = [[sum(key(o.token_ids) == c for o in run) for c in cells] for run in (plain, spec)]
        assert chi2_contingency(table).pvalue > P_VALUE_THRESHOLD


# The tiny models that carry a random MTP layer in their family's released layout (engine/model_sources/tiny.py):
# Qwen3.5 / 3.6's ``mtp.*``, DeepSeek-V3's and V3.2's ``model.layers.3.*`` (the layer after the last)
MTP_MODELS = [pytest.param(name, marks=pytest.mark.slow)
              for name in ("qwen3.6-tiny", "deepseek-v3-tiny", "deepseek-v3.2-tiny")]


@pytest.fixture(scope="module", params=MTP_MODELS)
def mtp(request) -> LLM:
    return new_llm(request.param, block_size=4, num_kv_blocks=256, speculative="mtp", speculative_draft_budget=64)


@pytest.mark.slow
def test_mtp_drafts_keep_greedy_tokens_identical(mtp):
    """``--speculative mtp`` loads the checkpoint's MTP layer and drafts with it, and greedy tokens equal the plain
    engine's, cache hot, n = 2, and under a grammar. (Random MTP weights seldom guess right: the point is
    exactness, and that drafts are made and verified.)"""
    name = mtp.engine.model_dir.name
    plain = new_llm(name, block_size=4, num_kv_blocks=256)
    assert not any(name.startswith("mtp.") for name, _ in plain.engine.runner.model.named_parameters())
    assert any(name.startswith("mtp.") for name, _ in mtp.engine.runner.model.named_parameters())
    prompts = random_prompts(1000, [13, 6], seed=7)
    grammar = StructuredOutputSpec("json_schema", json.dumps(SCHEMA))
    for params in (SamplingParams(max_tokens=12, temperature=0),
                   SamplingParams(max_tokens=12, temperature=0),  # prompts and replies from the prefix cache
                   SamplingParams(max_tokens=12, temperature=0, n=2),
                   SamplingParams(max_tokens=16, temperature=0, structured_output=grammar)):
        want, got = plain.generate(prompts, params), mtp.generate(prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    assert mtp.stats.prefix_cache_hits_tokens > 0
    stats = mtp.engine.scheduler.drafter.stats["mtp"]
    assert stats.verifications > 0 and stats.draft_tokens > stats.verifications  # several drafts a step
    assert mtp.stats.spec_draft_tokens == stats.draft_tokens and stats.mean_accepted_length >= 1
    mtp.engine.scheduler.kv.check_invariants()


@pytest.mark.slow
def test_mtp_catch_up_drafts_as_one_prefill_would(mtp):
    """The MTP layer's K/V, filled step by step (each position paired with the token after it: accepted drafts in,
    rejected ones left out), gives the drafts that one prefill of the same tokens gives, without the prefix cache.
    The steps verify oracle drafts in place of the layer's (the reference continuation, one wrong token every other
    step), so that some are accepted and some rejected; the layer's own drafts are what is compared."""
    name = mtp.engine.model_dir.name
    prompt = random_prompts(1000, [9], seed=8)[0]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    context = prompt + mtp.generate([prompt], greedy)[0].token_ids
    oracle = OracleDrafts([context], wrong_every=2)
    drafter = mtp.engine.scheduler.drafter
    offers: list[tuple[int, list[int]]] = []

    def offer(seq_id, n, drafts, offer=drafter.offer):
        offers.append((n, drafts))
        offer(seq_id, n, oracle(seq_id, "mtp", context[:n], len(drafts), None) or drafts)

    drafter.offer = offer
    accepted = drafter.stats["mtp"].accepted_tokens
    try:
        assert mtp.generate([prompt], greedy)[0].token_ids == context[len(prompt):]
    finally:
        del drafter.offer
    assert drafter.stats["mtp"].accepted_tokens > accepted
    fresh = new_llm(name, block_size=4, num_kv_blocks=256, speculative="mtp", enable_prefix_caching=False)
    for length, drafts in offers[-3:]:
        first: list[tuple[int, list[int]]] = []
        fresh.engine.scheduler.drafter.offer = lambda seq_id, n, d: first.append((n, d))
        fresh.generate([context[: length - 1]], SamplingParams(max_tokens=2, temperature=0))
        assert first[0] == (length, drafts)


def test_mtp_refused_on_a_model_without_an_mtp_layer():
    with pytest.raises(ValueError, match="no multi-token-prediction layer.*use ngram or suffix"):
        new_llm("qwen3-tiny", speculative="mtp")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3.6-tiny", "deepseek-v3-tiny"])
@pytest.mark.slow
def test_mtp_under_tensor_parallelism_drafts_as_one_rank(model):
    """Tensor parallel 2: the MTP layer is split as the model's layers (its projection replicated), rank 0 takes
    the drafts' argmax and broadcasts them for the next chained step. The drafts equal one rank's, and so do the
    greedy tokens (which equal the plain engine's: test_mtp_drafts_keep_greedy_tokens_identical), cache hot."""
    prompts = random_prompts(1000, [13, 6], seed=9)
    params = SamplingParams(max_tokens=10, temperature=0)
    runs = []
    for size in (1, 2):
        with new_llm(model, block_size=4, num_kv_blocks=256, speculative="mtp", speculative_draft_budget=64,
                 tensor_parallel_size=size) as llm:
            drafter = llm.engine.scheduler.drafter
            offers: list[tuple[int, list[int]]] = []
            drafter.offer = lambda seq_id, n, drafts, offer=drafter.offer: (offers.append((n, drafts)),
                                                                             offer(seq_id, n, drafts))
            tokens = [o.token_ids for _ in range(2) for o in llm.generate(prompts, params)]
            assert llm.stats.prefix_cache_hits_tokens > 0
            runs.append((tokens, sorted(offers), drafter.stats["mtp"].draft_tokens))
    assert runs[1] == runs[0] and runs[0][2] > 0


@pytest.mark.slow
@pytest.mark.slow
def test_mtp_refused_when_the_checkpoint_lacks_the_layer(tmp_path):
    """A DeepSeek-V3 checkpoint whose config.json announces an MTP layer that its tensors lack (as some re-quantized
    releases strip it) loads without --speculative mtp and is refused with it."""
    src, dst = resolve_model("deepseek-v3-tiny"), tmp_path / "stripped"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).symlink_to(f)
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")}, str(dst / "model.safetensors"))
    new_llm(str(dst), block_size=4, num_kv_blocks=16)
    with pytest.raises(ValueError, match="lacks the multi-token-prediction layer.*use ngram or suffix"):
        new_llm(str(dst), block_size=4, num_kv_blocks=16, speculative="mtp")


def _one_layer_model(src, tensors: dict, out_dir):
    """DeepSeek-V3's MTP layer as transformers' own one-layer DeepSeek-V3 model: its decoder layer as layer 0 and
    ``shared_head.norm`` as the final norm, with the target's embedding and LM head."""
    from transformers import AutoModelForCausalLM

    config = json.loads((src / "config.json").read_text())
    mtp = f"model.layers.{config['num_hidden_layers']}."
    own = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
    layer = {"model.layers.0." + name[len(mtp):]: t for name, t in tensors.items()
             if name.startswith(mtp) and not name[len(mtp):].startswith(own)}
    out_dir.mkdir()
    shared = {name: tensors[name] for name in ("model.embed_tokens.weight", "lm_head.weight")}
    shared["model.norm.weight"] = tensors[mtp + "shared_head.norm.weight"]
    save_file({**layer, **shared}, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1, "first_k_dense_replace": 0}))
    model, info = AutoModelForCausalLM.from_pretrained(str(out_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    return model.eval(), mtp


@pytest.mark.slow
@pytest.mark.parametrize("model", ["deepseek-v3-tiny", "deepseek-v3.2-tiny"])
@pytest.mark.slow
def test_deepseek_mtp_drafts_equal_transformers_decoder_layer(tmp_path, model):
    """kvserve's DeepSeek-V3 MTP drafts against an oracle built from transformers' own layers on the same weights:
    ``x_i = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)])`` with ``h_i`` transformers' target hidden states (after the
    final norm), the MTP decoder layer and ``shared_head.norm`` run as a one-layer model over ``x``, and each further
    draft chained from the layer's output before the norm. The drafts offered after one prefill are its argmaxes."""
    src = resolve_model(model)
    tensors = load_file(src / "model.safetensors")
    block, mtp = _one_layer_model(src, tensors, tmp_path / "mtp")
    target = hf_model(model)
    states: list = []
    block.model.layers[0].register_forward_hook(lambda module, args, out: states.append(out))
    embed = tensors["model.embed_tokens.weight"]

    def rms_norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + target.config.rms_norm_eps) * tensors[mtp + name]

    def project(next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        both = torch.cat([rms_norm(embed[next_tokens], "enorm.weight"), rms_norm(hidden, "hnorm.weight")], -1)
        return both @ tensors[mtp + "eh_proj.weight"].T

    @torch.no_grad()
    def oracle(context: list[int], k: int) -> list[int]:
        ids = torch.tensor([context])
        hidden = target.model(ids).last_hidden_state[0]
        emitted = int(target(ids).logits[0, -1].argmax())
        x = project(torch.tensor(context[1:] + [emitted]), hidden)
        drafts: list[int] = []
        for _ in range(k):
            states.clear()
            drafts.append(int(block(inputs_embeds=x[None]).logits[0, -1].argmax()))
            state = states[-1][0] if isinstance(states[-1], tuple) else states[-1]
            x = torch.cat([x, project(torch.tensor([drafts[-1]]), state[0, -1:])])
        return drafts

    llm = new_llm(model, block_size=4, num_kv_blocks=256, speculative="mtp", enable_prefix_caching=False)
    for context in random_prompts(1000, [9, 18], seed=8):  # V3.2: past its index_topk of 16, attention is sparse
        offers: list[tuple[int, list[int]]] = []
        llm.engine.scheduler.drafter.offer = lambda seq_id, n, drafts: offers.append((n, drafts))
        llm.generate([context], SamplingParams(max_tokens=2, temperature=0))
        n, drafts = offers[0]
        assert n == len(context) + 1 and len(drafts) > 1
        assert drafts == oracle(context, len(drafts))
