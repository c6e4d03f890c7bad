"""HF → jtilert conversion (jtilert.convert): the converted checkpoint loads to exactly what loading the HF
folder gives, at tp=1, 2 and 8; sharded loading and resharding; weight-format changes; layer subsets;
verify; the synthetic generator; full-size plans."""

import json
import shutil

import jax
import numpy as np
import pytest

import jtilert
from jtilert.store import checkpoint
from jtilert.store import converter
from jtilert.store import hf
from jtilert.ops.quant import dequantize, quantize_weight

IDS = np.random.RandomState(5).randint(0, 128, 14)

# DeepSeek-V3.2 architecture, small, with every tp-split dimension a multiple of 8·128 so fp8 block scales
# split on whole blocks at tp=8 (16 heads of 64+64 / 64, expert and dense width 1024).
ALIGNED = jtilert.preset("tiny").replace(
    hidden_size=256, intermediate_size=1024, moe_intermediate_size=1024, num_attention_heads=16, q_lora_rank=128,
    kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=8,
    num_experts_per_tok=2, n_group=4, topk_group=2, vocab_size=512, num_hidden_layers=2, first_k_dense_replace=1,
    index_n_heads=4, index_head_dim=64, index_topk=16)


def flat(model):
    return {k: np.asarray(v) for k, v in checkpoint.flat_params(model).items()}


def assert_same_params(a, b):
    pa, pb = checkpoint.flat_params(a), checkpoint.flat_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and pa[k].shape == pb[k].shape, k
        assert pa[k].sharding.is_equivalent_to(pb[k].sharding, pa[k].ndim), k
        assert np.array_equal(np.asarray(pa[k]), np.asarray(pb[k]), equal_nan=True), k


@pytest.fixture(scope="module")
def fp8_src(tmp_path_factory):
    """A synthetic fp8 HF folder (several files + index, MTP layer with its embed/head copies)."""
    return jtilert.random_checkpoint(ALIGNED, tmp_path_factory.mktemp("src") / "aligned", max_file_bytes=3 << 20)


@pytest.fixture(scope="module")
def converted(fp8_src, tmp_path_factory):
    root = tmp_path_factory.mktemp("dst")
    return {tp: jtilert.convert(fp8_src, root / f"tp{tp}", tp=tp) for tp in (1, 2, 8)}


def test_golden_fp32_convert_load_score_is_bit_exact(tmp_path):
    src = "tests/golden/dsv32"
    dst = jtilert.convert(src, tmp_path / "c", tp=2)
    mesh = jtilert.make_mesh(2)
    a, b = jtilert.load(dst, mesh=mesh), checkpoint.load_hf(src, mesh=mesh)
    assert_same_params(a, b)
    np.testing.assert_array_equal(jtilert.score(a, IDS, mesh=mesh), jtilert.score(b, IDS, mesh=mesh))
    meta = json.loads((dst / "jtilert.json").read_text())
    assert meta["tp"] == 2 and meta["layout_version"] == 2 and meta["weight_format"] == "fp32"
    assert set(meta["pack"].values()) == {"identity"}
    assert sorted(p.name for p in dst.iterdir()) == ["generation_config.json", "jtilert.json", "params"]
    assert sorted(p.name for p in (dst / "params").iterdir()) == ["replicated", "tp0", "tp1"]
    assert not list(tmp_path.glob(".c.*"))


@pytest.mark.parametrize("name", ["glm5", "glm52"])
def test_glm_folders_convert(tmp_path, name):
    src = f"tests/golden/{name}"
    dst = jtilert.convert(src, tmp_path / "g", tp=2)
    mesh = jtilert.make_mesh(2)
    m = jtilert.load(dst, mesh=mesh)
    assert_same_params(m, checkpoint.load_hf(src, mesh=mesh))
    assert m.cfg.model_type == "glm_moe_dsa"
    if name == "glm52":  # shared-indexer layers ship no indexer weights
        assert m.cfg.indexer_types[1] == "shared"
        assert "layers.1.self_attn.indexer.wq_b.weight" not in checkpoint.layer_params(m)
        assert m.indexers.wq_b.weight[...].shape[0] == m.cfg.indexer_types.count("full") + m.cfg.num_nextn_predict_layers


