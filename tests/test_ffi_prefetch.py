"""The engine's L2 prefetch (`jtilert.ffi.prefetch`, cuda/src/prefetch.cu): wiring, the no-op the
primitive is where the engine does not run (a zero token, `ordered` the identity), the CUDA lowering's
custom call (operands in order, the stacks themselves, a traced layer), the errors for inputs it does
not take, and the kernel's PTX (the bulk prefetch). What it does to a GEMV runs on the GPU:
tests/gpu/prefetch_check.py."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jtilert.ffi as jf
from jtilert.ffi import _lib
from jtilert.ffi import ops as ffi_ops
from jtilert.ffi import prefetch

ROOT = pathlib.Path(__file__).resolve().parents[1]
S = jax.ShapeDtypeStruct
FP8 = jnp.float8_e4m3fn

# o_proj's fp8 stack and its scales, the router's fp32 gate (three layers)
O_PROJ, O_SCALE, GATE = S((3, 7168, 2048), FP8), S((3, 56, 16), jnp.float32), S((3, 256, 7168), jnp.float32)


def _nvcc():
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def test_prefetch_is_built_registered_and_exported():
    assert "src/prefetch.cu" in (ROOT / "cuda" / "CMakeLists.txt").read_text()
    assert "XLA_FFI_DEFINE_HANDLER_SYMBOL(JtPrefetchL2" in (ROOT / "cuda" / "src" / "ffi.cc").read_text()
    assert "cudaError_t jt_prefetch_l2(" in (ROOT / "cuda" / "include" / "jtilert" / "engine.h").read_text()
    assert _lib.TARGETS["jtilert_prefetch_l2"] == "JtPrefetchL2"
    assert jf.prefetch_l2 is prefetch.prefetch_l2 and jf.ordered is prefetch.ordered
    assert "prefetch_l2" in jf.__all__ and "ordered" in jf.__all__


def _small_stacks(seed=0):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.normal(size=(3, 64, 128)).astype(np.float32)).astype(FP8)
    s = jnp.asarray(rng.random((3, 1, 1)).astype(np.float32))
    g = jnp.asarray(rng.normal(size=(3, 16, 128)).astype(np.float32))
    return w, s, g


def test_fallback_token_is_zero_and_ordered_returns_x_unchanged():
    w, s, g = _small_stacks()
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 128)), jnp.bfloat16)
    after = jnp.arange(12.0).reshape(3, 4)

    @jax.jit
    def f(i, after, x, w, s, g):
        tok = prefetch.prefetch_l2(i, after * 2, w, s, g)
        return tok, prefetch.ordered(x, tok)

    _lib._warned.clear()  # noqa: SLF001
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for layer in (0, 2, -1):
            tok, y = f(jnp.int32(layer), after, x, w, s, g)
            assert tok.dtype == jnp.int32 and tok.shape == (1,)
            np.testing.assert_array_equal(np.asarray(tok), np.zeros(1, np.int32))
            assert y.dtype == x.dtype and np.asarray(y).tobytes() == np.asarray(x).tobytes()
        # eagerly too, a Python int layer, no ordering operand
        tok = prefetch.prefetch_l2(1, None, w)
        np.testing.assert_array_equal(np.asarray(tok), np.zeros(1, np.int32))
        assert np.asarray(prefetch.ordered(x, tok)).tobytes() == np.asarray(x).tobytes()
    # on a CPU there is nothing to fall back from: the no-op is the documented lowering, no warning
    assert not [r for r in rec if "prefetch" in str(r.message)]


def test_ordered_takes_any_pytree_and_keeps_the_dependency():
    x = {"a": jnp.ones(3), "b": jnp.full((2, 2), 5, jnp.int8)}
    for token in ((jnp.zeros(1, jnp.int32), jnp.float32(2.5)), jnp.bfloat16(-1), jnp.zeros(2, bool)):
        out = jax.jit(prefetch.ordered)(x, token)
        assert jax.tree.structure(out) == jax.tree.structure(x)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(x)):
            assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # XLA keeps the select on the token's value: the consumer reads the token (a barrier's unused
    # output is dropped by XLA, and what fed it with it)
    hlo = jax.jit(lambda x, t: prefetch.ordered(x, t) * 2).lower(jnp.ones(3), jnp.zeros(1, jnp.int32)).compile()
    txt = hlo.as_text()
    assert "select" in txt and "opt-barrier" not in txt, txt
    assert re.search(r"s32\[1\]\{0\} parameter\(1\)", txt) and "compare" in txt, txt


@pytest.mark.parametrize("loop", ["jit", "fori_loop", "scan"])
def test_the_call_stays_with_its_token_unused(monkeypatch, loop):
    """The prefetch carries the side effect of an FFI call: neither JAX nor XLA drops it when nothing
    reads its token, at the top level or inside a layer loop."""
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)

    def body(i, x, w):
        prefetch.prefetch_l2(i, x, w)
        return x * 2
    f = {"jit": lambda x, w: body(0, x, w),
         "fori_loop": lambda x, w: jax.lax.fori_loop(0, 3, lambda i, x: body(i, x, w), x),
         "scan": lambda x, w: jax.lax.scan(lambda x, i: (body(i, x, w), None), x, jnp.arange(3))[0]}[loop]
    txt = _cuda_text(jax.jit(f), S((4,), jnp.float32), S((3, 64, 128), FP8))
    calls = [line for line in txt.splitlines() if "custom_call @jtilert_prefetch_l2" in line]
    assert len(calls) == 1 and "has_side_effect = true" in calls[0], txt


def test_inside_shard_map_the_fallback_runs_per_device():
    if jax.device_count() < 2:
        pytest.skip("needs 2 host devices (tests/conftest.py sets XLA_FLAGS)")
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    w, s, _ = _small_stacks()
    x = jnp.arange(8.0).reshape(2, 4)

    def f(i, x, w, s):
        return prefetch.ordered(x * 3, prefetch.prefetch_l2(i, x, w, s))
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P("tp"), P(), P()), out_specs=P("tp")))
    np.testing.assert_array_equal(np.asarray(g(jnp.int32(1), x, w, s)), np.asarray(x * 3))


def _cuda_text(f, *args):
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_cuda_lowering_emits_one_custom_call_on_the_stacks(monkeypatch):
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)

    @jax.jit
    def f(i, after, x, w, s, g):
        tok = prefetch.prefetch_l2(i, after * 2, w, s, g)
        return prefetch.ordered(x, tok) + 1
    txt = _cuda_text(f, S((), jnp.int32), S((64, 8), jnp.float32), S((1, 2048), jnp.bfloat16), O_PROJ, O_SCALE, GATE)
    calls = [line for line in txt.splitlines() if "custom_call @jtilert_prefetch_l2" in line]
    assert len(calls) == 1, txt
    call = calls[0]
    # operands in order: the layer's base and offset (int32[1] each, the base from the traced argument),
    # `after`, the stacks as passed
    sig = re.search(r":\s*\(([^)]*)\)\s*->\s*tensor<1xi32>", call)
    assert sig is not None, call
    assert [t.strip() for t in sig.group(1).split(", ")] == [
        "tensor<1xi32>", "tensor<1xi32>", "tensor<64x8xf32>", "tensor<3x7168x2048xf8E4M3FN>", "tensor<3x56x16xf32>",
        "tensor<3x256x7168xf32>"], call
    operands = re.search(r"@jtilert_prefetch_l2\(([^)]*)\)", call).group(1).split(", ")
    assert operands[3:] == ["%arg3", "%arg4", "%arg5"], call        # the stacks, not slices or copies
    layer_def = [line for line in txt.splitlines() if line.strip().startswith(operands[0] + " =")]
    assert layer_def and "reshape %arg0" in layer_def[0], layer_def  # the traced layer, read on the device
    after_def = [line for line in txt.splitlines() if line.strip().startswith(operands[2] + " =")]
    assert after_def and "multiply %arg1" in after_def[0], after_def
    assert not re.search(r"\b\w+ = -?[\d.e+]+ : [if]\d+", call), call   # attribute-free
    assert "has_side_effect = true" in call, call
    # the token reaches the consumer through `ordered`'s select
    tok = call.split("=")[0].strip()
    assert re.search(rf"stablehlo.(slice|reshape) {re.escape(tok)}\b", txt), txt
    assert "dynamic_slice" not in txt


def test_without_the_library_a_gpu_lowering_is_the_no_op_with_one_warning(monkeypatch):
    monkeypatch.setattr(_lib, "load", lambda: (None, "library not built (test)"))
    _lib._warned.clear()  # noqa: SLF001
    f = jax.jit(lambda i, w: prefetch.prefetch_l2(i, None, w))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            txt = _cuda_text(f, S((), jnp.int32), O_PROJ)
            assert "custom_call" not in txt and "stablehlo.constant dense<0> : tensor<i32>" in txt, txt
            f = jax.jit(lambda i, w: prefetch.prefetch_l2(i, None, w))   # a fresh trace: lowered again
    msgs = [str(r.message) for r in rec if "prefetch not issued" in str(r.message)]
    assert len(msgs) == 1 and "library not built (test)" in msgs[0], msgs


@pytest.mark.parametrize("shape", [(7168,), (0, 4), ()])
def test_an_array_without_a_layer_axis_is_refused_by_shape(shape):
    with pytest.raises(ValueError, match=re.escape(str(list(shape)))):
        prefetch.prefetch_l2(0, None, jnp.zeros((3, 8, 8)), jnp.zeros(shape))


def test_more_than_eight_stacks_or_none_are_refused():
    stacks = [jnp.zeros((2, 4))] * 9
    with pytest.raises(ValueError, match=r"1 to 8 stacks, got 9 .*\(2, 4\)"):
        prefetch.prefetch_l2(0, None, *stacks)
    with pytest.raises(ValueError, match="got 0"):
        prefetch.prefetch_l2(0, None)
    prefetch.prefetch_l2(0, None, *stacks[:8])   # eight are fine


def test_packed_dtypes_and_non_integer_layers_are_refused():
    with pytest.raises(ValueError, match=r"int4\[3, 8\]"):
        prefetch.prefetch_l2(0, None, jnp.zeros((3, 8), jnp.int4))
    with pytest.raises(ValueError, match="integer scalar"):
        prefetch.prefetch_l2(jnp.float32(1), None, jnp.zeros((3, 8)))
    with pytest.raises(ValueError, match="integer scalar"):
        prefetch.prefetch_l2(jnp.zeros(2, jnp.int32), None, jnp.zeros((3, 8)))


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found: the CUDA sources cannot be compiled here")
def test_kernel_issues_bulk_l2_prefetches(tmp_path):
    """prefetch.cu alone to PTX for sm_90a, warnings as errors: the bulk prefetch and the per-line
    prefetch of unaligned ends are there, nothing is stored but the token."""
    ptx = tmp_path / "prefetch.ptx"
    cmd = [_nvcc(), "-gencode=arch=compute_90a,code=sm_90a", "-Werror=all-warnings", "-Xcompiler=-Wall,-Wextra,-Werror",
           "-I", str(ROOT / "cuda" / "include"), "-ptx", str(ROOT / "cuda" / "src" / "prefetch.cu"), "-o", str(ptx)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    text = ptx.read_text()
    assert "cp.async.bulk.prefetch.L2.global" in text
    assert "prefetch.global.L2" in text
    assert len(re.findall(r"^\s*st\.global", text, flags=re.M)) == 1   # token[0] = 0


# ---- in the decode step: DecodeConfig.l2_prefetch ------------------------------------------------

def _prefetches(jaxpr, found):
    """Every prefetch_l2 equation in a jaxpr (loop and jit bodies included)."""
    from decode_jaxprs import sub_jaxprs   # tests/decode_jaxprs.py
    for e in jaxpr.eqns:
        if e.primitive is prefetch.prefetch_l2_p:
            found.append(e)
        for inner in sub_jaxprs(e):
            _prefetches(inner, found)
    return found


@pytest.mark.parametrize("on", [False, True])
def test_the_decode_step_prefetches_o_proj_once_per_layer_when_asked(on):
    """dsv32-tp8-shard's one-token pallas step: with l2_prefetch, every layer issues one prefetch of
    o_proj's fp8 weight and scale stacks at its layer index, after the query projections; without it
    (the default) there is none."""
    from decode_jaxprs import decode_step
    from jtilert.ops.table import DecodeConfig, Ops
    from jtilert.pallas import interpret as interp
    ops = Ops(DecodeConfig(backend="pallas", l2_prefetch=on))
    step, state, cache = decode_step("dsv32-tp8-shard", 5, ops)
    with interp.compile_for_gpu():
        jaxpr = jax.make_jaxpr(step)(state, cache).jaxpr
    found = _prefetches(jaxpr, [])
    if not on:
        assert not found
        return
    # one per layer: the dense loop's trip runs 3 layers, the MoE loop's 2
    assert len(found) == 5, len(found)
    for e in found:
        layer, layer_offset, after, *stacks = e.invars
        # the attention stacks hold the 5 layers and the MTP block's
        assert [(tuple(s.aval.shape), s.aval.dtype) for s in stacks] == [
            ((6, 7168, 2048), jnp.float8_e4m3fn), ((6, 56, 16), jnp.float32)]
        assert after.aval.shape[-1] == 3072 + 8192   # q_b | wq_b merged: the query projections' output
        # nothing reads the token: the call's effect keeps it in the step
        assert e.effects, e
