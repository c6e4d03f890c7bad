"""The engine's one-launch MoE (`jtilert.ffi.moe`, cuda/src/moe.cu): wiring, the shapes it takes, the
XLA lowering of its primitive against `reference_moe`, the CUDA lowering's custom call on the whole
layer stacks, and the fallback without an engine (the kernel itself runs on the GPU:
tests/gpu/moe_check.py)."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jtilert.ffi import _lib, moe
from jtilert.ffi import ops as ffi_ops
from jtilert.ops import reference
from jtilert.ops.layer import Layer
from jtilert.ops.table import DecodeConfig, Ops

ROOT = pathlib.Path(__file__).resolve().parents[1]
H, I, K, E, L = 1024, 128, 7, 8, 3   # (K + 1) * I = 1024: 8 gate/up pairs and 8 output rows a CTA


def _fp8(key, shape):
    kw, ks = jax.random.split(key)
    w = (jax.random.normal(kw, shape) * 4).astype(jnp.float8_e4m3fn)
    s = jnp.exp(jax.random.uniform(ks, (*shape[:-2], shape[-2] // 128, shape[-1] // 128), minval=-7, maxval=-4))
    return w, s


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 10)
    experts = (*_fp8(k[0], (L, E, I, H)), *_fp8(k[1], (L, E, I, H)), *_fp8(k[2], (L, E, H, I)))
    shared = (*_fp8(k[3], (L, I, H)), *_fp8(k[4], (L, I, H)), *_fp8(k[5], (L, H, I)))
    f = jax.random.normal(k[6], (1, H), jnp.bfloat16)
    res = (jax.random.normal(k[7], (1, H)) * 4).astype(jnp.bfloat16)
    w = jax.random.uniform(k[8], (1, K), minval=0.1, maxval=1.0)
    ids = jax.random.permutation(k[9], E)[:K][None].astype(jnp.int32)
    return f, w, ids, experts, shared, res


def test_moe_decode_is_built_and_exported():
    assert "src/moe.cu" in (ROOT / "cuda" / "CMakeLists.txt").read_text()
    assert "JtMoeDecode" in (ROOT / "cuda" / "src" / "ffi.cc").read_text()
    assert _lib.TARGETS["jtilert_moe_decode"] == "JtMoeDecode"


def test_unsupported_names_what_the_kernel_does_not_take():
    f, w, ids, ex, sh, res = _inputs()
    assert moe.unsupported(f, w, ids, ex, sh, res) is None
    assert "bf16" in moe.unsupported(f.astype(jnp.float32), w, ids, ex, sh, res)
    assert "one token" in moe.unsupported(jnp.concatenate([f, f]), w, ids, ex, sh, res)
    assert "residual" in moe.unsupported(f, w, ids, ex, sh, None)
    bf16_experts = (ex[0].astype(jnp.bfloat16), *ex[1:])
    assert "fp8" in moe.unsupported(f, w, ids, bf16_experts, sh, res)
    wide = (*_fp8(jax.random.key(1), (L, 2 * I, H)), *sh[2:])
    assert "shared expert of width 256" in moe.unsupported(f, w, ids, ex, wide, res)
    assert "k=0" in moe.unsupported(f, w[:, :0], ids[:, :0], ex, sh, res)   # no routed expert: C refuses it too

    def stacks(h, i):   # the check reads shapes and dtypes only
        def fp8(*shape):
            return (jax.ShapeDtypeStruct(shape, jnp.float8_e4m3fn),
                    jax.ShapeDtypeStruct((*shape[:-2], shape[-2] // 128, shape[-1] // 128), jnp.float32))
        return ((*fp8(L, E, i, h), *fp8(L, E, i, h), *fp8(L, E, h, i)), (*fp8(L, i, h), *fp8(L, i, h), *fp8(L, h, i)))
    assert moe.unsupported(f[:, :512], w, ids, *stacks(512, I), res[:, :512]) is None   # 8 CTAs' output rows
    assert "H=576" in moe.unsupported(f[:, :576], w, ids, *stacks(576, I), res[:, :576])   # not 128-blocks
    # I = 768, k = 3: 24 gate/up pairs a CTA, but phase 2's 4 segments x 8 chunks of 8 rows do not fit
    # the ring's 24 slots; I = 1024, k = 2: 3 x 8 chunks do
    assert "above the kernel's ring" in moe.unsupported(f, w[:, :3], ids[:, :3], *stacks(H, 768), res)
    assert moe.unsupported(f, w[:, :2], ids[:, :2], *stacks(H, 1024), res) is None
    with pytest.raises(ValueError, match="moe_decode: .*bf16"):
        moe.moe_decode(f.astype(jnp.float32), w, ids, ex, sh, res, 0)


def test_primitive_lowers_to_the_reference_in_xla():
    """On a machine without the engine the primitive's XLA lowering is `reference_moe`, bit for bit,
    at every layer of the stack (a negative index counting from the end), given as base + offset."""
    f, w, ids, ex, sh, res = _inputs(1)
    for layer in (0, 2, -1):
        got = jax.jit(lambda *a: moe.moe_decode_p.bind(*a))(f, w, ids, *ex, *sh, res,
                                                            *Layer(jnp.int32(layer + 1), -1).operands())
        want = moe.reference_moe(f, w, ids, ex, sh, res, layer % L)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_moe_decode_without_the_engine_warns_and_runs_the_reference(monkeypatch):
    f, w, ids, ex, sh, res = _inputs(2)
    monkeypatch.setattr(ffi_ops, "engine_status", lambda: (False, "no GPU backend (test)"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = moe.moe_decode(f, w, ids, ex, sh, res, 1)
    assert any("engine's MoE not used" in str(c.message) for c in caught)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(moe.reference_moe(f, w, ids, ex, sh, res, 1), np.float32))
    # the result is the MoE: residual + routed + shared, not the residual alone
    assert np.abs(np.asarray(got, np.float32) - np.asarray(res, np.float32)).max() > 0.1


def test_cuda_lowering_passes_the_whole_stacks_and_the_layer(monkeypatch):
    """Cross-lowered for CUDA inside a loop over the layers: one custom call per iteration with 18
    operands, every weight and scale the loop's own [L, ...] stack (no slice of a layer in front
    of the call), the layer's base and offset last."""
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    f, w, ids, ex, sh, res = _inputs(3)

    def chain(f, w, ids, ex, sh, res):
        return jax.lax.fori_loop(0, L, lambda i, x: moe.moe_decode(x, w, ids, ex, sh, res, i), f)

    txt = jax.jit(chain).trace(f, w, ids, ex, sh, res).lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @jtilert_moe_decode\(([^)]*)\)", txt)
    assert len(calls) == 1, calls
    ops = [o.strip() for o in calls[0].split(",")]
    assert len(ops) == 18
    assert all(o.startswith(("%arg", "%iterArg")) for o in ops[3:15]), ops   # the stacks as they came in
    line = next(x for x in txt.splitlines() if "custom_call @jtilert_moe_decode" in x)
    assert f"tensor<{L}x{E}x{I}x{H}xf8E4M3FN>" in line and f"tensor<{L}x{H}x{I}xf8E4M3FN>" in line
    assert "tensor<1xi32>" in line   # the layer, read on the device
    assert re.search(r"timeout_ms = \d+ : i64", txt), "the wait's bound, JTILERT_FFI_TIMEOUT_MS"


