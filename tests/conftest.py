"""Test-wide setup. Without a GPU, Triton kernels run under the Triton interpreter (set before triton is imported).

Test tiers (README, Tests): `python -m pytest -q -m "not slow"` is the fast tier, `python -m pytest -q` (and
`.ci/run`) runs everything. A test is in the slow tier when it carries `@pytest.mark.slow` in its file, or when the
rules below mark it: every behaviour keeps one quick case in the fast tier, and the slow tier holds the rest of the
sweep (the other kernel shapes under the Triton interpreter, the other models of an HF-equality sweep, the other
tensor-parallel layouts, the Triton-backend twins of engine tests, the real-weights model where a random-weights one
shows the same), and every test that took longer than FAST_SECONDS in the last recorded full run
(tests/durations.json) except each file's quickest, so that the fast tier keeps its time and still runs every file.
`KVSERVE_RECORD_DURATIONS=1 python -m pytest -q` records the run's times there (run it after adding heavy tests).
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

# Files whose parametrized tests sweep Triton kernels against their references under the interpreter: the first case
# of each test stays in the fast tier, the others are slow.
KERNEL_SWEEPS = ("tests/kernels/test_triton_ops.py", "tests/kernels/test_fp8.py", "tests/kernels/test_sparse.py",
                 "tests/kernels/test_moe.py", "tests/kernels/test_mla.py", "tests/kernels/test_recurrent.py",
                 "tests/kernels/test_compressed.py", "tests/kernels/test_sliding_window.py",
                 "tests/kernels/test_gelu.py")

# Test ids (a prefix of the node id, parameters included) in the slow tier, with why.
SLOW = (
    # HF equality: qwen3-moe-tiny's variety check repeats the dense models' (its equality checks stay quick).
    "tests/models/test_hf_equality.py::test_tiny_model_outputs_are_varied[qwen3-moe-tiny]",
    # The padded decode path: the torch case stays quick; the Triton ones run the attention kernel interpreted.
    "tests/worker/test_decode_graph_padding.py::test_padded_decode_matches_unpadded_greedy_tokens[triton",
    "tests/worker/test_decode_graph_padding.py::test_padding_rows_write_no_kv_page[triton]",
    # FP8: the torch paths and the small block case stay quick.
    "tests/models/test_fp8_weights.py::test_triton_backend_keeps_fp8_weights_and_runs_the_fp8_gemm[block0-True]",
    "tests/models/test_fp8_weights.py::test_broken_fp8_checkpoints_fail_with_the_tensor_named",
    "tests/worker/test_fp8_kv_cache.py::test_fp8_kv_cache_stays_within_the_stated_logprob_distance[qwen3-tiny]",
    "tests/worker/test_fp8_kv_cache.py::test_fp8_kv_cache_triton_backend_gives_the_torch_backends_tokens",
    # KV tiers: the host tier's round trip stays quick; disk restarts and corruption write and reread files.
    "tests/kv/test_kv_tiers.py::test_disk_tier_survives_a_restart",
    "tests/kv/test_kv_tiers.py::test_a_corrupt_block_file_is_dropped_at_startup",
    "tests/kv/test_kv_tiers.py::test_session_held_across_a_tool_call[False]",
    # The offline CLI in a subprocess (the API itself is quick); constrained decoding at temperature 1 over seeds.
    "tests/engine/test_offline_api.py::test_generate_cli_prints_the_greedy_completion",
    "tests/worker/test_structured_output.py::test_every_output_validates_at_temperature_1",
    "tests/worker/test_structured_output.py::test_preempted_constrained_requests_resume_their_grammar",
    "tests/sched/test_scheduling.py::test_chunked_prefill_with_tiny_token_budgets[7]",
    # Benchmarks run end to end (their report shapes stay quick).
    "tests/bench/test_gpu_check.py::test_engine_steps_run_on_cpu_with_small_shapes",
    "tests/bench/test_gpu_check.py::test_dry_run_resolves_every_step_from_carried_wheels",
    "tests/bench/test_gpu_check.py::test_engine_on_the_triton_backend_matches_hf",
    "tests/bench/test_gpu_check.py::test_tensor_parallel_step_compares_two_ranks_with_one_and_says_when_gpus_are_missing",
    "tests/bench/test_agent_sessions.py::test_engine_replay_matches_the_simulator_request_for_request[device-only LRU]",
    "tests/bench/test_agent_sessions.py::test_engine_replay_matches_the_simulator_request_for_request[+ host tier]",
    "tests/bench/test_agent_sessions.py::test_engine_replay_matches_the_simulator_request_for_request[+ session",
    "tests/bench/test_structured_bench.py::test_bench_structured_reports_every_fraction",
    "tests/bench/test_engine_run.py::test_engine_hits_match_the_simulator",
    # Schema fuzzing (a few hundred hypothesis cases against qwen_server, ~15 s): the same validation and error
    # shapes are checked case by case in the fast tier by tests/server/http/test_bad_input.py and test_request_fields.py.
    "tests/server/http/test_fuzz_schema.py::",
)

# Sweeps of one check over models or layouts: every test of the file whose parameter id is listed is slow.
SLOW_CASES = {
    # qwen3-tiny, deepseek-tiny and qwen3-moe-tiny stay quick. deepseek-v3-tiny's MLA + MoE equality with HF stays in
    # the fast tier through tests/models/test_moe_mla_models.py (the greedy tokens of its save_pretrained directory).
    "tests/models/test_hf_equality.py": ("smollm2-135m", "deepseek-v3-tiny"),
}

# Sweeps whose cases each pay one expensive setup (a parametrized module fixture): one case stays in the fast tier
# with all its tests (they cost little beyond that setup), every other case is slow.
FAST_CASE = {
    # MoE split by expert over 2 ranks, with async scheduling; dense qwen3-tiny over 2 ranks stays quick in
    # tests/server/models/test_tensor_parallel_serve.py.
    "tests/parallel/test_tensor_parallel.py": "qwen3-moe-tiny-tp2-ep-async",
}


# Seconds (setup + call + teardown) a test may have taken in the last recorded full run and stay in the fast tier.
FAST_SECONDS = 1.0
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    first_cases: set[str] = set()
    kept_fast: set[str] = set()  # the FAST_CASE tests: their recorded times are their shared setup's
    for item in items:
        nodeid = item.nodeid
        path = nodeid.split("::", 1)[0]
        case = nodeid.split("[", 1)[1][:-1] if nodeid.endswith("]") else None  # the parameter id
        if nodeid.startswith(SLOW) or (case is not None and case in SLOW_CASES.get(path, ())):
            item.add_marker(pytest.mark.slow)
        elif path in FAST_CASE and case is not None:
            if case == FAST_CASE[path]:
                kept_fast.add(nodeid)
            else:
                item.add_marker(pytest.mark.slow)
        elif nodeid.startswith(KERNEL_SWEEPS) and case is not None:
            function = nodeid.split("[", 1)[0]
            if function in first_cases:
                item.add_marker(pytest.mark.slow)
            first_cases.add(function)
    _mark_slow_by_recorded_time(items, kept_fast)


def _mark_slow_by_recorded_time(items: list[pytest.Item], kept_fast: set[str]) -> None:
    """Slow: a test that took over FAST_SECONDS when last recorded, unless it is its file's quickest fast test or kept
    fast by FAST_CASE. A test not recorded yet stays fast."""
    recorded: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        if item.get_closest_marker("slow") is None and item.nodeid in recorded:
            by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    for file_items in by_file.values():
        quickest = min(file_items, key=lambda item: recorded[item.nodeid])
        for item in file_items:
            if item is not quickest and item.nodeid not in kept_fast and recorded[item.nodeid] > FAST_SECONDS:
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
