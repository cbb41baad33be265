#!/usr/bin/env bash
# The GPU plan of issue #35 (NCCL's bus bandwidth on 4 GPUs), one command on a machine of WORLD GPUs:
#   WORLD=4 BUDGET_S=420 bash nanoparallel/cuda/gpu_plan.sh      # from the repository root
# Everything it writes is packed into ONE file, $OUT/nanoparallel.tgz, with paths relative to the
# repository root (tar xzf it there): result Reports in nanoparallel/results/, logs, check summaries
# and the tables made from this run in nanoparallel/results/gpu-plan/. In order of priority:
# 1. check: every new algorithm of issue #35 on WORLD ranks, one at a time, failing fast (a timeout,
#    a crash or a wrong result stops that algorithm only; the rest go on), then the faults they must
#    raise; the summary (check-x$WORLD.json) is what later steps read: a new algorithm that did not
#    pass is never timed;
# 2. diagnosis: NVLink by traffic pattern (one pair, ring, all links at once, incast), every
#    collective's algorithms over steps x programs at 64 MiB, 256 MiB, 1 GiB (lab/diagnose.py); then
#    NCCL's own choice (NCCL_DEBUG=INFO) and its pinned algorithms and protocols (lab/nccl_info.py);
#    the steps and programs the diagnosis found best go to the sweeps (lab/tuning.py --tuning-out);
# 3. the sweep of every collective against NCCL, 8 B to 1 GiB, on WORLD GPUs, each implementation
#    checked at each size before it is timed;
# 4. the same sweep on 2 GPUs (CUDA_VISIBLE_DEVICES=0,1), the same code;
# then, if budget is left, the new algorithms' check on 2 GPUs and the old full check sampled.
# Each step has its own time limit, cut to what is left of BUDGET_S; a failing step is logged and
# the rest go on. Last: the tables auto would take from this run (not written into the tree) and a
# summary table. Exit status 1 if any step failed or timed out.
# A narrower run (defaults in brackets): CHECK_GROUPS ["new faults"] and CHECK_S [95] for step 1,
# CHECK2_GROUPS ["new"] for the 2-GPU check, DIAG_COLLECTIVES [all] for step 2, SWEEP_MIN_BYTES [16]
# for steps 3-4, CHECK_OLD [1] (0 skips the old check), RUN [busbw] (the result files' tags:
# <device>-cuda-x4-RUN.json, -cuda-x2-RUN.json, -cuda-x4-RUN-diagnose.json, -cuda-x4-RUN-nccl.json;
# a new name keeps a later run from overwriting an earlier one's files). The follow-up of the
# 2026-11-28 run, which gives two_shot_pipelined's check the time it lacked, runs the faults of
# every new kernel and times every collective from 64 MiB a second time (about 6 minutes):
#   WORLD=4 BUDGET_S=500 RUN=busbw2 CHECK_GROUPS="all_reduce/two_shot_pipelined new faults" CHECK_S=200 \
#     CHECK2_GROUPS=all_reduce/two_shot_pipelined DIAG_COLLECTIVES=all_reduce SWEEP_MIN_BYTES=67108864 \
#     CHECK_OLD=0 bash nanoparallel/cuda/gpu_plan.sh
export PYTHONPATH=$PWD/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set -u
OUT=${OUT:-/tmp/nanoparallel-gpu-plan}
PY=${PYTHON:-$(command -v python3 || command -v python)}
BUDGET_S=${BUDGET_S:-420}
WORLD=${WORLD:-4}
CHECK_GROUPS=${CHECK_GROUPS:-new faults}
CHECK_S=${CHECK_S:-95}
CHECK2_GROUPS=${CHECK2_GROUPS:-new}
DIAG_COLLECTIVES=${DIAG_COLLECTIVES:-broadcast all_gather all_to_all all_reduce reduce_scatter}
SWEEP_MIN_BYTES=${SWEEP_MIN_BYTES:-16}
CHECK_OLD=${CHECK_OLD:-1}
RUN=${RUN:-busbw}
RESERVE_S=20 # packing and the summary at the end
STAGE=$(mktemp -d)
RES=$STAGE/nanoparallel/results
AUX=$RES/gpu-plan
mkdir -p "$AUX" "$OUT"
LOG=$AUX/gpu_plan.log
failed=0

