"""Kernel-sized tiny DSA models, generated from a seed with NumPy alone.

The models of make_golden.py (hidden 64, kv_lora 32, expert width 16, fp32 weights) are too small
for the Pallas decode kernels, which need bf16 (or fp8) weights, every GEMV K a multiple of 64,
kv_lora a multiple of 64 and an expert width that is a multiple of 128. The models here are the
smallest that every decode kernel accepts. Their weights are not committed: this module writes
the Hugging Face folder (config.json + a bf16 model.safetensors) from the seed, and is imported
both by make_golden.py (Python 3.11 with torch/transformers, which makes golden.npz) and by the
tests (Python 3.12 with jtilert, which regenerates the folder into a temporary directory).
It needs only numpy and safetensors.

Every weight is exactly representable in bfloat16 (rounded before saving), so transformers, which
loads the folder as float32, and jtilert, which runs it in bf16, use identical values; the only
difference left is jtilert's bf16 activations.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
from safetensors import TensorSpec, serialize_file

# Kernel constraints (jtilert/ops/table.py, jtilert/pallas/*.py) each shape meets:
#   GEMV / swiglu / router / lm head: K = hidden, q_lora, heads·v_head, intermediate multiples of 64
#   MoE experts: expert width (moe_intermediate) a multiple of 128
#   sparse MLA: kv_lora a multiple of 64, rope dim a multiple of 8 (heads padded to 8 by the wrapper)
#   kv_b per head (heads_linear): K = kv_lora, and qk_nope_head_dim — 16 here: that absorption runs the
#            reference (test_golden_kernels lets its warning pass)
#   indexer: index key rows of 128 bytes (64 bf16) so the kernel appends the key itself; the heads
#            are padded to 32 by the kernel; cache rows a multiple of 8 (the caller's cache length)
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    first_k_dense_replace=1,
    num_hidden_layers=2,  # one dense layer, one MoE layer: each layer-loop body once
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,  # o_proj K = 4 · 16 = 64
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    intermediate_size=64,
    n_shared_experts=1,
    index_n_heads=8,  # more heads than make_golden's 4: fewer keys whose ReLU'd score is exactly 0
    index_head_dim=64,  # rope slice 16 + pass 48
    index_topk=16,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    hidden_act="silu",
    attention_bias=False,
)

CONFIGS = {
    "dsv32_kernel": dict(
        COMMON,
        architectures=["DeepseekV32ForCausalLM"],
        model_type="deepseek_v32",
        n_group=4,
        topk_group=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=128,  # = factor · original_max_position_embeddings
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
    ),
    "glm5_kernel": dict(
        COMMON,
        architectures=["GlmMoeDsaForCausalLM"],
        model_type="glm_moe_dsa",
        n_group=1,
        topk_group=1,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        indexer_types=["full", "full"],
    ),
}

T_PROMPT = 17  # index_topk + 1: sparse selection really runs (one key dropped), few decisions to flip
N_GREEDY = 3


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """HF key -> shape of every tensor of the checkpoint (per-expert layout, [out, in] weights)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    heads, ql, kvl = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, vh = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    e, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        layer = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_a_proj.weight": (ql, h),
            "self_attn.q_a_layernorm.weight": (ql,),
            "self_attn.q_b_proj.weight": (heads * (nope + rope), ql),
            "self_attn.kv_a_proj_with_mqa.weight": (kvl + rope, h),
            "self_attn.kv_a_layernorm.weight": (kvl,),
            "self_attn.kv_b_proj.weight": (heads * (nope + vh), kvl),
            "self_attn.o_proj.weight": (h, heads * vh),
            "self_attn.indexer.wq_b.weight": (ih * idim, ql),
            "self_attn.indexer.wk.weight": (idim, h),
            "self_attn.indexer.k_norm.weight": (idim,),
            "self_attn.indexer.k_norm.bias": (idim,),
            "self_attn.indexer.weights_proj.weight": (ih, h),
        }
        if n < cfg["first_k_dense_replace"]:
            i = cfg["intermediate_size"]
            layer.update({"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)})
        else:
            si = mi * cfg["n_shared_experts"]
            layer.update({"mlp.gate.weight": (e, h), "mlp.gate.e_score_correction_bias": (e,),
                          "mlp.shared_experts.gate_proj.weight": (si, h), "mlp.shared_experts.up_proj.weight": (si, h),
                          "mlp.shared_experts.down_proj.weight": (h, si)})
            for x in range(e):
                layer.update({f"mlp.experts.{x}.gate_proj.weight": (mi, h), f"mlp.experts.{x}.up_proj.weight": (mi, h),
                              f"mlp.experts.{x}.down_proj.weight": (h, mi)})
        out.update({p + k: s for k, s in layer.items()})
    return out


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), kept as float32."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def weights(name: str, seed: int) -> dict[str, np.ndarray]:
    """The model's tensors (float32, bf16-exact), drawn in sorted key order from one generator.
    Same distributions as make_golden.randomize_: linear weights N(0, 1/fan_in), lm_head
    N(0, 2.5²/H), embeddings N(0, 1), norm weights 1 + 0.2·N(0, 1), indexer k_norm.bias 0.2·N(0, 1),
    router e_score_correction_bias 0.1·N(0, 1)."""
    cfg = CONFIGS[name]
    rng = np.random.default_rng(seed)
    out = {}
    for key, shape in sorted(shapes(cfg).items()):
        z = rng.standard_normal(shape)
        leaf = key.split(".")
        if key.endswith("e_score_correction_bias"):
            v = 0.1 * z
        elif key.endswith("k_norm.bias"):
            v = 0.2 * z
        elif "norm" in leaf[-2] and leaf[-1] == "weight":
            v = 1.0 + 0.2 * z
        elif key == "model.embed_tokens.weight":
            v = z
        elif key == "lm_head.weight":
            v = z * (2.5 / np.sqrt(shape[-1]))
        else:
            v = z / np.sqrt(shape[-1])
        out[key] = to_bf16(v)
    return out


def prompt(name: str, seed: int) -> np.ndarray:
    """The prompt's token ids [T_PROMPT] int32 (its own generator: independent of the weights)."""
    rng = np.random.default_rng([seed, 1])
    return rng.integers(2, CONFIGS[name]["vocab_size"], T_PROMPT).astype(np.int32)  # no bos / eos


def scored(golden: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, transformers' logits at each of them) from a golden.npz: the prompt and the greedy
    tokens but the last; the prompt's logits, then the greedy rows (greedy_logits[0] is the prompt's
    last row)."""
    ids = np.concatenate([golden["input_ids"], golden["greedy"][:-1]])
    return ids, np.concatenate([golden["logits"], golden["greedy_logits"][1:]])


def checksum(tensors: dict[str, np.ndarray]) -> int:
    """CRC-32 of every tensor's name and float32 bytes in key order (golden.npz records it, so a NumPy
    whose generator draws different numbers fails loudly instead of comparing another model)."""
    crc = 0
    for key in sorted(tensors):
        crc = zlib.crc32(key.encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(tensors[key], np.float32).tobytes(), crc)
    return crc


def write_folder(name: str, seed: int, folder: str | Path) -> dict[str, np.ndarray]:
    """Write the HF folder (config.json, model.safetensors with every tensor BF16) and return the
    tensors (float32)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(CONFIGS[name], dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tensors = weights(name, seed)
    # bf16 bits = the high half of the (bf16-exact) float32 bits; numpy has no bfloat16 dtype
    bits = {k: np.ascontiguousarray(v.view(np.uint32) >> 16).astype(np.uint16) for k, v in tensors.items()}
    specs = {k: TensorSpec(dtype="bfloat16", shape=b.shape, data_ptr=b.ctypes.data, data_len=b.nbytes)
             for k, b in bits.items()}
    serialize_file(specs, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return tensors
