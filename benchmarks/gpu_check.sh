#!/usr/bin/env bash
# Device check, one call on a bare GPU machine (Python 3.12, torch 2.11, no registry):
#   builds the extension, runs tests/cuda, prints H2D bandwidth and busy fractions.
# Missing wheels (lz4 there) travel in .whl/ (see the device tool's README):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl lz4==4.4.5
# and run with carry=[".whl"]:  bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
PYLOADER_BUILD_JOBS=16 python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
set +e
python3 -m pytest -q -p no:cacheprovider tests/cuda
rc=$?
set -e
if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then echo "tests/cuda failed (rc=$rc)"; fi  # 5: no tests collected
python3 benchmarks/gpu_bench.py --device cuda --json "${OUT:-/tmp}/gpu_bench.json"
