#!/usr/bin/env bash
# The prepared GPU check (kernel tests on the GPU, engine vs HF transformers, decode timing, nano-vllm throughput).
# Usage: bash benchmarks/gpu_check.sh [--out results.json] [--peak-bandwidth-tbs 4.8] [...]; see --help.
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
# The packages are imported from this checkout; no install step (the GPU machine may have no network).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Keep Triton's current default (FP fusion on) explicitly; it silences the 3.9 deprecation warning.
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
# 470 s: the whole check stays under 8 minutes even if a step hangs.
exec timeout 470 python -m benchmarks.gpu_check "$@"
