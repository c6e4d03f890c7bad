"""index_prep's CTAs alone on their SMs (bench/experiments/index_prep_exclusive.patch): what they ask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from test_pallas_index_prep import _case   # tests/ is on sys.path

from jtilert.pallas import _hopper as hw
from jtilert.pallas import index_prep as ip
from jtilert.pallas import interpret as interp


def test_index_prep_takes_its_sms_whole(monkeypatch):
    """Each CTA asks for all but EXCLUSIVE_SLACK bytes of its block's shared memory, so no CTA of a
    kernel beside it shares its SM (two CTAs of 64-row tiles on the layer's chain), and the kernel
    still lowers for the GPU (Mosaic's own count of its shared memory fits)."""
    cfg, args, q_col, k_col = _case("dsv32-tp8-shard", 1, 3)
    asked = []
    real = ip.plgpu.kernel
    monkeypatch.setattr(ip.plgpu, "kernel", lambda body, **kw: asked.append(kw["scratch_types"]) or real(body, **kw))

    def f(q_x, k_x, nw, nb, cos, sin, w, layer):
        return ip.index_prep(cfg, q_x, q_col, k_x, k_col, nw, nb, 1e-6, cos, sin, w, layer=layer)

    with interp.compile_for_gpu():
        jax.jit(f).trace(*args, jnp.int32(2)).lower(lowering_platforms=("cuda",))
    need = hw.smem_bytes(hw.Scope(tuple(asked[0]), reduces=True))
    assert hw.SMEM_BYTES - ip.EXCLUSIVE_SLACK - hw.SMEM_ALIGN < need <= hw.SMEM_BYTES
