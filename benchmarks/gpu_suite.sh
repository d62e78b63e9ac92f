#!/usr/bin/env bash
# The CUDA tests and every GPU benchmark in one go, most important first, inside a deadline
# (SUITE_SECONDS, default 480: a step that would start too late is skipped and says so); the
# last lines, "GPU targets:", name every GPU target of issues #46 and #43 as met, MISSED or NOT
# MEASURED (why), from the benchmarks' machine-readable lines (benchmarks/targets.py:
# "TARGET <name> <value> <op> <threshold> <unit> met|MISSED").
#   OUT=/tmp/gpu bash benchmarks/gpu_suite.sh          # everything
#   OUT=/tmp/gpu bash benchmarks/gpu_suite.sh quick    # the CUDA tests and the operator targets (~2 min)
#   OUT=/tmp/gpu bash benchmarks/gpu_suite.sh summary  # only the summary again, from the logs in $OUT
# Logs go to $OUT (nine files; a run first removes the last run's); CI never runs this (it has no
# GPU; the CUDA tests skip there).
# On a machine with torch but without this project's other dependencies, put their wheels in
# .whl/ (pyro-ppl, pyro-api, hydra-core, omegaconf, antlr4-python3-runtime): they are installed
# into a scratch folder and the repository itself is put on PYTHONPATH.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cfbnn-gpu}
mkdir -p "$OUT"
MODE=${1:-all}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
START=$SECONDS
DEADLINE=${SUITE_SECONDS:-480}
LOGS="cuda_tests.log bench_operators.log bench_elbo.log bench_predict.log bench_gradvar.log bench_cuda_graphs.log
  bench_matmul_precision.log bench_others.log"

