#!/usr/bin/env bash
# Build the megablocks peer for the benchmark: megablocks 0.10.0 and stanford-stk 0.7.1 from the
# sdists carried in .whl/ (both are source-only on PyPI; megablocks pins torch 2.7.0, which we
# ignore with --no-deps --no-build-isolation against the machine's torch).
#
# Three small patches, applied here to the unpacked sources (none of the peer's code is committed):
#   1. megablocks csrc/cumsum.h: drop the `debug_synchronous` argument that CUB (CUDA 13) removed
#      from DeviceScan::ExclusiveSum/InclusiveSum;
#   2. stk backend/triton_kernels.py: widen every block index loaded from the int16 topology
#      (row_indices, column_indices, block_offsets_t) to int32 before arithmetic: under Triton >= 3.2
#      `pid_m * BLOCK_M` stays int16 and overflows past 256 block-rows (stk issue/PR #168);
#   3. megablocks layers/arguments.py: lift the `triton >= 3.2` guard on mlp_impl="sparse" that
#      exists because of (2).
# Every step is logged and time-limited; any failure stops the script with status 0 ("soft"): the
# bench then notes that megablocks did not import. Log: $MEGABLOCKS_SETUP_LOG.
# MEGABLOCKS_SETUP_DRY=1: unpack and patch only (to check the patches without a GPU).
# The build does not fit the GPU job's peers step on a fresh machine, so it can be done once and
# carried: MEGABLOCKS_WHEEL_OUT=DIR builds wheels of both (patched) into DIR as well (bring them back
# through $OUT into .whl/); when .whl/ already holds megablocks-0.10.0-*.whl and
# stanford_stk-0.7.1-*.whl (built on a machine like the GPU one: torch 2.11, CUDA 13, Python 3.12),
# they are installed instead of building, and the import is checked the same way.
set -u
LOG=${MEGABLOCKS_SETUP_LOG:-/tmp/megablocks_peer_setup.log}
PY=${PYTHON:-python}
BUILD_TIMEOUT=${MEGABLOCKS_BUILD_TIMEOUT:-110}   # the CUDA extension builds in about a minute on an H100 host
: > "$LOG"
log() { echo "[megablocks peers_setup] $*" | tee -a "$LOG"; }
soft_fail() { log "FAILED: $* (megablocks will be reported as not run)"; exit 0; }

# the sdists: $PAPERCLUB_WHL_DIR, else .whl/ at the repository root, else /work/main/.whl
here=$(cd "$(dirname "$0")" && pwd)
for d in "${PAPERCLUB_WHL_DIR:-}" "$here/../../.whl" ".whl" "/work/main/.whl"; do
  if [ -n "$d" ] && [ -f "$d/megablocks-0.10.0.tar.gz" ]; then WHL=$d; break; fi
done
[ -n "${WHL:-}" ] || soft_fail "megablocks-0.10.0.tar.gz not found (looked in PAPERCLUB_WHL_DIR, .whl/)"
[ -f "$WHL/stanford_stk-0.7.1.tar.gz" ] || soft_fail "stanford_stk-0.7.1.tar.gz not found in $WHL"
log "sdists in $WHL; python: $($PY -c 'import sys, torch, triton; print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)' 2>&1)"

prebuilt_mb=$(ls "$WHL"/megablocks-0.10.0-*.whl 2>/dev/null | head -1)
prebuilt_stk=$(ls "$WHL"/stanford_stk-0.7.1-*.whl 2>/dev/null | head -1)
if [ -n "$prebuilt_mb" ] && [ -n "$prebuilt_stk" ] && [ "${MEGABLOCKS_SETUP_DRY:-0}" != 1 ]; then
  log "installing the prebuilt (patched) wheels $(basename "$prebuilt_stk") $(basename "$prebuilt_mb")"
  timeout 120 "$PY" -m pip install --no-deps "$prebuilt_stk" "$prebuilt_mb" >> "$LOG" 2>&1 \
    || soft_fail "pip install of the prebuilt wheels"
  timeout 60 "$PY" -c "import torch, megablocks_ops, megablocks.layers.dmoe; print('megablocks imports')" >> "$LOG" 2>&1 \
    || soft_fail "import megablocks from the prebuilt wheel (built for another torch/CUDA/Python?)"
  log "megablocks 0.10.0 + stanford-stk 0.7.1 installed from prebuilt wheels and importable"
  exit 0
