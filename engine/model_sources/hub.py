"""Models by Hugging Face repo id, fetched with huggingface_hub only when such a model is asked for."""
from __future__ import annotations

from pathlib import Path

# What a serving engine needs from a model repo: configs, tokenizer, chat template, safetensors weights.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


class HubUnavailableError(RuntimeError):
    """The model is neither in the local Hugging Face cache nor downloadable now."""


def hub_snapshot(repo_id: str, revision: str | None = None, local_files_only: bool = False) -> Path:
    """The local snapshot directory of `repo_id`, downloading the files it lacks unless `local_files_only`."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    try:
        path = snapshot_download(
            repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=local_files_only
        )
    except (OSError, HfHubHTTPError, HFValidationError) as exc:
        raise HubUnavailableError(
            f"cannot get {repo_id!r} from the Hugging Face hub: {type(exc).__name__}: {exc}\n"
            "This model needs network access to huggingface.co (or a copy already in the local Hugging Face cache); "
            "alternatively pass the path of a local model directory."
        ) from exc
    return Path(path)

