#!/usr/bin/env bash
# The prepared GPU check (kernel tests on the GPU, engine vs HF transformers, decode timing, nano-vllm throughput).
# Usage: bash benchmarks/gpu_check.sh [--out results.json] [--peak-bandwidth-tbs 4.8] [...]; see --help.
set -euo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET
# Keep Triton's current default (FP fusion on) explicitly; it silences the 3.9 deprecation warning.
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"
python -c "import kernels" 2>/dev/null || pip install -q --no-deps -e .
exec timeout 470 python -m benchmarks.gpu_check "$@"