# The GPU targets, one a line: name (as the benchmark's TARGET line names it) | the benchmarks that
# measure it, the preferred first | what it is | the target.
GPU_TARGETS='kernels_per_step/D=90|bench_operators|kernels per closed-form step, D=90/H=200 (#46)|<= 18
kernels_per_step/D=2048|bench_operators|kernels per closed-form step, D=2048/H=1000 (#46)|<= 18
graphed_step_over_mlp/D=90|bench_operators|graphed closed-form step / graphed MLP, D=90/H=200 (#46)|<= 1.4 x
graphed_step_over_mlp/D=2048|bench_operators|graphed closed-form step / graphed MLP, D=2048/H=1000 (#46)|<= 1.4 x
tail_fwd_bwd_us/500x1000|bench_operators|tail fwd+bwd, cfbnn::relu_tail + relu_tail_backward, 500x1000 float32 (#46)|<= 20 us
det_over_plain/2048-1000-1000-1000/b256|bench_predict|deterministic prediction / plain head, 2048-1000-1000-1000, batch 256 (#46)|<= 1.5 x
mc512_over_deterministic/2048-1000-1000-1000/b256|bench_cuda_graphs bench_predict|MC-512 / deterministic, imagenet-predict table, paper head (#46)|>= 100 x
kernels_per_step/D=90/no_worse|bench_operators|kernels per closed-form step, D=90/H=200 (#43, no worse)|<= 27
kernels_per_step/D=2048/no_worse|bench_operators|kernels per closed-form step, D=2048/H=1000 (#43, no worse)|<= 27
graphed_step_over_mlp/D=90/no_worse|bench_operators|graphed closed-form step / graphed MLP, D=90/H=200 (#43, no worse)|<= 1.66 x
graphed_step_over_mlp/D=2048/no_worse|bench_operators|graphed closed-form step / graphed MLP, D=2048/H=1000 (#43, no worse)|<= 1.85 x
eager_elbo_operators_over_reference/D=90|bench_elbo|eager CUDA ELBO, operators / reference ops, D=90/H=200 (#43)|<= 1 x
eager_elbo_operators_over_reference/D=2048|bench_elbo|eager CUDA ELBO, operators / reference ops, D=2048/H=1000 (#43)|<= 1 x
vmap_triton_launches|bench_gradvar|vmap over the Triton operators: Triton launches of the analytic draws (#43)|>= 1'

# why_not_measured BENCH...: why none of these benchmarks' logs has a target's line (one phrase)
why_not_measured() {
  local bench log reasons="" reason
  for bench in "$@"; do
    log=$OUT/$bench.log
    if [ ! -f "$log" ]; then
      reason="$bench.py not run$([ "$MODE" = quick ] && echo " (quick mode)")"
    elif grep -q "^SKIPPED (suite deadline)" "$log"; then
      reason="$bench.py skipped: suite deadline"
    elif grep -q "^== exit 124" "$log"; then
      reason="$bench.py timed out after $(grep -m1 "^== exit 124" "$log" | sed -E 's/^== exit 124: timed out after ([0-9]+ s( \(the suite deadline\))?).*/\1/')"
    elif grep -q "^== exit [1-9]" "$log"; then
      reason="$bench.py failed ($(grep -m1 -oE "^== exit [0-9]+" "$log" | sed 's/^== //'): $(grep -vE "^(==|TARGET)" "$log" | tail -1 | cut -c1-100))"
    else
      reason="$bench.py printed no line for it"
    fi
    reasons=${reasons:+$reasons; }$reason
  done
  echo "$reasons"
}

# summary: every GPU target as one line, met / MISSED with the value, or NOT MEASURED (why)
summary() {
  local name benches what target bench line found
  echo "GPU targets (issues #46 and #43; measured in this run, ratios side by side):"
  while IFS='|' read -r name benches what target; do
    found=""
    for bench in $benches; do
      line=$(awk -v n="$name" '$1 == "TARGET" && $2 == n' "$OUT/$bench.log" 2>/dev/null | tail -1)
      if [ -n "$line" ]; then
        found=$bench
        break
      fi
    done
    if [ -z "$found" ]; then
      printf '  %-13s %s (target %s): %s\n' "NOT MEASURED" "$what" "$target" "$(why_not_measured $benches)"
      continue
    fi
    echo "$line" | awk -v what="$what" -v bench="$found" '{
      said = $7; for (i = 8; i <= NF; i++) said = said " " $i
      unit = ($6 == "-") ? "" : " " $6
      verdict = (said == "met" || said == "MISSED") ? said : "NOT MEASURED"
      printf "  %-13s %s: %s%s (target %s %s%s) [%s]%s\n", verdict, what, $3, unit, $4, $5, unit, bench,
        (verdict == "NOT MEASURED") ? ", off the GPU " said : ""
    }'
  done <<<"$GPU_TARGETS"
}

# report: the closing lines -- the tests' tally, the benchmarks' own target blocks, then "GPU targets:"
report() {
  echo
  echo "== summary ($(head -2 "$OUT/gpu.txt" 2>/dev/null | tail -1 | cut -c1-60))$([ "$MODE" != summary ] && echo ", $((SECONDS - START)) s")"
  grep -E "passed|failed|error" "$OUT/cuda_tests.log" 2>/dev/null | tail -1
  [ -f "$OUT/bench_cuda_graphs.log" ] && sed -n '/^CUDA graph targets:/,$p' "$OUT/bench_cuda_graphs.log"
  [ -f "$OUT/bench_matmul_precision.log" ] && echo "runtime.matmul_precision (highest = the default; high = TF32):" \
    && grep -E "speed-up|^   (highest|high) " "$OUT/bench_matmul_precision.log"
  [ -f "$OUT/bench_operators.log" ] && sed -n '/^Operator targets:/,$p' "$OUT/bench_operators.log"
  echo
  summary
}

if [ "$MODE" = summary ]; then
  report
  exit 0
fi
for log in $LOGS; do rm -f "$OUT/$log"; done  # the summary reads this run's lines only
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cfbnn-site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/cfbnn-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

# step LOG MAX_SECONDS COMMAND...: run COMMAND (output appended to $OUT/LOG) for at most
# MAX_SECONDS, or less if the deadline is nearer; skipped with a line if under 20 s are left.
# A command that fails or times out leaves "== exit N ..." in its log (the summary says why).
step() {
  local log=$1 max=$2 began=$SECONDS rc why=""
  shift 2
  local left=$((DEADLINE - (SECONDS - START)))
  if [ "$left" -lt 20 ]; then
    echo "SKIPPED (suite deadline): $*" | tee -a "$OUT/$log"
    return
  fi
  [ "$max" -gt "$left" ] && max=$left && why=" (the suite deadline)"
  echo "== $* (at most ${max} s)" | tee -a "$OUT/$log"
  timeout "$max" "$@" 2>&1 | grep -Ev "^W1|^ *$" | tee -a "$OUT/$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" = 124 ]; then
    echo "== exit 124: timed out after $max s$why: $*" | tee -a "$OUT/$log"
  elif [ "$rc" != 0 ]; then
    echo "== exit $rc after $((SECONDS - began)) s: $*" | tee -a "$OUT/$log"
  fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  | tee -a "$OUT/gpu.txt"
step cuda_tests.log 240 $PY -m pytest tests/test_cuda.py tests/moments/test_moments_properties.py tests/moments/test_ops.py \
  tests/moments/test_tail_ops.py tests/moments/test_elbo_ops.py tests/moments/test_leaky_ops.py tests/moments/test_relu_squared_ops.py tests/moments/test_relu_mean_ops.py tests/moments/test_nan_propagation.py \
  tests/moments/test_prediction_ops.py \
  tests/bnn/test_operator_elbo.py \
  -k "cuda or test_cuda" -q -p no:cacheprovider -rs
step bench_operators.log 120 $PY benchmarks/bench_operators.py --device cuda --list-kernels --repeats 3
if [ "$MODE" != quick ]; then
  # the other benchmarks with a GPU target first (bench_predict also measures the MC-512 target,
  # should bench_cuda_graphs, which runs imagenet-predict itself, not get to it)
  step bench_elbo.log 120 $PY benchmarks/bench_elbo.py --device cuda --variance-draws 20 --repeats 5
  step bench_predict.log 90 $PY benchmarks/bench_predict.py --device cuda
  step bench_gradvar.log 90 $PY benchmarks/bench_gradvar.py --device cuda --loop-samples 300
  step bench_cuda_graphs.log 150 $PY benchmarks/bench_cuda_graphs.py --repeats 3
  # TF32 or not (runtime.matmul_precision): closed-form and plain-MLP steps, eager and graphed, at
  # D=90/H=200 and D=2048/H=1000, and a short Table 1 run's test LL, under highest and high (~1.5 min)
  step bench_matmul_precision.log 150 $PY benchmarks/bench_matmul_precision.py --device cuda --precisions highest,high
  step bench_others.log 60 $PY benchmarks/bench_optimizer.py --device cuda
  step bench_others.log 60 $PY benchmarks/bench_moments.py --devices cuda
  step bench_others.log 90 $PY benchmarks/bench_vae.py --device cuda
fi
report
