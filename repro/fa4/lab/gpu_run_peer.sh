#!/usr/bin/env bash
# One device call (second of two): flash-attn-4 as a peer on the H100, and Nsight Compute counters
# for the gap between our forward and cuDNN's. Run from the repository root; carry .whl/cx2 and
# .whl/fa4rest. The first call of the pair must have left the other half of the CuTe-DSL runtime
# tarball at /root/cx/cxpart.aa:  mkdir -p /root/cx && cp .whl/cx1/cxpart.aa /root/cx/
# Writes under $OUT: run.log, <device>-fa4-smoke.json, <device>-peer.json, ncu-raw.csv,
# ncu-details.csv, ncu.log (bash repro/fa4/lab/gpu_run_peer.sh, from the repository root). Every step runs under `timeout`, capped so that the whole call ends
# within BUDGET seconds.
set -o pipefail
BUDGET=${BUDGET:-520}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
export PYTHONUNBUFFERED=1 PAPERCLUB_RECORD_CLAIMS=0 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1

# cap N [RESERVE]: N seconds, or fewer so that RESERVE seconds stay for the steps after this one.
cap() {
  local want=$1 left=$((BUDGET - SECONDS - ${2:-0}))
  if ((left < 5)); then left=5; fi
  if ((want < left)); then echo "$want"; else echo "$left"; fi
}
step() { echo; echo "=== [t=${SECONDS}s] $*"; }

step "install flash-attn-4 and its CuTe-DSL runtime into /tmp/site"
SITE=/tmp/site
rm -rf "$SITE" && mkdir -p "$SITE"
# pip first: with --target it would skip (or, with --upgrade, replace) the nvidia_cutlass_dsl/ folder
# that the tarball fills, while tar merges into the folders pip made.
timeout "$(cap 60)" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target "$SITE" .whl/fa4rest/*.whl || echo "pip install of .whl/fa4rest failed (rc=$?)"
if [ -f /root/cx/cxpart.aa ] && [ -f .whl/cx2/cxpart.ab ]; then
  timeout "$(cap 90)" bash -c "cat /root/cx/cxpart.aa .whl/cx2/cxpart.ab | xz -d | tar x -C $SITE" \
    || echo "unpacking the cutlass-dsl-libs-cu13 tarball failed (rc=$?)"
else
  echo "MISSING: /root/cx/cxpart.aa (from the first call) or .whl/cx2/cxpart.ab is not here:"
  ls -l /root/cx/ .whl/cx2/ 2>&1
  echo "without nvidia-cutlass-dsl-libs-cu13 flash-attn-4 cannot import; the rest still runs"
fi
# The .pth file that puts dsl_packages/ (the `cutlass` package) on sys.path is only read in site
# directories, not in PYTHONPATH entries, so that folder is named here directly.
export PYTHONPATH=$PWD/site:$PWD:$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages
du -sh "$SITE" 2>/dev/null

step "versions"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,driver_version --format=csv
timeout "$(cap 60)" python3 - <<'EOF'
import importlib.metadata as md, torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cudnn", torch.backends.cudnn.version())
for name in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
             "nvidia-cutlass-dsl-libs-cu13", "quack-kernels", "apache-tvm-ffi", "torch-c-dlpack-ext",
             "cuda-bindings", "einops"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
EOF

step "flash-attn-4 smoke test (one small shape, vs float64)"
timeout "$(cap 180 300)" python3 -m repro.fa4.bench --only fa4-smoke --out "$OUT"
smoke=$?
echo "smoke exit status: $smoke (0 ran, 3 did not import/compile/run, 124 timed out)"
# A failure is the answer and could leave a broken CUDA context: leave flash-attn-4 out from here on.
# A timeout is more likely slow compilation (kept in the on-disk JIT cache), so the peer run tries it.
nofa4=()
if [ "$smoke" -ne 0 ] && [ "$smoke" -ne 124 ]; then nofa4=(--no-fa4); fi

step "benchmark rows: flash-attn-4, cuDNN, ours (TMA on), S = 1k..16k, causal and not ${nofa4[*]}"
timeout "$(cap 330 60)" python3 -m repro.fa4.bench --only peer "${nofa4[@]}" --out "$OUT"
echo "peer bench exit status: $?"

step "Nsight Compute: one forward each at S = 8k, non-causal"
# flash-attn-4 only where the smoke test passed: a hang or crash would lose the whole report.
ncu_nofa4=(--no-fa4)
if [ "$smoke" -eq 0 ]; then ncu_nofa4=(); fi
# paperclub.lab.run_ncu: finds ncu, profiles `python -m repro.fa4.lab.ncu --target`, retries without the
# extra pipe metrics if ncu refuses one, exports ncu-raw.csv / ncu-details.csv and prints the summary
timeout "$(cap 200 10)" python3 -m repro.fa4.lab.ncu --out "$OUT" --timeout-s "$(cap 120 20)" "${ncu_nofa4[@]}"
echo "ncu exit status: $?"
step "done"
ls -la "$OUT"
sleep 1  # let tee write the last lines of run.log
