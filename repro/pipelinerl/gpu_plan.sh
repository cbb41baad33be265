#!/usr/bin/env bash
# PipelineRL with actors and trainers on their own GPUs (issue #34): the whole GPU session in one script.
#
#   BUDGET_S=520 bash repro/pipelinerl/gpu_plan.sh   # 4 GPUs: placements 1+1, 1+3, 2+2, three modes each
#   PLAN_LR=0 BUDGET_S=495 bash repro/pipelinerl/gpu_plan.sh   # the same at learning rate 0: one fixed
#                                                    # policy, so every mode and placement generates the same
#                                                    # lengths (throughput only; the reward stays flat);
#                                                    # results/<device>-placements-lr0.json, raw in placements-raw-lr0/
#   BUDGET_S=420 bash repro/pipelinerl/gpu_plan.sh   # on a 2-GPU host: the two-GPU plan (below), about 415 s
#   PLAN_LR=0 PLAN_SKIP="faults onegpu 1+1" BUDGET_S=330 bash repro/pipelinerl/gpu_plan.sh
#                                                    # 4 GPUs: only 1+3 and 2+2 (after pre-training), for a
#                                                    # session with little device time; PLAN_SKIP names any
#                                                    # of faults, onegpu, 1+1, 1+3, 2+2 (the 4-GPU plan);
#                                                    # PLAN_SUFFIX=-x names its files apart, as below
#   SMOKE=1 bash repro/pipelinerl/gpu_plan.sh        # 2 GPUs, toy sizes, every code path, <= 70 s:
#                                                    # pre-training, then 1+1, the one-GPU runs and both
#                                                    # faults at once, 2 s per mode (~35 s on a GPU host)
#
# Run from the repository root. Writes ONE file, $OUT/pipelinerl.tgz (paths relative to the repository
# root), and prints a summary table last. Back in the repository:
#   python -m repro.pipelinerl.plan ingest pipelinerl.tgz     # unpacks under repro/pipelinerl/results/, prints the summary
#
# Steps (estimated times on 4 H100s at BUDGET_S=520; T = seconds of training per mode, about 45):
#   1. pre-training on GPU 0 (28 s + start-up)  ||  the two fault launches (1+1, pipeline, a process
#      SIGKILLed after step 10: an actor on GPUs 1,2; the lead trainer on GPUs 3,2), about 20 s each
#   2. placement 1+1 on GPUs 0,1 (3 T + ~15 s)  ||  the one-GPU runs on GPU 2 (three modes as threads of
#      one process, 3 T + ~10 s; the simulator's fit and the half-batch trainer step come from here only)
#   3. placement 1+3 on GPUs 0-3 (3 T + ~15 s)  ||  the simulator's predictions for 1+1, 1+3, 2+2 (CPU)
#   4. placement 2+2 on GPUs 0-3 (3 T + ~15 s)
#   5. the report (paperclub.bench Report JSON, ~8 s), the archive, the summary
#
# The two-GPU plan (2 or 3 GPUs, not SMOKE): only placement 1+1, and no step shares a GPU with a timed
# one (the 4-GPU plan's one-GPU runs and faults would have to share GPUs here: left out, so there are
# no simulator predictions in it). Estimated at BUDGET_S=420 on 2 H100s, T about 30 s:
#   1. pre-training on GPU 0, stopped after PLAN_PRETRAIN_STEPS (201: the steps the 4-GPU run of 28 Nov
#      2026 made in its 28 s) with the same schedule, so every run starts from that run's policy (~40 s)
#   2. one launch of 1+1 (three modes, T each, ~3 T + 20 s) per entry "lr:seed" of PLAN_RUNS, in order,
#      default "0:0 2e-4:0 2e-4:1": learning rate 0 first (one fixed policy: every mode generates the same
#      lengths, so trained tokens/s compares the schedules alone), then the plan's lr 2e-4 on seed 0 (the
#      4-GPU run's) and seed 1 (how far one seed's length drift moves the ratio)
#   3. the report (<device>-placements-2gpu.json, raw records and digest.json in placements-raw-2gpu/),
#      the archive, the summary. PLAN_SUFFIX=-more (say) appends to both names, so a second session's runs
#      land beside the first's instead of replacing them.
# Every step runs under its own `timeout`, cut to what is left of the budget; a failing step is logged
# (steps.tsv, and its log) and the rest go on. Modes run in the order conventional, pipeline, async, and
# each launch rewrites its results after every mode, so a launch cut short keeps the modes it finished.
set -u

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/site:$PWD"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

