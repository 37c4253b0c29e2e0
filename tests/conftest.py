"""Test-wide setup. Without a GPU, Triton kernels run under the Triton interpreter (set before triton is imported).

Test tiers (README, Tests): `python -m pytest -q -m "not slow"` is the fast tier, `python -m pytest -q` (and
`.ci/run`) runs everything. A test's tier is in the test itself: `@pytest.mark.slow`, or, for a sweep, which of its
cases stay fast (`@pytest.mark.fast_cases(...)`) or go slow (`@pytest.mark.slow_cases(...)`). Every behaviour keeps
one quick case in the fast tier; a test over about a second is slow unless it is its file's quickest.
`KVSERVE_RECORD_DURATIONS=1 python -m pytest -q` records the run's times in tests/durations.json, where a fast test
that has grown shows (docs/TESTS.md).
"""
import ctypes
import gc
import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `-n auto` (pyproject's addopts) runs the suite on pytest-xdist workers: one per core, no more than the machine's
# memory holds (a worker, its session servers and the processes its tests start reached 10 GB in the whole suite:
# WORKER_BYTES), and no more than MAX_WORKERS (past that, every worker's own session servers cost more than the
# parallelism gives). `-n 0` runs in one process (`--pdb` implies it).
WORKER_BYTES = 10 << 30
MAX_WORKERS = 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    cores = len(os.sched_getaffinity(0))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores, memory // WORKER_BYTES, MAX_WORKERS))


# A worker's torch uses its share of the cores: two workers with a thread per core each oversubscribe the machine
# (on two cores, over half the CPU time went to the kernel, threads waiting on each other).
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // workers))

def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A parametrized test's tier, case by case, from its own markers: `fast_cases(ids...)` keeps the cases named
    fast and makes the others slow (a sweep keeps one quick case in the fast tier); `slow_cases(ids...)` makes just
    the cases named slow. A case's id is what pytest shows between the brackets."""
    for item in items:
        case = item.nodeid.split("[", 1)[1][:-1] if item.nodeid.endswith("]") else None
        fast, slow = item.get_closest_marker("fast_cases"), item.get_closest_marker("slow_cases")
        if case is not None and ((fast and case not in fast.args) or (slow and case in slow.args)):
            item.add_marker(pytest.mark.slow)


# How much the process may grow (bytes) after a full collection before the next module starts with another.
SWEEP_GROWTH = 2 << 30
_swept_at_rss = 0


@pytest.fixture(autouse=True, scope="module")
def _free_module_memory():
    """Before each module: engines the modules before it left in reference cycles are freed and the heap handed back,
    so that a test process does not grow module by module (it passed 20 GB on a 24 GB machine before this).
    What survives is frozen (`gc.freeze`): a full collection walks the objects of torch, transformers and the live
    servers for about 0.5 s, over a minute of the fast tier's 116 modules; frozen ones are not walked again. An object
    frozen while in use and dropped in a cycle later waits for the process to grow by SWEEP_GROWTH: then all are
    unfrozen and collected."""
    global _swept_at_rss
    sweep = _rss() - _swept_at_rss > SWEEP_GROWTH  # true for the first module
    if sweep:
        gc.unfreeze()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    if sweep:
        _swept_at_rss = _rss()
    gc.freeze()
    yield


def _rss() -> int:
    """This process's resident bytes (0 where /proc is missing: then every module starts with a full collection)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.unfreeze()  # the interpreter's last collection frees frozen objects too (nanobind reports leaks otherwise)


DURATIONS = Path(__file__).with_name("durations.json")
_run_times: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _run_times[report.nodeid] = _run_times.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if os.environ.get("KVSERVE_RECORD_DURATIONS") != "1" or not _run_times:
        return
    if hasattr(session.config, "workerinput"):  # a pytest-xdist worker: the controller records every worker's tests
        return
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    recorded.update({nodeid: round(seconds, 2) for nodeid, seconds in _run_times.items()})
    DURATIONS.write_text(json.dumps(dict(sorted(recorded.items())), indent=0) + "\n")

# The HF oracle's session fixtures (a Qwen3 LLM, the hybrid checkpoints), for every folder that compares with it.
from tests.hf_oracle import hybrid_dirs, qwen3_llm  # noqa: E402, F401
