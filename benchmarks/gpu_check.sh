#!/usr/bin/env bash
# kvserve's GPU check, self-contained for a machine with no package registry (docs/bench/GPU.md).
#   bash benchmarks/gpu_check.sh --prepare     here: download the wheels the device lacks into .whl/
#   bash benchmarks/gpu_check.sh --dry-run     here: resolve every step's inputs without CUDA
#   bash benchmarks/gpu_check.sh [--quick] --out FILE    on the GPU (9 minutes; --quick: 4)
# Wheels in $KVSERVE_WHEEL_DIR (default .whl/) are installed offline into a temporary site first.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # the kernels run natively on the GPU
export PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore
# Keep Triton's current default (FP fusion on) explicitly; it silences the 3.9 deprecation warning.
export TRITON_DEFAULT_FP_FUSION="${TRITON_DEFAULT_FP_FUSION:-1}"

wheel_dir="${KVSERVE_WHEEL_DIR:-.whl}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout, not an installed kvserve
if [[ " $* " != *" --prepare "* ]] && compgen -G "$wheel_dir/*.whl" >/dev/null; then
  site="$(mktemp -d "${TMPDIR:-/tmp}/kvserve-site.XXXXXX")"
  trap 'rm -rf "$site"' EXIT
  mapfile -t wheels < <(python3 -m benchmarks.gpu.wheels "$wheel_dir")  # all on the device; cp312 ones not here
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "${wheels[@]}" || { echo "gpu_check: installing the wheels in $wheel_dir failed" >&2; exit 3; }
  export PYTHONPATH="$PWD:$site${PYTHONPATH#"$PWD"}" KVSERVE_WHEEL_SITE="$site"
fi

# A hard stop just past the plan's own budget (510 s, --quick 210 s), inside the device tool's 600 s call.
limit=550
[[ " $* " == *" --quick "* ]] && limit=240
timeout "$limit" python3 -m benchmarks.gpu.check "$@"