def test_the_kernels_hi_lo_input_form_keeps_about_8_bits():
    """moe.cu's input form in NumPy, block by block as quantize_input does it: hi = e4m3(x / s_hi),
    s_hi = max|x| / 448, then the rest the same way (lo). Each element comes back within 2^-8 of its
    block's largest (the claim in moe.cu's header), and a row of e4m3 weights' dot product with it
    within 1e-3 of the exact one, on seeded random bf16 inputs with outliers."""
    import ml_dtypes
    e4m3 = ml_dtypes.float8_e4m3fn
    rng = np.random.default_rng(0)
    x = rng.standard_normal(7168).astype(np.float32)
    x[::97] *= 30
    x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    back = np.zeros_like(x)
    for b in range(0, x.size, 128):
        r = x[b:b + 128].copy()
        for _ in range(2):   # hi, then lo
            m = np.abs(r).max()
            sc = np.float32(m / 448 if m > 0 else 1)
            q = (r / sc).astype(e4m3).astype(np.float32) * sc
            back[b:b + 128] += q
            r = r - q
        assert np.abs(back[b:b + 128] - x[b:b + 128]).max() <= 2.0**-8 * np.abs(x[b:b + 128]).max()
    w = (rng.standard_normal((64, x.size)) * 4).astype(e4m3).astype(np.float32)
    exact, got = w.astype(np.float64) @ x, w.astype(np.float64) @ back
    assert np.linalg.norm(got - exact) <= 1e-3 * np.linalg.norm(exact)


