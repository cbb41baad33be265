#!/usr/bin/env bash
# The whole GPU job of issue #6 on a machine of WORLD GPUs (default 2), one command, under 10 minutes:
#   bash nanoparallel/cuda/gpu_run.sh            # writes to $OUT (default: nanoparallel/results/gpu-run)
#   WORLD=4 BUDGET_S=570 bash nanoparallel/cuda/gpu_run.sh   # 4 GPUs, results tagged cuda-x4
# 1. check.py: every collective, algorithm, dtype and awkward size against a float64 reference,
#    plus the knobs (pipeline steps, copy-engine pieces, programs, uncached splits);
# 2. lab/diagnose.py: NVLink by traffic pattern, each collective's algorithms over steps x programs
#    at 64 MiB / 256 MiB / 1 GiB;
# 3. sweep.py: every collective and algorithm against NCCL, 8 B and 16 B x 4^k to 1 GiB, each
#    implementation checked at each size before it is timed.
# The 4-GPU plan of issue #35 (fail-fast checks, NCCL's own choices, 4 and 2 GPUs) is gpu_plan.sh.
# Each step has its own time limit, cut to what is left of the whole budget, so a hang in one
# still leaves the others their time; the exit status is 1 if any step failed or timed out.
export PYTHONPATH=$PWD/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set -u
OUT=${OUT:-nanoparallel/results/gpu-run}
PY=${PYTHON:-$(command -v python || command -v python3)}
BUDGET_S=${BUDGET_S:-540}
WORLD=${WORLD:-2}
mkdir -p "$OUT"
failed=0

step() {  # step NAME LIMIT_S COMMAND...: run with the smaller of LIMIT_S and the budget left
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  ((left < limit)) && limit=$left
  if ((limit < 20)); then
    echo "[$SECONDS s] $name: skipped, only ${left}s of the budget left" | tee -a "$OUT/gpu_run.log"
    failed=1
    return
  fi
  echo "[$SECONDS s] $name: start (limit ${limit}s): $*" | tee -a "$OUT/gpu_run.log"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$SECONDS s] $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)')" | tee -a "$OUT/gpu_run.log"
  tail -n 3 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$OUT/gpu_run.log"
  ((rc != 0)) && failed=1
}

{
  echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null)  python: $PY"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  nvidia-smi topo -m 2>&1 | head -n 4
} >"$OUT/gpu_run.log"

# the full check grows with the ranks (broadcast roots, references): 220 s did not cover 4 H100s
step check $((110 * WORLD)) "$PY" -m nanoparallel.cuda.check --world-size "$WORLD"
step diagnose 150 "$PY" -m nanoparallel.cuda.lab.diagnose --world-size "$WORLD" --out "$OUT"
# the sweep checks again in its own job (check_all quick, and each timed shape) so its JSON says so
step sweep 200 "$PY" -m nanoparallel.cuda.sweep --world-size "$WORLD" --min-bytes 16 --step 4 --tag "cuda-x$WORLD" \
  --check-all --max-iters 50 --out "$OUT"
echo "[$SECONDS s] done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$OUT/gpu_run.log"
exit $failed
