#!/usr/bin/env bash
# The KDA tuning job in one device call: GPU tests, --tune (ours only: each --try against the
# defaults, interleaved rounds), the kernel-time breakdown, then Nsight Compute on one forward +
# backward (full set; by default the forward's kernels) with the per-instruction SASS view of the
# intra-chunk kernel.
#   bash repro/kda/gpu_tune.sh --seqlens 2048,4096 --try SPLIT_B_STAGES=1 --try INTRA_FWD_QG=False,INTRA_FWD_KB=False
# Writes under $OUT: gpu_tests.log, tune.log, tune.json, breakdown.log, ncu.log, ncu-details.csv,
# ncu-source-<kernel>.csv. BUDGET (s) caps the whole call; NCU=0 leaves Nsight Compute out;
# PROFILE_SET="NAME=VALUE ..." profiles (and breaks down) with those settings instead of the defaults;
# NCU_KERNELS (a regex) picks the kernels Nsight Compute profiles, NCU_SOURCE (names) those whose
# per-instruction view is exported as ncu-source-<name>.csv.
set -o pipefail
BUDGET=${BUDGET:-560}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/site:$PWD PYTHONUNBUFFERED=1 PAPERCLUB_RECORD_CLAIMS=0
left() { echo $((BUDGET - SECONDS - ${1:-10})); }
timeout 150 python3 -m pytest -q -m gpu repro/kda -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests: exit $? ($(tail -n 1 "$OUT/gpu_tests.log"))"
[ "${NCU:-1}" = 1 ] && reserve=110 || reserve=30
timeout "$(left $reserve)" python3 -m repro.kda.bench --tune --out "$OUT" "$@" 2>&1 | tee "$OUT/tune.log" | grep -E "^B=|failed"
profile_set=()
for pair in ${PROFILE_SET:-}; do profile_set+=(--set "$pair"); done
timeout "$(left $((reserve - 10)))" python3 -m repro.kda.bench --breakdown --impls ours "${profile_set[@]}" 2>&1 \
  | grep -v "^setting" >"$OUT/breakdown.log"
grep -A8 "^ours" "$OUT/breakdown.log"
[ "${NCU:-1}" = 1 ] || exit 0
NCU_BIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
if [ -z "$NCU_BIN" ]; then echo "ncu not found"; exit 0; fi
rep=/tmp/kda-ncu
rm -f $rep.ncu-rep
timeout "$(left 40)" "$NCU_BIN" --profile-from-start off --clock-control none --set full \
  -k regex:"${NCU_KERNELS:-kda_(intra|wy|state|out)_fwd}" -f -o $rep python3 -m repro.kda.bench --profile-target "${profile_set[@]}" >"$OUT/ncu.log" 2>&1
echo "ncu exit status: $?"
tail -5 "$OUT/ncu.log"
if [ -s $rep.ncu-rep ]; then
  timeout 20 "$NCU_BIN" --import $rep.ncu-rep --csv --page details >"$OUT/ncu-details.csv"
  for kern in ${NCU_SOURCE:-kda_intra_fwd}; do
    timeout 30 "$NCU_BIN" --import $rep.ncu-rep --csv --page source --print-source sass \
      -k regex:"$kern" >"$OUT/ncu-source-$kern.csv" 2>&1
  done
  ls -la "$OUT"
fi