# GPUs given to us: CUDA_VISIBLE_DEVICES if set, else every GPU the machine has. PLAN_DEVICE=cpu (a dry
# run of this script on a CPU machine, with gloo) pretends to have PLAN_GPUS GPUs.
if [ "${PLAN_DEVICE:-cuda}" = "cpu" ]; then
  mapfile -t GPUS < <(seq 0 $(( ${PLAN_GPUS:-2} - 1 )))
elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
  IFS=, read -r -a GPUS <<< "$CUDA_VISIBLE_DEVICES"
else
  mapfile -t GPUS < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ')
fi
NG=${#GPUS[@]}
SMOKE="${SMOKE:-0}"
TWO=0; [ "$SMOKE" != "1" ] && [ "$NG" -lt 4 ] && TWO=1   # the two-GPU plan
START=$(date +%s)
if [ "$SMOKE" = "1" ]; then
  BUDGET=$(( ${BUDGET_S:-66} < 66 ? ${BUDGET_S:-66} : 66 ))
  SUB=smoke
  SFLAG=--smoke
else
  BUDGET="${BUDGET_S:-520}"
  SUB=placements-raw${PLAN_LR:+-lr$PLAN_LR}${PLAN_SUFFIX:-}
  [ "$TWO" = "1" ] && SUB=placements-raw-2gpu${PLAN_SUFFIX:-}
  SFLAG=
fi
# PLAN_SIZES=smoke: the full schedule with the toy sizes (a dry run of this script's 4-GPU branch)
[ "${PLAN_SIZES:-}" = "smoke" ] && SFLAG=--smoke
OUT="${OUT:-$PWD/gpu-plan-out}"
mkdir -p "$OUT"
WORK=$(mktemp -d)
RES="$WORK/repro/pipelinerl/results"          # what goes into the archive
RAW="$RES/$SUB"                                # raw records and logs
mkdir -p "$RAW"
PY="${PYTHON:-python3}"
RUN="$PY -m torch.distributed.run --standalone --monitor-interval 1"
skip() { [[ " ${PLAN_SKIP:-} " == *" $1 "* ]]; }   # a step of the 4-GPU plan left out by PLAN_SKIP
LAUNCH="-m repro.pipelinerl.launch"

g() { local IFS=,; local out=(); for i in "$@"; do out+=("${GPUS[$i]}"); done; echo "${out[*]}"; }

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
secs() { local ms=$(( $(now_ms) - $1 )); printf "%d.%03d" $(( ms / 1000 )) $(( ms % 1000 )); }  # since $1 (ms)
log() { echo "[gpu_plan $(( $(date +%s) - START ))s] $*"; }
printf "step\trc\tseconds\tlimit_s\n" > "$RAW/steps.tsv"

# step NAME CAP_S RESERVE_S CMD...: run CMD under timeout min(CAP_S, left - RESERVE_S), log to $RAW/NAME.log
step() {
  local name=$1 cap=$2 reserve=$3; shift 3
  local lim=$(( $(left) - reserve )); [ "$lim" -gt "$cap" ] && lim=$cap
  if [ "$lim" -lt 5 ]; then
    log "$name: skipped, ${lim}s left for it"; printf "%s\tskipped\t0\t%s\n" "$name" "$lim" >> "$RAW/steps.tsv"; return 124
  fi
  log "$name: start (limit ${lim}s)"
  local t0; t0=$(now_ms)
  timeout -k 2 "$lim" "$@" > "$RAW/$name.log" 2>&1
  local rc=$?
  local dt; dt=$(secs "$t0")
  printf "%s\t%s\t%s\t%s\n" "$name" "$rc" "$dt" "$lim" >> "$RAW/steps.tsv"
  log "$name: exit $rc after ${dt}s"
  if [ "$rc" != 0 ]; then tail -n 15 "$RAW/$name.log" | sed "s/^/  [$name] /"; fi
  grep -h '^\[.* [a-z]*\] ' "$RAW/$name.log" 2>/dev/null | sed "s/^/  /"
  return "$rc"
}

# fault NAME GPUS WHO EXPECT: a pipeline run killed mid-way; record whether it ended and named the process
fault() {
  local name=$1 gpus=$2 who=$3 expect=$4 t0 rc
  t0=$(now_ms)
  # random initial weights (pre-training runs meanwhile): a large max_lag, so that the random policy's
  # long sequences are not all dropped as stale before the fault's step comes
  CUDA_VISIBLE_DEVICES=$gpus step "fault-$name" "$FAULT_CAP" "$RESERVE" \
    $RUN --nproc-per-node 2 $LAUNCH $ARGS --max-lag "$FAULT_LAG" --modes pipeline --time-per-mode 60 \
    --fault "$who" --stall-s 30 --out "$RAW/run-fault-$name.json"
  rc=$?
  $PY -m repro.pipelinerl.plan fault-record --case "$name" --rc "$rc" --seconds "$(secs "$t0")" \
    --log "$RAW/fault-$name.log" --expect "$expect" --out "$RAW/fault-$name.json" || true
}

log "budget ${BUDGET}s, smoke=$SMOKE, GPUs: ${GPUS[*]:-none} ($NG), out $OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv > "$RAW/gpus.txt" 2>&1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" \
  >> "$RAW/gpus.txt" 2>&1
ARGS=$($PY -m repro.pipelinerl.plan launch-args $SFLAG)
# PRE_S: pre-training seconds; RESERVE: kept for the report and the archive; FIX: a launch's start-up
# and per-mode overheads beyond 3 T; PRE_RESERVE: what step 1 must leave for steps 2-5
if [ "$SMOKE" = "1" ]; then
  PRE_S=3; FAULT_CAP=40; RESERVE=14; FAULT_STEP=3; FIX=14; PRE_RESERVE=34; FAULT_LAG=64
else
  PRE_S=28; FAULT_CAP=60; RESERVE=20; FAULT_STEP=10; FIX=20; PRE_RESERVE=80; FAULT_LAG=2048
fi
ARGS="$ARGS --stall-s 60"
[ -n "${PLAN_LR:-}" ] && ARGS="$ARGS --lr $PLAN_LR"   # after the plan's own --lr: the last one counts
[ "${PLAN_DEVICE:-cuda}" = "cpu" ] && ARGS="$ARGS --device cpu"
LATER=0; [ "$NG" -ge 4 ] && LATER=2            # launches after 1+1 (1+3, 2+2)

if [ "$NG" -lt 2 ]; then
  log "needs at least 2 GPUs, found $NG"; exit 2
fi

# ---- 5. (defined here, run last): report, digest, archive, summary; the two-GPU plan calls it too ----
finish() {
  if [ "$SMOKE" = "1" ]; then TAG=placements-smoke; REP_DIR="$RAW"; else TAG=placements; REP_DIR="$RES"; fi
  if [ "$TWO" = "1" ]; then TAG=placements-2gpu${PLAN_SUFFIX:-}; else TAG="$TAG${PLAN_LR:+-lr$PLAN_LR}${PLAN_SUFFIX:-}"; fi
  step report 40 2 $PY -m repro.pipelinerl.plan report --dir "$RAW" --results-dir "$REP_DIR" --tag "$TAG"
  # the diagnosis behind the page's findings (lab/placements.py), while the per-step records are here
  step digest 20 2 $PY -m repro.pipelinerl.lab.placements "$RAW" --out "$RAW/digest.json"
  rm -f "$RAW/weights.pt"                         # 13 MB of pre-trained weights: not worth carrying back
  tar czf "$OUT/pipelinerl.tgz" -C "$WORK" repro/pipelinerl/results
  log "wrote $OUT/pipelinerl.tgz ($(du -h "$OUT/pipelinerl.tgz" | cut -f1)); steps:"
  column -t -s $'\t' "$RAW/steps.tsv" 2>/dev/null || cat "$RAW/steps.tsv"
  REPORT=$(ls "$REP_DIR"/*-"$TAG".json 2>/dev/null | head -n 1)
  if [ -n "$REPORT" ]; then
    $PY -m repro.pipelinerl.plan summary "$REPORT"
  else
    log "no report was written: see $RAW/report.log in the archive"
  fi
  log "done in $(( $(date +%s) - START ))s"
}

# ---- the two-GPU plan: pre-training, then 1+1 once per "lr:seed" of PLAN_RUNS, nothing beside them ----
if [ "$TWO" = "1" ]; then
  read -r -a RUNS <<< "${PLAN_RUNS:-0:0 2e-4:0 2e-4:1}"
  N=${#RUNS[@]}
  PRE_STEPS="${PLAN_PRETRAIN_STEPS:-201}"
  CUDA_VISIBLE_DEVICES=$(g 0) step pretrain $(( PRE_S + 40 )) $(( RESERVE + N * (3 * 8 + FIX) )) \
    $PY -m repro.pipelinerl.plan pretrain --out "$RAW" $SFLAG --budget-s $(( PRE_S + 20 )) --stop-after "$PRE_STEPS"
  if [ -f "$RAW/weights.pt" ]; then WFLAG="--weights $RAW/weights.pt"; else
    log "no pre-trained weights: the runs start from random weights, at max_lag $FAULT_LAG"
    WFLAG="--max-lag $FAULT_LAG"
  fi
  T=$(( ( $(left) - N * FIX - RESERVE - 10 ) / (3 * N) )); [ "$T" -gt 60 ] && T=60; [ "$T" -lt 8 ] && T=8
  log "two-GPU plan: runs (lr:seed) ${RUNS[*]}, T = ${T}s of training per mode; estimated $(( N * (3 * T + FIX) ))s of launches, report and archive ~${RESERVE}s; left $(left)s"
  k=0
  for run in "${RUNS[@]}"; do
    k=$(( k + 1 ))
    lr=${run%%:*}; seed=${run##*:}
    tag="lr$lr-seed$seed"
    CUDA_VISIBLE_DEVICES=$(g 0 1) step "launch-1+1-$tag" $(( 3 * T + 45 )) $(( RESERVE + (N - k) * (3 * T + FIX) )) \
      $RUN --nproc-per-node 2 $LAUNCH $ARGS $WFLAG --lr "$lr" --seed "$seed" --trainers 1 --name "1+1 $tag" \
      --modes conventional,pipeline,async --time-per-mode "$T" --out "$RAW/launch-1+1-$tag.json"
  done
  finish
  exit 0
fi

# ---- 1. pre-training || faults (the smoke run starts the faults with step 2: its critical path) ----
if [ "$SMOKE" = "1" ] || [ "$NG" -lt 4 ]; then FA=$(g 0 1); FT=$(g 1 0); else FA=$(g 1 2); FT=$(g 3 2); fi
start_faults() {
  fault actor "$FA" "actor:0@$FAULT_STEP" "actor 0 (rank 1) died" &
  PID_FA=$!
  fault trainer "$FT" "trainer@$FAULT_STEP" "trainer 0 (rank 0) died" &
  PID_FT=$!
}
if skip faults; then start_faults() { PID_FA=; PID_FT=; log "faults: skipped (PLAN_SKIP)"; }; fi
[ "$SMOKE" != "1" ] && start_faults
CUDA_VISIBLE_DEVICES=$(g 0) step pretrain $(( PRE_S + 40 )) "$PRE_RESERVE" \
  $PY -m repro.pipelinerl.plan pretrain --out "$RAW" $SFLAG --budget-s $PRE_S
[ "$SMOKE" != "1" ] && [ -n "$PID_FA" ] && wait $PID_FA $PID_FT
if [ -f "$RAW/weights.pt" ]; then
  WFLAG="--weights $RAW/weights.pt"
else  # random weights: with max_lag 128 a random policy's long sequences would nearly all go stale
  log "no pre-trained weights: the runs start from random weights, at max_lag $FAULT_LAG"
  WFLAG="--max-lag $FAULT_LAG"
fi

# ---- 2. placement 1+1 || one-GPU runs ----------------------------------------------------------
if [ "$SMOKE" = "1" ]; then
  T=2
else
  # launches still to come: 1+1 (with the one-GPU runs beside it) and the LATER ones, less the skipped
  LATER=0; [ "$NG" -ge 4 ] && { skip 1+3 || LATER=$((LATER + 1)); skip 2+2 || LATER=$((LATER + 1)); }
  FIRST=1; skip 1+1 && skip onegpu && FIRST=0
  [ $((LATER + FIRST)) -eq 0 ] && { log "PLAN_SKIP leaves no launch"; finish; exit 0; }
  T=$(( ( $(left) - (LATER + FIRST) * FIX - RESERVE - 10 ) / (3 * (LATER + FIRST)) )); [ "$T" -gt 60 ] && T=60; [ "$T" -lt 8 ] && T=8
fi
log "T = ${T}s of training per mode; estimated: step 2 $(( 3 * T + FIX ))s, steps 3-4 $(( LATER * (3 * T + FIX) ))s, report and archive ~${RESERVE}s; left $(left)s"
[ "$SMOKE" = "1" ] && start_faults   # on the same two GPUs as the rest: timings do not matter in the smoke run
# the one-GPU runs share GPU 0 with the 1+1 trainer in the smoke run (two GPUs only); alone on GPU 2 otherwise
if [ "$NG" -ge 3 ]; then OG=$(g 2); else OG=$(g 0); fi
PID_OG=
if ! skip onegpu; then
  CUDA_VISIBLE_DEVICES=$OG step onegpu $(( 3 * T + 40 )) $(( RESERVE + LATER * (3 * T + FIX) )) \
    $PY -m repro.pipelinerl.plan onegpu --dir "$RAW" $SFLAG --time-per-mode "$T" ${PLAN_LR:+--lr "$PLAN_LR"} &
  PID_OG=$!
fi
skip 1+1 || CUDA_VISIBLE_DEVICES=$(g 0 1) step launch-1+1 $(( 3 * T + 45 )) $(( RESERVE + LATER * (3 * T + FIX) )) \
  $RUN --nproc-per-node 2 $LAUNCH $ARGS $WFLAG --trainers 1 --name 1+1 --modes conventional,pipeline,async \
  --time-per-mode "$T" --out "$RAW/launch-1+1.json"
[ -n "$PID_OG" ] && wait $PID_OG

# ---- 3. placement 1+3 || predictions; 4. placement 2+2 -------------------------------------------
if [ -f "$RAW/onegpu.json" ]; then
  PLACES=1+1; [ "$NG" -ge 4 ] && PLACES=1+1,1+3,2+2
  step predict 120 "$RESERVE" $PY -m repro.pipelinerl.plan predict --dir "$RAW" --placements "$PLACES" &
  PID_PR=$!
else
  PID_PR=
fi
if [ "$NG" -ge 4 ]; then
  skip 1+3 || CUDA_VISIBLE_DEVICES=$(g 0 1 2 3) step launch-1+3 $(( 3 * T + 45 )) $(( RESERVE + 3 * T + FIX )) \
    $RUN --nproc-per-node 4 $LAUNCH $ARGS $WFLAG --trainers 1 --name 1+3 --modes conventional,pipeline,async \
    --time-per-mode "$T" --out "$RAW/launch-1+3.json"
  skip 2+2 || CUDA_VISIBLE_DEVICES=$(g 0 1 2 3) step launch-2+2 $(( 3 * T + 45 )) "$RESERVE" \
    $RUN --nproc-per-node 4 $LAUNCH $ARGS $WFLAG --trainers 2 --name 2+2 --modes conventional,pipeline,async \
    --time-per-mode "$T" --out "$RAW/launch-2+2.json"
else
  log "placements 1+3 and 2+2 need 4 GPUs: skipped"
fi
[ -n "$PID_PR" ] && wait "$PID_PR"
[ "$SMOKE" = "1" ] && wait $PID_FA $PID_FT


# ---- 5. ----------------------------------------------------------------------------------------------
finish
