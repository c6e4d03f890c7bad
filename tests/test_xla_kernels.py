"""bench/xla_kernels.py: what an optimized HLO module launches, and the decode step compiled for an
H200 on this machine (in .venv-xla, jax's CUDA plugin: `make xla-venv`; .ci/run makes it)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from bench import xla_kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"

# The shapes of XLA's printout that `launches` reads: views and tuples launch nothing, a fusion or a
# custom call one kernel, a while loop its body and condition every trip (and its condition once
# more, with a set_while_condition kernel each time), a conditional its smaller branch.
HLO = """HloModule jit_step, is_scheduled=true

%fused_add (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  %c = s32[] constant(1)
  ROOT %add.1 = s32[] add(%p, %c)
}

%body (state: (s32[], f32[8])) -> (s32[], f32[8]) {
  %state = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[8]{0} get-tuple-element(%state), index=1
  %loop_add_fusion = s32[] fusion(%i), kind=kLoop, calls=%fused_add
  %mpmd_map.3 = f32[8]{0} custom-call(%x, %i), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(run)/while/body/jtilert_gemv_fp8x2_norm_2240x7168/mpmd_map"}
  %jtilert_topk_select.2 = (s32[1,4]{1,0}, f32[1,4]{1,0}) custom-call(%mpmd_map.3), custom_call_target="jtilert_topk_select"
  ROOT %tuple.1 = (s32[], f32[8]) tuple(%loop_add_fusion, %mpmd_map.3)
}

%cond (state.1: (s32[], f32[8])) -> pred[] {
  %state.1 = (s32[], f32[8]) parameter(0)
  %i.1 = s32[] get-tuple-element(%state.1), index=0
  ROOT %loop_compare_fusion = pred[] fusion(%i.1), kind=kLoop, calls=%fused_add
}

%small (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  ROOT %loop_exp_fusion = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_add
}

%large (b: f32[8]) -> f32[8] {
  %b = f32[8]{0} parameter(0)
  %loop_exp_fusion.1 = f32[8]{0} fusion(%b), kind=kLoop, calls=%fused_add
  %loop_exp_fusion.2 = f32[8]{0} fusion(%loop_exp_fusion.1), kind=kLoop, calls=%fused_add
  ROOT %copy.3 = f32[8]{0} copy(%loop_exp_fusion.2)
}

ENTRY %main (x0: f32[8], flag: s32[]) -> f32[8] {
  %x0 = f32[8]{0} parameter(0)
  %flag = s32[] parameter(1)
  %loop_convert_fusion.7 = f32[8]{0} fusion(%x0), kind=kLoop, calls=%fused_add
  %init = (s32[], f32[8]) tuple(%flag, %loop_convert_fusion.7)
  %while.5 = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = f32[8]{0} get-tuple-element(%while.5), index=1
  %b = f32[8]{0} bitcast(%out)
  ROOT %conditional.2 = f32[8]{0} conditional(%flag, %b, %b), branch_computations={%large, %small}
}
"""


def test_launches_counts_what_a_step_runs():
    got = xla_kernels.launches(HLO)
    assert got["loops"] == [{"loop": "while.5", "trips": 3, "kernels_per_trip": 5, "names": {
        "loop_add_fusion": 1, "jtilert_gemv_fp8x2_norm_2240x7168": 1, "jtilert_topk_select": 1, "loop_compare_fusion": 1,
        "set_while_condition": 1}}]
    assert got["conditionals"] == [[1, 3]]
    assert got["names"] == {"loop_convert_fusion": 1, "loop_add_fusion": 3, "jtilert_gemv_fp8x2_norm_2240x7168": 3,
                            "jtilert_topk_select": 3, "loop_compare_fusion": 4, "set_while_condition": 4,
                            "loop_exp_fusion": 1, "set_case_condition": 1}
    assert got["kernels"] == 20


THUNKS = """000: kCommandBuffer [source       | next=003 (1)]
    001: kCustomKernel [source       | next=002 (1)] loop_add_fusion grid: [1, 1, 1]
    002: kWhile        [prev=001 (1) | sink        ]
    condition:
        004: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
      body:
        005: kCustomCall   [source | sink] kCustomCall
003: kAsyncStart    [prev=000 (1) | sink        ] stream=computation_stream[0], async_id=3
    006: kCopy [source | sink] (no description)
