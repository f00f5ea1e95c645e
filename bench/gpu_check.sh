#!/usr/bin/env bash
# One prepared check for a CUDA machine (written for an H200) that has python3 with torch,
# triton, pytest (+ pytest-benchmark) and nothing else: no package registry, no install.
#
#   bench/gpu_check.sh OUT_DIR            (from anywhere; about 4 minutes)
#
# 1. the kernel tests on CUDA (Triton compiled for the GPU, and the torch path on CUDA
#    tensors), results as JUnit XML + log;
# 2. the GPU benchmark (bench/gpu_bench.py) as JSON.
# The repository is a plain working tree, not installed: `sdcp_fast.kernels` is made
# importable through a throw-away package folder whose `kernels` is a symlink to kernels/
# (the real sdcp_fast/__init__.py imports the core, which needs cbor2: not on that machine).
set -uo pipefail
OUT=${1:?usage: bench/gpu_check.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir -p "$SHIM/sdcp_fast"
printf '"""Shim: only the kernels package, for bench/gpu_check.sh."""\n' > "$SHIM/sdcp_fast/__init__.py"
ln -s "$ROOT/kernels" "$SHIM/sdcp_fast/kernels"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
# GPU_CHECK_SMOKE=1 rehearses the whole script on a machine without a GPU (interpreter, tiny)
SMOKE=()
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then
  export TRITON_INTERPRET=1
  SMOKE=(--smoke)
else
  unset TRITON_INTERPRET  # compile for the GPU
fi
cd "$SHIM"  # so that the repository's own sdcp_fast/ is not first on sys.path

start=$(date +%s)
"$PY" - <<'PY' | tee "$OUT/environment.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
import sdcp_fast.kernels as k
print("kernels paths", k.available_paths())
PY

# The shared known-answer vectors live outside the repository; without them that test
# file cannot run here (it fails, never skips, where the file is expected to exist).
VECTORS=${SDCP_VECTORS:-/work/shared/vectors/sdcp-vectors.json}
IGNORE=(--ignore "$ROOT/tests/kernels/test_statistics.py")  # CPU-path statistics, needs scipy
[ "${GPU_CHECK_SMOKE:-0}" = 1 ] && IGNORE+=(-m "not slow" -k "not triton")  # rehearsal: quick
if [ ! -f "$VECTORS" ]; then
  echo "note: $VECTORS not here: tests/kernels/test_target_dist_vectors.py not run" | tee -a "$OUT/environment.txt"
  IGNORE+=(--ignore "$ROOT/tests/kernels/test_target_dist_vectors.py")
fi
timeout 150 "$PY" -m pytest "$ROOT/tests/kernels" "${IGNORE[@]}" -q -p no:cacheprovider \
  --rootdir "$ROOT" -o addopts="" --junitxml "$OUT/kernel_tests.xml" 2>&1 | tee "$OUT/kernel_tests.log"
tests_rc=${PIPESTATUS[0]}

left=$(( 270 - ($(date +%s) - start) ))
budget=$(( left > 60 ? left - 40 : 20 ))
timeout $(( budget + 60 )) "$PY" "$ROOT/bench/gpu_bench.py" --out "$OUT" --budget-s "$budget" "${SMOKE[@]}" 2>&1 | tee "$OUT/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}

printf '{"kernel_tests_rc": %d, "gpu_bench_rc": %d, "seconds": %d}\n' \
  "$tests_rc" "$bench_rc" $(( $(date +%s) - start )) | tee "$OUT/summary.json"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
