#!/usr/bin/env bash
# The KDA tuning job in one device call: GPU tests, lab/tuning.py tune (ours only: each --try against
# the defaults, interleaved rounds), the kernel-time breakdown, then Nsight Compute on one forward +
# backward (lab/ncu.py: full set; by default the forward's kernels) with the per-instruction SASS view
# of the intra-chunk kernel.
#   bash repro/kda/lab/gpu_tune.sh --seqlens 2048,4096 --try bwd_dqk_stages=1 --try wy_bk=32,wy_bv=32
# Writes under $OUT: gpu_tests.log, tune.log, <device>-tune.json, breakdown.log, breakdown.json,
# ncu.log, ncu-raw.csv, ncu-details.csv, ncu-source-<kernel>.csv. BUDGET (s) caps the whole call;
# NCU=0 leaves Nsight Compute out; PROFILE_SET="NAME=VALUE ..." profiles (and breaks down) with those
# KDAConfig fields instead of the defaults; NCU_KERNELS (a regex) picks the kernels Nsight Compute
# profiles, NCU_SOURCE (names) those whose per-instruction view is exported.
set -o pipefail
BUDGET=${BUDGET:-560}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/site:$PWD PYTHONUNBUFFERED=1 PAPERCLUB_RECORD_CLAIMS=0
left() { echo $((BUDGET - SECONDS - ${1:-10})); }
timeout 150 python3 -m pytest -q -m gpu repro/kda -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests: exit $? ($(tail -n 1 "$OUT/gpu_tests.log"))"
[ "${NCU:-1}" = 1 ] && reserve=110 || reserve=30
timeout "$(left $reserve)" python3 -m repro.kda.lab.tuning tune --out "$OUT" "$@" 2>&1 | tee "$OUT/tune.log" | grep -E "^B=|failed"
profile_set=()
for pair in ${PROFILE_SET:-}; do profile_set+=(--set "$pair"); done
timeout "$(left $((reserve - 10)))" python3 -m repro.kda.lab.tuning breakdown --impls ours --out "$OUT" "${profile_set[@]}" \
  >"$OUT/breakdown.log" 2>&1
grep -A8 "^ours" "$OUT/breakdown.log"
[ "${NCU:-1}" = 1 ] || exit 0
sources=()
for kern in ${NCU_SOURCE:-kda_intra_fwd}; do sources+=(--source "$kern"); done
timeout "$(left 20)" python3 -m repro.kda.lab.ncu --out "$OUT" --kernels "${NCU_KERNELS:-kda_(intra|wy|state|out)_fwd}" \
  --timeout-s "$(left 40)" "${sources[@]}" "${profile_set[@]}"
ls -la "$OUT"