def test_pack_layout_is_recorded_and_checked(tmp_path, monkeypatch):
    """A registered packer (here: columns reversed, a stand-in for a kernel's swizzle) changes the stored
    bytes, is named in the metadata, and a checkpoint packed differently from this process is refused."""
    src = "tests/golden/dsv32"
    plain = jtilert.convert(src, tmp_path / "plain", tp=2)
    mesh = jtilert.make_mesh(2)
    reference = jtilert.load(plain, mesh=mesh)
    flip = converter.Packer("reverse-columns", lambda x: x[..., ::-1], lambda x: x[..., ::-1])
    monkeypatch.setitem(converter.PACKERS, "linear_weight", flip)
    packed = jtilert.convert(src, tmp_path / "packed", tp=2)
    meta = json.loads((packed / "jtilert.json").read_text())
    assert meta["pack"]["linear_weight"] == "reverse-columns" and meta["pack"]["expert_weight"] == "identity"
    f = "params/tp1/layers.0.self_attn.o_proj.weight.bin"
    assert (packed / f).read_bytes() != (plain / f).read_bytes()
    assert_same_params(jtilert.load(packed, mesh=mesh), reference)  # unpacked to the logical layout
    jtilert.verify(packed, against=src)
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"parameter \S+ is stored with layout 'reverse-columns', this jtilert packs "
                                         r"linear_weight parameters as 'identity'; convert the checkpoint again"):
        jtilert.load(packed, mesh=mesh)


