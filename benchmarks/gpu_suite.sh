#!/usr/bin/env bash
# The CUDA tests and every GPU benchmark in one go, most important first, inside a deadline
# (SUITE_SECONDS, default 480: a step that would start too late is skipped and says so); the
# last lines say which GPU targets are met.
#   OUT=/tmp/gpu bash benchmarks/gpu_suite.sh          # everything
#   OUT=/tmp/gpu bash benchmarks/gpu_suite.sh quick    # the CUDA tests and the operator targets (~2 min)
# Logs go to $OUT (seven files); CI never runs this (it has no GPU; the CUDA tests skip there).
# On a machine with torch but without this project's other dependencies, put their wheels in
# .whl/ (pyro-ppl, pyro-api, hydra-core, omegaconf, antlr4-python3-runtime): they are installed
# into a scratch folder and the repository itself is put on PYTHONPATH.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cfbnn-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
START=$SECONDS
DEADLINE=${SUITE_SECONDS:-480}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cfbnn-site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/cfbnn-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# step LOG MAX_SECONDS COMMAND...: run COMMAND (output appended to $OUT/LOG) for at most
# MAX_SECONDS, or less if the deadline is nearer; skipped with a line if under 20 s are left.
step() {
  local log=$1 max=$2
  shift 2
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then
    echo "SKIPPED (suite deadline): $*" | tee -a "$OUT/$log"
    return
  fi
  [ "$max" -gt "$left" ] && max=$left
  echo "== $* (at most ${max} s)" | tee -a "$OUT/$log"
  timeout "$max" "$@" 2>&1 | grep -Ev "^W1|^ *$" | tee -a "$OUT/$log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee -a "$OUT/gpu.txt"
step cuda_tests.log 240 $PY -m pytest tests/test_cuda.py tests/moments/test_moments_properties.py tests/moments/test_ops.py \
  tests/moments/test_tail_ops.py tests/moments/test_elbo_ops.py tests/moments/test_leaky_ops.py tests/moments/test_relu_squared_ops.py tests/moments/test_relu_mean_ops.py tests/moments/test_nan_propagation.py \
  tests/bnn/test_operator_elbo.py \
  -k "cuda or test_cuda" -q -p no:cacheprovider -rs
step bench_operators.log 120 $PY benchmarks/bench_operators.py --device cuda --list-kernels --repeats 3
if [ "$1" != quick ]; then
  step bench_cuda_graphs.log 150 $PY benchmarks/bench_cuda_graphs.py --repeats 3
  step bench_elbo.log 120 $PY benchmarks/bench_elbo.py --device cuda --variance-draws 20 --repeats 5
  # TF32 or not (runtime.matmul_precision): closed-form and plain-MLP steps, eager and graphed, at
  # D=90/H=200 and D=2048/H=1000, and a short Table 1 run's test LL, under highest and high (~1.5 min)
  step bench_matmul_precision.log 150 $PY benchmarks/bench_matmul_precision.py --device cuda --precisions highest,high
  step bench_others.log 60 $PY benchmarks/bench_optimizer.py --device cuda
  step bench_others.log 60 $PY benchmarks/bench_moments.py --devices cuda
  step bench_others.log 90 $PY benchmarks/bench_gradvar.py --device cuda --loop-samples 300
  step bench_others.log 90 $PY benchmarks/bench_vae.py --device cuda
  step bench_others.log 90 $PY benchmarks/bench_predict.py --device cuda
fi
echo
echo "== summary ($(head -2 "$OUT/gpu.txt" | tail -1 | cut -c1-60)), $((SECONDS - START)) s"
grep -E "passed|failed|error" "$OUT/cuda_tests.log" | tail -1
[ -f "$OUT/bench_cuda_graphs.log" ] && sed -n '/^CUDA graph targets:/,$p' "$OUT/bench_cuda_graphs.log"
[ -f "$OUT/bench_matmul_precision.log" ] && echo "runtime.matmul_precision (highest = the default; high = TF32):" \
  && grep -E "speed-up|^   (highest|high) " "$OUT/bench_matmul_precision.log"
sed -n '/^Operator targets:/,$p' "$OUT/bench_operators.log"
