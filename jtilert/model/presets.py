"""Named model configurations: the two families at full size, one GPU's share of each under 8-way
tensor parallelism (for benchmarks on one GPU), and the embedded tiny models. What each family is and
how its checkpoints are laid out: `models/<family>/README.md`."""

from __future__ import annotations

from jtilert.model.config import ModelConfig, RopeConfig

DEEPSEEK_V32 = ModelConfig(
    rope=RopeConfig(theta=10000.0, type="yarn", factor=40, original_max_position_embeddings=4096,
                    beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
    index_quant="fp8")

GLM_5 = ModelConfig(
    model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144, intermediate_size=12288,
    moe_intermediate_size=2048, num_hidden_layers=78, num_attention_heads=64, q_lora_rank=2048,
    kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, n_group=1, topk_group=1,
    rms_norm_eps=1e-5, index_n_heads=32, indexer_rope_interleaved=True, index_quant="fp8",
    rope=RopeConfig(theta=1e6), max_position_embeddings=202752)

# The embedded model (models/tiny): DeepSeek-V3.2 architecture at toy size. Heads, expert intermediate
# size and vocab divide by 8 so the same checkpoint runs at tp=8.
TINY = ModelConfig(
    vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=8, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16,
    v_head_dim=16, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
    first_k_dense_replace=1, index_n_heads=8, index_head_dim=32, index_topk=32,
    rope=RopeConfig(theta=10000.0), max_position_embeddings=4096, bos_token_id=None, eos_token_id=())

TINY_GLM5 = TINY.replace(model_type="glm_moe_dsa", n_group=1, topk_group=1, indexer_rope_interleaved=True,
                         indexer_types=("full", "shared", "full", "shared"), rms_norm_eps=1e-5,
                         rope=RopeConfig(theta=1e6))

# One GPU's share of DeepSeek-V3.2 under 8-way tensor parallelism (for benchmarks on one GPU).
DSV32_TP8_SHARD = DEEPSEEK_V32.replace(num_attention_heads=16, moe_intermediate_size=256,
                                       intermediate_size=2304, vocab_size=129280 // 8)

# The same for GLM-5 (64 heads, expert intermediate 2048, dense intermediate 12288, vocab 154880 / 8).
GLM5_TP8_SHARD = GLM_5.replace(num_attention_heads=8, moe_intermediate_size=256, intermediate_size=1536,
                               vocab_size=154880 // 8)

PRESETS: dict[str, ModelConfig] = {
    "tiny": TINY,
    "tiny-glm5": TINY_GLM5,
    "deepseek-v3.2": DEEPSEEK_V32,
    "glm-5": GLM_5,
    "dsv32-tp8-shard": DSV32_TP8_SHARD,
    "glm5-tp8-shard": GLM5_TP8_SHARD,
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named config; `num_hidden_layers=` etc. override fields."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
