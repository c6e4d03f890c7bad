"""One model config for DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`), read from an HF config.json."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# Fields an HF config.json must give: they set the parameters' shapes (or which layers are dense, or
# how many experts a token uses), and a default from another model would only fail later on a shape.
# `n_routed_experts` may be given as `num_experts`.
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
            "index_n_heads", "index_head_dim", "index_topk")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str = "deepseek_v32"
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-6
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    # Per layer: "full" runs the indexer, "shared" reuses the previous full layer's top-k (GLM-5.2).
    indexer_types: tuple[str, ...] = ()
    # DeepSeek-V3.2's indexer uses half-split RoPE, GLM-5's interleaved; MLA itself is always interleaved.
    indexer_rope_interleaved: bool = False
    # "fp8": the official kernel's Hadamard + fp8 block-quantised scoring; "none": scores in fp32.
    index_quant: str = "none"
    # MLA latent cache: "none" keeps latent + rope rows in the activation dtype; "fp8" is FlashMLA's
    # layout (656 bytes per position at L=512: e4m3 latent, one fp32 scale per 128, bf16 rope).
    kv_cache_quant: str = "none"
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 163840
    num_nextn_predict_layers: int = 1
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)

    def __post_init__(self):
        if not self.indexer_types:
            object.__setattr__(self, "indexer_types", ("full",) * self.num_hidden_layers)
        else:
            object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.validate()

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.type == "yarn" and r.mscale_all_dim and r.factor > 1:
            m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
            scale *= m * m
        return scale

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def replace(self, **changes) -> "ModelConfig":
        if "num_hidden_layers" in changes and "indexer_types" not in changes:
            n = changes["num_hidden_layers"]
            types = self.indexer_types
            changes["indexer_types"] = tuple(types[i] if i < len(types) else types[-1] for i in range(n))
        return dataclasses.replace(self, **changes)

    # ---- validation ------------------------------------------------------------------------
    def validate(self) -> None:
        def bad(field, why):
            raise ValueError(f"config field {field!r}: {why} (got {getattr(self, field)!r})")

        if self.model_type not in MODEL_TYPES:
            bad("model_type", f"unsupported; expected one of {MODEL_TYPES}")
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                  "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                  "index_head_dim", "index_topk", "max_position_embeddings"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                bad(f, "must be a positive integer")
        if self.qk_rope_head_dim % 2:
            bad("qk_rope_head_dim", "must be even")
        if self.index_head_dim < self.qk_rope_head_dim:
            bad("index_head_dim", f"must be >= qk_rope_head_dim={self.qk_rope_head_dim}")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            bad("first_k_dense_replace", f"must be in [0, num_hidden_layers={self.num_hidden_layers}]")
        if self.first_k_dense_replace < self.num_hidden_layers:
            if self.n_routed_experts <= 0 or self.moe_intermediate_size <= 0:
                bad("n_routed_experts", "MoE layers need experts and moe_intermediate_size > 0")
            if self.n_group <= 0 or self.n_routed_experts % self.n_group:
                bad("n_group", f"must divide n_routed_experts={self.n_routed_experts}")
            if not 0 < self.topk_group <= self.n_group:
                bad("topk_group", f"must be in [1, n_group={self.n_group}]")
            per_group = self.n_routed_experts // self.n_group
            if not 0 < self.num_experts_per_tok <= self.topk_group * per_group:
                bad("num_experts_per_tok", f"must be in [1, topk_group*experts_per_group={self.topk_group * per_group}]")
            if self.n_group > 1 and per_group < 2:
                bad("n_group", "group scores use the top-2 experts of a group: need >= 2 experts per group")
        if self.first_k_dense_replace > 0 and self.intermediate_size <= 0:
            bad("intermediate_size", "dense layers need intermediate_size > 0")
        if len(self.indexer_types) != self.num_hidden_layers:
            bad("indexer_types", f"needs one entry per layer ({self.num_hidden_layers})")
        if any(t not in ("full", "shared") for t in self.indexer_types):
            bad("indexer_types", "entries must be 'full' or 'shared'")
        if self.indexer_types and self.indexer_types[0] != "full":
            bad("indexer_types", "the first layer must run its own indexer ('full')")
        if self.index_quant not in ("fp8", "none"):
            bad("index_quant", "must be 'fp8' or 'none'")
        if self.index_quant == "fp8" and self.index_head_dim % 128:
            bad("index_quant", f"fp8 scoring quantises 128-wide blocks: index_head_dim={self.index_head_dim}")
        if self.kv_cache_quant not in ("fp8", "none"):
            bad("kv_cache_quant", "must be 'fp8' or 'none'")
        if self.kv_cache_quant == "fp8" and self.kv_lora_rank % 128:
            bad("kv_cache_quant", f"the fp8 cache scales 128-wide groups: kv_lora_rank={self.kv_lora_rank}")
        if self.rope.type not in ("default", "yarn"):
            raise ValueError(f"config field 'rope_parameters.rope_type': unsupported {self.rope.type!r}")
        if self.num_nextn_predict_layers not in (0, 1):
            bad("num_nextn_predict_layers", "must be 0 or 1")

    # ---- HF config.json ---------------------------------------------------------------------
    @classmethod
    def from_hf(cls, source: str | Path | dict, **overrides) -> "ModelConfig":
        """Read an HF config.json (path to the file or its folder, or the parsed dict)."""
        where = "config"
        if not isinstance(source, dict):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            where = str(path)
            if not path.exists():
                raise FileNotFoundError(f"no config.json at {path}")
            try:
                source = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        d = dict(source)
        mt = d.get("model_type")
        if mt not in MODEL_TYPES:
            raise ValueError(f"{where}: unknown model_type {mt!r}; expected one of {MODEL_TYPES}")
        given = set(d) | set(overrides) | ({"n_routed_experts"} if "num_experts" in d else set())
        missing = [f for f in REQUIRED if f not in given]
        if missing:
            raise ValueError(f"{where}: missing required field{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(missing)}")
        rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
        theta = rp.get("rope_theta", d.get("rope_theta", 10000.0 if mt == "deepseek_v32" else 1e6))
        rtype = rp.get("rope_type", rp.get("type", "default"))
        rope = RopeConfig(
            theta=float(theta), type=rtype, factor=float(rp.get("factor") or 1.0),
            original_max_position_embeddings=int(rp.get("original_max_position_embeddings") or 4096),
            beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
            mscale=float(rp.get("mscale") or 1.0), mscale_all_dim=float(rp.get("mscale_all_dim") or 0.0))
        n_layers = overrides["num_hidden_layers"] if "num_hidden_layers" in overrides else d["num_hidden_layers"]
        indexer_types = d.get("indexer_types") or _indexer_pattern(d, n_layers)
        eos = d.get("eos_token_id", 1)
        quant = d.get("quantization_config") or {}
        kw: dict[str, Any] = {f.name: d[f.name] for f in dataclasses.fields(cls)
                              if f.name in d and f.name not in ("rope", "indexer_types", "eos_token_id")}
        kw.update(model_type=mt, rope=rope, indexer_types=tuple(indexer_types),
                  eos_token_id=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
                  indexer_rope_interleaved=(mt == "glm_moe_dsa"),
                  index_quant="fp8" if quant.get("quant_method") == "fp8" else "none",
                  # transformers' configs omit it (and its files hold no MTP layer); the released ones say 1
                  num_nextn_predict_layers=d.get("num_nextn_predict_layers", 0))
        if "n_routed_experts" not in d and "num_experts" in d:
            kw["n_routed_experts"] = d["num_experts"]
        kw.update(overrides)
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from None

    def to_hf(self) -> dict:
        """The HF config.json dict (what `from_hf` reads back)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("rope", "indexer_rope_interleaved", "index_quant", "kv_cache_quant", "indexer_types",
                               "eos_token_id")}
        r = self.rope
        rp = {"rope_type": r.type, "rope_theta": r.theta}
        if r.type == "yarn":
            rp.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                      beta_fast=r.beta_fast, beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim)
        d.update(rope_parameters=rp, indexer_types=list(self.indexer_types), eos_token_id=list(self.eos_token_id),
                 architectures=["DeepseekV32ForCausalLM" if self.model_type == "deepseek_v32" else "GlmMoeDsaForCausalLM"],
                 jtilert={"index_quant": self.index_quant, "indexer_rope_interleaved": self.indexer_rope_interleaved,
                          "kv_cache_quant": self.kv_cache_quant})
        return d

    @classmethod
    def from_json_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of `to_hf`, keeping jtilert's own fields."""
        extra = d.get("jtilert", {})
        return cls.from_hf(d, **extra)


def _indexer_pattern(d: dict, n_layers: int) -> list[str]:
    """GLM-5.2: `index_topk_pattern` ("FSS...") or the freq/offset schedule, as transformers derives it."""
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(d.get("index_topk_freq", 1), 1)
    offset = d.get("index_skip_topk_offset", 2)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(n_layers)]
