import json

import pytest

from jtilert import ModelConfig, preset
from jtilert.model.presets import PRESETS


def test_presets_have_documented_shapes():
    ds = preset("deepseek-v3.2")
    assert (ds.hidden_size, ds.num_hidden_layers, ds.num_attention_heads, ds.index_topk) == (7168, 61, 128, 2048)
    assert ds.rope.type == "yarn" and ds.index_quant == "fp8" and not ds.indexer_rope_interleaved
    glm = preset("glm-5")
    assert (glm.hidden_size, glm.num_hidden_layers, glm.v_head_dim, glm.n_group) == (6144, 78, 256, 1)
    assert glm.indexer_rope_interleaved
    shard = preset("dsv32-tp8-shard", num_hidden_layers=4)
    assert (shard.num_attention_heads, shard.moe_intermediate_size, shard.intermediate_size, shard.vocab_size) == (
        16, 256, 2304, 129280 // 8)
    assert shard.num_hidden_layers == 4 and len(shard.indexer_types) == 4
    tiny = preset("tiny")
    for n in (tiny.num_attention_heads, tiny.moe_intermediate_size, tiny.vocab_size):
        assert n % 8 == 0
    assert set(PRESETS) >= {"tiny", "tiny-glm5", "deepseek-v3.2", "glm-5", "dsv32-tp8-shard", "glm5-tp8-shard"}
    for full, part in (("deepseek-v3.2", "dsv32-tp8-shard"), ("glm-5", "glm5-tp8-shard")):
        f, p = preset(full), preset(part)   # one rank's share: every tp-split width over 8, the rest equal
        split = ("num_attention_heads", "moe_intermediate_size", "intermediate_size", "vocab_size")
        assert all(getattr(p, n) * 8 == getattr(f, n) for n in split)
        assert p.replace(**{n: getattr(f, n) for n in split}) == f


def test_softmax_scale_has_yarn_mscale():
    ds = preset("deepseek-v3.2")
    assert ds.softmax_scale == pytest.approx(192**-0.5 * (0.1 * __import__("math").log(40) + 1) ** 2)
    assert preset("glm-5").softmax_scale == pytest.approx(256**-0.5)


@pytest.mark.parametrize("name", ["dsv32", "glm5", "glm52"])
def test_reads_transformers_config(name):
    cfg = ModelConfig.from_hf(f"tests/golden/{name}")
    raw = json.load(open(f"tests/golden/{name}/config.json"))
    assert cfg.hidden_size == raw["hidden_size"] and cfg.index_topk == raw["index_topk"]
    assert cfg.indexer_rope_interleaved == (name != "dsv32")
    if name == "glm52":
        assert cfg.indexer_types == tuple(raw["indexer_types"]) and "shared" in cfg.indexer_types
    # to_hf / from_json_dict round trip keeps every field
    assert ModelConfig.from_json_dict(cfg.to_hf()) == cfg


def test_glm52_indexer_pattern_from_freq_and_offset():
    raw = json.load(open("tests/golden/glm52/config.json"))
    raw.pop("indexer_types")
    raw.update(index_topk_freq=2, index_skip_topk_offset=1, num_hidden_layers=4)
    assert ModelConfig.from_hf(raw).indexer_types == ("full", "shared", "full", "shared")


@pytest.mark.parametrize("change, field", [
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 9}, "topk_group"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"index_head_dim": 8}, "index_head_dim"),
    ({"indexer_types": ("shared",) * 61}, "indexer_types"),
    ({"index_quant": "int4"}, "index_quant"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_inconsistent_fields_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        preset("deepseek-v3.2").replace(**change)


def test_bad_config_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="llama"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        preset("nope")


@pytest.mark.parametrize("field", ["hidden_size", "num_hidden_layers", "n_routed_experts"])
def test_missing_required_field_is_named(tmp_path, field):
    """A config.json without a shape field is an error naming it (it used to fall back to DeepSeek-V3.2's
    value and fail later on a shape); n_routed_experts may come as num_experts."""
    raw = json.load(open("tests/golden/dsv32/config.json"))
    del raw[field]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"config.json: missing required field {field}$"):
        ModelConfig.from_hf(tmp_path)
    raw["num_experts"] = 16
    if field == "n_routed_experts":
        assert ModelConfig.from_hf(raw).n_routed_experts == 16
