#!/usr/bin/env bash
# Device check: one call on a bare GPU machine (Python 3.12, torch 2.11, no package registry).
# Builds the extension, runs tests/cuda as a gate, then benchmarks/gpu_bench.py: pinned H2D
# bandwidth of pyloader vs raw torch copies, and the busy fraction of a synthetic training
# step fed by pyloader vs torch's DataLoader, ending with a short table.
#
#   bash benchmarks/gpu_check.sh [--quick]   # full: < 4 min (230 s); --quick: < 2 min (110 s)
#
# A missing wheel (lz4 there) travels in .whl/, made once here in the repo's root:
#   mkdir -p .git/info && echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl lz4==4.4.5
# and the device call names it: carry=[".whl"], command "bash benchmarks/gpu_check.sh", timeout_s=300
# (the script keeps to its own budget; the margin lets a kill still return $OUT).
#
# Every stage writes its results as it goes, to $OUT when set (what comes back from the
# device call), else to a new temp dir: summary.txt (one line per stage, appended at once),
# env.txt, build.log (the whole pip/compiler log; its last 40 lines are printed on failure),
# pytest_cuda.log, gpu_bench.log, and gpu_bench.json (rewritten after every measurement),
# so a run cut off at its limit still returns what it measured.
#
# Exit status: 0 all passed and measured; 1 tests/cuda failed (the benchmark still ran, to
# help diagnose); 2 the wheels or the build failed (nothing after it ran); 3 no CUDA device
# (built, tests skipped, nothing measured); 4 the benchmark failed or was cut short.
# GPU_CHECK_BUDGET_S overrides the budget; GPU_CHECK_PYTEST_ARGS adds pytest arguments (-k ...);
# GPU_CHECK_DEVICE=cpu runs the benchmark's CPU twin (a dry run of this script without a GPU).
set -uo pipefail  # no -e: each stage's status is checked and reported below
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

QUICK=0
case "${1:-}" in
  --quick) QUICK=1 ;;
  "") ;;
  *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
