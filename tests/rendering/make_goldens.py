"""Regenerate the golden prompts in ``goldens/`` from the official chat templates, rendered exactly as transformers does.

    python -m tests.rendering.make_goldens [--templates DIR]

For every family and every corpus case: the request goes through the family renderer's ``prepare`` (the same
validation and normalization the server applies), then the *official* Jinja template is rendered by
``transformers.utils.chat_template_utils.render_jinja_template`` with the tokenizer's special tokens. A request that
``prepare`` refuses, or that makes the official template raise, is recorded as an expected error. The templates used
are copied to ``templates/`` so the test suite needs nothing outside the repository; a template that is not in the
source directory (the newer ones) is read from ``templates/`` itself. ``SOURCES`` says where each stored copy came
from; the golden file repeats it.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

from transformers.utils.chat_template_utils import render_jinja_template

from server.rendering import get_renderer
from server.rendering.native.deepseek_dsml import thinking_on
from tests.rendering.corpus import CASES

HERE = Path(__file__).resolve().parent
GOLDENS = HERE / "goldens"
TEMPLATES = HERE / "templates"
DEFAULT_SOURCE = Path("/work/shared/reference/chat_templates")

_QWEN_TOKENS = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
_DEEPSEEK_TOKENS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                    "pad_token": "<｜end▁of▁sentence｜>"}

# family -> (official template file, the tokenizer's special_tokens_map)
OFFICIAL: dict[str, tuple[str, dict]] = {
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", _QWEN_TOKENS),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", _QWEN_TOKENS),
    "qwen3-coder": ("Qwen3-Coder.jinja", _QWEN_TOKENS),
    "qwen3.6": ("Qwen-Qwen3.6-27B.jinja", _QWEN_TOKENS),
    "deepseek-v3": ("deepseek-ai-DeepSeek-V3.jinja", _DEEPSEEK_TOKENS),
    "deepseek-v3-0324": ("deepseek-ai-DeepSeek-V3-0324.jinja", _DEEPSEEK_TOKENS),
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1.jinja", _DEEPSEEK_TOKENS),
    "deepseek-r1": ("deepseek-ai-DeepSeek-R1.jinja", _DEEPSEEK_TOKENS),
    "deepseek-r1-0528": ("deepseek-ai-DeepSeek-R1-0528.jinja", _DEEPSEEK_TOKENS),
    "deepseek-r1-distill": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", _DEEPSEEK_TOKENS),
    "glm-4.7": ("zai-org-GLM-4.7-Flash.jinja", {"bos_token": None, "eos_token": "<|endoftext|>",
                                                "pad_token": "<|endoftext|>"}),
    "minimax-m2": ("MiniMaxAI-MiniMax-M2.jinja", {"bos_token": "]~!b[", "eos_token": "[e~[", "pad_token": None}),
    "kimi-k2": ("moonshotai-Kimi-K2-Thinking.jinja", {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]"}),
    # Kimi-K3 ships a Python encoder (encoding_k3.py), not a template: llama.cpp's Jinja port of it (SOURCES).
    "kimi-k3": ("Kimi-K3.jinja", {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]"}),
    # Gemma 3's template knows no tools: prepare writes them as Google's function-calling guide prompts them.
    "gemma3": ("google-gemma-3-it.jinja", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}),
    "gemma4": ("google-gemma-4-31B-it.jinja", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}),
    # No Jinja template: the official Python encoders, run on the prepared messages.
    "deepseek-v3.2": ("encoding_dsv32.py", {}),
    "deepseek-v4": ("encoding_dsv4.py", {}),
    # The reference is OpenAI's openai-harmony library (tests/rendering/harmony_reference.py), which the official
    # Jinja template (stored beside the others) only approximates (tests/rendering/test_harmony_rendering.py compares them).
    "gpt-oss": ("openai-gpt-oss-20b.jinja", {}),
    # The reference is mistral-common's own v13 encoder (tests/rendering/mistral_reference.py), as for Mistral's
    # models the Hub's chat_template.jinja is generated from it; its v13 template is stored beside the others.
    "devstral": ("mistral-common-v13.jinja", {}),
}

_SHARED_SOURCES = "see /work/shared/reference/chat_templates/SOURCES.md"
# family -> where its stored template came from (written into the golden file).
SOURCES: dict[str, str] = {
    "qwen3.6": (
        "chat_template.jinja of Qwen/Qwen3.6-27B (the same file as Qwen/Qwen3.6-35B-A3B's), 7,765 bytes, sha256 "
        "c726bb991c3150f3ee3d690930f43ed1e7c28dcef27cfbc6de3400db1da2a9a6: the SHA256 that a public deployment note "
        "reports for the file downloaded from both official Qwen repos. Recovered from the verbatim copy of "
        "Qwen/Qwen3.6-27B-FP8 (revision c79abb8dddf284f31fd5a44fed917f261c72948b) in GitHub w32zhong/"
        "qwen3.6-fp8-config-fix chat_template.jinja (commit 36892a01bc975c411f9b272361391e4d3583ef04), whose one "
        "local edit (a `force_thinking` generation prompt) is reverted to the official `enable_thinking` block, as "
        "quoted in ggml-org/llama.cpp PR #22507; the result hashes to the official SHA256 above."
    ),
    "glm-4.7": (
        "chat_template.jinja of zai-org/GLM-4.7-Flash, 3,120 bytes, sha256 "
        "d63ad536c3c81880043e22ec7fd08db42b4d8fb7c89c7138bc562bfa25281375: the hash of the copy ggml-org/llama.cpp "
        "keeps as models/templates/GLM-4.7-Flash.jinja (its Git LFS pointer, e.g. in GitHub Raudbjorn/ggml-llama.cpp "
        "at commit 96fcab17564eac2bd9f4976c660616c7a0757e13). The text was recovered from the verbatim copy quoted in "
        "a Dart prompt formatter on GitHub (a comment block, read through the code search) and hashes to exactly that."
    ),
    "minimax-m2": (
        "chat_template.jinja of MiniMaxAI/MiniMax-M2, 6,482 bytes, sha256 "
        "967ff7e387676f4b4340585da0585416532f1e6c5ee3f1ede64b2c21ef7ea001: the verbatim copy ggml-org/llama.cpp "
        "keeps as models/templates/MiniMax-M2.jinja, added by PR #16932 (commit 1920345c3bcec451421bb6abc4981678cc721154, "
        "'Remove undeeded Minimax-M2 template patch': the official file unpatched), read from the fork GitHub "
        "Anemll/anemll-flash-llama.cpp at that commit; its Git LFS pointer in GitHub Raudbjorn/ggml-llama.cpp "
        "(commit 71768d0036b49cd39208c0905183203c0f62e8d9) names the same sha256 and size. MiniMax-M2.5 'supports the "
        "same toolcall syntax as MiniMax-M2' (its docs/tool_calling_guide.md); its own repository's template was not "
        "found offline."
    ),
    "kimi-k2": (
        "A COPY, not read from the model repository: models/templates/moonshotai-Kimi-K2-Thinking.jinja of GitHub "
        "ggml-org/llama.cpp (commit 0c3c896ea80643608b4e961eec7e1efcd844e109), llama.cpp's copy named after the Hub "
        "repository moonshotai/Kimi-K2-Thinking, 3,430 bytes, sha256 "
        "833d0c375531149a922a0f2addf9a66cce8e4503c500fe4ca6a95e9d1ed3c75a. A mirror of the Hub file at its later "
        "revision 'fix-default-system-prompt (#12)' writes the tools as tojson(separators=(',', ':')); this is the "
        "earlier one. Kimi-Linear-48B-A3B-Instruct's own chat_template.jinja is in no stored source in full: the "
        "first 25 of its 48 lines (huggingface.co/hyper-accel/tiny-random-kimi-linear, commit 'Upload tokenizer "
        "from kimi_linear') are Kimi-K2-Instruct's form of the same dialect, without <think>, the default system "
        "message or spaces in the tools' JSON (docs/MODELS.md). Kimi-K2-Instruct copies were not picked: llama.cpp's "
        "moonshotai-Kimi-K2.jinja renders no tool calls in the history, and the llama.cpp forks' Kimi-K2-Instruct.jinja "
        "calls list.append, which transformers' sandbox refuses (every case with a call fails there)."
    ),
    "kimi-k3": (
        "A PORT, not the model's own file: moonshotai/Kimi-K3 ships no chat_template.jinja; its format is the Python "
        "encoder encoding_k3.py of the model repository (tokenization_kimi.py's apply_chat_template calls it). The "
        "stored template is models/templates/Kimi-K3.jinja of GitHub ggml-org/llama.cpp (commit "
        "181a4a8fb1af6142a7bf611dddd36fe34a3de3fe), llama.cpp's Jinja port of that encoder, 14,936 bytes, sha256 "
        "6b9c0d9aff91cf15db6db37578bff619a81acb32ae4d076ad59bec985a53e999. Checked once by hand against vLLM's "
        "copy of the encoder, vllm/tokenizers/encoding_k3.py ('Derived from moonshotai/Kimi-K3 encoding_k3.py at "
        "commit c5d1dd4'; not in this repository), on the corpus' raw requests with the same thinking_effort: 97 of "
        "the 99 cases normalization accepts render the same bytes; the encoder drops a developer message (kvserve "
        "renders it as system, as for every family) and refuses arguments that are JSON but not an object (kvserve "
        "writes them as a json block). The port writes thinking_effort=max when none is given (the encoder no note), "
        "also accepts 'medium', names an assistant message, sorts keys without regard to case and, given a JSON "
        "arguments string, writes a json block where the encoder parses it into arguments; kvserve passes the port "
        "the parsed object, as the encoder does (docs/MODELS.md)."
    ),
    "gemma3": (
        "chat_template of google/gemma-3-*-it (the same for 270M to 27B): `_CHAT_TEMPLATE` of "
        "src/transformers/models/gemma3/convert_gemma3_weights.py in GitHub huggingface/transformers (commit "
        "0d7e95d96b4e187c651e2b2406ed98ed40d74963), the template that Google's conversion script writes into the "
        "released tokenizers, 1,539 bytes with its final newline. The gemma3-270m GGUF (tokenizer.chat_template) "
        "carries none: it is the pretrained model. The template has no tools: the tool cases are the prompt of "
        "Google's function-calling guide for Gemma 3 (ai.google.dev/gemma/docs/capabilities/function-calling, its "
        "JSON variant: the instructions and the function list in the system prompt, calls as "
        '{"name": ..., "parameters": {...}}) with results in ```tool_output blocks, as '
        "server/rendering/native/gemma3.py prepares them, rendered by this template."
    ),
    "deepseek-v3.2": (
        "encoding/encoding_dsv32.py of deepseek-ai/DeepSeek-V3.2 (MIT licence, Copyright (c) 2023 DeepSeek), recovered "
        "from the verbatim copy in GitHub papkdvvoetochie/aboba (encoding_dsv32.py, commit "
        "7d7804828183d80a86189c36fb8ef7617ebdad76, Jan 2026). vLLM (vllm/tokenizers/deepseek_v32_encoding.py) and "
        "SGLang (encoding_dsv32.py, 'adapted') keep older copies whose tool prompt lacks the blank lines between its "
        "paragraphs; this one has them, as does llama.cpp's DeepSeek-V3.2 template derived from the release."
    ),
    "gpt-oss": (
        "openai-harmony 0.0.8 (PyPI), OpenAI's harmony encoder that gpt-oss was trained with: "
        "render_conversation_for_completion with its default auto_drop_analysis and no conversation date, its o200k "
        "vocabulary read offline from bpe-openai's copy. The stored template is chat_template.jinja of "
        "openai/gpt-oss-20b at its 2025-08-08 revision ('Update chat_template.jinja (#94)', 16,738 bytes, sha256 "
        "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146), from the Hub repository's history as "
        "mirrored in GitHub EchoCog/gpt-oss-20b (commit cbf31f6); it renders a date and differs from the library on "
        "instructions, past reasoning, later system messages and tools without descriptions (test_harmony.py)."
    ),
    "devstral": (
        "mistral-common 1.9.1 (PyPI), Mistral's reference encoder for Devstral Small 2 / Devstral 2: MistralTokenizer "
        "with InstructTokenizerV13 and InstructRequestNormalizerV13, the request validator's structure checks left "
        "out (mistral_reference.encode(validate=False)), over the tekken vocabulary its wheel ships "
        "(tests/rendering/mistral_reference.py). The stored template is "
        "tests/data/chat_templates/v13.jinja of GitHub mistralai/mistral-common (commit bc022b9, 8,838 bytes), "
        "the Jinja form of the same format that mistral-common generates for the Hub; a case the library refuses "
        "is an expected error."
    ),
    "gemma4": (
        "chat_template.jinja of google/gemma-4-31B-it as released (the E2B/E4B/26B-A4B/31B -it models share it), "
        "12,311 bytes, sha256 45f9fa7033b7ba229b59c48d4c0997fc5d68963753f7f039f2e0702f4c50509b: llama.cpp's copy "
        "models/templates/google-gemma-4-31B-it.jinja (named after the Hub repository) as mirrored in GitHub "
        "acproject/seq2seq_llama.cpp (commit 6626e786afc71be2514e584ca545834293d6e93d). Not checked against the Hub "
        "file itself (no network): an LFS pointer to the same path in GitHub Raudbjorn/ggml-llama.cpp (commit "
        "18f8ce4) names a 12,045-byte revision (sha256 2dfbfc7d...), and later revisions also scan role:tool "
        "messages and keep reasoning between calls (llama.cpp's google-gemma-4-31B-it-interleaved.jinja). Tool "
        "results reach the template as the assistant message's tool_responses, as server/rendering/native/gemma4.py "
        "prepares them."
    ),
    "deepseek-v4": (
        "encoding/encoding_dsv4.py of deepseek-ai/DeepSeek-V4 (MIT licence, Copyright (c) 2023 DeepSeek), recovered "
        "from GitHub supermy/ds4rs encoding/ (commit 2ecc534c2423f589fd2c3f04b76b46dc41f6f162), a copy of the model "
        "repo's encoding folder with Chinese comments added to the code; DeepSeek's own README and four test cases "
        "(tests/rendering/deepseek_v4_cases/) come with it, and this encoder reproduces all four byte for byte. "
        "DeepSeek's logic is followed where vLLM's copy differs (vLLM reads `reasoning` instead of "
        "`reasoning_content`, and encodes object arguments directly instead of the string form)."
    ),
}


def load_encoder(path: Path) -> ModuleType:
    """An official DeepSeek encoder module, loaded from its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def encode_official(family: str, encoder: ModuleType, case) -> dict:
    """The DeepSeek encoders in place of a template: ``thinking`` picks the mode, V4 takes ``reasoning_effort``."""
    try:
        prepared = get_renderer(family).prepare(case.messages, case.tools)
    except ValueError as exc:
        return {"error": f"normalization: {exc}"}
    options: dict = {"drop_thinking": case.kwargs.get("drop_thinking", True)}
    if family == "deepseek-v4":
        options["reasoning_effort"] = case.kwargs.get("reasoning_effort")
    mode = "thinking" if thinking_on(case.kwargs) else "chat"
    try:
        return {"prompt": encoder.encode_messages(copy.deepcopy(prepared.messages), mode, **options)}
    except Exception as exc:  # noqa: BLE001 - an encoder failure is a recorded outcome
        return {"error": f"encoder: {type(exc).__name__}: {exc}"}


