#!/usr/bin/env bash
# The CUDA tests and every GPU benchmark in one go (about 7 minutes on an H100 or H200); its last
# lines say which GPU targets are met.
#   OUT=/tmp/gpu bash benchmarks/gpu_suite.sh          # everything
#   OUT=/tmp/gpu bash benchmarks/gpu_suite.sh quick    # the CUDA tests and the operator targets (~2 min)
# Logs go to $OUT; CI never runs this (it has no GPU; tests/test_cuda.py skips there).
# On a machine with torch but without this project's other dependencies, put their wheels in
# .whl/ (pyro-ppl, pyro-api, hydra-core, omegaconf, antlr4-python3-runtime): they are installed
# into a scratch folder and the repository itself is put on PYTHONPATH.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cfbnn-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cfbnn-site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/cfbnn-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
timeout 300 $PY -m pytest tests/test_cuda.py tests/moments/test_moments_properties.py tests/moments/test_ops.py \
  -k "cuda or test_cuda" -q \
  -p no:cacheprovider -rs 2>&1 | tee "$OUT/cuda_tests.log"
if [ "$1" = quick ]; then
  timeout 180 $PY benchmarks/bench_operators.py --device cuda --list-kernels --repeats 3 2>&1 | tee "$OUT/bench_operators.log"
  grep -E "passed|failed|error" "$OUT/cuda_tests.log" | tail -1
  exit 0
fi
timeout 240 $PY benchmarks/bench_cuda_graphs.py 2>&1 | tee "$OUT/bench_cuda_graphs.log"
timeout 180 $PY benchmarks/bench_operators.py --device cuda 2>&1 | tee "$OUT/bench_operators.log"
timeout 120 $PY benchmarks/bench_moments.py --devices cuda 2>&1 | tee "$OUT/bench_moments.log"
timeout 300 $PY benchmarks/bench_elbo.py --device cuda 2>&1 | grep -Ev "^W1|^ *$" | tee "$OUT/bench_elbo.log"
timeout 300 $PY benchmarks/bench_gradvar.py --device cuda --loop-samples 300 2>&1 | tee "$OUT/bench_gradvar.log"
timeout 200 $PY benchmarks/bench_vae.py --device cuda 2>&1 | tee "$OUT/bench_vae.log"
timeout 300 $PY benchmarks/bench_predict.py --device cuda 2>&1 | grep -Ev "^W1|^ *$" | tee "$OUT/bench_predict.log"
echo
echo "== summary ($(head -1 "$OUT/gpu.txt" | cut -c1-60))"
grep -E "passed|failed|error" "$OUT/cuda_tests.log" | tail -1
sed -n '/^CUDA graph targets:/,$p' "$OUT/bench_cuda_graphs.log"
sed -n '/^Operator targets:/,$p' "$OUT/bench_operators.log"
