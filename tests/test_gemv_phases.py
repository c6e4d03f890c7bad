"""bench/cta_profile.py and bench/experiments/gemv_phases.py: the GEMV kernels lower for CUDA with
Mosaic's on-device profiler around their named phases, and a CTA's trace reads back into its ranges and
the GEMV's phases."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from bench import cta_profile
from bench.experiments import gemv_phases as ph
from bench.experiments import gemv_w8a8
from jtilert.pallas import gemv
from jtilert.pallas import interpret as interp


def _events(tid, start_us, ranges):
    """Mosaic's trace events of one CTA: (name, begin, end) in cycles since its first event."""
    ev = []
    for name, b, e in ranges:
        ev += [dict(name=name, ph="B", ts=start_us + b / 1e3, pid=1, tid=tid, at=b, order=0),
               dict(name=name, ph="E", ts=start_us + e / 1e3, pid=1, tid=tid, at=e, order=1)]
    ev.sort(key=lambda x: (x["at"], x["order"]))
    return ev


def test_a_cta_trace_reads_back_into_its_phases():
    ranges = [("cta", 0, 9000), ("step", 1500, 2000), ("x_prep", 600, 1400), ("x_wait", 600, 900),
              ("step", 2600, 3000), ("step", 3500, 3900), ("epilogue", 8000, 9000)]
    c = ph.cta_phases(cta_profile.cta(_events(1, 100.0, ranges)))
    assert c["to_first_step"] == pytest.approx(1500)
    assert c["x_wait"] == pytest.approx(300) and c["x_prep"] == pytest.approx(800)
    assert c["steps"] == pytest.approx([500, 400, 400]) and c["gaps"] == pytest.approx([600, 500])
    assert c["epilogue"] == pytest.approx(1000) and c["span"] == pytest.approx(9000)
    other = ph.cta_phases(cta_profile.cta(_events(2, 100.5, [("cta", 0, 7000), ("step", 1000, 1500)])))
    s = ph.summarise([[c, other]], mhz=1000.0)
    assert s["start_spread_us"] == pytest.approx(0.5)
    assert s["span"] == pytest.approx(8000) and s["us_at_sm_clock"]["span"] == pytest.approx(8.0)
    assert s["first_step"] == pytest.approx(500) and s["step"] == pytest.approx(400)
    assert s["x_prep"] == pytest.approx(400)


@pytest.mark.parametrize("form", ["fp8x2", "wgmma", "w8a8_hilo"])
def test_profiled_kernels_lower_for_cuda(form, tmp_path):
    """With the profiler on (as on the GPU), each form's kernel lowers with its phase ranges: Mosaic
    lowers the kernel first, then jax lowers the host callback that writes its trace, which needs a
    CUDA backend (none here) — so reaching that error means the profiled kernel lowered."""
    S = jax.ShapeDtypeStruct
    fns = {"fp8x2": gemv.linear, "wgmma": lambda x, w, s: gemv.linear(x, w, s, config=gemv.GemvConfig(engine="wgmma")),
           "w8a8_hilo": gemv_w8a8.w8a8_hilo}
    specs = (S((1, 2048), jnp.bfloat16), S((7168, 2048), jnp.float8_e4m3fn), S((56, 16), jnp.float32))
    with interp.compile_for_gpu(), cta_profile.kernel_profiles(str(tmp_path)):
        with pytest.raises(ValueError, match="backend cpu is different from the lowering platform cuda"):
            jax.jit(fns[form]).trace(*specs).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("form", ["router", "head_weights"])
def test_profiled_fma_kernels_lower_for_cuda(form, tmp_path):
    """The FMA engine's forms of `gemv_phases --fma` (the router with its norm, the head weights over
    28 K slices) lower with the profiler on, as above."""
    from jtilert.pallas import moe
    S = jax.ShapeDtypeStruct
    n = 256 if form == "router" else 64
    specs = (S((1, 7168), jnp.bfloat16), S((7168,), jnp.bfloat16), S((n, 7168), jnp.float32))
    fns = {"router": lambda x, nw, w: moe.norm_router_partials(x, nw, 1e-6, w),
           "head_weights": lambda x, nw, w: gemv.index_weights(x, nw, 1e-6, w)}
    with interp.compile_for_gpu(), cta_profile.kernel_profiles(str(tmp_path)):
        with pytest.raises(ValueError, match="backend cpu is different from the lowering platform cuda"):
            jax.jit(fns[form]).trace(*specs).lower(lowering_platforms=("cuda",))


def test_profiled_heads_of_splits_lowers_for_cuda(tmp_path):
    """`gemv_phases --splits`' merged form (W_uv's heads GEMV fed the 32 split partials, its "merge"
    range) lowers with the profiler on, as above."""
    S = jax.ShapeDtypeStruct
    f32 = jnp.float32
    specs = (S((1, 1, 32, 16, 512), f32), S((1, 1, 32, 16), f32), S((1, 1, 32, 16), f32),
             S((16, 128, 512), jnp.float8_e4m3fn), S((16, 1, 4), f32))
    with interp.compile_for_gpu(), cta_profile.kernel_profiles(str(tmp_path)):
        with pytest.raises(ValueError, match="backend cpu is different from the lowering platform cuda"):
            jax.jit(gemv.heads_linear_of_splits).trace(*specs).lower(lowering_platforms=("cuda",))


def test_a_trace_file_names_its_kernel(tmp_path):
    """The outermost range of every CTA is the kernel's name (kernel_profiles wraps the body in it)."""
    import json
    ev = (_events(1, 10.0, [("jtilert_moe_down", 0, 900), ("step", 100, 400)])
          + _events(2, 10.2, [("jtilert_moe_down", 0, 1200)]))
    path = tmp_path / "kernel-1-trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    name, ctas = cta_profile.read_trace(str(path))
    assert name == "jtilert_moe_down" and [c.span for c in ctas] == pytest.approx([900, 1200])
    from bench.experiments.kernel_ctas import kernel_summary
    s = kernel_summary(name, ctas, mhz=1000.0)
    assert s["ctas"] == 2 and s["start_spread_us"] == pytest.approx(0.2)
    assert s["span_max_us"] == pytest.approx(1.2) and s["kernel_us"] == pytest.approx(1.4)


@pytest.mark.parametrize("name", ["MoE down", "indexer, fp8 append", "sparse MLA combine"])
def test_every_kind_of_kernel_lowers_profiled(name, tmp_path):
    """kernel_ctas profiles every kernel of the step: each kind (warpgroup and lane semantics) lowers
    for CUDA with the profiler and its named body (then the trace's host callback needs a CUDA
    backend, as above). MoE down for one token: its lowering grows with the tokens, and one token
    has the same kinds of code as four."""
    from tests.test_kernel_shapes import KERNELS, S, _q
    f, specs = KERNELS[name]
    if name == "MoE down":
        specs = (S((8, 256), jnp.bfloat16), S((1, 8), jnp.float32), S((1, 8), jnp.int32), *_q(256, 7168, 256))
    jax.clear_caches()
    with interp.compile_for_gpu(), cta_profile.kernel_profiles(str(tmp_path)):
        with pytest.raises(ValueError, match="backend cpu is different from the lowering platform cuda"):
            jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))
