#!/usr/bin/env bash
# The KDA GPU job in one device call (about 8 minutes on an H100): GPU tests, then the benchmark
# against flash-linear-attention 0.6.0 (its wheels carried in .whl/kda: the GPU machine has no
# network) and SDPA flash, all in one process so that every row shares one set of versions.
#   bash repro/kda/gpu_run.sh [extra bench args, e.g. --set BACKWARD=split]
# Writes under $OUT: gpu_tests.log, bench.log, <device>.json. BUDGET (s) caps the whole call.
set -o pipefail
BUDGET=${BUDGET:-540}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 PAPERCLUB_RECORD_CLAIMS=0
SITE=/tmp/kda-site
rm -rf "$SITE" && mkdir -p "$SITE"
if ls .whl/kda/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/kda/*.whl \
    || echo "pip install of .whl/kda failed: fla rows will be missing"
  export PYTHONPATH=$PYTHONPATH:$SITE
else
  echo "no .whl/kda wheels carried: fla rows will be missing"
fi
timeout 120 python3 -m pytest -q -m gpu repro/kda -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests: exit $? ($(tail -n 1 "$OUT/gpu_tests.log"))"
left=$((BUDGET - SECONDS - 20))
timeout "$left" python3 -m repro.kda.bench --out "$OUT" --budget-s $((left - 60)) "$@" 2>&1 | tee "$OUT/bench.log" | grep -E "^T=|failed|wrote"
