"""Every native renderer must reproduce its official template byte for byte on the whole corpus (goldens/)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from server.rendering import FAMILIES, get_renderer
from tests.rendering.corpus import CASES

HERE = Path(__file__).resolve().parent
CASES_BY_NAME = {case.name: case for case in CASES}


def load_golden(family: str) -> dict:
    return json.loads((HERE / "goldens" / f"{family}.json").read_text(encoding="utf-8"))


def test_corpus_is_large_and_goldens_are_current() -> None:
    assert len(CASES) >= 60
    assert len(CASES_BY_NAME) == len(CASES), "case names must be unique"
    for family in FAMILIES:
        golden = load_golden(family)
        assert set(golden["cases"]) == set(CASES_BY_NAME), f"{family}: goldens are stale, run make_goldens.py"
        template = (HERE / "templates" / golden["template"]).read_bytes()
        assert hashlib.sha256(template).hexdigest() == golden["template_sha256"]


@pytest.mark.parametrize("family", FAMILIES)
def test_native_renderer_matches_official_template(family: str) -> None:
    renderer = get_renderer(family)
    mismatches = []
    for name, expected in load_golden(family)["cases"].items():
        case = CASES_BY_NAME[name]
        if "error" in expected:
            with pytest.raises(ValueError):
                renderer.render(case.messages, case.tools, case.add_generation_prompt, **case.kwargs)
            continue
        got = renderer.render(case.messages, case.tools, case.add_generation_prompt, **case.kwargs)
        if got != expected["prompt"]:
            mismatches.append(f"{name}:\n  want {expected['prompt']!r}\n  got  {got!r}")
    assert not mismatches, "\n".join(mismatches)


def test_every_family_renders_most_cases() -> None:
    # Guards against goldens that are all errors (which would make the byte test vacuous).
    for family in FAMILIES:
        results = load_golden(family)["cases"].values()
        assert sum("prompt" in r for r in results) >= 60, family


def test_renderer_does_not_mutate_the_request() -> None:
    case = CASES_BY_NAME["parallel_calls_three_with_text"]
    snapshot = json.dumps([case.messages, case.tools])
    for family in FAMILIES:
        get_renderer(family).render(case.messages, case.tools)
    assert json.dumps([case.messages, case.tools]) == snapshot
