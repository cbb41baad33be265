#!/usr/bin/env bash
# One device call: GPU tests, then the launch-shape sweep (stage "sweep") or the full benchmark
# (stage "bench"). Run from the repository root; writes logs and JSON under $OUT.
set -o pipefail
export PYTHONPATH=$PWD/site:$PWD PYTHONUNBUFFERED=1 PAPERCLUB_RECORD_CLAIMS=0
stage=${1:-sweep}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.backends.cudnn.version())'
if [ "$stage" = sweep ]; then
  timeout 240 python3 -m pytest repro/fa4/tests/test_kernel.py -q -p no:cacheprovider --maxfail=5 2>&1 | tee "$OUT/pytest-gpu.log" | tail -25
  timeout 270 python3 -m repro.fa4.bench --sweep --out "$OUT" 2>&1 | tee "$OUT/sweep.log" | tail -45
else
  timeout 330 python3 -m repro.fa4.bench --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -150
  timeout 100 python3 -m pytest repro/fa4/tests/test_kernel.py -m gpu -q -p no:cacheprovider --maxfail=8 2>&1 | tee "$OUT/pytest-gpu.log" | tail -15
fi