def test_fp8_tp_layouts_load_exactly_and_agree(fp8_src, converted):
    scores = {}
    for tp, dst in converted.items():
        mesh = jtilert.make_mesh(tp) if tp > 1 else None
        m = jtilert.load(dst, mesh=mesh)
        assert_same_params(m, checkpoint.load_hf(fp8_src, mesh=mesh))
        w = m.moe.experts.down.weight[...]
        assert w.dtype == jax.numpy.float8_e4m3fn
        assert w.addressable_shards[0].data.shape[1:] == (8, 256, 1024 // tp)
        scores[tp] = jtilert.score(jtilert.load(dst, mesh=mesh, dtype="float32"), IDS, mesh=mesh, prefill=10)
    assert np.isfinite(scores[1]).all() and scores[1].std() > 0.1
    for tp in (2, 8):  # the same logits up to the order of the all-reduce sums
        np.testing.assert_allclose(scores[tp], scores[1], atol=2e-3, rtol=1e-3)
    files = sorted(p.relative_to(converted[8]).as_posix() for p in converted[8].rglob("*.bin"))
    assert "params/tp7/layers.1.mlp.experts.gate.weight.bin" in files
    assert "params/replicated/layers.1.self_attn.q_a_proj.weight.bin" in files
    assert "params/tp3/mtp.layer.self_attn.q_b_proj.scale.bin" in files


def test_mesh_size_must_match_unless_resharding(converted):
    with pytest.raises(ValueError, match=r"laid out for tp=8; loading it onto a mesh with tp=2 needs reshard=True"):
        jtilert.load(converted[8], mesh=jtilert.make_mesh(2))
    with pytest.raises(ValueError, match=r"laid out for tp=2; loading it without a mesh needs reshard=True"):
        jtilert.load(converted[2])
    mesh = jtilert.make_mesh(2)
    assert_same_params(jtilert.load(converted[8], mesh=mesh, reshard=True), jtilert.load(converted[2], mesh=mesh))
    assert_same_params(jtilert.load(converted[2], reshard=True), jtilert.load(converted[1]))
    mesh8 = jtilert.make_mesh(8)
    assert_same_params(jtilert.load(converted[1], mesh=mesh8, reshard=True), jtilert.load(converted[8], mesh=mesh8))


def test_reshard_checks_fp8_block_alignment(tmp_path):
    src = jtilert.random_checkpoint("tiny", tmp_path / "tiny")  # fp8, widths not multiples of 128
    dst = jtilert.convert(src, tmp_path / "t", tp=1)
    with pytest.raises(ValueError, match=r"parameter layers.0.self_attn.o_proj.weight of shape \(128, 128\): fp8 "
                                         r"block scales need each of the tp=2 slices"):
        jtilert.load(dst, mesh=jtilert.make_mesh(2), reshard=True)
    with pytest.raises(ValueError, match=r"parameter layers.0.self_attn.o_proj.weight of shape \(128, 128\): fp8 "
                                         r"block scales need each of the tp=2 slices of axis 1 \(128 / 2\)"):
        jtilert.convert(src, tmp_path / "t2", tp=2)
    assert not (tmp_path / "t2").exists() and not list(tmp_path.glob(".t2*"))


def test_stored_tensor_reads_any_slice(converted):
    meta = json.loads((converted[8] / "jtilert.json").read_text())
    name = "layers.1.mlp.experts.down.weight"
    t8 = checkpoint.StoredTensor(converted[8], name, meta)
    full = checkpoint.StoredTensor(converted[1], name, json.loads((converted[1] / "jtilert.json").read_text())).read()
    np.testing.assert_array_equal(t8.read(), full)
    np.testing.assert_array_equal(t8.read((3, slice(10, 20), slice(100, 700))), full[3, 10:20, 100:700])
    np.testing.assert_array_equal(t8.read((5, 7)), full[5, 7])


def test_dequantising_to_bf16_matches_dequantize(fp8_src, tmp_path):
    dst = jtilert.convert(fp8_src, tmp_path / "b", tp=2, dtype="bf16")
    m = jtilert.load(dst, mesh=jtilert.make_mesh(2))
    ref = checkpoint.load_hf(fp8_src)
    for layer in (m.layers.self_attn.q_b_proj, m.mtp.eh_proj):
        assert layer.scale is None and layer.weight[...].dtype == jax.numpy.bfloat16
    a, b = m.moe.experts.up, ref.moe.experts.up
    np.testing.assert_array_equal(np.asarray(a.weight[...]),
                                  np.asarray(dequantize(b.weight[...], b.scale[...], jax.numpy.bfloat16)))
    assert jtilert.verify(dst, against=fp8_src)["spot_checked"] > 0


def test_quantising_fp32_to_fp8_matches_quantize_weight(tmp_path):
    src = "tests/golden/dsv32"
    dst = jtilert.convert(src, tmp_path / "q", dtype="fp8")
    m, ref = jtilert.load(dst), checkpoint.load_hf(src)
    for got, want in ((m.layers.self_attn.kv_b_proj, ref.layers.self_attn.kv_b_proj),
                      (m.moe.experts.down, ref.moe.experts.down)):
        q, s = quantize_weight(want.weight[...])
        np.testing.assert_array_equal(np.asarray(got.scale[...]), np.asarray(s))
        np.testing.assert_array_equal(np.asarray(dequantize(got.weight[...], got.scale[...], np.float32)),
                                      np.asarray(dequantize(q, s, np.float32)))
    assert m.lm_head.scale is None and m.lm_head.weight[...].dtype == jax.numpy.bfloat16
    jtilert.verify(dst, against=src)


def test_layer_subset_and_no_mtp(fp8_src, tmp_path):
    src = "tests/golden/dsv32"  # layer 0 dense, 1-2 MoE
    dst = jtilert.convert(src, tmp_path / "s", layers="1:3")
    m, ref = jtilert.load(dst), checkpoint.load_hf(src)
    assert m.cfg.num_hidden_layers == 2 and m.cfg.first_k_dense_replace == 0
    a, b = checkpoint.layer_arrays(m), checkpoint.layer_arrays(ref)
    for k in a:
        parts = k.split(".")
        if parts[0] == "layers":
            parts[1] = str(int(parts[1]) + 1)
        np.testing.assert_array_equal(a[k], b[".".join(parts)], err_msg=k)
    dst = jtilert.convert(fp8_src, tmp_path / "n", mtp=False)
    assert jtilert.load(dst).mtp is None
    with pytest.raises(ValueError, match=r"layers 1:3: layer 1 reuses an earlier layer's indexer"):
        jtilert.convert("tests/golden/glm52", tmp_path / "x", layers="1:3")
    with pytest.raises(ValueError, match=r"layers 0:9: need 0 <= a < b <= 3"):
        jtilert.convert(src, tmp_path / "x", layers="0:9")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x*"))


def test_verify_finds_damage(fp8_src, converted, tmp_path):
    dst = tmp_path / "v"
    shutil.copytree(converted[2], dst)
    report = jtilert.verify(dst, against=fp8_src)
    assert report["tensors"] > 0 and report["spot_checked"] > 0 and report["tp"] == 2
    f = dst / "params/tp1/layers.1.mlp.experts.gate.weight.bin"
    data = bytearray(f.read_bytes())
    data[12345] ^= 0x01
    f.write_bytes(bytes(data))
    g = dst / "params/replicated/embed_tokens.bin"
    size = g.stat().st_size
    g.write_bytes(g.read_bytes()[:-2])
    (dst / "params/tp0/lm_head.weight.bin").unlink()
    with pytest.raises(ValueError, match="3 problem") as e:
        jtilert.verify(dst)
    msg = str(e.value)
    assert "tp1/layers.1.mlp.experts.gate.weight.bin: checksum mismatch" in msg
    assert f"embed_tokens.bin: {size - 2} bytes, parameter embed_tokens needs {size}" in msg
    assert "tp0/lm_head.weight.bin: missing" in msg


def test_verify_against_a_different_source_fails(fp8_src, converted, tmp_path):
    other = tmp_path / "other"
    jtilert.random_checkpoint(ALIGNED, other, seed=1)
    with pytest.raises(ValueError, match=r"row \d+ differs from model.layers.\d+"):
        jtilert.verify(converted[1], against=other)


def test_cli_convert_and_verify(fp8_src, tmp_path, capsys):
    from jtilert.cli import main
    dst = tmp_path / "cli"
    assert main(["convert", str(fp8_src), str(dst), "--tp", "2", "--quiet"]) == 0
    assert main(["verify", str(dst), "--against", str(fp8_src), "--quiet"]) == 0
    assert json.loads(capsys.readouterr().out)["tp"] == 2
    assert main(["convert", str(fp8_src), str(dst), "--quiet"]) == 2
    assert "exists (pass --overwrite" in capsys.readouterr().err
    assert main(["convert", str(fp8_src), str(dst), "--tp", "4", "--layers", "0:1", "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert "B/s" in err and "GB/s), tp=4" in err  # the progress bar and the summary
    assert checkpoint.info(dst)["tp"] == 4 and checkpoint.info(dst)["layers"] == 1


def test_random_checkpoint_layout(fp8_src):
    raw = json.loads((fp8_src / "config.json").read_text())
    assert jtilert.ModelConfig.from_hf(raw, num_nextn_predict_layers=1) == ALIGNED
    index = json.loads((fp8_src / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    tensors = hf.open_folder(fp8_src)
    assert tensors.keys() == index.keys()
    key = "model.layers.1.mlp.experts.7.down_proj"
    assert tensors[key + ".weight"].meta(key + ".weight") == ((256, 1024), np.dtype("float8_e4m3fn"))
    assert tensors[key + ".weight_scale_inv"].meta(key + ".weight_scale_inv") == ((2, 8), np.dtype(np.float32))
    s = tensors[key + ".weight_scale_inv"].get(key + ".weight_scale_inv")
    assert np.all(np.log2(s) == np.round(np.log2(s)))  # ue8m0: powers of two
    assert "model.layers.2.embed_tokens.weight" in tensors and "model.layers.2.shared_head.head.weight" in tensors
    assert tensors["model.norm.weight"].meta("model.norm.weight")[1] == np.dtype("bfloat16")
    b = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert b.meta("model.layers.1.mlp.gate.e_score_correction_bias")[1] == np.float32


def test_source_name_inverts_target_name():
    cfg = jtilert.preset("glm-5").replace(num_hidden_layers=4)
    for name in checkpoint.layer_params(checkpoint.abstract_model(cfg, "fp8")):
        key = hf.source_name(name, 4).format(e=5)
        assert hf.target_name(key, 4)[0] == name, (name, key)


def test_full_size_deepseek_plan_at_tp8(tmp_path):
    """The real DeepSeek-V3.2 shapes (61 layers + MTP, 686 GB of fp8) plan cleanly at tp=8 and 16, and a
    tp that splits fp8 blocks is refused by name (the data is sparse: headers only)."""
    src = jtilert.random_checkpoint("deepseek-v3.2", tmp_path / "dsv32", sparse=True)
    p = converter.plan(src, tp=8)
    assert len(p.files) == 161 and 680e9 < p.nbytes < 690e9
    experts = next(i for i in p.items if i.name == "layers.60.mlp.experts.gate.weight")
    assert experts.local_shape == (256, 256, 7168) and len(experts.mats) == 256
    assert next(i for i in p.items if i.name == "mtp.layer.self_attn.o_proj.weight").local_shape == (7168, 2048)
    with pytest.raises(ValueError, match=r"parameter layers.0.mlp.down_proj.weight of shape \(7168, 18432\): fp8 "
                                         r"block scales need each of the tp=32 slices of axis 1 \(18432 / 32\)"):
        converter.plan(src, tp=32)
