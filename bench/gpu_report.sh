#!/usr/bin/env bash
# The decode report of bench/RESULTS.md on a 2-GPU H200 machine, in two device-tool calls of ~6 min
# (call B within 30 s of A keeps the machine and the engine build):
#
#   OUT=$OUT bench/gpu_report.sh A      -> $OUT/results_A.tgz (every log and JSON), $OUT/session.txt
#   OUT=$OUT bench/gpu_report.sh B      -> $OUT/results_B.tgz
#
# A, two things at once: GPU 1 times the 61-layer step, pallas and reference, with a CUPTI kernel
# profile and the Generator's host loop; the CPUs build the CUDA engine. (The comparison with
# transformers is not here: it needs an idle host and GPU, bench/gpu_session.sh's vs parts.)
# B: the tp=2 step with psum and with the engine (both GPUs), then the 8-layer attention/MLP
# breakdown on GPU 0 while the engine's top-k self-test runs. Each phase has a hard time limit so its
# results are packed before the tool's 10-minute limit.
set -uo pipefail
export WORK=${WORK:-/tmp/jtilert_report}
mkdir -p "$WORK"
S=bench/gpu_session.sh
case ${1:?A or B} in
  A)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv > "$WORK/machine.txt" 2>&1
    timeout 330 bash $S build &
    CUDA_VISIBLE_DEVICES=1 timeout 330 bash $S decode &
    wait ;;
  B)
    timeout 150 bash $S build tp2
    CUDA_VISIBLE_DEVICES=0 BACKENDS=pallas timeout 170 bash $S breakdown &
    timeout 170 bash $S select &
    wait ;;
esac
tar czf "${OUT:?}/results_$1.tgz" -C "$WORK" . && cp "$WORK/session.txt" "$OUT/"
cat "$WORK/session.txt"
