#!/usr/bin/env bash
# GPU run of the CUDA engine (issue 6): build, checks, sanitizers, timings.
#
#   OUT=/some/dir tests/gpu/run_engine_gpu.sh        (from the repository root, >= 2 GPUs)
#
# Steps (logs under $OUT, at most 8 files):
#   1. cmake/nvcc build of cuda/ (library + self-test), ptxas report  -> build.log
#   2. self-test without XLA: all-reduce / GEMV+AR / MoE expert-down+AR / merge_topk vs CPU references,
#      bit-identical ranks, interleaved calls; one-GPU exact top-k (topk_select) vs a
#      sorted reference; CUDA-graph timings (BENCH lines); the timeout path
#                                                                     -> selftest.log
#   3. compute-sanitizer memcheck + racecheck on the small self-test  -> sanitizer.log
#   4. JAX checks: vs psum, bit-identical across ranks (expert_down_all_reduce also
#      inside the tiny model at tp=2, engine vs psum), 10,000 calls in one jitted
#      loop; jtilert.ffi.top_k == lax.top_k, split_topk over 2 GPUs; with XLA
#      command buffers on                                             -> checks.log
#   5. timings through JAX (bench/engine.py; the top-k sections again on
#      their own budget if the main run did not reach them)           -> bench.log, bench.json
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0 ...); the engine never uses it.
set -uo pipefail
OUT=${OUT:-$PWD/out/engine}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
PY=${PYTHON:-python3}
BUDGET=${BENCH_BUDGET_S:-150}
CALLS=${CALLS:-10000}
SUM=$OUT/summary.txt
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a "$SUM"; }

{ date -u; nvidia-smi; nvidia-smi topo -m; nvcc --version; $PY -c 'import jax; print("jax", jax.__version__, jax.devices())'; } > "$OUT/machine.txt" 2>&1
grep -E "H200|H100|NV[0-9]+" "$OUT/machine.txt" | head -8 | tee -a "$SUM"

# ---- 1. build
BUILD=${BUILD_DIR:-build/gpu}
INC=$($PY -c 'import jax.ffi; print(jax.ffi.include_dir())')
if cmake -S cuda -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DJTILERT_PTXAS_VERBOSE=ON \
     -DJTILERT_XLA_FFI_INCLUDE="$INC" > "$OUT/build.log" 2>&1 &&
   cmake --build "$BUILD" -j "$(nproc)" >> "$OUT/build.log" 2>&1; then
  log "build ok"
else
  log "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1
fi
export JTILERT_FFI_LIB=$PWD/$BUILD/libjtilert_engine.so
ST=$BUILD/jtilert_selftest

# ---- 2. self-test (no XLA)
timeout 240 "$ST" --iters 3 --bench > "$OUT/selftest.log" 2>&1
log "selftest rc=$?"
timeout 60 "$ST" --timeout-test >> "$OUT/selftest.log" 2>&1
log "timeout-test rc=$?"
grep -E "^(PASS|FAIL|SKIP|OK|FAILED)" "$OUT/selftest.log" | tee -a "$SUM"

# ---- 3. compute-sanitizer on the small case
: > "$OUT/sanitizer.log"
for tool in ${SANITIZERS-memcheck racecheck}; do   # SANITIZERS="" skips them
  echo "===== compute-sanitizer --tool $tool" >> "$OUT/sanitizer.log"
  timeout 200 compute-sanitizer --tool "$tool" --error-exitcode 9 "$ST" --small --iters 2 \
    >> "$OUT/sanitizer.log" 2>&1
  rc=$?
  log "compute-sanitizer $tool rc=$rc ($(grep -c '^PASS' "$OUT/sanitizer.log") PASS lines so far)"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Hazard|Invalid" "$OUT/sanitizer.log" | tail -3 | tee -a "$SUM"
done

# ---- 4. JAX checks with command buffers on
CB_SETS=("FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL" "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL" "")
CBFLAGS=""
for cb in "${CB_SETS[@]}"; do
  f="--xla_gpu_enable_command_buffer=$cb --xla_gpu_graph_min_graph_size=1"
  if XLA_FLAGS="$f" timeout 60 $PY -c 'import jax, jax.numpy as jnp; jax.jit(lambda x: x + 1)(jnp.ones(4)).block_until_ready()' > /dev/null 2>&1; then
    CBFLAGS=$f; break
  fi
done
log "XLA_FLAGS for checks and timings: ${CBFLAGS:-<default>}"
XLA_FLAGS="$CBFLAGS" timeout 420 $PY tests/gpu/engine_gpu_checks.py --calls "$CALLS" > "$OUT/checks.log" 2>&1
log "jax checks rc=$?"
grep -E "^(PASS|FAIL|OK|FAILED)" "$OUT/checks.log" | cut -c1-220 | tee -a "$SUM"

# ---- 5. timings
XLA_FLAGS="$CBFLAGS" timeout $(( BUDGET + 200 )) $PY bench/engine.py --out "$OUT/bench.json" \
  --budget-s "$BUDGET" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
log "bench rc=$?"
if [ -n "$CBFLAGS" ] && [ "${BENCH_CMDBUF_OFF:-1}" = 1 ]; then
  echo "##### command buffers off" >> "$OUT/bench.log"
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" timeout 120 $PY bench/engine.py --sections allreduce \
    --quick --budget-s 30 >> "$OUT/bench.log" 2>&1
  log "bench (command buffers off) rc=$?"
fi
# the top-k sections (one-GPU select, split indexer) with a budget of their own when the
# sections before them spent the main one
if [ "${BENCH_TOPK:-1}" = 1 ] && ! grep -q "engine select + engine merge" "$OUT/bench.log"; then
  echo "##### top-k sections, own budget" >> "$OUT/bench.log"
  XLA_FLAGS="$CBFLAGS" timeout 300 $PY bench/engine.py --sections select,indexer --budget-s 120 \
    >> "$OUT/bench.log" 2>&1
  log "bench top-k rc=$?"
fi

echo "===== selftest timings (best all-reduce grid per size; all in selftest.log)"
grep "^BENCH" "$OUT/selftest.log" | grep -v "^BENCH all_reduce" | cut -c1-170
grep "^BENCH all_reduce" "$OUT/selftest.log" | sort -t= -k2,2 -k5,5n | awk '{print}' | cut -c1-110 | head -60 | \
  awk -F'graph_us_per_call=' '{split($1,a," grid="); k=a[1]; v=$2+0; if(!(k in b)||v<b[k]){b[k]=v; l[k]=$0}} END{for(k in l) print l[k]}' | sort
echo "===== bench"; grep -vE "Warning|warn" "$OUT/bench.log" | cut -c1-260 | tail -30
echo "===== summary"; cat "$SUM"
