"""Build-once model directories: built in a temporary directory and renamed into place, so a reader never sees a
half-written model and concurrent processes (parallel test workers) never race.

Each directory records the fingerprint of the recipe that built it; a changed recipe (or builder version) rebuilds.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

BUILD_MARKER = "kvserve_build.json"


def cache_root() -> Path:
    """`$KVSERVE_CACHE_DIR/models`, by default ~/.cache/kvserve/models."""
    root = os.environ.get("KVSERVE_CACHE_DIR") or Path.home() / ".cache" / "kvserve"
    return Path(root).expanduser() / "models"


def is_built(target: Path, fingerprint: str) -> bool:
    try:
        marker = json.loads((target / BUILD_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("fingerprint") == fingerprint


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    # The lock only saves duplicate work; correctness comes from the atomic rename below.
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _make_readable(directory: Path) -> None:
    # mkdtemp (and some writers) create private files; a model cache is readable like any other download.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def build_once(target: Path, fingerprint: str, build: Callable[[Path], None]) -> Path:
    """Return `target`, first running `build(tmp_dir)` and moving the result there unless it is already built."""
    if is_built(target, fingerprint):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{target.name}.lock"):
        if is_built(target, fingerprint):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".building", dir=target.parent))
        stale = target.parent / f".{target.name}.stale-{os.getpid()}"
        try:
            build(staging)
            (staging / BUILD_MARKER).write_text(json.dumps({"fingerprint": fingerprint}) + "\n", encoding="utf-8")
            _make_readable(staging)
            if target.exists():  # built by an older recipe: move it aside first, rename cannot replace a full dir
                os.rename(target, stale)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(stale, ignore_errors=True)
    return target
