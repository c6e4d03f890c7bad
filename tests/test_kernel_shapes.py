"""Every kernel call a model makes fits its kernel (issue 15). For every preset (tp = 1, 2 and 8 where
its weights divide; the -tp8-shard presets, one GPU's share already, at tp = 1), fp8 and bf16
weights, T = 1..4 tokens and a MAX_DECODE_TOKENS chunk, the decode step (main model, and the lm
head at T = 1) and the MTP draft are traced abstractly (`jax.eval_shape` on an abstract model with
its dense layers and two MoE layers, under `shard_map` for tp > 1) with backend="pallas". The
kernels' bodies are never traced: `plgpu.kernel` is replaced by a stand-in that returns zeros of
the kernel's output type, so the whole path down to each launch runs as in a real step: the op
table's conditions, the wrappers' own checks, the config resolution and the shared-memory check
each kernel makes before it is built. Any exception fails the case. An op the table declines, or
whose kernel refuses the shapes, runs the reference with a warning: none may name a shortfall of
shared memory, and the full-size models may decline none. The CUDA engine's ops (engine
all-reduce, split indexer, top-k) are bound abstractly and their GEMV task tables checked.

The shared-memory count the kernels check with (`_hopper.smem_bytes`) is compared with Mosaic's
own count at lowering (cross-lowered for CUDA with Mosaic's bound set to 0, whose error message
states the kernel's bytes), for each kernel at the configurations the models resolve to.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jtilert.ffi import _lib
from jtilert.ffi import ops as ffi_ops
from jtilert.model import presets, transformer
from jtilert.ops import reference, table
from jtilert.pallas import _hopper as hw
from jtilert.pallas import gemv, indexer, lm_head, moe, sparse_mla
from jtilert.pallas import interpret as interp
from jtilert.parallel import sharding
from jtilert.runtime.sampling import Sampling

BF16, FP8, F32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
S = jax.ShapeDtypeStruct
# the GEMV kernel's name prefixes on its tensor-core engines (GemvConfig.engine "wgmma", "fp8x2")
TENSOR_CORE_GEMVS = ("jtilert_gemv_wgmma_", "jtilert_gemv_fp8x2_")
TOKENS = (1, 2, 3, 4, table.MAX_DECODE_TOKENS)
TPS = (1, 2, 8)
CACHE_ROWS = 4160     # more than index_topk: the full top-k reaches sparse MLA
FORMATS = ("fp8", "bf16")   # (fp32 weights compute in fp32: every projection runs the reference)


@dataclasses.dataclass
class Launch:
    kernel: str
    grid: tuple
    scratch_bytes: int          # the explicit scratch alone (pipelines come on top)
    inputs: tuple = ()          # the operands' shapes

    @property
    def k(self) -> int:         # GEMV kernels: x [T, K] is the first operand
        return self.inputs[0][-1]


def _abstract(cfg, fmt, tp):
    """(graphdef, flat abstract state, its treedef, its tp specs, the state) of a model as the pallas
    Engine holds it at tensor-parallel degree tp (`decode_weights`)."""
    gd, state = nnx.split(transformer.decode_weights(transformer.abstract_model(cfg, fmt), tp=tp, backend="pallas"))
    flat, tdef = jax.tree_util.tree_flatten(state)
    specs = jax.tree_util.tree_leaves(sharding.param_specs(state), is_leaf=lambda x: isinstance(x, P))
    return gd, flat, tdef, specs, state


def _held(cfg, fmt, tp: int) -> bool:
    """Whether the pallas Engine can hold the model at tp: its decode model builds (the merged q_b | wq_b
    splits over tp in whole scale blocks) and `sharding.shard_state` splits every weight."""
    try:
        return _divides(_abstract(cfg, fmt, tp)[4], tp)
    except ValueError:
        return False


def _divides(state, tp: int) -> bool:
    """Whether `sharding.shard_state` splits every weight of the model over tp ranks."""
    ok = True

    def check(path, x):
        nonlocal ok
        try:
            sharding.check_split(".".join(map(str, sharding.path_names(path))), x.shape, x.dtype, tp)
        except ValueError:
            ok = False
    jax.tree_util.tree_map_with_path(check, state)
    return ok


def _step(gd, tdef, config, tp, t, with_head):
    """The decode step's kernel work: the main model on t tokens, the lm head's candidates (one
    token) and the MTP draft on t hidden states."""
    def run(flat, cache, tokens, start, hidden, params, key):
        m = nnx.merge(gd, jax.tree_util.tree_unflatten(tdef, flat))
        ops = table.Ops(config, sharding.AXIS if tp > 1 else None)
        h, cache = m.hidden(ops, tokens, start, cache)
        out = [h, cache]
        if with_head:
            out.append(m.next_token(ops, h, params, key))
        if m.mtp is not None:
            out.append(m.draft(ops, hidden, tokens, start, cache))
        return out
    return run


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """plgpu.kernel → a stand-in recording each launch; engine ops bound abstractly; fresh warnings."""
    launches: list[Launch] = []

    def kernel(body, *, out_type, scratch_types=(), grid=(), kernel_name=None, **_):
        launch = Launch(kernel_name or getattr(body, "__name__", "?"), tuple(grid),
                        hw.smem_bytes(hw.Scope(tuple(scratch_types))))
        launches.append(launch)

        def call(*args):
            launch.inputs = tuple(tuple(jnp.shape(a)) for a in args)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_type)
        return call

    plans = []
    real_plan = ffi_ops._plan.build_gemv_plan

    def build_gemv_plan(n, k, **kw):
        plan = real_plan(n, k, **kw)
        ffi_ops._plan.check_gemv_plan(plan, num_sms=kw.get("num_sms"))
        plans.append((n, k, plan.nwc, plan.rpw))
        return plan

    monkeypatch.setattr(plgpu, "kernel", kernel)
    # kernels are called straight (no jax.jit), so no jit cache keeps a stand-in's trace
    monkeypatch.setattr(table, "_jitted", lambda fn, *_: fn)
    monkeypatch.setattr(table, "_engine_loads", lambda: True)
    monkeypatch.setattr(ffi_ops, "EMIT_WITHOUT_GPU", True)
    monkeypatch.setattr(ffi_ops._plan, "build_gemv_plan", build_gemv_plan)
    monkeypatch.setattr(_lib, "_warned", set())
    return launches, plans


def _configs(tp, t):
    yield table.DecodeConfig(backend="pallas")
    if tp > 1 and t == 1:   # the engine's fused all-reduces and the split indexer take one token
        yield table.DecodeConfig(backend="pallas", engine_all_reduce=True, split_indexer=True)


def _layers_cut(cfg):
    """The preset with its dense layers and two MoE layers: a step traces one loop body per stack,
    so every kernel shape is the same as with all the layers, only the stacks are shorter."""
    keep = min(cfg.num_hidden_layers, cfg.first_k_dense_replace + 2)
    return cfg if keep == cfg.num_hidden_layers else cfg.replace(num_hidden_layers=keep)


# (model, weight formats, tensor-parallel degrees): every preset at tp = 1, 2, 8 where its weights
# divide; the -tp8-shard presets are one GPU's share of a tp=8 model already (tp=1); DeepSeek's
# FlashMLA-layout fp8 latent cache on that share.
MODELS = {name: (presets.preset(name), FORMATS, (1,) if name.endswith("-tp8-shard") else TPS)
          for name in presets.PRESETS}
MODELS["dsv32-tp8-shard, fp8 latent cache"] = (presets.preset("dsv32-tp8-shard", kv_cache_quant="fp8"),
                                               ("fp8",), (1,))
CASES = [(name, fmt) for name, (_, fmts, _) in MODELS.items() for fmt in fmts]


@pytest.mark.parametrize("name,fmt", CASES)
def test_every_kernel_launch_of_a_preset_fits(name, fmt, stand_in_kernels):
    launches, plans = stand_in_kernels
    cfg, _, tps = MODELS[name]
    cfg = _layers_cut(cfg)
    dtype = transformer.compute_dtype(fmt)
    cache = jax.eval_shape(lambda: transformer.init_cache(cfg, CACHE_ROWS, dtype))
    mesh = sharding.make_mesh(max(TPS))
    params = jax.eval_shape(Sampling().arrays)
    key = jax.eval_shape(lambda: jax.random.key(0))
    cases, tps = 0, [tp for tp in tps if _held(cfg, fmt, tp)]
    for tp in tps:
        gd, flat, tdef, specs, _ = _abstract(cfg, fmt, tp)
        # every projection of the full-size models runs its kernel (the tiny ones' fp8 experts and
        # K of 32 are below the kernels' granularity: the op table declines them)
        all_kernels = not name.startswith("tiny")
        for t in TOKENS:
            for config in _configs(tp, t):
                where = f"{name} {fmt} tp={tp} T={t} {config}"
                f = _step(gd, tdef, config, tp, t, with_head=t == 1)
                if tp > 1:
                    sub = jax.sharding.Mesh(mesh.devices[:tp], mesh.axis_names)
                    f = jax.shard_map(f, mesh=sub, in_specs=(specs,) + (P(),) * 6, out_specs=P(), check_vma=False)
                before = len(launches)
                with interp.compile_for_gpu(), warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        jax.eval_shape(f, flat, cache, S((t,), jnp.int32), S((), jnp.int32),
                                       S((t, cfg.hidden_size), dtype), params, key)
                    except Exception as e:   # noqa: BLE001 - name the case
                        raise AssertionError(f"{where}: {type(e).__name__}: {e}") from e
                new = launches[before:]
                assert any(x.kernel.startswith(TENSOR_CORE_GEMVS) for x in new), where
                for launch in new:
                    assert launch.scratch_bytes <= hw.SMEM_BYTES, (where, launch)
                declined = [str(w.message) for w in caught if "kernel does not apply" in str(w.message)]
                assert not any("B of shared memory" in m for m in declined), (where, declined)
                # the attention kernels take at most 4 tokens: a chunk of more declines them, by name
                over = [m for m in declined if f"tokens (at most {indexer.MAX_TOKENS}" in m]
                assert bool(over) <= (t > indexer.MAX_TOKENS), (where, over)
                # mla_prep writes bf16 caches only: the fp8 packed latent cache runs its reference
                packed = [m for m in declined if "mla_prep kernel" in m and "fp8 packed latent cache" in m]
                assert bool(packed) <= (cfg.kv_cache_quant == "fp8"), (where, packed)
                assert not (all_kernels and set(declined) - set(over) - set(packed)), (where, declined)
                cases += 1
    assert cases >= len(TOKENS)
    assert bool(plans) == (max(tps) > 1)   # the engine's GEMV tables were built and checked (tp > 1)
    if cfg.num_nextn_predict_layers:         # the MTP block's eh_proj (K = 2·hidden) was among them
        assert any(x.kernel.startswith(TENSOR_CORE_GEMVS) and x.k == 2 * cfg.hidden_size for x in launches)


def test_attention_shapes_no_config_fits_are_declined_by_the_op_table(stand_in_kernels):
    """Sparse MLA with a 1024-wide latent (no block_k fits the SMEM) or 96 local heads (not whole
    64-head CTAs), the indexer with 512 heads: the op table's conditions decline them (so Ops
    warns once and runs the reference), and the kernels refuse them with a ValueError; the models' shapes pass.
    fp8 index keys 256 wide: the kernel cannot append them (one 128-wide quantisation block per
    key), so XLA appends and the kernel scores."""
    t, rows = 2, 4160
    idx = S((t, 2048), jnp.int32)

    def mla(heads, lat):
        return (S((t, heads, lat), BF16), S((t, heads, 64), BF16), S((rows, lat), BF16), S((rows, 64), BF16),
                idx, 0.1)
    unsupported = table.OPS["sparse_mla"].unsupported
    assert unsupported(*mla(16, 512)) is None
    assert "no block_k" in unsupported(*mla(16, 1024))
    assert "heads" in unsupported(*mla(96, 512))
    launches, _ = stand_in_kernels
    with interp.compile_for_gpu():
        for heads, lat in [(16, 1024), (96, 512)]:   # the kernel refuses them by name, launching nothing
            with pytest.raises(ValueError, match="sparse_mla kernel: .*(block_k|heads)"):
                jax.eval_shape(lambda *a: sparse_mla.sparse_mla(*a[:5], 0.1), *mla(heads, lat)[:5])
        assert not launches

    def index(heads, width):
        return (presets.preset("dsv32-tp8-shard", index_n_heads=heads, index_head_dim=width),
                S((t, heads, width), FP8), S((t, heads), F32), S((t, width), BF16), S((rows, width), FP8),
                S((rows,), F32), S((t,), jnp.int32), S((), jnp.int32))
    unsupported = table.OPS["indexer_append_scores"].unsupported
    assert unsupported(*index(64, 128)) is None
    assert "512 index heads" in unsupported(*index(512, 128))
    assert unsupported(*index(64, 256)) is None
    cfg, q, w, k, _, _, positions, start = index(64, 256)
    with interp.compile_for_gpu():
        jax.eval_shape(lambda *a: indexer.indexer_append_scores(cfg, *a, layer=jnp.int32(1)),
                       q, w, k, S((3, rows, 256), FP8), S((3, rows), F32), positions, start)
    # one scoring launch: q, w, cache, scales, positions, offsets (no new keys: XLA appended them)
    assert len(launches) == 1 and launches[0].inputs[2] == (3, rows, 256) and len(launches[0].inputs) == 6


# ---- the shapes that needed a larger split-K (issue 15) ------------------------------------------

def _resolved(n, k, t, p=1, itemsize=1, **kw):
    with interp.compile_for_gpu():
        return gemv.GemvConfig(**kw).resolved(n, k, t, p, itemsize, 132)


@pytest.mark.parametrize("t", [1, 2, 3, 4])
def test_eh_proj_resolves_to_a_config_that_fits(t):
    """The MTP block's eh_proj (2·7168 → 7168, fp8) needed 266240 B at split_k=2: it gets 4."""
    cfg = _resolved(7168, 14336, t)
    assert cfg.split_k == 4 and cfg.stages == 4 and cfg.block_k == 256
    assert hw.smem_bytes(gemv.projection_smem(cfg, k=14336, p=1, itemsize=1, tb=t)) <= hw.SMEM_BYTES


