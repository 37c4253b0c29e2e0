"""The model registry, the build-once cache, and `kvserve models`. No network: hub models are checked offline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from engine.model_sources import cache
from engine.model_sources.templates import load_template
from engine.registry import (
    TEMPLATE_FAMILIES,
    default_model_name,
    get_model_spec,
    guess_template_family,
    list_models,
    resolve_model,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_registry_lists_the_required_models() -> None:
    specs = {spec.name: spec for spec in list_models()}
    assert default_model_name() == "smollm2-135m"
    assert specs["qwen3-tiny"].source == "tiny" and specs["qwen3-tiny"].template == "qwen3"
    assert specs["deepseek-tiny"].source == "tiny" and specs["deepseek-tiny"].template == "deepseek-v3.1"
    assert specs["smollm2-135m"].source == "gguf" and specs["smollm2-135m"].template == "jinja"
    by_repo = {spec.repo_id: spec for spec in specs.values() if spec.source == "hf"}
    assert by_repo["Qwen/Qwen3-0.6B"].template == "qwen3"
    assert by_repo["Qwen/Qwen3-8B"].template == "qwen3"
    assert by_repo["Qwen/Qwen2.5-7B-Instruct"].template == "qwen2.5"
    assert by_repo["deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"].template == "deepseek-r1-distill"
    assert all(spec.template in TEMPLATE_FAMILIES for spec in specs.values())
    # the agents' own architectures: Qwen3-MoE and DeepSeek-V2/V3
    assert (specs["qwen3-moe-tiny"].source, specs["qwen3-moe-tiny"].template) == ("tiny", "qwen3-coder")
    assert (specs["deepseek-v3-tiny"].source, specs["deepseek-v3-tiny"].template) == ("tiny", "deepseek-v3.1")
    assert specs["qwen3-coder-30b-a3b"].repo_id == "Qwen/Qwen3-Coder-30B-A3B-Instruct"
    assert specs["qwen3-coder-30b-a3b"].template == "qwen3-coder"
    assert (specs["qwen3-30b-a3b"].repo_id, specs["qwen3-30b-a3b"].template) == ("Qwen/Qwen3-30B-A3B", "qwen3")
    assert specs["deepseek-v2-lite-chat"].repo_id == "deepseek-ai/DeepSeek-V2-Lite-Chat"
    assert (specs["deepseek-v3.1"].repo_id, specs["deepseek-v3.1"].template) == ("deepseek-ai/DeepSeek-V3.1",
                                                                                "deepseek-v3.1")


def test_todays_deepseek_models_and_the_gpus_they_need(capsys) -> None:
    """V3.2 and V4 by HF id with their encoders' families; `kvserve serve` says how many GPUs a real one needs
    before it downloads anything, and when they outgrow one machine."""
    from server.cli.serve import _say_gpu_requirement

    specs = {spec.name: spec for spec in list_models()}
    assert (specs["deepseek-v3.2-tiny"].source, specs["deepseek-v3.2-tiny"].template) == ("tiny", "deepseek-v3.2")
    for name, repo, family, gpus in [("deepseek-v3.2", "deepseek-ai/DeepSeek-V3.2", "deepseek-v3.2", 16),
                                     ("deepseek-v4-flash", "deepseek-ai/DeepSeek-V4-Flash", "deepseek-v4", 8),
                                     ("deepseek-v4-pro", "deepseek-ai/DeepSeek-V4-Pro", "deepseek-v4", 32),
                                     ("glm-5", "zai-org/GLM-5", "glm-4.7", 16)]:
        assert (specs[name].repo_id, specs[name].template, specs[name].gpus) == (repo, family, gpus)
    assert specs["qwen3-8b"].gpu_requirement() is None
    _say_gpu_requirement("deepseek-v4-flash", 1)
    flash = capsys.readouterr().err
    assert "deepseek-v4-flash needs 8 GPUs" in flash and "--tensor-parallel-size 8" in flash
    assert "more than one" not in flash
    _say_gpu_requirement("deepseek-v4-flash", 8)
    assert capsys.readouterr().err == ""  # enough ranks asked for: nothing to say
    _say_gpu_requirement("deepseek-ai/DeepSeek-V4-Pro", 8)
    assert "more than one 8-GPU machine" in capsys.readouterr().err


def test_devstral_models() -> None:
    """devstral-small-tiny and the released Devstral models by HF id, all in the devstral family; Devstral 2 (123B
    dense, ~246 GB in bf16) needs two H200s."""
    specs = {spec.name: spec for spec in list_models()}
    tiny = specs["devstral-small-tiny"]
    assert (tiny.source, tiny.template, tiny.build["model_type"], tiny.build["tokenizer"]) == (
        "tiny", "devstral", "ministral3", "tekken")
    assert (specs["devstral-small-2"].repo_id, specs["devstral-small-2"].template, specs["devstral-small-2"].gpus) == (
        "mistralai/Devstral-Small-2-24B-Instruct-2512", "devstral", None)
    assert (specs["devstral-2"].repo_id, specs["devstral-2"].template, specs["devstral-2"].gpus) == (
        "mistralai/Devstral-2-123B-Instruct-2512", "devstral", 2)


def test_minimax_models() -> None:
    """minimax-m2-tiny (the architecture, a stand-in tokenizer) and MiniMax-M2.5 by HF id, in the minimax-m2 family;
    M2.5 (229B, ~460 GB with its experts in bf16) needs four H200s."""
    specs = {spec.name: spec for spec in list_models()}
    tiny = specs["minimax-m2-tiny"]
    assert (tiny.source, tiny.template, tiny.build["model_type"], tiny.build["tokenizer"]) == (
        "tiny", "minimax-m2", "minimax_m2", "minimax")
    assert (specs["minimax-m2.5"].repo_id, specs["minimax-m2.5"].template, specs["minimax-m2.5"].gpus) == (
        "MiniMaxAI/MiniMax-M2.5", "minimax-m2", 4)


def test_kimi_models() -> None:
    """kimi-linear-tiny (the architecture, a stand-in tokenizer) in the kimi-k2 family; Kimi-Linear-48B-A3B by HF id
    keeps its own template (its tokenizer is remote code kvserve does not run)."""
    specs = {spec.name: spec for spec in list_models()}
    tiny = specs["kimi-linear-tiny"]
    assert (tiny.source, tiny.template, tiny.build["model_type"], tiny.build["tokenizer"]) == (
        "tiny", "kimi-k2", "kimi_linear", "kimi")
    assert specs["kimi-linear-48b-a3b"].repo_id == "moonshotai/Kimi-Linear-48B-A3B-Instruct"
    # Kimi-K3's format: on kimi-linear-tiny's recipe with K3's stand-in tokenizer; the release by HF id (2.8T, ~5.6 TB
    # with its experts in bf16: 40 H200s)
    k3_tiny = specs["kimi-k3-format-tiny"]
    assert (k3_tiny.template, k3_tiny.build["tokenizer"]) == ("kimi-k3", "kimi-k3")
    assert {k: v for k, v in k3_tiny.build.items() if k != "tokenizer"} == {
        k: v for k, v in tiny.build.items() if k != "tokenizer"}
    assert (specs["kimi-k3"].repo_id, specs["kimi-k3"].template, specs["kimi-k3"].gpus) == (
        "moonshotai/Kimi-K3", "kimi-k3", 40)


def test_a_registered_model_is_found_by_its_repo_id() -> None:
    assert get_model_spec("Qwen/Qwen3-8B").name == "qwen3-8b"


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        get_model_spec("no-such-model")
    assert "no-such-model" in str(info.value)
    assert "qwen3-tiny" in str(info.value) and "smollm2-135m" in str(info.value)


def _model_dir(path: Path, chat_template: str | None) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    config = {} if chat_template is None else {"chat_template": chat_template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_local_directory_template_is_guessed_only_on_an_exact_match(tmp_path: Path) -> None:
    qwen = _model_dir(tmp_path / "qwen", load_template("qwen3"))
    edited = _model_dir(tmp_path / "edited", load_template("qwen3").replace("<tool_call>", "<call>"))
    bare = _model_dir(tmp_path / "bare", None)
    assert guess_template_family(qwen) == "qwen3"
    assert guess_template_family(edited) == "jinja"
    assert guess_template_family(bare) == "jinja"
    spec = get_model_spec(str(qwen))
    assert (spec.source, spec.template, spec.path) == ("local", "qwen3", qwen.resolve())
    assert resolve_model(str(qwen)) == qwen.resolve()


def test_standalone_chat_template_file_is_read(tmp_path: Path) -> None:
    model = _model_dir(tmp_path / "m", None)
    (model / "chat_template.jinja").write_text(load_template("deepseek-v3.1"))
    assert guess_template_family(model) == "deepseek-v3.1"


def test_a_gemma4_checkpoint_with_the_released_template_is_rendered_natively(tmp_path: Path) -> None:
    """google/gemma-4-*-it's chat_template.jinja as released (the golden's) is family gemma4; a later revision of it
    (one that also reads role:tool messages) is the model's own Jinja template."""
    released = (Path(__file__).parents[1] / "rendering" / "templates" / "google-gemma-4-31B-it.jinja").read_text()
    assert load_template("gemma4") == released
    model = _model_dir(tmp_path / "g4", None)
    (model / "chat_template.jinja").write_text(released)
    assert guess_template_family(model) == "gemma4"
    (model / "chat_template.jinja").write_text(released.replace("{%- for message in loop_messages -%}",
                                                                "{%- for message in loop_messages if true -%}"))
    assert guess_template_family(model) == "jinja"


