#!/usr/bin/env bash
# One device-tool call that runs the chosen GPU benchmarks from the checkout and keeps every log.
#
#   OUT=$OUT bench/gpu_session.sh PART [PART ...]      (device tool: `bash bench/gpu_session.sh ...`)
#
# PARTs (each under its own time limit, logs and JSON in $OUT/<part>.*):
#   stream       bench/kernels.py --only stream: what the TMA pipeline streams with no arithmetic
#   kernels      bench/kernels.py --sweep --quick: projection / MoE / lm-head kernels vs XLA (issue 4)
#   attention    bench/attention.py (issue 5)
#   decode       bench.decode: dsv32-tp8-shard, 61 layers, context 4096, pallas + reference (issue 7)
#   breakdown    bench.decode at 8 layers with the attention / MLP timing variants and a CUPTI profile
#   tp2          bench.decode at tp=2, 4 layers, engine vs psum (2 GPUs; issues 6 and 7)
#   transformers transformers' model vs ours on the same 4-layer bf16 checkpoint (issue 7)
#   engine       tests/gpu/run_engine_gpu.sh: CUDA engine build, checks, sanitizers, timings (2 GPUs)
set -uo pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" "$OUT/stream"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
T0=$(date +%s)
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "[$(( $(date +%s) - T0 ))s] $name: $*" | tee -a "$OUT/session.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "[$(( $(date +%s) - T0 ))s] $name rc=$rc" | tee -a "$OUT/session.txt"
  tail -25 "$OUT/$name.log"
}
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv; } >> "$OUT/session.txt" 2>&1
DEC="python3 -m bench.decode --preset dsv32-tp8-shard --context 4096"
for part in "$@"; do
  case $part in
    stream) OUT=$OUT/stream step stream 150 python3 bench/kernels.py --only stream ;;
    kernels) OUT=$OUT step kernels 300 python3 bench/kernels.py --sweep --quick ;;
    attention) OUT=$OUT step attention 200 python3 bench/attention.py ;;
    decode) step decode 400 $DEC --layers 61 --backend pallas,reference --kernels \
              --out "$OUT/decode.json" --plot "$OUT/decode.png" ;;
    breakdown) step breakdown 300 $DEC --layers 8 --backend pallas,reference --breakdown --kernels \
                 --out "$OUT/breakdown.json" ;;
    tp2) step tp2 300 $DEC --layers 4 --tp 2 --backend pallas,reference --all-reduce psum,engine \
           --out "$OUT/tp2.json" ;;
    transformers)
      ck=/tmp/jt_dsv32_4l
      step make_checkpoint 200 python3 -c "import jtilert; jtilert.random_checkpoint('dsv32-tp8-shard', '$ck', fmt='bf16', num_layers=4, overwrite=True)"
      step ours_ckpt 200 python3 -m bench.decode --checkpoint $ck --context 1024 --backend pallas,reference \
        --out "$OUT/ours_4l.json"
      step transformers 300 python3 -m bench.transformers_decode $ck --context 1024 --new 32 --out "$OUT/transformers.json"
      step transformers_compile 300 python3 -m bench.transformers_decode $ck --context 1024 --new 32 --compile \
        --out "$OUT/transformers_compile.json" ;;
    engine) OUT=$OUT/engine step engine 400 tests/gpu/run_engine_gpu.sh ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