@pytest.mark.parametrize("shift", [0, 16])
def test_block_dots_rotated_rows_sum_on_the_diagonal(shift):
    """moe.cu's block_dot in NumPy, lane by lane with PTX's m16n8k32 fragment layout (A: a0/a2 row g,
    a1/a3 row g + 8, columns 4t.. and 4t + 16..; B: column g; C: c0/c1 row g, c2/c3 row g + 8, columns
    2t, 2t + 1): when row g reads its columns rotated by g * shift bytes, and A's rows g and g + 8 hold
    hi and lo at the same columns, the lane that `holds_row` (lane % 4 == lane / 8) finds row g's dot
    products with hi and lo on the diagonal, and no other column of C is needed."""
    rng = np.random.default_rng(shift)
    hi, lo = rng.standard_normal(128), rng.standard_normal(128)
    w = rng.standard_normal((8, 128))
    c = np.zeros((16, 8))
    for s4 in range(4):
        a, b = np.full((16, 32), np.nan), np.full((32, 8), np.nan)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            k0 = (g * shift + s4 * 32 + t * 4) & 127
            for half, k in ((0, k0), (1, (k0 + 16) & 127)):
                cols = slice(t * 4 + 16 * half, t * 4 + 16 * half + 4)
                a[g, cols], a[g + 8, cols], b[cols, g] = hi[k:k + 4], lo[k:k + 4], w[g, k:k + 4]
        c += a @ b
    got = {}
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        if t == lane >> 3:   # holds_row: c[g & 1] and c[2 + (g & 1)] are C[g][2t + (g & 1)] = C[g][g]
            got[g] = (c[g, 2 * t + (g & 1)], c[g + 8, 2 * t + (g & 1)])
    assert sorted(got) == list(range(8))
    for g in range(8):
        np.testing.assert_allclose(got[g], (w[g] @ hi, w[g] @ lo), rtol=1e-12)
    # the shift spreads phase 2's rows (a multiple of 128 bytes apart) over the 32 banks
    banks = {(g * 256 + ((g * shift + t * 4) & 127)) // 4 % 32 for g in range(8) for t in range(4)}
    assert len(banks) == (32 if shift else 4)


# ---- in the decode step: DecodeConfig.engine_moe ------------------------------------------------

def _ops_moe(engine_moe: bool, f, w, ids, ex, sh, res, norm=None):
    """Ops.moe under backend "pallas" (interpret mode on the CPU) as a function of the layer: on x = f
    and, with a norm (weight stack, eps), on f normed as the router writes it."""
    ops = Ops(DecodeConfig(backend="pallas", engine_moe=engine_moe))
    if norm is None:
        return lambda i: ops.moe(f, w, ids, ex, sh, layer=i, residual=res)
    return lambda i: ops.moe(f, w, ids, ex, sh, layer=i, residual=res, norm=norm,
                             x_normed=reference.rms_norm(f, norm[0][i], norm[1]))


def _at_layer(fn, layer):
    return np.asarray(jax.jit(fn)(jnp.int32(layer)), np.float32)


@pytest.fixture
def moe_decode_calls(monkeypatch):
    """The calls of moe_decode, which still runs (here: its reference, the engine not loaded)."""
    calls = []

    def spy(*args):
        calls.append(args)
        return real(*args)
    real = moe.moe_decode
    monkeypatch.setattr(moe, "moe_decode", spy)
    monkeypatch.setattr(_lib, "_warned", set())   # each warning comes once per process
    return calls


def test_engine_moe_runs_the_layer_as_the_pallas_path_does(moe_decode_calls):
    """engine_moe: one token's MoE call, with the FFN's norm as the decode model has it, goes to
    moe_decode on the normed f (on the CPU its reference, with the engine's warning) and gives the
    pallas path's result: the MoE's part of it (the output less the residual, which is small here so
    that the comparison sees that part) within 2 % in norm, where bf16 rounding leaves ~0.6 % and one
    expert left out, the shared one left out, the wrong layer or x in place of f are all > 20 % off."""
    f, w, ids, ex, sh, res = _inputs(4)
    res = (res / 16).astype(jnp.bfloat16)
    norm = ((1 + 0.2 * jax.random.normal(jax.random.key(5), (L, H))).astype(jnp.bfloat16), 1e-6)
    with pytest.warns(RuntimeWarning, match="engine's MoE not used"):
        got = _at_layer(_ops_moe(True, f, w, ids, ex, sh, res, norm), 1)
    assert len(moe_decode_calls) == 1
    want = _at_layer(_ops_moe(False, f, w, ids, ex, sh, res, norm), 1)
    assert len(moe_decode_calls) == 1
    part = want - np.asarray(res, np.float32)
    assert np.linalg.norm(got - want) <= 0.02 * np.linalg.norm(part)


def test_engine_moe_warns_once_where_the_engine_does_not_take_the_call(moe_decode_calls):
    """Two decode tokens: the pallas path's program, the same as without engine_moe, and one
    warning naming moe, the shapes and the reason, at the first trace only."""
    f, w, ids, ex, sh, res = _inputs(6)
    two = (jnp.concatenate([f, -f]), jnp.concatenate([w, w]), jnp.concatenate([ids, ids[:, ::-1]]),
           ex, sh, jnp.concatenate([res, res]))
    program = lambda engine_moe: str(jax.make_jaxpr(_ops_moe(engine_moe, *two))(jnp.int32(0)))  # noqa: E731
    with pytest.warns(UserWarning, match=r"does not take moe on bfloat16\[2, 1024\].*\(2 tokens \(it takes one\)\)"):
        got = program(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = program(True)
    assert got == again == program(False)
    assert not moe_decode_calls


def test_engine_moe_is_off_by_default():
    assert DecodeConfig().engine_moe is False
    assert DecodeConfig(backend="pallas").engine_moe is False


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("git") is None, reason="nvcc or git not found")
@pytest.mark.parametrize("patch,source,marker", [("moe_trace.patch", "moe.cu", "jt_moe_trace")])
def test_the_experiment_patches_apply_to_the_engine_and_compile(tmp_path, patch, source, marker):
    """bench/experiments' patches of the engine still apply (moe_trace.patch: the stamps
    bench/experiments/moe_trace.py reads), and the patched source builds."""
    shutil.copytree(ROOT / "cuda", tmp_path / "cuda")
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "test_ffi_moe.py", tmp_path / "tests")
    r = subprocess.run(["git", "apply", str(ROOT / "bench" / "experiments" / patch)], cwd=tmp_path,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert marker in (tmp_path / "cuda" / "src" / source).read_text()
    r = subprocess.run(["nvcc", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-I", str(tmp_path / "cuda" / "include"),
                        "-c", str(tmp_path / "cuda" / "src" / source), "-o", str(tmp_path / "patched.o")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