def test_deepseek_encoder_checkpoints_are_rendered_by_their_family(tmp_path: Path) -> None:
    """DeepSeek-V3.2 / V4 ship an encoder, no chat template: the architecture names the family, and the tokenizer
    kvserve writes for them carries no template either."""
    from engine.model_sources.deepseek_tokenizer import write_deepseek_tokenizer

    for model_type, family in (("deepseek_v32", "deepseek-v3.2"), ("deepseek_v4", "deepseek-v4")):
        model = tmp_path / model_type
        model.mkdir()
        info = write_deepseek_tokenizer(model, family)
        (model / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert "chat_template" not in json.loads((model / "tokenizer_config.json").read_text(encoding="utf-8"))
        assert guess_template_family(model) == family and info.num_tokens == 129_280
    assert guess_template_family(_model_dir(tmp_path / "llama", None)) == "jinja"


def test_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        get_model_spec(str(tmp_path))


def test_build_once_builds_once_under_concurrency(tmp_path: Path) -> None:
    target = tmp_path / "models" / "m"
    calls: list[int] = []

    def build(out: Path) -> None:
        calls.append(1)
        time.sleep(0.2)  # long enough that every thread arrives while the first build runs
        (out / "weights.bin").write_bytes(b"x" * 100)

    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(cache.build_once(target, "f1", build))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [target] * 4
    assert (target / "weights.bin").read_bytes() == b"x" * 100
    assert sorted(p.name for p in target.parent.iterdir() if not p.name.endswith(".lock")) == ["m"]


def test_build_once_rebuilds_on_a_new_fingerprint_and_survives_a_failed_build(tmp_path: Path) -> None:
    target = tmp_path / "m"
    cache.build_once(target, "v1", lambda out: (out / "v").write_text("1"))
    cache.build_once(target, "v1", lambda out: (out / "v").write_text("ignored: already built"))
    assert (target / "v").read_text() == "1"

    def failing(out: Path) -> None:
        (out / "v").write_text("partial")
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        cache.build_once(target, "v2", failing)
    assert (target / "v").read_text() == "1"  # the old build is untouched, no half-built directory is left
    assert not cache.is_built(target, "v2")
    cache.build_once(target, "v2", lambda out: (out / "v").write_text("2"))
    assert (target / "v").read_text() == "2" and cache.is_built(target, "v2")
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["m"]


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    assert cache.cache_root() == tmp_path / "models"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "server.cli", "models", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_cli_lists_the_registry() -> None:
    result = _cli()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "SOURCE", "TEMPLATE", "ON"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["qwen3-tiny"][1:3] == ["tiny", "qwen3"]
    assert rows["smollm2-135m"][1:4] == ["(default)", "gguf", "jinja"]
    assert rows["qwen3-8b"][1:3] == ["hf", "qwen3"]
    assert "Qwen/Qwen3-8B" in rows["qwen3-8b"]


@pytest.mark.slow
def test_cli_path_builds_a_tiny_model_and_reports_it_on_disk(tmp_path: Path) -> None:
    env = {"KVSERVE_CACHE_DIR": str(tmp_path)}
    result = _cli("--path", "qwen3-tiny", env=env)
    assert result.returncode == 0, result.stderr
    model_dir = Path(result.stdout.strip())
    assert model_dir == tmp_path / "models" / "qwen3-tiny"
    expected = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
    for name in expected:
        assert (model_dir / name).is_file(), name
    listing = {line.split()[0]: line.split() for line in _cli(env=env).stdout.splitlines()[1:]}
    assert listing["qwen3-tiny"][3] == "yes"
    assert listing["deepseek-tiny"][3] == "no"


@pytest.mark.slow
def test_cli_hub_model_without_network_fails_clearly(tmp_path: Path) -> None:
    # Offline mode with an empty HF cache: the error must come from the missing snapshot, not from a crash.
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "KVSERVE_CACHE_DIR": str(tmp_path)}
    result = _cli("--path", "qwen3-0.6b", env=env)
    assert result.returncode == 1
    assert "Qwen/Qwen3-0.6B" in result.stderr and "huggingface.co" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_cli_unknown_model_fails_clearly() -> None:
    result = _cli("--path", "no-such-model")
    assert result.returncode == 1
    assert "unknown model 'no-such-model'" in result.stderr and "qwen3-tiny" in result.stderr
