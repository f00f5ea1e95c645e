#!/usr/bin/env bash
# Wheels for the Python packages bench/gpu_check.sh imports that the GPU machine lacks
# (it has python3 3.12 with torch, triton, pytest and bench/gpu_machine_packages.txt, and no
# package registry). Python 3.12 x86_64 manylinux or pure wheels, at the versions installed
# here (so the rehearsal tests what travels), no dependencies resolved: the list below is the
# closure, checked by the rehearsal's import audit (bench/gpu_imports.py).
#
#   bench/gpu_wheels.sh [DIR]      (default: .whl at the repository root, ignored by git)
#
# The check installs them with `pip install --no-index --no-deps --target` into a temporary
# folder. Needs a package index here (PyPI); at most 60 MiB in all.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-$ROOT/.whl}
PY=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PY" ] || PY=python3
LIMIT_MIB=60

# distribution: why the check needs it
WANTED=(
  cbor2         # sdcp_fast.core (messages, the commit records)
  cryptography  # sdcp_fast.transport (certificates), imported by the verifier package
  cffi          # cryptography's bindings (_cffi_backend)
  ngh2          # sdcp_fast.transport's HTTP/2 server and client (libnghttp2), imported by the verifier package
  h2 hpack hyperframe   # hypercorn's HTTP/2 (the metrics page, below)
  hypercorn priority wsproto   # sdcp_fast.transport.asgi (the metrics page)
  redis         # tests/cache/conftest.py (the GPU-tier tests' directory)
  sniffio       # anyio/httpx at run time; not in the machine's package list
  tomli-w       # sdcp_fast.config, which cache.testing imports through procs (die_with_parent)
)

pins=()
for dist in "${WANTED[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$dist")
  pins+=("$dist==$version")
done

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DIR" "${pins[@]}" 2> >(grep -v "^WARNING: Location" >&2)

count=$(ls "$DIR"/*.whl | wc -l)
if [ "$count" -ne "${#pins[@]}" ]; then
  echo "expected ${#pins[@]} wheels in $DIR, found $count" >&2
  exit 1
fi
bytes=$(cat "$DIR"/*.whl | wc -c)
mib=$(( (bytes + (1 << 20) - 1) >> 20 ))
if [ "$mib" -gt "$LIMIT_MIB" ]; then
  echo "wheels take $mib MiB, over the $LIMIT_MIB MiB limit" >&2
  exit 1
fi
echo "gpu_wheels: ${#pins[@]} wheels, $mib MiB in $DIR (${pins[*]})"
