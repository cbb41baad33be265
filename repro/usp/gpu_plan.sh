#!/usr/bin/env bash
# USP on several GPUs (issues #33, #37): the whole GPU plan in one command, from the repository root.
#
#   BUDGET_S=520 bash repro/usp/gpu_plan.sh      # the full plan on a 4-GPU host (4 x H100 or H200)
#   SMOKE=1 bash repro/usp/gpu_plan.sh           # every code path at toy sizes on the GPUs given (2), ~100 s
#
# Every step runs under its own `timeout`, cut to what is left of BUDGET_S (the whole plan ends within
# it, packing included); a failing step is logged and the next one runs. Results: paperclub.bench
# Report JSON under repro/usp/results/ and the raw material (logs, profiler traces, NCCL logs) under
# usp-raw/, packed into ONE file $OUT/usp.tgz with paths relative to the repository root:
#     tar xzf usp.tgz                     # in the repository: results land in repro/usp/results/
#     python -m repro.usp.ingest          # only if the plan's own ingest step did not run
# The machine has no network: carry .whl/ (yunchang-0.6.4-py3-none-any.whl) with the call.
# The last lines printed are a summary table of the steps.
#
# Steps of the full plan, in priority order, with the time each is given (estimated need in brackets):
#   setup      peers (yunchang wheel from .whl/), topology                                    20 s  [12]
#   checks     torchrun: selfcheck (every split/layout/mask, bf16+fp32) and the profiler
#              timeline (hybrid causal and not, ring, Ulysses +- pipeline, flash kernel)    70 s  [45]
#   sweep      torchrun: weak scaling 1/2/G GPUs at 16k, 64k, 32k per GPU, strong scaling
#              at 128k, every split, zigzag vs contiguous, flash vs cuDNN                   170 s  [165]
#   peers      torchrun: torch context parallel and yunchang beside ours                     90 s  [88]
#   dpsp       torchrun: data vs sequence parallel at equal global batch                     45 s  [38]
#   comm       torchrun with NCCL_DEBUG=INFO: bytes per rank counted / formula / NCCL / NVLink,
#              MHA vs GQA                                                                     35 s  [30]
#   comm-report  the comm Report from the NCCL logs                                          8 s  [3]
#   kernels    one GPU: local kernels (cuDNN, flash, fa4 Triton, fa4 Gluon), emulated rings   50 s  [50]
#   tests      pytest -m gpu repro/usp/tests/test_gpu.py (one GPU; the 2-rank test two)    rest  [60]
#   ingest     summaries for the page (weak/strong scaling, peers, zigzag, DP vs SP)          5 s
#   pack       $OUT/usp.tgz                                                                    2 s
# Estimated in all: about 430 s on 4 x H100 if attention runs near 450 TFLOP/s; the sweep, peers and
# dpsp stop starting new blocks when their budget runs out (the rows so far are written after
# every block), so a slower machine gives fewer rows, not a cut-off file.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PEERS=/tmp/usp-peers
export PYTHONPATH=$PEERS:$ROOT/site:$ROOT
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then BUDGET_S=${BUDGET_S:-120}; else BUDGET_S=${BUDGET_S:-520}; fi
OUT=${OUT:-/tmp/usp-out}
STAGE=$(mktemp -d /tmp/usp-stage.XXXX)
RES=$STAGE/repro/usp/results
RAW=$STAGE/usp-raw
mkdir -p "$OUT" "$RES" "$RAW/logs" "$RAW/nccl" "$RAW/traces"
START=$(date +%s)
RESERVE=8  # kept for ingest, packing and the summary
STEPS=()

left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# step NAME SECONDS COMMAND...: run COMMAND under timeout min(SECONDS, what is left - RESERVE)
step() {
  local name=$1 share=$2
  shift 2
  local avail=$(($(left) - RESERVE))
  local t=$((share < avail ? share : avail))
  if [ "$t" -lt 5 ]; then
    STEPS+=("$name|skipped|0|${share}|no time left")
    echo "[plan] $name: skipped (no time left)"
    return
  fi
  echo "[plan] $name: up to ${t} s ($(left) s left of ${BUDGET_S})"
  local t0=$(date +%s)
  timeout -k 5 "$t" "$@" >"$RAW/logs/$name.log" 2>&1
  local rc=$?
  local dt=$(($(date +%s) - t0))
  local what=ok
  [ $rc -ne 0 ] && what="rc=$rc"
  [ $rc -eq 124 ] && what="timeout"
  STEPS+=("$name|$what|$dt|$t|$(grep -v '^|' "$RAW/logs/$name.log" | grep -E 'Error|error|FAIL|failed' | head -1 | cut -c1-90)")
  echo "[plan] $name: $what in ${dt} s"
  tail -n 3 "$RAW/logs/$name.log" | sed 's/^/    /'
}

# GPUs visible, and the ranks of the multi-GPU steps
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  NGPU=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
else
  NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
fi
NGPU=${USP_NGPU:-$NGPU}
[ "$NGPU" -gt 4 ] && [ -z "${USP_NGPU:-}" ] && NGPU=4
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node $NGPU"
# USP_DEVICE=cpu and USP_DB_ARGS (extra dist_bench arguments) let the plan itself run on a CPU (gloo)
DEVICE=${USP_DEVICE:-cuda}
DB="-m repro.usp.dist_bench --out $RES --device $DEVICE ${USP_DB_ARGS:-}"
echo "[plan] USP GPU plan: SMOKE=$SMOKE BUDGET_S=$BUDGET_S NGPU=$NGPU stage=$STAGE"