left() { echo $((BUDGET_S - RESERVE_S - SECONDS)); }

reap() { # stray rank processes of a step that was killed must not hold the GPUs for the next one
  local pids
  for _ in 1 2 3 4 5; do
    pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
    [[ -z $pids ]] && return
    sleep 1
  done
  echo "[$SECONDS s] killing leftover GPU processes of this plan: $pids" | tee -a "$LOG"
  for p in $pids; do kill -9 "$p" 2>/dev/null; done
}

step() { # step NAME LIMIT_S COMMAND...: run with the smaller of LIMIT_S and the budget left
  local name=$1 limit=$2
  shift 2
  local l
  l=$(left)
  ((l < limit)) && limit=$l
  if ((limit < 25)); then
    echo "[$SECONDS s] $name: skipped, only ${l}s of the budget left" | tee -a "$LOG"
    failed=1
    return 1
  fi
  echo "[$SECONDS s] $name: start (limit ${limit}s): $*" | tee -a "$LOG"
  timeout --kill-after=5 "$limit" "$@" >"$AUX/$name.log" 2>&1
  local rc=$?
  echo "[$SECONDS s] $name: exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)')" | tee -a "$LOG"
  tail -n 4 "$AUX/$name.log" | sed 's/^/    /' | tee -a "$LOG"
  ((rc != 0)) && failed=1
  reap
  return $rc
}

{
  echo "date: $(date -u +%FT%TZ)  commit: $(git rev-parse --short HEAD 2>/dev/null)  python: $PY  world: $WORLD  budget: $BUDGET_S s"
  echo "check: $CHECK_GROUPS ($CHECK_S s); check2: $CHECK2_GROUPS; diagnose: $DIAG_COLLECTIVES; sweeps from $SWEEP_MIN_BYTES B"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  nvidia-smi topo -m 2>&1 | head -n $((WORLD + 2))
} >"$LOG"
cat "$LOG"

CHECK=$AUX/check-x$WORLD.json
# shellcheck disable=SC2086  # the group lists are words
step check "$CHECK_S" "$PY" -m nanoparallel.cuda.check --world-size "$WORLD" --groups $CHECK_GROUPS \
  --budget-s $(($(left) < CHECK_S ? $(left) - 8 : CHECK_S - 8)) --timeout-s 15 --out "$CHECK"
# shellcheck disable=SC2086
step diagnose 70 "$PY" -m nanoparallel.cuda.lab.diagnose --world-size "$WORLD" --checked "$CHECK" \
  --collectives $DIAG_COLLECTIVES --tag "cuda-x$WORLD-$RUN-diagnose" --out "$RES"
