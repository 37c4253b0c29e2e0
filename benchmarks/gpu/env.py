"""What the GPU check finds on a machine: package versions against the project's pins, the CUDA runtime and
driver, the GPU, and the optional helpers it adapts to. Reading these never initializes CUDA."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import subprocess
import tomllib
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
CHECKED_PACKAGES = ("torch", "triton", "transformers", "safetensors", "tokenizers")


def pinned_requirements() -> dict[str, Requirement]:
    """The project's requirement on each checked package (dependencies, then the optional extras), from
    pyproject.toml, so the check and the package metadata never disagree."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    lines = project["dependencies"] + [line for extra in project["optional-dependencies"].values() for line in extra]
    pins: dict[str, Requirement] = {}
    for line in lines:
        req = Requirement(line)
        if req.name in CHECKED_PACKAGES:
            pins.setdefault(req.name, req)
    return pins


def package_versions() -> tuple[dict[str, str | None], list[str]]:
    """Installed version of each checked package, and a problem line for each one missing or below the pin."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    problems = []
    for name, req in pinned_requirements().items():
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = None
        versions[name] = version
        if version is None:
            problems.append(f"{name} is not installed (the project needs {req})")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{name} {version} does not satisfy the project's {req}")
    return versions, problems


def nvidia_driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def triton_has_nvidia_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def gpu_facts() -> tuple[dict[str, Any], list[str]]:
    """The GPU, its CUDA runtime and driver (this initializes CUDA), and what they rule out."""
    import torch

    props = torch.cuda.get_device_properties(0)
    facts = {
        "gpu": props.name, "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
        "memory_gib": props.total_memory / 2**30, "torch_cuda": torch.version.cuda, "driver": nvidia_driver(),
        "triton_nvidia_backend": triton_has_nvidia_backend(),
    }
    problems = []
    if (props.major, props.minor) < (8, 0):
        problems.append(f"compute capability {facts['capability']} has no bf16 tensor cores: the bf16 steps need 8.0+")
    if not facts["triton_nvidia_backend"]:
        problems.append("this Triton has no NVIDIA backend: every Triton step will fail")
    return facts, problems