def test_explicit_split_shrinks_the_pipeline_or_refuses():
    cfg = _resolved(7168, 14336, 2, split_k=4, stages=8)    # the token slice leaves room for 6 stages
    assert (cfg.split_k, cfg.stages, cfg.block_k) == (4, 6, 256)
    with pytest.raises(ValueError, match="shared memory"):   # [8, 7168] twice is the whole SMEM
        _resolved(7168, 14336, 2, split_k=2)


@pytest.mark.parametrize("n,k,split,stages", [(11264, 1536, 1, 3),    # q_b | wq_b merged: 176 CTAs
                                               (2240, 7168, 4, 3),     # q_a | wk | kv_a merged: 140 CTAs
                                               (7168, 2048, 1, 4)])    # o_proj: 112 CTAs, one per SM
def test_a_grid_beyond_the_sms_gets_two_ctas_per_sm(n, k, split, stages):
    """dsv32-tp8-shard's projections at one token on 132 SMs: a grid of more CTAs than SMs gets a
    pipeline shallow enough for two CTAs per SM (one wave); one that fits in a wave keeps four stages."""
    cfg = _resolved(n, k, 1)
    assert (cfg.split_k, cfg.stages) == (split, stages)
    smem = hw.smem_bytes(gemv.projection_smem(cfg, k=k, p=1, itemsize=1, tb=1))
    assert (smem <= hw.SMEM_HALF_SM) == (-(-n // 64) * split > 132)


# ---- the accounting against Mosaic's own count ---------------------------------------------------

def _lowered_smem(monkeypatch, f, *specs) -> tuple[hw.Scope, int]:
    """(the Scope the kernel in f checked, Mosaic's shared memory for it): lowered for CUDA with
    Mosaic's bound set to 0, whose error states the kernel's bytes."""
    from jax.experimental.mosaic.gpu import core as mosaic_core
    jax.clear_caches()   # an earlier test may have traced this kernel: trace it again here
    seen = []
    real = hw.check_smem
    monkeypatch.setattr(hw, "check_smem", lambda kernel, scope, what: seen.append(scope) or real(kernel, scope, what))
    monkeypatch.setattr(mosaic_core, "_SMEM_SIZE_BOUND", 0)
    with interp.compile_for_gpu(), pytest.raises(ValueError, match="exceeds available shared memory") as e:
        jax.jit(f).trace(*specs).lower(lowering_platforms=("cuda",))
    assert len(seen) == 1
    return seen[0], int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1))


