#!/usr/bin/env bash
# One prepared check for a CUDA machine (written for an H200) that has python3 3.12 with
# torch, triton, pytest (+ pytest-benchmark) and the packages of
# bench/gpu_machine_packages.txt, and no package registry. It ends within
# $GPU_CHECK_SECONDS (default 270 s: every step has a hard limit), so that a lent machine's
# 15 minutes hold two tries with their starts (about 2 minutes each):
#
#   bench/gpu_wheels.sh                 (here, once: the few wheels it needs, into .whl/)
#   bench/gpu_check.sh OUT_DIR          (there; carry .whl; 8 files in OUT_DIR; the device
#                                        tool's timeout_s 330)
#
# 1. installs the wheels from $GPU_WHEELS (default .whl/) with pip --no-index into a
#    temporary folder;
# 2. the tests that need a GPU, on CUDA (Triton compiled for it): the kernel tests, the
#    cache's GPU tier and q-row staging, the built-in model on CUDA, the verifier's device
#    path (token-exact against the reference); JUnit XML + log;
# 3. the compile check for this GPU (bench/gpu_compile.py --gpu device --sweep quick: every kernel
#    compiled for its architecture, registers, spills, occupancy, load widths), then the
#    kernel benchmark (bench/gpu_bench.py, with those figures beside the measured kernel
#    times) and the verifier end to end (bench/gpu_e2e.py), each within its time budget, as JSON.
# The repository is a plain working tree, not installed: `sdcp_fast` (with `kernels`
# inside it, as pyproject.toml maps it) is a throw-away folder of symlinks.
#
# GPU_CHECK_SMOKE=1 rehearses all of it on a machine without a GPU: interpreter, tiny
# sizes, the wheels installed for Python 3.12 (not imported here), and an audit that every
# module any step imported is on the GPU machine or in a wheel (bench/gpu_imports.py).
set -uo pipefail
OUT=${1:?usage: bench/gpu_check.sh OUT_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
[[ "$PY" == */* ]] && PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")  # the script changes directory
WHEELS=${GPU_WHEELS:-$ROOT/.whl}
SMOKE=${GPU_CHECK_SMOKE:-0}
# the rehearsal is not bound by a lent machine's minutes, but by a loaded CI machine's speed
TOTAL=${GPU_CHECK_SECONDS:-$([ "$SMOKE" = 1 ] && echo 480 || echo 270)}
start=$(date +%s)
elapsed() { echo $(( $(date +%s) - start )); }
left() { echo $(( TOTAL - 10 - $(elapsed) )); }   # 10 s kept for the audit and the summary

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
SHIM=$WORK/shim SITE=$WORK/wheels
mkdir -p "$SHIM/sdcp_fast" "$SITE"
for entry in "$ROOT"/sdcp_fast/*; do ln -s "$entry" "$SHIM/sdcp_fast/"; done
ln -s "$ROOT/kernels" "$SHIM/sdcp_fast/kernels"
cat > "$SHIM/pytest.ini" <<'INI'
[pytest]
addopts = -ra
timeout = 300
markers =
    slow: long statistical or end-to-end tests
    gpu: needs a CUDA device
filterwarnings =
    ignore:invalid value encountered:RuntimeWarning:triton.runtime.interpreter
INI

# 1. wheels
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  echo "no wheels in $WHEELS: run bench/gpu_wheels.sh first (and carry .whl)" | tee "$OUT/summary.json"
  exit 2
fi
PIP=(-m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --target "$SITE")
if [ "$SMOKE" = 1 ]; then
  # check that they install for the GPU machine's Python; import the local ones here
  PIP+=(--python-version 3.12 --implementation cp --only-binary=:all:
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
fi
# (at most 8 files come back from the device tool: the wheel log goes into environment.txt)
"$PY" "${PIP[@]}" "$WHEELS"/*.whl 2>&1 | grep -v "^WARNING: Location" | tee "$OUT/environment.txt"
wheels_rc=${PIPESTATUS[0]}

if [ "$SMOKE" = 1 ]; then
  export TRITON_INTERPRET=1 SDCP_IMPORT_AUDIT=$OUT/imports.txt
  : > "$SDCP_IMPORT_AUDIT"
  "$PY" -c "import sys; sys.path.insert(0, '$ROOT/bench'); import gpu_imports; print(gpu_imports.SITECUSTOMIZE)" \
    > "$SHIM/sitecustomize.py"
  export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  SIZE=(--smoke)
  MARKS=(-m "not slow" -k "not triton")  # the rehearsal: quick
else
  unset TRITON_INTERPRET  # compile for the GPU
  export PYTHONPATH="$SHIM:$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  SIZE=()
  MARKS=()
fi
cd "$WORK"  # not the repository: its own sdcp_fast/ (without kernels/) must not come first

"$PY" - <<'PY' 2>&1 | tee -a "$OUT/environment.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE")
import sdcp_fast.kernels as k, sdcp_fast.verifier
print("kernels paths", k.available_paths())
PY

# 2. tests. The shared known-answer vectors live outside the repository; without them that
# test file cannot run here (it fails, never skips, where the file is expected to exist).
VECTORS=${SDCP_VECTORS:-$ROOT/../shared/vectors/sdcp-vectors.json}
IGNORE=(--ignore "$ROOT/tests/kernels/test_statistics.py"  # CPU-path statistics, needs long runs
        --ignore "$ROOT/tests/kernels/test_gpu_compile.py")  # both targets' full sweep: step 3 compiles for this GPU
if [ ! -f "$VECTORS" ]; then
  echo "note: $VECTORS not here: tests/kernels/test_target_dist_vectors.py not run" | tee -a "$OUT/environment.txt"
  IGNORE+=(--ignore "$ROOT/tests/kernels/test_target_dist_vectors.py")
fi
# the device path first (pytest keeps this order), the kernel tests (Triton compiles each
# kernel variant on first use) last: a run cut at the limit has checked the end-to-end path
TESTS=("$ROOT/tests/cache/test_gpu_tier.py" "$ROOT/tests/cache/test_qrows.py" "$ROOT/tests/models/test_tiny_device.py"
       "$ROOT/tests/verifier/test_device_path.py" "$ROOT/tests/kernels")
# the rehearsal runs one kernel test file (CI runs them all anyway): the conftest and the
# test collection are what it checks
[ "$SMOKE" = 1 ] && TESTS=("${TESTS[@]:0:4}" "$ROOT/tests/kernels/test_verify_edges.py")
# SIGINT: pytest stops as after Ctrl-C and still writes its report and JUnit XML
timeout -s INT -k 10 $(( TOTAL * 2 / 5 )) "$PY" -m pytest "${TESTS[@]}" "${IGNORE[@]}" "${MARKS[@]}" -q -p no:cacheprovider \
  -c "$SHIM/pytest.ini" --rootdir "$ROOT" --junitxml "$OUT/tests.xml" 2>&1 | tee "$OUT/tests.log"
tests_rc=${PIPESTATUS[0]}

# 3. benchmarks, sharing what is left: the kernel bench 2/5 of it, the e2e the rest. Each
# stops starting points at its budget (a point started before then may take up to the
# margin: 15 s for a kernel point, 35 s for a 1B model's round of 64 sessions) and is cut
# at its hard limit; both write their JSON after every point.
# the compile check's log opens gpu_bench.log (the device tool brings back 8 files at most).
# It imports torch, triton and the repository only; it is left out of the import audit,
# which would count the modules torch makes at run time for its meta-tensor arithmetic
# (torch._dynamo's, with no file) as missing from the GPU machine.
GPUS=(--gpu device)
[ "$SMOKE" = 1 ] && GPUS=(--gpu sm90)   # no device here: the H100/H200 target
timeout -k 5 90 env -u SDCP_IMPORT_AUDIT "$PY" "$ROOT/bench/gpu_compile.py" --out "$WORK/compile" "${GPUS[@]}" \
  --sweep quick --jobs 1 \
  2>&1 | grep -v "FP_FUSION" | tee "$OUT/gpu_bench.log"
compile_rc=${PIPESTATUS[0]}
limit=$(( $(left) * 2 / 5 )); limit=$(( limit > 30 ? limit : 30 ))
timeout -k 5 "$limit" "$PY" "$ROOT/bench/gpu_bench.py" --out "$OUT" --budget-s $(( limit - 15 )) "${SIZE[@]}" \
  --compile-json "$WORK/compile/gpu_compile.json" 2>&1 | tee -a "$OUT/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}
limit=$(left); limit=$(( limit > 45 ? limit : 45 ))
timeout -k 5 "$limit" "$PY" "$ROOT/bench/gpu_e2e.py" --out "$OUT" --budget-s $(( limit - 35 )) "${SIZE[@]}" \
  2>&1 | tee "$OUT/gpu_e2e.log"
e2e_rc=${PIPESTATUS[0]}

imports_rc=0
if [ "$SMOKE" = 1 ]; then
  unset SDCP_IMPORT_AUDIT
  "$PY" "$ROOT/bench/gpu_imports.py" "$OUT/imports.txt" "$SITE" "$ROOT" "$WORK" 2>&1 | tee "$OUT/imports.log"
  imports_rc=${PIPESTATUS[0]}
fi

printf '{"wheels_rc": %d, "tests_rc": %d, "gpu_compile_rc": %d, "gpu_bench_rc": %d, "gpu_e2e_rc": %d, "imports_rc": %d, "smoke": %s, "seconds": %d}\n' \
  "$wheels_rc" "$tests_rc" "$compile_rc" "$bench_rc" "$e2e_rc" "$imports_rc" "$([ "$SMOKE" = 1 ] && echo true || echo false)" \
  "$(elapsed)" | tee "$OUT/summary.json"
[ "$wheels_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ "$compile_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$e2e_rc" -eq 0 ] \
  && [ "$imports_rc" -eq 0 ]
