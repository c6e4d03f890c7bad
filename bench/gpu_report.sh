#!/usr/bin/env bash
# The decode report of bench/RESULTS.md in one device-tool call on a 2-GPU H200 machine (~9 min):
#
#   OUT=$OUT bench/gpu_report.sh          -> $OUT/results.tgz (every log and JSON), $OUT/session.txt
#
# Phase A, three things at once: GPU 0 times ours and transformers' model on one 4-layer bf16
# checkpoint (made on the CPU meanwhile); GPU 1 runs the attention/MLP breakdown (8 layers) and the
# 61-layer step with the Generator's host loop; the CPUs build the CUDA engine. Phase B (both GPUs):
# the tp=2 step with psum and with the engine, then the engine's top-k self-test. Each phase has a
# hard time limit so the results are packed before the tool's 10-minute limit.
set -uo pipefail
export WORK=${WORK:-/tmp/jtilert_report} BACKENDS=${BACKENDS:-pallas}
mkdir -p "$WORK"
S=bench/gpu_session.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$WORK/machine.txt" 2>&1
timeout 320 bash $S build &
timeout 320 bash -c "bash $S checkpoint && CUDA_VISIBLE_DEVICES=0 bash $S ours_4l hf_eager hf_compile" &
CUDA_VISIBLE_DEVICES=1 timeout 320 bash $S breakdown decode &
wait
bash $S pack
timeout 190 bash $S tp2 select
bash $S pack
cat "$WORK/session.txt"
