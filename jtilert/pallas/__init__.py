"""Pallas Mosaic-GPU kernels (Hopper) for batch-1 decode.

Projection / MoE / lm-head kernels (issue 4):

* `gemv`: block-scaled GEMV (bf16 or fp8 e4m3 + 128×128 scales), fused RMSNorm prologue, residual
  epilogue, SwiGLU pair;
* `moe`: router, selected experts' gate/up/SiLU reading only the chosen experts, down projection
  with the routing-weighted sum (and the shared expert);
* `lm_head`: vocab-sharded GEMV with top-k candidates in the epilogue.

Attention kernels: `indexer` (key append + lightning-indexer scores), `sparse_mla` (absorbed
attention over the selected latent rows), `mla_prep` (the rope, the latent's norm and the cache
writes between the projections and attention) and `index_prep` (the indexer's key norm, rope, query
and key rotation and the queries' fp8 quantisation between the projections and the indexer). Every
kernel takes the model's stacked [L, ...] weights or caches with a traced `layer=` index. Which op runs
which kernel: `jtilert.ops.table.OPS`. Without a GPU every kernel runs in GPU interpret mode (see `interpret`).
"""

from __future__ import annotations

from jtilert.pallas.interpret import interpret as interpret_mode  # noqa: F401
from jtilert.pallas.gemv import (GemvConfig, linear, linear_residual, rmsnorm_linear,  # noqa: F401
                                 swiglu, swiglu_pair)
from jtilert.pallas.moe import (expert_down, expert_gate_up, moe_experts, moe_with_shared,  # noqa: F401
                                norm_route, norm_router_partials, pack_shared_expert, route, router_partials)
from jtilert.pallas.lm_head import lm_head_argmax, lm_head_candidates, lm_head_topk  # noqa: F401


def available() -> bool:
    """Whether the kernels can run here: on a Hopper GPU, or in GPU interpret mode on the CPU."""
    try:
        import jax.experimental.pallas.mosaic_gpu  # noqa: F401
    except ImportError:
        return False
    return True

