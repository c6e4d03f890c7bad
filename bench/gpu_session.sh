#!/usr/bin/env bash
# GPU benchmarks from the checkout, in one device-tool call; every log and JSON is kept.
#
#   JTILERT_COMMIT=<commit> WORK=/tmp/w bench/gpu_session.sh PART [PART ...]     logs and JSON in $WORK/<part>.*
#   (the device tool returns ≤ 8 files from $OUT: tar $WORK into $OUT, as bench/gpu_report.sh does;
#   SAVE_TO=$OUT re-tars $WORK into $SAVE_TO/session.tgz after every part, so a call that runs out of
#   time still brings back the parts that finished)
#
# BACKENDS (default pallas,reference) picks the decode backends; VS_ARGS the vs parts' sizes (default
# --context 1024 --new 64 --samples 10). PARTs, each under a time limit:
#   stream       bench/kernels.py --only stream: what the TMA pipeline streams with no arithmetic
#   kernels      bench/kernels.py --quick: projection / MoE / lm-head kernels vs XLA (issue 4; ~4 min)
#   sweep        the same with the config sweeps (longer: the MoE sweep alone filled 5 minutes)
#   attention    bench/attention.py (issue 5)
#   decode       bench.decode: dsv32-tp8-shard, context 4096, CUPTI kernel profile (issue 7); 61 layers on an H200,
#                36 on an H100 (share_layers)
#   decodemoe    the same, pallas only, with DecodeConfig.engine_moe (each MoE layer one launch of the engine)
#   timeline     the same, pallas only, with --timeline (TIMELINE_LAYERS=LO:HI: the layers listed kernel by kernel):
#                one 4-step call under JAX's profiler, each kernel's start
#                and end in its second step (bench/timeline.py) → timeline.json ("timeline" in the run),
#                timeline.png (Gantt chart of layers 4-7), timeline.log
#   contexts     the same, pallas only, at contexts 32K and 128K (issue 14's long-context targets; share_layers)
#   glm5         bench.decode for GLM-5's share (glm5-tp8-shard, context 4096), pallas and plain XLA, CUPTI kernel
#                profile. All 78 layers on an H200 (90 GiB of weights); 41 on an H100 (about 47 GiB, as part
#                decode's 36 layers of dsv32-tp8-shard: a step of fewer layers)
#   breakdown    bench.decode at 8 layers with the attention / MLP timing variants (issue 7)
#   checkpoint   a 4-layer bf16 dsv32-tp8-shard HF checkpoint at $CK (on the CPU), for the comparison with
#                transformers, bench/vs_transformers.py (context 1024, 64 new tokens, greedy, batch 1; run it
#                with nothing else on the GPU or the host: SAVE_TO=$OUT bench/gpu_session.sh checkpoint
#                vs_jtilert vs_hf vs):
#   vs_jtilert   jtilert's Generator.generate / stream wall clock per token and device time per step,
#                the BACKENDS → vs_jtilert.json
#   vs_hf        transformers' generate, eager (static cache), and its decode step's device time → vs_hf.json
#   vs_hf_auto   the same as generate does it by default with a static cache (it compiles the step itself)
#   vs_hf_compile  the same with model.forward under torch.compile (mode default)
#   vs           the ratios: vs_jtilert.json against every vs_hf*.json there is → vs.json
#   flags        the 8-layer step with XLA's PDL launches / RAFT top-k on and off
#   cmdbuf       the 8-layer step with XLA command buffers off: is the 24 ms per-call dispatch their update?
#   graphs       bench.decode 61 layers, pallas, layer loop, kernel profiles, under XLA's command-buffer options:
#                DecodeConfig's default (CONCURRENT scheduling: graph edges from buffer dependencies, so a
#                layer's independent branches overlap), XLA's own (every node after the one before), CONCURRENT
#                with the layer loops unrolled into the graph, CONCURRENT_REGIONS (~2 min each; GRAPHS picks
#                the variants, default "default xla unroll regions")
#   tp2split     tp=2, 4 layers, 32K context: the indexer split over the GPUs vs not (after build)
#   kvfp8        the 8-layer step with FlashMLA's fp8 latent cache (656 B per position)
#   check        tests/gpu/decode_check.py: pallas vs reference logits, 4 layers, 32 decode steps
#   checkall     the same with every kernel on only (no --per-op: a minute instead of three)
#   checkpatch   checkall in a copy of this checkout with PATCH (a bench/experiments patch) applied
#   checkglm5    checkall on GLM-5's share (glm5-tp8-shard, 4 layers: 3 dense, 1 MoE)
#   checkglm5patch  checkglm5 in a copy of this checkout with PATCH applied
#   golden       tests/test_golden_kernels.py on the GPU (JAX_PLATFORMS=cuda): the compiled kernels on the kernel-sized
#                golden models against transformers' logits and greedy tokens (issue 14's independent check)
#   goldencheck  tests/gpu/golden_check.py: every kernel call of the golden kernel models against the reference on
#                its inputs (--shadow, both models), then their logits with one kernel at a time (GOLDEN_MODELS)
#   prep         tests/gpu/prep_check.py: the mla_prep and index_prep kernels vs their references at
#                dsv32/glm5-tp8-shard shapes
#   asyncdispatch  callvariants, then callvariants and ringcheck with PJRT_GPU_ENABLE_ASYNC_DISPATCH=1 (PjRt's GPU
#                client runs each execution's thunk walk and graph launch on a dispatch thread), then
#                tests/gpu/async_dispatch_check.py: the stream's forms under it, each in its own process (after build)
#   ringcheck    tests/gpu/ring_check.py: Generator.stream through the token ring, each step's tokens written at its
#                end, against the steps that return their tokens (tiny model, both backends, plain and MTP, greedy
#                and sampled), and the time a token of each (after build)
#   ringbehind   the same with DecodeConfig.ring_write_behind, the default (each step's tokens written while the
#                next step runs, before its sampling)
#   route        tests/gpu/route_check.py: the engine's router selection vs the reference, and their times
#   envab        bench.decode at the share's layers, pallas, without --kernels (no CUPTI), one process each:
#                this script's environment, the same without XLA_FLAGS, with the program cache on, and this
#                script's environment again (what one process to the next varies): does the environment
#                change the step or the served step a user gets?
#   queued       bench.decode --call-variants without --kernels (no CUPTI), twice: the timing loop's program and the
#                stream's in calls of 1 to 32 steps queued back to back (`queued_forms`): a call's fixed device cost
#                against a step's
#   streamstep   bench/experiments/stream_step.py: the timing loop's and the stream's programs (the ring written at
#                each step's end and behind it, plain and MTP) in calls of STREAM_STEPS steps queued, rounds
#                alternating the forms (STREAM_FORMS=a,b,... picks some)
#   moe          tests/gpu/moe_check.py: the engine's one-launch MoE vs the reference and the pallas path, and
#                their times per MoE in a dependent chain
#   moepatch     part moe on a copy of this checkout with PATCH applied (a bench/experiments patch of moe.cu)
#   gemvpair     tests/gpu/gemv_pair_check.py: the attention's output path (W_uv merging sparse MLA's splits, then
#                o_proj with the residual) as one kernel of two phases (jtilert/pallas/gemv_pair.py) vs its two
#                kernels and the reference, then both in a chain (CUPTI)
#   moepair      tests/gpu/moe_pair_check.py: the routed experts' gate/up and down as one kernel of two phases
#                (moe.moe_experts on gemv_pair.chain, the step's) vs the two kernels and the reference,
#                then both in a chain of MoE calls (CUPTI)
#   ncumoe       ncu on the one-launch MoE: speed of light, warp stalls, memory, source counters
#   ncu          Nsight Compute on the router's selection and the indexer's top-k launched alone
#                (bench/experiments/engine_ncu.py): speed of light, launch, occupancy, warp stalls (the top-k's
#                by reason and by source line)
#   unrolled     bench.decode 61 layers, pallas, the unrolled layer loop, CUPTI profile with kernel names
#   scale8       bench.decode 8 layers, pallas, layer loop, CUPTI profile: enqueue and kernels vs layers
#   before_after bench.decode 61 layers with kernel profiles: the code before issue 13 (.baseline, carried:
#                git archive ba89fb0 | tar -x -C .baseline) then this checkout, pallas and reference (~10 min)
#   ab           bench.decode 61 layers, pallas, kernel profiles: .baseline (another tree, carried) then this checkout
#   base         the first half of ab alone (.baseline), for a "decode" part right after it
#   unroll       bench.decode (share_layers), pallas: the layer loop at DecodeConfig's default layers per iteration
#                and at two (layers_per_iteration; UNROLLS picks the --layer-loop list, default loop,loop/2)
#   defaults     bench.decode 61 layers, pallas, without XLA_FLAGS: DecodeConfig's default options against
#                CONCURRENT scheduling alone (XLA's own command-buffer kinds: the layer loops not captured)
#   trees        the same for every tree in TREES (carried folders, default .baseline, or bench/experiments
#                patches, several joined by '+' applied in order), then this checkout: a
#                bisection on one machine under this script's XLA flags (each tree ~1 min; TREE_ARGS: more
#                bench.decode arguments for every tree; TREE_LAYERS: the layers, default what fits the GPU,
#                `share_layers`: 61 on an H200, 36 on an H100)
#   chain        bench/experiments/gemv_chain.cu: a chain of 32 fp8 GEMVs (14.7 MB each; then 128 of 1 MB),
#                one launch each against one persistent launch with and without its weight stream
#                running ahead (CUDA, no JAX)
#   pchain       bench/experiments/pallas_chain.py: dependent fp8 GEMVs on the fp8x2 wgmma arithmetic in Pallas, the
#                attention's input pairs (x_proj-like [2304, 7168] of x, q_b | wq_b [11264, 1536] of its output,
#                inputs RMS-normed, 16 pairs over 132 CTAs, against the step's own rmsnorm_linear pair), the same
#                shapes as a chain, then 32 of 14.7 MB and 64 of 1 MB: one kernel a GEMV against one kernel whose phases
#                wait on a grid-wide GMEM semaphore (with and without each phase's first weight tiles asked for
#                before the wait), and the floors without arithmetic (PCHAIN_FORMS: the forms; PCHAIN_RUNS: the sizes)
#   gemvbound    bench/experiments/gemv_bound.py: o_proj's fp8 GEMV cold and from L2 under tuning configs, K 256..2048,
#                bf16 weights (what bounds the GEMV kernel)
#   inflight     the same, o_proj and x_proj with GemvConfig.in_flight 0 and 1 only
#   swap         bench/experiments/gemv_swap.py: the fp8 GEMV with the weights as wgmma's B and x's halves as A,
#                against the shipped one (o_proj, x_proj, q_b | wq_b; cold, warm, error against bf16 activations)
#   phases       bench/experiments/gemv_phases.py: each GEMV form's phases CTA by CTA (Mosaic's on-device profiler:
#                x's wait and preparation, the steps and the waits between them, the epilogue), o_proj, x_proj,
#                q_b | wq_b, the fp8x2 and wgmma engines and the w8a8 kernel fed x split
#   phasesfma    the same with --fma: the FMA engine's router and indexer head weights GEMVs by phase
#   phasessplits the same with --splits: W_uv's heads GEMV fed x, and fed the split partials (the merge's cost)
#   ctas         bench/experiments/kernel_ctas.py: every Mosaic kernel of one 4-layer pallas decode step, CTA by CTA
#                (Mosaic's on-device profiler): the CTAs' start spread, spans, and the tail after the median CTA
#   w8a8         bench/experiments/gemv_w8a8.py: the fp8-activation GEMV against the shipped one (o_proj, x_proj,
#                q_b | wq_b; cold, warm; its error against its reference and against bf16 activations;
#                W8A8_ONLY: the forms timed, e.g. shipped,shipped_wgmma)
#   prefetch     tests/gpu/prefetch_check.py (o_proj's and the router's GEMV cold against after an L2 prefetch, after
#                build), then bench.decode 61 layers, pallas, without and with --l2-prefetch, back to back
#   mtp          bench.decode 61 layers, pallas, plain and MTP speculative step (verify 2 + draft)
#   mtp_glm5     the same for glm5-tp8-shard (all its layers)
#   prefill      bench.prefill 61 layers: 1024 and 1100 prompt tokens, chunks 256, 1024+64 and 1024+128, grouped MoE
#                vs the old dense one
#   prefill32k   bench.prefill 61 layers: a 32K prompt, chunks 1024+128 (the default) and 2048
#   latency      bench.latency: mtp + prefill + prefill32k (and the tiny model's acceptance) → latency-61.json
#   hlodump      XLA's optimized HLO of the 4-layer decode step (command buffers, streams), this checkout and,
#                where the checkout carries it, the code before issue 13 in .baseline (git archive ba89fb0)
#   hlodump_mtp  the same for the 4-layer MTP step (its call enqueues in 5.75 ms, the plain step's in 0.74)
#   capture      the 4-layer plain step with the same logs (is each layer loop one command buffer?)
#   mtp_sync     the 4-layer MTP step with XLA's command-buffer logs: which thunk makes the host wait in the call
#   recompile    bench.decode 61 layers, pallas, in a new process: the step from the persistent cache (RECOMPILE_LOOPS:
#                a process for each layer loop listed, e.g. "loop/4 loop/8", each after a process of that loop alone)
#   pdl          bench/pdl_probe.py: chains of tiny Mosaic kernels (with and without PDL) and XLA fusions, per kernel,
#                with command buffers on, off, and on without XLA's own PDL (issue 14; ~2 min)
#   progcache    bench.prepare --compile, 61 layers, pallas, MTP: the Generator's preparation with the program
#                cache cold, warm, then off (JAX's cache warm): what a second process pays (issue 13 item 4)
#   lowering     bench.prepare, 61 layers, pallas, lowered for the GPU without compiling: the kernels lowered one
#                after another, then by one forked worker per CPU (lowering_cache.prelower), then the MTP programs
#   callcost     the 61-layer step loop (5 steps per call) under XLA's command-buffer update mode SKIP_TEMP and its
#                exclusive-lock option (CALLCOST: the flag sets; "" for the default)
#   compilevariants  the 61-layer pallas step's first compile, cold, by stage, under XLA's default autotuning, with
#                autotuning off, two layers per loop iteration, ptxas as a library, without the kernels'
#                background compile (noprecompile; default2 / noprecompile2: a second run of each) (COMPILE_VARIANTS picks)
#   loops        the 61-layer pallas step under each layer-loop form of LOOPS (default four and eight layers per
#                iteration), one process
#   compileprofile  the same first compile with XLA's stage under JAX's profiler (host events by name)
#   callvariants the step loop (the layers that fit the GPU, `share_layers`) in bench.decode --call-variants'
#                forms (one step a call: the token as a pinned host output, the token ring; and the stream's
#                calls of STREAM_STEPS steps through the ring): what a call's enqueue is, and what a step's
#                host loop costs
#   callvariants_ab  the same, 100 calls per form, for .baseline (another tree, carried) then this checkout
#   build        the CUDA engine library and self-test (python -m jtilert.ffi.build --selftest)
#   select       the engine's one-GPU self-tests (top-k select, token ring) and their CUDA-graph timings (after build)
#   selectpatch  part select in a copy of this checkout with PATCH applied
#   tp2          bench.decode at tp=2, 4 layers, psum vs the engine's all-reduce (2 GPUs, after build)
#   engine       tests/gpu/run_engine_gpu.sh: the whole engine check (2 GPUs, ~12 min)
# Two parts can share a 2-GPU machine: CUDA_VISIBLE_DEVICES=0 ... & CUDA_VISIBLE_DEVICES=1 ... &
# The 61-layer parts need an H200 (dsv32-tp8-shard's fp8 weights are 81.8 GiB): call the device tool with
# needs_h200 (a call for nvidia-h200 without it may get an H100, where they stop at the memory check), or
# set FULL_DEPTH=1 on an H100: every dsv32-tp8-shard part then runs 61 layers storing half the routed
# experts (shard_set: the same experts read a step, 1.6 % fewer bytes)
set -uo pipefail
WORK=${WORK:-${OUT:-$PWD/out}}
# a WORK folder that an earlier call left on this host (the device machines keep /tmp between leases) is
# emptied first: its files would be packed with this call's, and its compile cache would make this
# call's cold compiles warm
if [ -d "$WORK" ] && [ -n "$(ls -A "$WORK")" ]; then echo "emptying $WORK (left by an earlier call)" >&2; rm -rf "${WORK:?}"/*; fi
mkdir -p "$WORK"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
B=${BACKENDS:-pallas,reference}
CK=${CK:-/tmp/jt_dsv32_4l}
export JTILERT_COMPILATION_CACHE=${JTILERT_COMPILATION_CACHE:-$WORK/xla_cache}
# the device copy's git metadata may lag the working tree: the caller names the commit (bench/provenance.py)
echo "commit ${JTILERT_COMMIT:-(not given: set JTILERT_COMMIT)}" >> "$WORK/session.txt"
# the program cache (jax.export of each step) only in the part that measures it, until it is checked here
export JTILERT_PROGRAM_CACHE=${JTILERT_PROGRAM_CACHE:-off}
T0=$(date +%s)
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "[$(date -u +%T) +$(( $(date +%s) - T0 ))s] $name: $*" >> "$WORK/session.txt"
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "[$(date -u +%T) +$(( $(date +%s) - T0 ))s] $name rc=$rc" >> "$WORK/session.txt"
  grep -v "Warning\|^\s*$" "$WORK/$name.log" | tail -30
  pack
  return $rc
}
pack() {  # with SAVE_TO: $WORK into $SAVE_TO/session.tgz
  if [ -n "${SAVE_TO:-}" ]; then   # the raw HLO dumps stay out (hundreds of MB): part hlodump packs what is kept
    tar czf "$SAVE_TO/session.tgz" -C "$WORK" --exclude='xla_cache*' --exclude='./patched*' --exclude=./hlo --exclude=./hlo_base --exclude=./hlo_mtp . 2>/dev/null
  fi
}
patched_tree() {  # patched_tree PATCH[+PATCH...]: this checkout with the patches applied in order (patch -p1:
  # git apply skips the paths outside a repository's subfolder) and its engine and self-test built (log:
  # $WORK/build_<name>.log, whose last line is the library), once, in $WORK/patched_<name> (<name>: the
  # patches' names joined by "_and_"); prints the folder, or fails (no folder left)
  local ps t name f
  ps=$(for f in ${1//+/ }; do realpath "$f"; done)
  name=$(for f in ${1//+/ }; do basename "$f" .patch; done | paste -sd' ' | sed 's/ /_and_/g'); t=$WORK/patched_$name
  if [ ! -d "$t" ]; then
    mkdir -p "$t" && tar -c --exclude=./.git --exclude=./.venv --exclude=./.trees --exclude=./bench/results . \
      | tar -x -C "$t" && (cd "$t" && for f in $ps; do patch -s -p1 < "$f" || exit 1; done \
      && PYTHONPATH=$PWD timeout 300 python3 -m jtilert.ffi.build --selftest) > "$WORK/build_$name.log" 2>&1 \
      || { echo "patched_tree: $1 did not apply or build ($WORK/build_$name.log)" >&2; rm -rf "$t"; return 1; }
  fi
  echo "$t"
}
patched_check() {  # patched_check NAME LIMIT_S OUT [ARGS...]: tests/gpu/decode_check.py ARGS (JSON: $WORK/OUT)
  # in a copy of this checkout with PATCH (a bench/experiments patch) applied (patched_tree)
  local name=$1 limit=$2 out=$3 t; shift 3
  [ -n "${PATCH:-}" ] || { echo "$name: name the patch in PATCH" >&2; return; }   # the part is skipped
  t=$(patched_tree "$PATCH") \
    && (cd "$t" && PYTHONPATH=$PWD step "$name" "$limit" python3 tests/gpu/decode_check.py "$@" --out "$WORK/$out")
}
tree_of() {  # tree_of TREE: a folder as it is, or a bench/experiments patch made into patched_tree's folder
  if [ "${1%.patch}" != "$1" ]; then patched_tree "$1"; else echo "$1"; fi
}
call_variants() {  # call_variants NAME: part callvariants' run, logged as NAME, its JSON $WORK/NAME.json
  step "$1" 420 $DEC --layers "$(share_layers)" --backend pallas --steps 5 --samples 6 --call-variants --kernels \
    --out "$WORK/$1.json"
}
share_layers() {  # the layers of dsv32-tp8-shard that fit this GPU: 61 on an H200; 36 on an H100, where the
  # 61 layers' 81.8 GiB of fp8 weights pass the 59 GiB that JAX takes of its 80 GB (61 with FULL_DEPTH)
  if big_gpu || [ -n "${FULL_DEPTH:-}" ]; then echo 61; else echo 36; fi
}
shard_set() {  # with FULL_DEPTH on an H100: dsv32-tp8-shard storing 128 routed experts a MoE layer in 4 groups
  # of 32, the best 2 kept (DeepSeek-V3.2: 256 in 8, the best 4), so that all 61 layers fit (a peak of 47 GiB
  # at context 4096).
  # A step reads what it reads with 256: the same 8 experts a token, each group's two largest scores
  # taken by warps; only the router's weights are half (1.8 MB a layer less: 1.6 % of a step's bytes)
  if [ -n "${FULL_DEPTH:-}" ] && ! big_gpu; then echo "--set n_routed_experts=128 --set n_group=4 --set topk_group=2"; fi
}
glm5_layers() {  # the same for glm5-tp8-shard: all 78 (90.2 GiB) on an H200; 41 (about 47 GiB, as
  # dsv32's 36) on an H100
  if big_gpu; then echo 78; else echo 41; fi
}
big_gpu() {  # more than 100 GB of GPU memory (an H200)
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  [ "${mib:-0}" -gt 100000 ]
}
SHARD="--preset dsv32-tp8-shard $(shard_set)"
DEC="python3 -m bench.decode $SHARD --context 4096"
VS="python3 -m bench.vs_transformers $CK ${VS_ARGS:---context 1024 --new 64 --samples 10}"
for part in "$@"; do
  case $part in
    stream) OUT=$WORK/stream step stream 150 python3 bench/kernels.py --only stream ;;
    kernels) OUT=$WORK/kernels step kernels 300 python3 bench/kernels.py --quick ;;
    sweep) OUT=$WORK/sweep step sweep 540 python3 bench/kernels.py --sweep --quick ;;
    attention) OUT=$WORK/attention step attention 200 python3 bench/attention.py ;;
    lowering)
      P="python3 -m bench.prepare --preset dsv32-tp8-shard --layers 61 --backend pallas"
      step lowering_serial 300 $P --workers 0
      step lowering_parallel 300 $P
      step lowering_parallel_mtp 300 $P --mtp ;;
    callvariants_ab)  # the call variants of .baseline (another tree, carried) then of this checkout, 100 calls each
      for side in base this; do
        dir=.; [ $side = base ] && dir=.baseline
        (cd $dir && PYTHONPATH=$PWD step callvariants_$side 300 $DEC --layers 61 --backend pallas --steps 5 \
          --samples 20 --call-variants --out "$WORK/callvariants_$side.json")
      done ;;
    compilevariants)  # the first compile, cold (a cache folder of its own each), under COMPILE_VARIANTS
      # (default "default autotune0 loop2"): its stages in each run's compile_stages
      for v in ${COMPILE_VARIANTS:-default autotune0 loop2}; do
        pc=1   # the kernels compiled in the background as they are lowered (lowering_cache.precompile)
        case $v in
          default|default2) f="" ; a="" ;;
          autotune0) f="--xla_gpu_autotune_level=0" ; a="" ;;
          nvptxlib) f="--xla_gpu_enable_libnvptxcompiler=true" ; a="" ;;   # ptxas as a library, not a process per module
          loop2) f="" ; a="--layer-loop loop/2" ;;
          noprecompile|noprecompile2) f="" ; a="" ; pc=0 ;;   # the kernels compiled inside XLA's compile
        esac
        XLA_FLAGS="$XLA_FLAGS $f" JTILERT_COMPILATION_CACHE=$WORK/xla_cache_$v JTILERT_KERNEL_PRECOMPILE=$pc \
          step "compile_$v" 300 $DEC --layers 61 --backend pallas --steps 5 --samples 2 $a --out "$WORK/compile_$v.json"
      done ;;
    loops)  # the step under each layer-loop form of LOOPS (default "loop,loop/8": four and eight layers per
      # iteration), one process, kernel profiles
      step loops 480 $DEC --layers 61 --backend pallas --layer-loop "${LOOPS:-loop,loop/8}" --kernels --samples 6 \
        --out "$WORK/loops.json" ;;
    compileprofile)  # the first compile, cold, with XLA's stage under JAX's profiler: where its seconds go
      JTILERT_COMPILATION_CACHE=$WORK/xla_cache_profile step compileprofile 300 $DEC --layers 61 --backend pallas \
        --steps 5 --samples 2 --compile-profile --out "$WORK/compileprofile.json" ;;
    callvariants) call_variants callvariants ;;
    asyncdispatch)  # PjRt's GPU client launching each program from a dispatch thread of its own: part
      # callvariants without it, then with it, then the ring's stream check with it (after build)
      call_variants callvariants
      PJRT_GPU_ENABLE_ASYNC_DISPATCH=1 call_variants callvariants_async
      PJRT_GPU_ENABLE_ASYNC_DISPATCH=1 step ringcheck_async 200 python3 tests/gpu/ring_check.py "$WORK/ring_check_async.json"
      step async_dispatch_check 300 python3 tests/gpu/async_dispatch_check.py "$WORK/async_dispatch_check.json" ;;
    golden) JAX_PLATFORMS=cuda step golden 400 python3 -m pytest -q -p no:cacheprovider -x tests/test_golden_kernels.py ;;
    decode) step decode 480 $DEC --layers "$(share_layers)" --backend "$B" --kernels --samples 10 \
              --out "$WORK/decode.json" --plot "$WORK/decode.png" ;;
    decodemoe) step decodemoe 480 $DEC --layers 61 --backend pallas --engine-moe --kernels --samples 10 \
                 --out "$WORK/decodemoe.json" --plot "$WORK/decodemoe.png" ;;
    timeline)  # bench.decode writes the chart as <out stem>-timeline.png: renamed to timeline.png
      step timeline 480 $DEC --layers 61 --backend pallas --kernels --samples 10 --timeline ${TIMELINE_LAYERS:+--timeline-layers $TIMELINE_LAYERS} \
        --out "$WORK/timeline.json"
      [ -f "$WORK/timeline-timeline.png" ] && mv "$WORK/timeline-timeline.png" "$WORK/timeline.png" && pack ;;
    contexts)  # issue 14's long-context targets: the pallas step (share_layers) at 32K and 128K, kernel profiles
      for c in 32768 131072; do
        step "decode_$c" 300 python3 -m bench.decode $SHARD --context $c --layers "$(share_layers)" \
          --backend pallas --kernels --samples 6 --out "$WORK/decode_$c.json"
      done ;;
    breakdown) step breakdown 200 $DEC --layers 8 --backend "$B" --breakdown --samples 10 \
                 --out "$WORK/breakdown.json" ;;
    checkpoint) JAX_PLATFORMS=cpu step checkpoint 200 python3 -c \
                  "import jtilert; jtilert.random_checkpoint('dsv32-tp8-shard', '$CK', fmt='bf16', num_layers=4, overwrite=True)" ;;
    vs_jtilert) step vs_jtilert 300 $VS --side jtilert --backend "$B" --out "$WORK/vs_jtilert.json" ;;
    vs_hf) step vs_hf 150 $VS --side transformers --compile off --out "$WORK/vs_hf.json" ;;
    vs_hf_auto) step vs_hf_auto 240 $VS --side transformers --compile auto --out "$WORK/vs_hf_auto.json" ;;
    vs_hf_compile) step vs_hf_compile 240 $VS --side transformers --compile default --out "$WORK/vs_hf_compile.json" ;;
    vs) step vs 60 python3 -m bench.vs_transformers --combine "$WORK/vs_jtilert.json" "$WORK"/vs_hf*.json \
          --out "$WORK/vs.json" ;;
    flags)  # XLA options that may cut the per-kernel cost or the top-k, on the 8-layer step
      for f in "" --xla_gpu_enable_pdl=true --xla_gpu_experimental_enable_raft_for_stable_topk=true; do
        n=flags${f:+_$(echo "$f" | sed 's/--xla_gpu_//; s/=true//; s/experimental_enable_//; s/_for_stable_topk//')}
        XLA_FLAGS="$XLA_FLAGS $f" step "$n" 200 $DEC --layers 8 --backend "$B" --samples 10 \
          --kernels --out "$WORK/$n.json"
      done ;;
    cmdbuf) XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_command_buffer=" step cmdbuf_off 200 $DEC --layers 8 \
              --backend "$B" --samples 10 --out "$WORK/cmdbuf_off.json" ;;
    graphs)  # one machine, back to back: the shipped default first, so every variant has its same-run baseline
      for v in ${GRAPHS:-default xla unroll regions}; do
        c="--xla-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
        case $v in
          default) f="" ;;                                                   # DecodeConfig's: CONCURRENT
          xla) f="--xla-option xla_gpu_command_buffer_unroll_loops=false" ;;  # XLA's own scheduling
          unroll) f="$c --xla-option xla_gpu_command_buffer_unroll_loops=true" ;;
          regions) f="--xla-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT_REGIONS" ;;
        esac
        # the options as DecodeConfig.xla_options (given ones replace its default): compile options of
        # the decode steps, as they would ship
        step "graphs_$v" 150 $DEC --layers 61 --backend pallas --kernels --samples 6 $f --out "$WORK/graphs_$v.json"
      done ;;
    tp2split)  # the indexer split over the 2 GPUs against every GPU scoring all rows, at 32K context
      for split in "" --split-indexer; do
        step "tp2split${split:+_on}" 200 python3 -m bench.decode --preset dsv32-tp8-shard --context 32768 --layers 4 \
          --tp 2 --backend pallas --all-reduce engine --samples 10 $split --out "$WORK/tp2split${split:+_on}.json"
      done ;;
    kvfp8) step kvfp8 200 $DEC --layers 8 --backend pallas,reference --set kv_cache_quant=fp8 --samples 10 \
             --out "$WORK/kvfp8.json" ;;
    unrolled) step unrolled 300 $DEC --layers 61 --backend pallas --layer-loop unrolled --kernels --samples 6 \
                --out "$WORK/unrolled.json" ;;
    scale8) step scale8 150 $DEC --layers 8 --backend pallas --kernels --samples 10 --out "$WORK/scale8.json" ;;
    before_after)  # the code before issue 13 (.baseline, ba89fb0) and this checkout, 61 layers, one machine
      (cd .baseline && JTILERT_COMPILATION_CACHE=off PYTHONPATH=$PWD step baseline 330 $DEC --layers 61 \
        --backend pallas --kernels --samples 8 --out "$WORK/baseline.json")
      step current 270 $DEC --layers 61 --backend pallas,reference --kernels --samples 8 --out "$WORK/current.json" ;;
    ab|base)  # another tree (.baseline, carried: e.g. git archive main | tar -x -C .baseline) against this checkout,
         # pallas, 61 layers, kernel profiles, back to back on one machine: a branch against main in one run
         # ("base" runs the other tree alone, for a "decode" right after it to be the other side)
      (cd .baseline && PYTHONPATH=$PWD step ab_base 200 $DEC --layers 61 --backend pallas --kernels --samples 6 \
        --out "$WORK/ab_base.json")
      [ "$part" = ab ] && step ab_this 200 $DEC --layers 61 --backend pallas --kernels --samples 6 --out "$WORK/ab_this.json" ;;
    trees)  # each carried tree in TREES, then this checkout, back to back on one machine (a part given
      # twice runs twice: its files get the round's number, tree_<name>_<round>); a TREES entry that is a
      # patch (bench/experiments/*.patch) is this checkout with the patch applied, made here
      TREES_ROUND=$(( ${TREES_ROUND:-0} + 1 ))
      for t in ${TREES:-.baseline} .; do
        t=$(tree_of "$t") || continue
        n=tree_$( [ "$t" = . ] && echo this || basename "$t" | tr -d .)_$TREES_ROUND
        (cd "$t" && PYTHONPATH=$PWD step "$n" 200 $DEC --layers "${TREE_LAYERS:-$(share_layers)}" --backend pallas \
          --kernels --samples 6 ${TREE_ARGS:-} --out "$WORK/$n.json")
      done ;;
    unroll)  # the layer loop at each of UNROLLS' layers per iteration, one process
      step unroll 300 $DEC --layers "$(share_layers)" --backend pallas --layer-loop "${UNROLLS:-loop,loop/2}" --kernels --samples 6 \
        --out "$WORK/unroll.json" ;;
    defaults)  # what a user gets: no XLA_FLAGS, DecodeConfig's default options, then the options before
      # the layer loops were captured by default (CONCURRENT scheduling alone), back to back
      XLA_FLAGS="" step defaults_now 200 $DEC --layers 61 --backend pallas --kernels --samples 6 \
        --out "$WORK/defaults_now.json"
      XLA_FLAGS="" step defaults_concurrent_only 200 $DEC --layers 61 --backend pallas --kernels --samples 6 \
        --xla-option xla_gpu_command_buffer_scheduling_mode=CONCURRENT --out "$WORK/defaults_concurrent_only.json" ;;
    glm5) step glm5 480 python3 -m bench.decode --preset glm5-tp8-shard --layers "$(glm5_layers)" --context 4096 \
            --backend pallas,reference \
            --kernels --samples 6 --out "$WORK/glm5.json" ;;
    mtp_glm5) step mtp_glm5 540 python3 -m bench.decode --preset glm5-tp8-shard --context 4096 --backend pallas \
                --mtp --samples 6 --out "$WORK/mtp_glm5.json" ;;
    mtp) step mtp 540 $DEC --layers 61 --backend pallas --mtp --samples 6 --out "$WORK/mtp.json" ;;
    selectpatch)  # the engine's top-k self-test and timings (part `select`) in this checkout with PATCH applied
      [ -n "${PATCH:-}" ] || { echo "part selectpatch needs PATCH (a patch of cuda/)" >&2; continue; }
      p=$PATCH
      patched_tree "$p" > /dev/null && step selectpatch 120 \
        "$(dirname "$(tail -1 "$WORK/build_$(basename "$p" .patch).log")")/jtilert_selftest" --select-only --iters 3 --bench ;;
    chain)  # bench/experiments/gemv_chain.cu: 32 dependent fp8 GEMVs as 32 launches, one persistent launch,
      # and one persistent launch whose weight stream runs ahead of the activations
      step chain_build 120 "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
        bench/experiments/gemv_chain.cu -o "$WORK/gemv_chain"
      step chain 120 "$WORK/gemv_chain" --json "$WORK/chain.json"
      step chain_1mb 120 "$WORK/gemv_chain" --dims 1024,1024 --gemvs 128 --json "$WORK/chain_1mb.json" ;;
    pchain)  # the attention's input pairs as the step runs them (norms; against the step's own pair), the
      # same pair as a chain without norms, then 14.7 MB and 1 MB GEMVs (PCHAIN_RUNS picks: pairs attn big
      # 1mb); the step's own GEMVs, form `shipped`, last (with it first, the 14.7 MB run printed nothing in
      # 180 s in session 34)
      f=${PCHAIN_FORMS:-launches,barrier,prefetch,ring,stream,shipped}
      for r in ${PCHAIN_RUNS:-pairs attn big 1mb}; do
        case $r in
          pairs) step pchain_pairs 200 python3 -m bench.experiments.pallas_chain --dims 2304,7168,11264,1536 \
                   --ctas 132 --attn --forms "$f" --out "$WORK/pallas_chain_pairs.json" ;;
          attn) step pchain_attn 150 python3 -m bench.experiments.pallas_chain --dims 2304,7168,11264,1536 \
                  --ctas 132 --forms "${f/,shipped/}" --out "$WORK/pallas_chain_attn.json" ;;   # shipped reads all of x: no such chain
          big) step pchain 150 python3 -m bench.experiments.pallas_chain --forms "$f" --out "$WORK/pallas_chain.json" ;;
          1mb) step pchain_1mb 150 python3 -m bench.experiments.pallas_chain --dims 2048,512 --gemvs 64 --forms "$f" \
                 --out "$WORK/pallas_chain_1mb.json" ;;
        esac
      done ;;
    gemvbound)
      step gemvbound 300 python3 -m bench.experiments.gemv_bound --out "$WORK/gemvbound.json" ;;
    w8a8)
      step w8a8 300 python3 -m bench.experiments.gemv_w8a8 ${W8A8_ONLY:+--only $W8A8_ONLY} --out "$WORK/w8a8.json" ;;
    swap)
      step swap 420 python3 -m bench.experiments.gemv_swap --out "$WORK/swap.json" ;;
    phases)
      step phases 300 python3 -m bench.experiments.gemv_phases --out "$WORK/phases.json" ;;
    phasesfma)  # the FMA engine's GEMVs (router, indexer head weights) by phase: where their fixed time goes
      step phasesfma 200 python3 -m bench.experiments.gemv_phases --fma --out "$WORK/phases_fma.json" ;;
    phasessplits)  # W_uv's heads GEMV fed x and fed sparse MLA's split partials, by phase (the merge's cost)
      step phasessplits 200 python3 -m bench.experiments.gemv_phases --splits --out "$WORK/phases_splits.json" ;;
    ctas)
      step ctas 300 python3 -m bench.experiments.kernel_ctas --out "$WORK/ctas.json" ;;
    inflight)
      step inflight 150 python3 -m bench.experiments.gemv_bound --in-flight --out "$WORK/inflight.json" ;;
    prefetch)
      step prefetch_check 150 python3 tests/gpu/prefetch_check.py --calls 30 --out "$WORK/prefetch_check.json"
      step prefetch_off 200 $DEC --layers 61 --backend pallas --kernels --samples 6 --out "$WORK/prefetch_off.json"
      step prefetch_on 200 $DEC --layers 61 --backend pallas --kernels --samples 6 --l2-prefetch \
        --out "$WORK/prefetch_on.json" ;;
    prefill) step prefill 540 python3 -m bench.prefill --layers 61 --lengths 1024,1100 --chunks 256,1024+64,1024+128 \
               --moe grouped,dense --samples 3 --out "$WORK/prefill.json" ;;
    prefill32k) step prefill32k 540 python3 -m bench.prefill --layers 61 --lengths 32768 --chunks 1024+128,2048 \
                  --samples 1 --out "$WORK/prefill32k.json" ;;
    latency) step latency 120 python3 -m bench.latency --decode "$WORK/mtp.json" \
               --prefill "$WORK/prefill.json" "$WORK/prefill32k.json" --out "$WORK/latency-61.json" ;;
    hlodump)
      DUMP="--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*(run|decode|step|loop).*"   # jit_run: the steps and bench loops
      XLA_FLAGS="$XLA_FLAGS --xla_dump_to=$WORK/hlo $DUMP" step hlodump 240 $DEC --layers 4 --backend pallas \
        --steps 2 --samples 2 --out "$WORK/hlodump.json"
      if [ -d .baseline ]; then
        (cd .baseline && XLA_FLAGS="$XLA_FLAGS --xla_dump_to=$WORK/hlo_base $DUMP" PYTHONPATH=$PWD \
          step hlodump_base 240 $DEC --layers 4 --backend pallas --steps 2 --samples 2 --out "$WORK/hlodump_base.json")
      fi
      for d in hlo hlo_base; do   # the optimized module of the bench loop only (the largest such file)
        [ -d "$WORK/$d" ] && tar czf "$WORK/$d.tgz" -C "$WORK/$d" \
          "$(ls -S "$WORK/$d" | grep 'after_optimizations.txt$' | head -1)"
      done ;;
    hlodump_mtp)  # the MTP step's program: why its call takes 5.75 ms to enqueue against the plain step's 0.74
      DUMP="--xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*(run|decode|step|loop).*"
      XLA_FLAGS="$XLA_FLAGS --xla_dump_to=$WORK/hlo_mtp $DUMP" step hlodump_mtp 240 $DEC --layers 4 --backend pallas \
        --mtp --steps 2 --samples 2 --out "$WORK/hlodump_mtp.json"
      tar czf "$WORK/hlo_mtp.tgz" -C "$WORK/hlo_mtp" "$(ls -S "$WORK/hlo_mtp" | grep 'after_optimizations.txt$' | head -1)" ;;
    mtp_sync)  # why the MTP call blocks the host (enqueue ≈ step): XLA's logs of which thunks become command buffers
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2,command_buffer_scheduling=2,conditional_thunk=2,while_thunk=2,command_buffer_thunk=1 \
        step mtp_sync 240 $DEC --layers 4 --backend pallas --mtp --steps 4 --samples 3 --out "$WORK/mtp_sync.json"
      grep -i "conditional\|while\|command buffer\|CommandBuffer" "$WORK/mtp_sync.log" | cut -c1-300 | sort | uniq -c \
        | sort -rn | head -60 > "$WORK/mtp_sync_summary.txt"
      gzip -f "$WORK/mtp_sync.log" ;;
    capture)  # the 4-layer plain step with XLA's command-buffer logs: does each layer loop become one command buffer?
      TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_conversion_pass=2,command_buffer_scheduling=2,while_thunk=2,command_buffer_thunk=1 \
        step capture 200 $DEC --layers 4 --backend pallas --steps 4 --samples 3 --out "$WORK/capture.json"
      grep -i "conditional\|while\|command buffer\|CommandBuffer" "$WORK/capture.log" | cut -c1-300 | sort | uniq -c \
        | sort -rn | head -60 > "$WORK/capture_summary.txt"
      gzip -f "$WORK/capture.log" ;;
    check) step check 240 python3 tests/gpu/decode_check.py --per-op --out "$WORK/check.json" ;;
    checkall) step check 120 python3 tests/gpu/decode_check.py --out "$WORK/check.json" ;;   # no per-op runs
    checkpatch) patched_check checkpatch 120 checkpatch.json ;;   # part checkall with PATCH applied
    checkglm5) step checkglm5 180 python3 tests/gpu/decode_check.py --preset glm5-tp8-shard \
                 --out "$WORK/check_glm5.json" ;;
    checkglm5patch) patched_check checkglm5patch 180 check_glm5patch.json --preset glm5-tp8-shard ;;
    goldencheck)
      step goldencheck_shadow 200 python3 tests/gpu/golden_check.py --shadow --out "$WORK/golden_shadow.json"
      step goldencheck 300 python3 tests/gpu/golden_check.py --out "$WORK/golden_check.json" \
        ${GOLDEN_MODELS:+--models $GOLDEN_MODELS} ;;
    prep) step prep 300 python3 tests/gpu/prep_check.py --out "$WORK/prep.json" ;;
    ringcheck) step ringcheck 200 python3 tests/gpu/ring_check.py "$WORK/ring_check.json" ;;
    ringbehind) step ringbehind 300 python3 tests/gpu/ring_check.py --write-behind "$WORK/ring_behind.json" ;;
    route) step route 200 python3 tests/gpu/route_check.py --out "$WORK/route.json" ;;
    queued)  # a call's fixed device cost: the call variants without CUPTI, two processes (their spread)
      for r in 1 2; do
        step "queued_$r" 300 $DEC --layers "$(share_layers)" --backend pallas --steps 5 --samples 6 --call-variants \
          --out "$WORK/queued_$r.json"
      done ;;
    streamstep) step streamstep 450 python3 -m bench.experiments.stream_step --layers "$(share_layers)" ${STREAM_FORMS:+--forms $STREAM_FORMS} \
                  --out "$WORK/stream_step.json" ;;
    envab)
      n=$(share_layers)
      for v in session no_xla_flags program_cache session_again; do
        case $v in
          no_xla_flags) e=(env XLA_FLAGS=) ;;
          program_cache) e=(env JTILERT_PROGRAM_CACHE=on) ;;
          *) e=() ;;
        esac
        step "envab_$v" 200 "${e[@]}" $DEC --layers "$n" --backend pallas --samples 6 --out "$WORK/envab_$v.json"
      done ;;
    moe) step moe 400 python3 tests/gpu/moe_check.py --out "$WORK/moe.json" ;;
    gemvpair) step gemvpair 240 python3 tests/gpu/gemv_pair_check.py --out "$WORK/gemv_pair.json" ;;
    moepair) step moepair 240 python3 tests/gpu/moe_pair_check.py --out "$WORK/moe_pair.json" ;;
    moepatch)  # the one-launch MoE check (part moe) in a copy of this checkout with PATCH (a bench/experiments
      # patch of cuda/src/moe.cu) applied: beside part moe's figures for this checkout in the same call
      [ -n "${PATCH:-}" ] || { echo "moepatch: name the patch in PATCH" >&2; continue; }
      t=$(patched_tree "$PATCH") \
        && (cd "$t" && PYTHONPATH=$PWD step moepatch 400 python3 tests/gpu/moe_check.py --out "$WORK/moepatch.json") ;;
    ncumoe)  # Nsight Compute on the one-launch MoE (bench/experiments/engine_ncu.py --only moe)
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" step ncumoe 200 ncu --clock-control none --kernel-name regex:moe_decode --launch-skip 1 \
        --launch-count 1 --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
        python3 -m bench.experiments.engine_ncu --only moe --repeat 3 ;;
    ncu)  # Nsight Compute on the engine's small kernels, this checkout's and each tree's in NCU_TREES (carried
      # folders, or bench/experiments patches applied to this checkout here, as in part trees; the driver is
      # this checkout's, the kernels the tree's; NCU_ARGS: the driver's arguments; NCU_KERNELS: which of
      # "route topk", default both)
      # (the top-k's cluster kernel hung under ncu's kernel replay: it runs under application replay, the
      # driver once per pass, with fewer sections)
      root=$PWD
      for t in . ${NCU_TREES:-}; do
        t=$(tree_of "$t") || continue
        n=ncu_$( [ "$t" = . ] && echo this || basename "$t" | tr -d .)
        [[ " ${NCU_KERNELS:-route topk} " == *" route "* ]] && \
        (cd "$t" && PYTHONPATH=$PWD XLA_FLAGS="--xla_gpu_enable_command_buffer=" step "${n}_route" 150 \
          ncu --clock-control none --kernel-name regex:route_select --section SpeedOfLight --section LaunchStats \
          --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
          python3 "$root/bench/experiments/engine_ncu.py" --only route ${NCU_ARGS:-})
        [[ " ${NCU_KERNELS:-route topk} " == *" topk "* ]] || continue
        (cd "$t" && PYTHONPATH=$PWD XLA_FLAGS="--xla_gpu_enable_command_buffer=" step "${n}_topk" 240 \
          ncu --clock-control none --replay-mode application --kernel-name regex:topk_ --launch-count 2 --section SpeedOfLight \
          --section LaunchStats --section WarpStateStats --section SchedulerStats --section SourceCounters \
          --metrics 'regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$' \
          -o "/tmp/${n}_topk" -f python3 "$root/bench/experiments/engine_ncu.py" --only topk --repeat 1 ${NCU_ARGS:-})
        # the report: every section's tables (the warp stalls by reason), then the stalls by source line (the
        # engine builds with -lineinfo)
        step "${n}_topk_details" 60 bash -c "ncu -i /tmp/${n}_topk.ncu-rep --print-details all || ncu -i /tmp/${n}_topk.ncu-rep"
        step "${n}_topk_source" 60 ncu -i "/tmp/${n}_topk.ncu-rep" --page source --csv --print-source cuda,sass
      done ;;
    pdl)
      XLA_FLAGS="$XLA_FLAGS" step pdl_cmdbuf 120 python3 -m bench.pdl_probe --out "$WORK/pdl_cmdbuf.json"
      XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_command_buffer=" step pdl_stream 120 python3 -m bench.pdl_probe \
        --out "$WORK/pdl_stream.json"
      XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_pdl=false" step pdl_xla_off 120 python3 -m bench.pdl_probe \
        --out "$WORK/pdl_xla_off.json" ;;
    progcache)
      PREP="python3 -m bench.prepare --compile --preset dsv32-tp8-shard --layers 61 --backend pallas --mtp"
      JTILERT_PROGRAM_CACHE=on step progcache_cold 300 $PREP
      JTILERT_PROGRAM_CACHE=on step progcache_warm 300 $PREP
      JTILERT_PROGRAM_CACHE=off step progcache_off 300 $PREP ;;
    recompile)  # one process for each layer loop of RECOMPILE_LOOPS (default: DecodeConfig's), after a part whose
      # process compiled that loop alone (decode, queued; after unroll's one process of two loops, each
      # recompile process compiled XLA's part cold, cause unknown: RESULTS.md session 55)
      for l in ${RECOMPILE_LOOPS:-default}; do
        n=recompile${RECOMPILE_LOOPS:+_${l//\//_}}
        step "$n" 300 $DEC --layers 61 --backend pallas ${RECOMPILE_LOOPS:+--layer-loop $l} --steps 5 --samples 4 \
          --out "$WORK/$n.json"
      done ;;
    callcost)  # does XLA update its command buffers on every call? the same loop under each update mode
      # (this XLA build rejects --xla_gpu_enable_command_buffer_va_remapping; CALLCOST picks the variants)
      for f in ${CALLCOST:-"" --xla_gpu_command_buffer_update_mode=SKIP_TEMP --xla_gpu_require_exclusive_lock=true}; do
        n=callcost${f:+_$(echo "$f" | sed 's/--xla_gpu_//; s/=.*//; s/command_buffer_//')}
        XLA_FLAGS="$XLA_FLAGS $f" step "$n" 300 $DEC --layers 61 --backend pallas --steps 5 --samples 6 \
          --out "$WORK/$n.json"
      done ;;
    build) step build 240 python3 -m jtilert.ffi.build --selftest ;;
    select) step select 90 "$(dirname "$(tail -1 "$WORK/build.log")")/jtilert_selftest" --select-only --iters 3 --bench ;;
    tp2) step tp2 200 $DEC --layers 4 --tp 2 --backend "$B" --all-reduce psum,engine \
           --samples 10 --out "$WORK/tp2.json" ;;
    engine) OUT=$WORK/engine step engine 900 tests/gpu/run_engine_gpu.sh ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