def _q(*shape):
    return S(shape, FP8), S((*shape[:-2], -(-shape[-2] // 128), shape[-1] // 128), F32)


ROWS = 4096
KERNELS = {   # one launch each, at the shapes and configurations the dsv32 shard resolves to
    "GEMV eh_proj fp8, split-K": (gemv.linear, (S((2, 14336), BF16), *_q(7168, 14336))),
    "GEMV x_proj rmsnorm fp8, split-K summed in a cluster": (
        lambda x, nw, w, s: gemv.rmsnorm_linear(x, nw, 1e-6, w, s, config=gemv.GemvConfig(split_sum="cluster")),
        (S((1, 7168), BF16), S((7168,), BF16), *_q(2240, 7168))),
    "GEMV o_proj + residual fp8": (gemv.linear_residual, (S((2, 2048), BF16), *_q(7168, 2048), S((2, 7168), BF16))),
    "GEMV gate/up pair fp8": (gemv.swiglu_pair, (S((1, 7168), BF16), *_q(2304, 7168), *_q(2304, 7168))),
    "GEMV rmsnorm bf16": (lambda x, nw, w: gemv.rmsnorm_linear(x, nw, 1e-6, w),
                          (S((3, 2048), BF16), S((2048,), BF16), S((7168, 2048), BF16))),
    "GEMV indexer head weights, fp32 FMA, split-K 28": (
        lambda x, nw, w: gemv.index_weights(x, nw, 1e-6, w),
        (S((1, 7168), BF16), S((7168,), BF16), S((64, 7168), F32))),
    "GEMV router, fp32 FMA": (lambda x, w: moe.router_partials(x, w), (S((4, 7168), BF16), S((256, 7168), F32))),
    "GEMV experts' gate/up": (lambda x, i, g, gs, u, us: moe.expert_gate_up(x, i, g, gs, u, us),
                              (S((2, 7168), BF16), S((2, 8), jnp.int32), *_q(256, 256, 7168), *_q(256, 256, 7168))),
    "GEMV q_b | wq_b, two CTAs per SM": (lambda x, nw, w, s: gemv.rmsnorm_linear(x, nw, 1e-6, w, s),
                                         (S((1, 2240), BF16), S((1536,), BF16), *_q(11264, 1536))),
    "MoE down": (lambda h, w, i, d, ds: moe.expert_down(h, w, i, d, ds),
                 (S((32, 256), BF16), S((4, 8), F32), S((4, 8), jnp.int32), *_q(256, 7168, 256))),
    "MoE down from the gate/up partials": (lambda h, w, i, d, ds, r: moe.expert_down(h, w, i, d, ds, residual=r),
                                          (S((4, 2, 8, 256), F32), S((1, 8), F32), S((1, 8), jnp.int32),
                                           *_q(256, 7168, 256), S((1, 7168), BF16))),
    "lm head": (lambda x, w: lm_head.lm_head_topk(x, w, 8), (S((1, 7168), BF16), S((16160, 7168), BF16))),
    "GEMV absorption per head fp8": (lambda x, w, s: gemv.heads_linear(x, w, s, layer=jnp.int32(1)),
                                     (S((2, 16, 512), BF16), S((3, 16, 128, 512), FP8), S((3, 16, 1, 4), F32))),
    "indexer, fp8 append": (lambda q, w, kn, kc, ks, pos: indexer.append_and_score(q, w, kn, kc, ks, pos,
                                                                                   layer=jnp.int32(1)),
                            (S((2, 64, 128), FP8), S((2, 64), F32), S((2, 128), F32), S((3, ROWS, 128), FP8),
                             S((3, ROWS), F32), S((2,), jnp.int32))),
    "sparse MLA, bf16 cache": (lambda ql, qp, kv, pe, idx: sparse_mla.sparse_mla_partials(
        ql, qp, kv, pe, idx, 0.1, layer=jnp.int32(1)),
        (S((2, 16, 512), BF16), S((2, 16, 64), BF16), S((3, ROWS, 512), BF16), S((3, ROWS, 64), BF16),
         S((2, 2048), jnp.int32))),
    "sparse MLA, fp8 cache": (lambda ql, qp, kv, idx: sparse_mla.sparse_mla_partials(
        ql, qp, kv, None, idx, 0.1, layer=jnp.int32(1)),
        (S((1, 16, 512), BF16), S((1, 16, 64), BF16), S((3, ROWS, reference.kv_fp8_words(512, 64)), jnp.uint32),
         S((1, 2048), jnp.int32))),
    "sparse MLA combine": (sparse_mla.combine_kernel,
                           (S((2, 1, 32, 16, 512), F32), S((2, 1, 32, 16), F32), S((2, 1, 32, 16), F32))),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_smem_count_is_mosaics(name, monkeypatch):
    f, specs = KERNELS[name]
    scope, mosaic = _lowered_smem(monkeypatch, f, *specs)
    assert hw.smem_bytes(scope) == mosaic