esac
if [ "$QUICK" = 1 ]; then BUDGET=${GPU_CHECK_BUDGET_S:-110}; else BUDGET=${GPU_CHECK_BUDGET_S:-230}; fi
OUT_DIR=${OUT:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
mkdir -p "$OUT_DIR"
SUMMARY=$OUT_DIR/summary.txt
: >"$SUMMARY"
PY=python3
BENCH_DEVICE=${GPU_CHECK_DEVICE:-cuda}

note() {  # a line for the log and for summary.txt, as soon as it is known
  echo "== [${SECONDS} s] $*"
  echo "[${SECONDS} s] $*" >>"$SUMMARY"
}
left() { echo $((BUDGET - SECONDS)); }
cap() {  # cap MAX RESERVE: at most MAX seconds, leaving RESERVE for the stages after
  local c=$(( $(left) - $2 ))
  [ "$c" -gt "$1" ] && c=$1
  echo "$c"
}
note "gpu_check.sh $([ "$QUICK" = 1 ] && echo --quick), budget ${BUDGET} s, results in $OUT_DIR"

# -- environment --------------------------------------------------------------------------
{
  timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
    || echo "nvidia-smi: none or failed"
  $PY -VV
  uname -srm
  nproc
} >"$OUT_DIR/env.txt" 2>&1
cat "$OUT_DIR/env.txt"

# -- wheels and build: a failure stops here ---------------------------------------------------
BUILD_LOG=$OUT_DIR/build.log
: >"$BUILD_LOG"
fail_build() {
  echo "---- last 40 lines of $BUILD_LOG ----"
  tail -n 40 "$BUILD_LOG"
  note "$1; full log: $BUILD_LOG. STOPPED (exit 2)"
  exit 2
}
if ls .whl/*.whl >/dev/null 2>&1; then
  echo "== installing $(ls .whl/*.whl | wc -l) carried wheels" | tee -a "$BUILD_LOG"
  timeout -k 5 60 $PY -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$BUILD_LOG" 2>&1 || fail_build "carried wheels failed to install (rc=$?)"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
t0=$SECONDS
bcap=$(cap 150 $([ "$QUICK" = 1 ] && echo 50 || echo 90))
# The whole log goes to the file (a pipe into tail would hide compiler errors and lose the
# log on a kill); the console gets a line per source compiled.
PYLOADER_BUILD_JOBS=$(nproc) timeout -k 5 "$bcap" $PY -m pip install -v --no-build-isolation --no-deps -e . \
  >>"$BUILD_LOG" 2>&1
brc=$?
[ "$brc" -eq 124 ] && fail_build "BUILD TIMED OUT after ${bcap} s"
[ "$brc" -ne 0 ] && fail_build "BUILD FAILED (rc=$brc) after $((SECONDS - t0)) s"
echo "   compiler warnings: $(grep -c -E ':[0-9]+:[0-9]+: warning:' "$BUILD_LOG") (build.log)"
$PY -c "import pyloader, pyloader._C" >>"$BUILD_LOG" 2>&1 || fail_build "built, but 'import pyloader._C' fails"
note "build ok ($((SECONDS - t0)) s)"

HAVE_GPU=0
$PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && HAVE_GPU=1
[ "$HAVE_GPU" = 0 ] && note "NO CUDA DEVICE visible to torch: tests/cuda will skip and nothing is measured"

# -- tests/cuda, the gate -----------------------------------------------------------------------
# Plugin-proof pytest: PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 loads no plugin installed there by
# entry point (whatever the image holds: benchmark, cov, xdist, randomly, asyncio...), so
# none can add a config-time warning, which filterwarnings=error (pyproject.toml) would turn
# into an aborted run, or reorder and parallelise the tests. A list of -p no:NAME would miss
# a plugin we did not think of. pytest-timeout, the one we need, is loaded by name where
# present. -W applies after the ini's filters, and only to PytestConfigWarning (e.g.
# "Unknown config option: timeout" where pytest-timeout is absent): pyloader's own warnings,
# and every other warning inside a test, are still errors.
t0=$SECONDS
PYTEST=(-p no:cacheprovider -W "ignore::pytest.PytestConfigWarning" -v -rfEs --durations=5
        -o faulthandler_timeout=45)
if $PY -c "import pytest_timeout" 2>/dev/null; then
  PYTEST+=(-p pytest_timeout -o timeout=60)
else
  echo "   (pytest-timeout missing: faulthandler dumps a hung test's stacks, the whole run has a limit)"
fi
# shellcheck disable=SC2206  # word splitting of the user's extra arguments is intended
PYTEST+=(${GPU_CHECK_PYTEST_ARGS:-})
tcap=$(cap $([ "$QUICK" = 1 ] && echo 50 || echo 100) $([ "$QUICK" = 1 ] && echo 35 || echo 60))
if [ "$tcap" -lt 20 ]; then
  trc=124
  note "tests/cuda NOT RUN: only $(left) s left after the build"
else
  # --quick: only what a first GPU run must check (tests/cuda/test_cuda_first_run.py, about
  # 30 s); the full check runs every file of tests/cuda.
  TESTS=tests/cuda
  [ "$QUICK" = 1 ] && TESTS=tests/cuda/test_cuda_first_run.py
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 timeout -k 5 "$tcap" $PY -m pytest "${PYTEST[@]}" "$TESTS" 2>&1 \
    | tee "$OUT_DIR/pytest_cuda.log"
  trc=${PIPESTATUS[0]}
  summ=$(grep -E '^=+ .*(passed|failed|error|skipped|no tests).* =+$' "$OUT_DIR/pytest_cuda.log" | tail -n 1 \
         | sed -E 's/^=+ //; s/ =+$//')
  case $trc in
    0) note "$TESTS ok ($((SECONDS - t0)) s): ${summ:-?}" ;;
    124|137) note "tests/cuda TIMED OUT after ${tcap} s (the last test started is in pytest_cuda.log)" ;;
    *) note "tests/cuda FAILED (rc=$trc, $((SECONDS - t0)) s): ${summ:-no summary; see pytest_cuda.log}" ;;
  esac
fi

# -- benchmark: still run after failed tests (it helps diagnose), within what is left ----------
t0=$SECONDS
bench_rc=0
if [ "$HAVE_GPU" = 0 ] && [ "$BENCH_DEVICE" != cpu ]; then
  note "benchmark skipped: no CUDA device"
elif [ "$(left)" -lt 25 ]; then
  bench_rc=1
  note "benchmark NOT RUN: only $(left) s left"
else
  lim=$(( $(left) - 3 ))
  bbudget=$(( lim > 24 ? lim - 12 : lim / 2 ))
  # --budget-s: the script stops starting measurements ~10 s before the hard limit and
  # prints its table; `timeout` is the backstop. Its JSON is rewritten after every step.
  timeout -k 5 "$lim" $PY benchmarks/gpu_bench.py --device "$BENCH_DEVICE" $([ "$QUICK" = 1 ] && echo --quick) \
    --budget-s "$bbudget" --json "$OUT_DIR/gpu_bench.json" 2>&1 | tee "$OUT_DIR/gpu_bench.log"
  bench_rc=${PIPESTATUS[0]}
  case $bench_rc in
    0) note "benchmark ok ($((SECONDS - t0)) s)" ;;
    124|137)
      note "benchmark KILLED at its limit (${lim} s); partial results:"
      [ -s "$OUT_DIR/gpu_bench.json" ] && timeout 30 $PY benchmarks/gpu_bench.py --report "$OUT_DIR/gpu_bench.json"
      ;;
    *) note "benchmark FAILED or cut short (rc=$bench_rc, $((SECONDS - t0)) s); see gpu_bench.log" ;;
  esac
fi

if [ "$trc" -ne 0 ] && [ "$trc" -ne 5 ]; then rc=1      # 5: no tests collected
elif [ "$HAVE_GPU" = 0 ]; then rc=3
elif [ "$bench_rc" -ne 0 ]; then rc=4
else rc=0
fi
note "done in ${SECONDS} s: exit $rc (tests rc=$trc, bench rc=$bench_rc)"
echo "---- summary.txt ----"
cat "$SUMMARY"
exit "$rc"