def render_official(family: str, template: str, case) -> dict:
    """``{"prompt": text}`` or ``{"error": "normalization: ..."/"template: ..."}`` for one case."""
    renderer = get_renderer(family)
    try:
        prepared = renderer.prepare(case.messages, case.tools)
    except ValueError as exc:
        return {"error": f"normalization: {exc}"}
    special_tokens = OFFICIAL[family][1]
    try:
        rendered, _ = render_jinja_template(
            conversations=[prepared.messages],
            tools=prepared.tools,
            chat_template=template,
            add_generation_prompt=case.add_generation_prompt,
            **{**special_tokens, **case.kwargs},
        )
    except Exception as exc:  # noqa: BLE001 - any template failure is a recorded outcome, not a generator bug
        return {"error": f"template: {type(exc).__name__}: {exc}"}
    return {"prompt": rendered[0]}


def render_library(family: str, case) -> dict:
    """gpt-oss and devstral: ``{"prompt": text}`` from openai-harmony or mistral-common, or the error."""
    from tests.rendering import harmony_reference, mistral_reference

    try:
        prepared = get_renderer(family).prepare(case.messages, case.tools)
    except ValueError as exc:
        return {"error": f"normalization: {exc}"}
    if family == "devstral":
        try:
            return {"prompt": mistral_reference.encode(prepared.messages, prepared.tools, validate=False)[0]}
        except Exception as exc:  # noqa: BLE001 - what the library refuses is a recorded outcome
            return {"error": f"library: {type(exc).__name__}: {exc}"}
    try:
        return {"prompt": harmony_reference.render(prepared.messages, prepared.tools, case.add_generation_prompt,
                                                   case.kwargs.get("reasoning_effort"))}
    except ValueError as exc:  # an effort the library does not know
        return {"error": f"library: {exc}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--templates", type=Path, default=DEFAULT_SOURCE, help="directory of the official .jinja files")
    parser.add_argument("--family", action="append", help="only these families (default: all)")
    args = parser.parse_args(argv)
    GOLDENS.mkdir(exist_ok=True)
    TEMPLATES.mkdir(exist_ok=True)
    for family, (filename, _) in OFFICIAL.items():
        if args.family and family not in args.family:
            continue
        source = args.templates / filename
        if source.is_file():
            shutil.copyfile(source, TEMPLATES / filename)
        template = (TEMPLATES / filename).read_text(encoding="utf-8")
        if family in ("gpt-oss", "devstral"):
            cases = {case.name: render_library(family, case) for case in CASES}
        elif filename.endswith(".py"):
            encoder = load_encoder(TEMPLATES / filename)
            cases = {case.name: encode_official(family, encoder, case) for case in CASES}
        else:
            cases = {case.name: render_official(family, template, case) for case in CASES}
        golden = {
            "family": family,
            "template": filename,
            "source": SOURCES.get(family, _SHARED_SOURCES),
            "template_sha256": hashlib.sha256((TEMPLATES / filename).read_bytes()).hexdigest(),
            "cases": cases,
        }
        text = json.dumps(golden, ensure_ascii=False, indent=1) + "\n"
        (GOLDENS / f"{family}.json").write_text(text, encoding="utf-8")
        errors = sum("error" in result for result in golden["cases"].values())
        print(f"{family}: {len(CASES)} cases, {errors} expected errors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