fi

work=$(mktemp -d)
tar xzf "$WHL/stanford_stk-0.7.1.tar.gz" -C "$work" || soft_fail "unpack stk"
tar xzf "$WHL/megablocks-0.10.0.tar.gz" -C "$work" || soft_fail "unpack megablocks"
STK=$work/stanford_stk-0.7.1
MB=$work/megablocks-0.10.0

timeout 30 "$PY" - "$STK" "$MB" <<'EOF' >> "$LOG" 2>&1 || soft_fail "patching (see $LOG)"
import re, sys
from pathlib import Path

stk, mb = Path(sys.argv[1]), Path(sys.argv[2])

def patch(path, pattern, repl, expect):
    text = path.read_text()
    new, n = re.subn(pattern, repl, text)
    if n < expect:
        sys.exit(f"{path}: expected at least {expect} matches of {pattern!r}, found {n}")
    path.write_text(new)
    print(f"patched {path.name}: {n} x {pattern!r}")

# 1. CUB's removed argument: "stream, debug_synchronous));" -> "stream));"
patch(mb / "csrc/cumsum.h", r",\s*debug_synchronous\)\);", "));", 2)
# 2. int16 block indices -> int32 before any arithmetic
patch(stk / "stk/backend/triton_kernels.py",
      r"tl\.load\(((?:row_indices|column_indices|block_offsets_t) \+ [^()]*)\)", r"tl.load(\1).to(tl.int32)", 6)
# 3. the Triton version guard, now that (2) is applied
patch(mb / "megablocks/layers/arguments.py", r"triton\.__version__ >= '3\.2\.0'", "False", 1)
EOF

if [ "${MEGABLOCKS_SETUP_DRY:-0}" = 1 ]; then rm -rf "$work"; log "dry run: all patches apply"; exit 0; fi

log "building megablocks 0.10.0 (patched, TORCH_CUDA_ARCH_LIST=9.0, limit ${BUILD_TIMEOUT} s)"
start=$(date +%s)
if [ -n "${MEGABLOCKS_WHEEL_OUT:-}" ]; then
  # build wheels once (kept in $MEGABLOCKS_WHEEL_OUT to carry back), then install from them
  mkdir -p "$MEGABLOCKS_WHEEL_OUT"
  timeout 60 "$PY" -m pip wheel --no-deps --no-build-isolation -w "$MEGABLOCKS_WHEEL_OUT" "$STK" >> "$LOG" 2>&1 \
    || soft_fail "pip wheel stk"
  TORCH_CUDA_ARCH_LIST=9.0 timeout "$BUILD_TIMEOUT" "$PY" -m pip wheel --no-deps --no-build-isolation \
    -w "$MEGABLOCKS_WHEEL_OUT" "$MB" >> "$LOG" 2>&1 || soft_fail "pip wheel megablocks after $(( $(date +%s) - start )) s"
  timeout 120 "$PY" -m pip install --no-deps "$MEGABLOCKS_WHEEL_OUT"/stanford_stk-0.7.1-*.whl \
    "$MEGABLOCKS_WHEEL_OUT"/megablocks-0.10.0-*.whl >> "$LOG" 2>&1 || soft_fail "pip install of the built wheels"
  log "wheels in $MEGABLOCKS_WHEEL_OUT: $(cd "$MEGABLOCKS_WHEEL_OUT" && ls *.whl | tr '\n' ' ')"
else
  timeout 60 "$PY" -m pip install --no-deps --no-build-isolation "$STK" >> "$LOG" 2>&1 || soft_fail "pip install stk"
  TORCH_CUDA_ARCH_LIST=9.0 timeout "$BUILD_TIMEOUT" "$PY" -m pip install --no-deps --no-build-isolation "$MB" >> "$LOG" 2>&1 \
    || soft_fail "pip install megablocks after $(( $(date +%s) - start )) s"
fi
log "built in $(( $(date +%s) - start )) s"
timeout 60 "$PY" -c "import torch, megablocks_ops, megablocks.layers.dmoe; print('megablocks imports')" >> "$LOG" 2>&1 \
  || soft_fail "import megablocks after the build"
log "megablocks 0.10.0 + stanford-stk 0.7.1 installed and importable"
rm -rf "$work"
exit 0
