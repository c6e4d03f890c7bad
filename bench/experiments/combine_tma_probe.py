"""What folding sparse MLA's combine into W_uv's heads GEMV needs from Mosaic GPU (RESULTS session 27,
Next 2), checked without a GPU: one CTA per head h (traced, from the grid index) copies its partials
o[t, g, :, h, :] ([splits, L] fp32: a squeezed middle dimension in the TMA box) and the m block [splits,
Hc] of its group, then weighs each split by a scalar read m[s, h] from shared memory. TMA boxes take at
most 256 elements a dimension and a contiguous shared-memory destination, so L = 512 goes in chunks
[L / 256, splits, 256].

    python -m bench.experiments.combine_tma_probe      (CPU: interpret mode, then lowered for CUDA)
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np
from jax import lax

import jtilert.pallas.interpret as _interp

F32 = jnp.float32
CHUNK = 256   # TMA's widest box dimension


def weighted_splits(o, m):
    """out[h] = Σ_s m[0, 0, s, h] · o[0, 0, s, h, :] for o [1, 1, S, Hc, L], m [1, 1, S, Hc]: one CTA a head."""
    _, _, n, hc, L = o.shape

    def body(o_ref, m_ref, out_ref, o_s, m_s, obar, mbar):
        h = lax.axis_index("h")
        for c in range(L // CHUNK):
            plgpu.copy_gmem_to_smem(o_ref.at[0, 0, :, h, pl.ds(c * CHUNK, CHUNK)], o_s.at[c], obar)
        plgpu.copy_gmem_to_smem(m_ref.at[0, 0], m_s, mbar)
        plgpu.barrier_wait(obar)
        plgpu.barrier_wait(mbar)
        for c in range(L // CHUNK):
            acc = None
            for s in range(n):
                v = o_s[c, s] * m_s[s, h]
                acc = v if acc is None else acc + v
            out_ref.at[h, pl.ds(c * CHUNK, CHUNK)][...] = acc

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((hc, L), F32), grid=(hc,), grid_names=("h",),
                          scratch_types=[plgpu.SMEM((L // CHUNK, n, CHUNK), F32), plgpu.SMEM((n, hc), F32),
                                         plgpu.Barrier(num_arrivals=L // CHUNK), plgpu.Barrier(num_arrivals=1)],
                          interpret=_interp.params(), kernel_name="jtilert_combine_tma_probe")
    return kernel(o, m)


def check() -> tuple[float, str]:
    """The probe at DeepSeek-V3.2's shapes (32 splits, 16 heads, L = 512) in interpret mode against
    NumPy, then lowered for CUDA (which raises where Mosaic cannot build it): (the max |error|, the
    lowered program's text)."""
    o = jax.random.normal(jax.random.key(0), (1, 1, 32, 16, 512), F32)
    m = jax.random.normal(jax.random.key(1), (1, 1, 32, 16), F32)
    with _interp.interpret():
        got = np.asarray(jax.jit(weighted_splits)(o, m))
    want = np.einsum("sh,shl->hl", np.asarray(m[0, 0]), np.asarray(o[0, 0]))
    with _interp.compile_for_gpu():
        text = jax.jit(weighted_splits).trace(*(jax.ShapeDtypeStruct(a.shape, F32) for a in (o, m))).lower(
            lowering_platforms=("cuda",)).as_text()
    return float(np.abs(got - want).max()), text


def main() -> int:
    err, _ = check()
    print(f"interpret: max |error| {err:.3g}; lowered for CUDA")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