step nccl 35 "$PY" -m nanoparallel.cuda.lab.nccl_info --world-size "$WORLD" --tag "cuda-x$WORLD-$RUN-nccl" --out "$RES"
mv "$RES"/nccl-debug-x*.log "$AUX"/ 2>/dev/null
DIAG=$(ls "$RES"/*-cuda-x$WORLD-$RUN-diagnose.json 2>/dev/null | head -n 1)
TUNING=()
if [[ -n $DIAG ]] && "$PY" -m nanoparallel.cuda.lab.tuning --diagnose "$DIAG" --tuning-out "$AUX/tuning-x$WORLD.json" \
  >>"$LOG" 2>&1; then
  TUNING=(--tuning "$AUX/tuning-x$WORLD.json")
fi
step sweep$WORLD 110 "$PY" -m nanoparallel.cuda.sweep --world-size "$WORLD" --min-bytes "$SWEEP_MIN_BYTES" --step 4 \
  --max-iters 30 --checked "$CHECK" ${TUNING[@]+"${TUNING[@]}"} --tag "cuda-x$WORLD-$RUN" --out "$RES"
step sweep2 90 env CUDA_VISIBLE_DEVICES=0,1 "$PY" -m nanoparallel.cuda.sweep --world-size 2 --min-bytes "$SWEEP_MIN_BYTES" --step 4 \
  --max-iters 30 --checked "$CHECK" --tag "cuda-x2-$RUN" --out "$RES"
# extras, only with budget to spare
# shellcheck disable=SC2086
step check2 60 env CUDA_VISIBLE_DEVICES=0,1 "$PY" -m nanoparallel.cuda.check --world-size 2 --groups $CHECK2_GROUPS \
  --budget-s $(($(left) < 60 ? $(left) - 8 : 52)) --timeout-s 15 --out "$AUX/check-x2.json"
if ((CHECK_OLD)); then
  step check-old 80 "$PY" -m nanoparallel.cuda.check --world-size "$WORLD" --groups old-quick \
    --budget-s $(($(left) < 80 ? $(left) - 8 : 72)) --timeout-s 15 --out "$AUX/check-old-x$WORLD.json"
fi

# the tables auto would take from this run, for the coordinator to review (not written into the tree)
SWEEPS=$(ls "$RES"/*-cuda-x2-$RUN.json "$RES"/*-cuda-x$WORLD-$RUN.json 2>/dev/null)
if [[ -n $SWEEPS ]]; then
  # shellcheck disable=SC2086
  "$PY" -m nanoparallel.cuda.lab.tuning --sweep $SWEEPS ${DIAG:+--diagnose "$DIAG"} --write "$AUX/auto_tables.py" \
    --summary "$RES" --pins >"$AUX/tuning.log" 2>&1 || echo "tuning failed (see tuning.log)" | tee -a "$LOG"
fi
echo "[$SECONDS s] done" | tee -a "$LOG"
tar czf "$OUT/nanoparallel.tgz" -C "$STAGE" nanoparallel
echo "packed $(tar tzf "$OUT/nanoparallel.tgz" | wc -l) paths into $OUT/nanoparallel.tgz ($(du -h "$OUT/nanoparallel.tgz" | cut -f1))"

# the short summary: best of ours against NCCL at the sizes of the targets, per world size
"$PY" - "$RES" "$CHECK" "$RUN" <<'EOF' || true
import json, sys
from pathlib import Path
res, check = Path(sys.argv[1]), Path(sys.argv[2])
if check.exists():
    groups = json.loads(check.read_text())["groups"]
    print("check:", ", ".join(f"{g} {r['status']} ({r['cases']})" for g, r in groups.items()))
for f in sorted(res.glob(f"*-{sys.argv[3]}.json")):
    doc = json.loads(f.read_text())
    rows = [r for r in doc["rows"] if r.get("time_us")]
    nccl = {(r["collective"], r["bytes"]): r for r in rows if r["algorithm"] == "nccl"}
    print(f"\n{doc['title']} ({doc['device']}): best of ours / NCCL busbw (>= 64 MiB), NCCL time / ours (<= 64 KiB)")
    for (coll, nb), ref in sorted(nccl.items()):
        if 64 << 10 < nb < 64 << 20:
            continue
        ours = [r for r in rows if r["collective"] == coll and r["bytes"] == nb and r["algorithm"] not in ("nccl", "auto")]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["time_us"])
        ratio = best["busbw_GBps"] / ref["busbw_GBps"] if nb >= 64 << 20 else ref["time_us"] / best["time_us"]
        print(f"  {coll:15s} {nb:>11d} B  {best['algorithm']:20s} {ratio:5.2f}x  ({best['time_us']:.1f} vs {ref['time_us']:.1f} us)")
EOF
exit $failed