007: kAsyncDone     [source       | sink        ] async_id=3
"""


def test_graph_counts_the_nodes_the_host_launches_in_one_call():
    assert xla_kernels.graph(THUNKS) == {"command_buffers": 1, "nodes": 4, "outside": 3}


def test_launches_needs_an_entry():
    with pytest.raises(ValueError, match="ENTRY"):
        xla_kernels.launches(HLO.replace("ENTRY ", ""))


@pytest.mark.skipif(not XLA_PYTHON.exists(), reason="no .venv-xla (make xla-venv; .ci/run makes it)")
def test_the_step_compiled_for_an_h200(tmp_path):
    """Nineteen layers of DeepSeek-V3.2's share: three dense layers (a loop of one trip, which XLA
    writes out in line), then two trips of the MoE loop (eight layers each: the default
    `DecodeConfig.layers_per_iteration`). Every kernel the jaxpr budget counts is a launch XLA keeps,
    and the layer loop's own kernels stay what they are: the counter's increment, `first + 1`, the
    condition and set_while_condition, and no other index arithmetic (XLA turns each layer index
    computed from the counter into a kernel of its own: i + 1 .. i + 3, i - 3 .. i were seven a trip
    of four)."""
    out = tmp_path / "r.json"
    proc = subprocess.run([str(XLA_PYTHON), "-m", "bench.xla_kernels", "--layers", "19", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [step] = json.loads(out.read_text())["programs"]
    names = step["names"]
    for kernel in ("jtilert_indexer", "jtilert_sparse_mla", "jtilert_topk_select", "jtilert_mla_prep"):
        assert names[kernel] == 19, (kernel, names)
    # a MoE layer: the router's selection, the routed experts as one kernel of two phases, the shared
    # expert's down (finishing its gate/up partials: no XLA kernel between them)
    for kernel in ("jtilert_route_select", "jtilert_moe_pair", "jtilert_moe_down"):
        assert names[kernel] == 16, (kernel, names)
    [loop] = step["loops"]
    assert loop["trips"] == 2, step["loops"]
    assert loop["kernels_per_trip"] <= 148, step["loops"]
    # a trip's kernels are its eight layers' (eight of each) and the loop's own four: the counter's
    # increment, `first + 1` (what the layers after the first read), the condition, set_while_condition
    loop_own = {name: n for name, n in loop["names"].items() if n % 8}
    assert sum(loop_own.values()) <= 4, loop_own
    assert step["kernels"] <= 359, names
    # one CUDA graph holds the step, its loop and the sampler's branches; the host runs the token's
    # copy to pinned memory beside it
    assert step["graph"]["command_buffers"] == 1 and step["graph"]["outside"] <= 5, step["graph"]


@pytest.mark.skipif(not XLA_PYTHON.exists(), reason="no .venv-xla (make xla-venv; .ci/run makes it)")
@pytest.mark.parametrize("program", ["decode_stream", "speculate_stream"])
def test_the_streams_device_loop_is_one_cuda_graph(tmp_path, program):
    """A stream call through the token ring is a device loop of decode steps; its top level is the
    loop and a copy, which XLA would leave to the host under its default minimum graph size (each
    step's condition read back, the call as long as its steps). `Engine.loop_options` has it recorded
    into one CUDA graph, nothing outside; the ring's write once in the loop's body and once after the
    loop (the write behind, the default)."""
    out = tmp_path / "r.json"
    args = ["--preset", "tiny", "--layers", "2", "--ring", "--program", program, "--out", str(out)]
    proc = subprocess.run([str(XLA_PYTHON), "-m", "bench.xla_kernels", *args, *(["--mtp"] if "spec" in program else [])],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [step] = json.loads(out.read_text())["programs"]
    assert step["graph"]["command_buffers"] == 1 and step["graph"]["outside"] == 0, step["graph"]
    [loop] = [x for x in step["loops"] if "jtilert_token_ring" in x["names"]]
    assert loop["names"]["jtilert_token_ring"] == 1 and step["names"]["jtilert_token_ring"] == 2, step["names"]


@pytest.mark.skipif(not XLA_PYTHON.exists(), reason="no .venv-xla (make xla-venv; .ci/run makes it)")
def test_a_token_buffer_in_host_memory_takes_the_loop_out_of_its_cuda_graph():
    """bench/experiments/ring_host_copy.py (bench/RESULTS.md, session 46): XLA writes a step's token into a
    carried buffer in pinned host memory by an async copy that no command buffer takes, so the device loop
    runs from the host; with the buffer in device memory the loop is one CUDA graph, nothing outside."""
    def launched(*args):
        proc = subprocess.run([str(XLA_PYTHON), "-m", "bench.experiments.ring_host_copy", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    control, host = launched("--control"), launched()
    assert control["command_buffers"] == 1 and control["outside"] == 0, control
    assert host["outside"] > 0, host
