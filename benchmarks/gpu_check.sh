#!/usr/bin/env bash
# One prepared GPU check (issue 5), for a lent GPU machine with torch and triton
# preinstalled and no network: builds the op library, runs the GPU tests and the GPU
# latency benchmark; everything it prints and the JSON land in ${OUT:-/tmp/gpu_check}.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu_check}"; mkdir -p "$OUT"
export TORCHINDUCTOR_CACHE_DIR="$OUT/inductor" SIZEBACKEND_CACHE_DIR="$OUT/sb"
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  pip install --no-build-isolation --no-deps -e . -q 2>&1 | tail -3
  timeout 240 python -m pytest -q -x tests/test_cudagraphs.py tests/test_ops.py -m "gpu or not gpu" 2>&1 | tail -15
  timeout 300 python benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" 2>&1
} | tee "$OUT/gpu_check.log"