setup() {
  rm -rf "$PEERS" && mkdir -p "$PEERS"
  # yunchang (pure Python; imports torch and triton, both on the machine); no network: the carried wheel
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$PEERS" "$ROOT"/.whl/yunchang-*.whl \
    || echo "yunchang wheel not installed (missing .whl/yunchang-*.whl?)"
  python3 -c "import yunchang; print('yunchang', yunchang.__version__)"
  nvidia-smi topo -m >"$RAW/topology.txt" 2>&1
  nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total,clocks.max.sm --format=csv >>"$RAW/topology.txt" 2>&1
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  cat "$RAW/topology.txt"
}
export -f setup
export PEERS ROOT RAW

if [ "$SMOKE" = 1 ]; then
  # one launch runs every mode at toy sizes (NCCL's log on, for the comm report's parser); the
  # one-GPU benchmark and a subset of the GPU tests run beside it (numbers mean nothing here)
  step setup 20 bash -c setup
  (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 45 python3 -m repro.usp.bench --out "$RES" --tag smoke \
     --device "$DEVICE" --seqs 2048 --backends auto sdpa --budget-s 30 >"$RAW/logs/kernels.log" 2>&1; echo "kernels rc=$?" >>"$RAW/logs/kernels.log") &
  KPID=$!
  (timeout 45 python3 -m pytest repro/usp/tests/test_gpu.py -m gpu -q -p no:cacheprovider -x -k "auto or multi" \
     >"$RAW/logs/tests.log" 2>&1; echo "tests rc=$?" >>"$RAW/logs/tests.log") &
  TPID=$!
  # each of sweep, peers, dpsp and comm has a budget of its own, so that every mode runs at least
  # one block (with one shared budget of 28 s the first run spent it on selfcheck, timeline and one
  # sweep block: peers, dpsp and comm ran nothing); the step leaves ~20 s for start-up (11 s measured)
  step all-modes 85 env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL NCCL_DEBUG_FILE="$RAW/nccl/nccl.%h.%p" \
    $RUN $DB --smoke --mode selfcheck,timeline,sweep,peers,dpsp,comm --budget-s 30 \
    --mode-budget sweep=10 --mode-budget peers=10 --mode-budget dpsp=6 --mode-budget comm=14
  wait $KPID $TPID
  STEPS+=("kernels|$(tail -1 "$RAW/logs/kernels.log")|-|45|beside the torchrun")
  STEPS+=("tests|$(tail -1 "$RAW/logs/tests.log")|-|45|$(grep -E 'passed|failed' "$RAW/logs/tests.log" | tail -1 | cut -c1-80)")
  RESERVE=6
  step comm-report 6 python3 -m repro.usp.dist_bench --mode comm-report --out "$RES" --nccl-log-dir "$RAW/nccl"
else
  # dist_bench's --budget-s counts from after its start-up (imports, NCCL: 11-14 s measured on 2026-11-28),
  # so each step's limit is 15-20 s above it (the process no longer destroys its communicators at the end)
  step setup 20 bash -c setup
  step checks 70 $RUN $DB --mode selfcheck,timeline --budget-s 52
  step sweep 170 $RUN $DB --mode sweep --budget-s 150
  step peers 90 $RUN $DB --mode peers --budget-s 72
  step dpsp 45 $RUN $DB --mode dpsp --budget-s 25
  step comm 35 env NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL NCCL_DEBUG_FILE="$RAW/nccl/nccl.%h.%p" \
    $RUN $DB --mode comm --budget-s 20
  step comm-report 8 python3 -m repro.usp.dist_bench --mode comm-report --out "$RES" --nccl-log-dir "$RAW/nccl"
  step kernels 50 env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" python3 -m repro.usp.bench --out "$RES" \
    --tag 1gpu --seqs 16384 65536 --backends auto sdpa fa4_gluon fa4 --budget-s 40
  step tests 90 python3 -m pytest repro/usp/tests/test_gpu.py -m gpu -q -p no:cacheprovider
fi

# ingest (summaries), the claims record of the GPU tests, traces into the raw folder, pack
RESERVE=0
step ingest 5 python3 -m repro.usp.ingest "$RES"
# the GPU tests' claims record, if this run wrote it
if [ -f repro/usp/results/claims-gpu.json ] && [ "$(stat -c %Y repro/usp/results/claims-gpu.json)" -ge "$START" ]; then
  cp repro/usp/results/claims-gpu.json "$RES/"
fi
[ -d "$RES/traces" ] && mv "$RES/traces"/* "$RAW/traces/" 2>/dev/null && rmdir "$RES/traces"
mv "$RES"/selfcheck-*.txt "$RES"/comm-raw-*.json "$RAW/" 2>/dev/null
tar czf "$OUT/usp.tgz" -C "$STAGE" repro usp-raw 2>/dev/null || echo "[plan] packing failed"

echo
echo "USP GPU plan ($([ "$SMOKE" = 1 ] && echo smoke || echo full)), $NGPU GPUs, $(($(date +%s) - START)) s of $BUDGET_S:"
printf '%-12s %-10s %6s %6s  %s\n' step status took limit note
for s in "${STEPS[@]}"; do
  IFS='|' read -r n st dt lim note <<<"$s"
  printf '%-12s %-10s %6s %6s  %s\n' "$n" "$st" "$dt" "$lim" "$note"
done
echo "results: $(cd "$STAGE" && ls repro/usp/results | tr '\n' ' ')"
echo "packed: $OUT/usp.tgz ($(du -h "$OUT/usp.tgz" 2>/dev/null | cut -f1))"
