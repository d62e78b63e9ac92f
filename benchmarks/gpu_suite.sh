#!/usr/bin/env bash
# The CUDA tests and every benchmark on a GPU machine, in one go (about 4 minutes on an H200).
#   OUT=/tmp/gpu bash benchmarks/gpu_suite.sh
# Logs go to $OUT; CI never runs this (it has no GPU; tests/test_cuda.py skips there).
set -o pipefail
OUT=${OUT:-/tmp/cfbnn-gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/gpu.txt"
timeout 240 $PY -m pytest tests/test_cuda.py tests/test_moments_properties.py -k "cuda" -q -p no:cacheprovider 2>&1 | tee "$OUT/cuda_tests.log"
timeout 120 $PY benchmarks/bench_moments.py --devices cuda 2>&1 | tee "$OUT/bench_moments.log"
timeout 300 $PY benchmarks/bench_elbo.py --device cuda --compile 2>&1 | grep -Ev "^W1|^ *$" | tee "$OUT/bench_elbo.log"
timeout 300 $PY benchmarks/bench_gradvar.py --device cuda --loop-samples 300 2>&1 | tee "$OUT/bench_gradvar.log"
timeout 200 $PY benchmarks/bench_vae.py --device cuda 2>&1 | tee "$OUT/bench_vae.log"
timeout 300 $PY benchmarks/bench_predict.py --device cuda --compile 2>&1 | grep -Ev "^W1|^ *$" | tee "$OUT/bench_predict.log"
start=$(date +%s)
timeout 300 $PY -m cfbnn_cli.cli train regression device=cuda hydra.run.dir=/tmp/cfbnn-gpu-run 2>&1 | tail -5 | tee "$OUT/train_regression.log"
echo "cfbnn train regression device=cuda: $(( $(date +%s) - start )) s wall" | tee -a "$OUT/train_regression.log"
cp /tmp/cfbnn-gpu-run/results.json "$OUT/train_regression_results.json" 2>/dev/null || true
