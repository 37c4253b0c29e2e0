"""lm-eval's `local-completions` against kvserve on a small multiple-choice task (a custom task over a local data
file: no hub), next to lm-eval's own transformers model (`hf`) on the same weights and items: the same accuracy, and
every loglikelihood within 1e-4. That is `echo` + `logprobs` (prompt logprobs computed in the prefill) end to end,
as lm-eval reads them (`token_logprobs[ctxlen:-1]`, and the top alternatives for `is_greedy`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.registry import resolve_model
from tests.server.conftest import LiveServer

TASK = "kvserve_capitals"
ITEMS = [  # (question, choices, index of the answer)
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("What is the capital of Italy?", ["Vienna", "Rome", "Athens", "Lisbon"], 1),
    ("What is the capital of Germany?", ["Munich", "Hamburg", "Berlin", "Bonn"], 2),
    ("What is the capital of Spain?", ["Barcelona", "Seville", "Valencia", "Madrid"], 3),
    ("What is the capital of Japan?", ["Tokyo", "Kyoto", "Osaka", "Seoul"], 0),
    ("What is the capital of Canada?", ["Toronto", "Ottawa", "Montreal", "Vancouver"], 1),
    ("How many legs does a spider have?", ["six", "ten", "eight", "four"], 2),
    ("What color is the sky on a clear day?", ["green", "red", "yellow", "blue"], 3),
    ("Which animal says moo?", ["a cow", "a cat", "a dog", "a duck"], 0),
    ("What do bees make?", ["milk", "honey", "silk", "wool"], 1),
    ("What is frozen water called?", ["steam", "sand", "ice", "salt"], 2),
    ("Which planet do we live on?", ["Mars", "Venus", "Jupiter", "Earth"], 3),
]
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _evaluate(model: str, model_args: dict, include: Path) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True, batch_size=1,
                           task_manager=TaskManager(include_path=str(include)))


def _loglikelihoods(results: dict) -> list[list[float]]:
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[resp[0][0] for resp in sample["resps"]] for sample in samples]


@pytest.mark.slow
@pytest.mark.slow
def test_lm_eval_local_completions_equals_transformers(smol_server: LiveServer, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
    (tmp_path / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data))
    model_dir = str(resolve_model("smollm2-135m"))

    served = _evaluate("local-completions", {
        "base_url": f"{smol_server.base_url}/v1/completions", "model": "smollm2-135m",
        "tokenizer_backend": "huggingface", "tokenizer": model_dir, "max_retries": 1,
    }, tmp_path)
    reference = _evaluate("hf", {"pretrained": model_dir, "dtype": "float32", "device": "cpu"}, tmp_path)

    mine, theirs = _loglikelihoods(served), _loglikelihoods(reference)
    assert len(mine) == len(ITEMS) and all(len(m) == 4 for m in mine)
    for item_mine, item_theirs in zip(mine, theirs):
        assert all(abs(a - b) < 1e-4 for a, b in zip(item_mine, item_theirs)), (item_mine, item_theirs)
    accuracy = served["results"][TASK]["acc,none"]
    assert accuracy == reference["results"][TASK]["acc,none"]
    assert accuracy > 0.25  # the real model does better than chance on these
