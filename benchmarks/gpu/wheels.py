"""The wheels the GPU machine needs (``benchmarks/gpu/wheels.txt``): downloading them here (``--prepare``) and
checking what a run would find (``--dry-run``, the environment step).

The device reaches no registry, so pip runs here with the device's interpreter and platform named explicitly, and
``gpu_check.sh`` installs the downloaded files there with ``pip install --no-index --no-deps --target SITE`` and puts
SITE on ``PYTHONPATH`` (exported as ``KVSERVE_WHEEL_SITE``).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS_FILE = Path(__file__).with_name("wheels.txt")
DEVICE_PYTHON = "3.12"  # the H200 image's python3
DEVICE_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                    "manylinux2014_x86_64", "manylinux1_x86_64")


@dataclass(frozen=True)
class WheelRequirement:
    name: str
    version: str

    @property
    def module(self) -> str:
        return self.name.replace("-", "_")

    @property
    def pin(self) -> str:
        return f"{self.name}=={self.version}"

    def find_wheel(self, directory: Path) -> Path | None:
        """The downloaded wheel of exactly this version (wheel file names spell the name with '_')."""
        stem = re.sub(r"[-_.]+", "_", self.name).lower()
        found = sorted(directory.glob(f"{stem}-{self.version}-*.whl"))
        return found[0] if found else None


def requirements(path: Path = REQUIREMENTS_FILE) -> list[WheelRequirement]:
    reqs = []
    for line in path.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if spec:
            name, sep, version = spec.partition("==")
            if not sep:
                raise ValueError(f"{path}: pin an exact version (NAME==VERSION), not {spec!r}")
            reqs.append(WheelRequirement(name.strip(), version.strip()))
    return reqs


def wheel_dir() -> Path:
    """Where the wheels are downloaded and read from: ``$KVSERVE_WHEEL_DIR`` or ``.whl`` at the repository root."""
    return Path(os.environ.get("KVSERVE_WHEEL_DIR") or REPO_ROOT / ".whl")


def download_command(directory: Path) -> list[str]:
    platforms = [arg for platform in DEVICE_PLATFORMS for arg in ("--platform", platform)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
            DEVICE_PYTHON, "--implementation", "cp", *platforms, "-d", str(directory),
            "-r", str(REQUIREMENTS_FILE)]


def prepare() -> int:
    """Download the pinned wheels into the wheel directory (here, where pip reaches the registry)."""
    directory = wheel_dir()
    directory.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(download_command(directory))
    wheels = [req.find_wheel(directory) for req in requirements()]
    missing = [req.pin for req, wheel in zip(requirements(), wheels) if wheel is None]
    if result.returncode or missing:
        print(f"wheels missing from {directory}: {', '.join(missing) or 'see the pip error above'}", file=sys.stderr)
        return 1
    size = sum(wheel.stat().st_size for wheel in wheels if wheel) / 2**20
    print(f"{len(wheels)} wheels in {directory} ({size:.1f} MiB): carry that folder to the device "
          f"(docs/bench/GPU.md has the exact call)")
    return 0


def installable_here(wheel: Path) -> bool:
    """Whether this interpreter can install ``wheel``: the dry run (Python 3.11 here) installs the pure and abi3 wheels
    as the device will, and leaves the device's cp312 builds to the packages installed here."""
    return not parse_wheel_filename(wheel.name)[3].isdisjoint(sys_tags())


def _installed(req: WheelRequirement, site: str | None) -> dict[str, Any]:
    spec = importlib.util.find_spec(req.module)
    if spec is None or not spec.submodule_search_locations:
        return {"found": False}
    location = str(next(iter(spec.submodule_search_locations)))
    try:
        version = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        version = None  # files without metadata: the registry's build fingerprint would fail
    return {"found": True, "location": location, "version": version,
            "from_carried_wheel": bool(site) and location.startswith(site)}


def wheel_status(require_carried: bool = True) -> tuple[dict[str, Any], list[str]]:
    """Each pinned package: its wheel in the wheel directory, and where this interpreter imports it from; and a
    problem line for each thing missing.

    ``require_carried`` (here, before carrying): every wheel must be downloaded and import from the site
    ``gpu_check.sh`` installed it into. Otherwise (on the device): importable with metadata is enough.
    """
    directory, site = wheel_dir(), os.environ.get("KVSERVE_WHEEL_SITE")
    rows = []
    for req in requirements():
        wheel = req.find_wheel(directory)
        rows.append({"requirement": req.pin, "wheel": wheel.name if wheel else None, **_installed(req, site),
                     "installable_here": bool(wheel) and installable_here(wheel)})
    problems = [f"{r['requirement']}: not importable" for r in rows if not r["found"] or not r["version"]]
    if require_carried:
        problems += [f"{r['requirement']}: no wheel in {directory}" for r in rows if not r["wheel"]]
        problems += [f"{r['requirement']}: not imported from the carried wheel" for r in rows
                     if r["installable_here"] and not r.get("from_carried_wheel")]
    if problems:
        problems.append("run `bash benchmarks/gpu_check.sh --prepare` here (it downloads the wheels), then carry "
                        "the wheel directory to the device")
    return {"wheel_dir": str(directory), "site": site, "wheels": rows}, problems


if __name__ == "__main__":  # gpu_check.sh: the wheels of a directory this interpreter can install, one per line
    print("\n".join(str(w) for w in sorted(Path(sys.argv[1]).glob("*.whl")) if installable_here(w)))
