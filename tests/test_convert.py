"""HF → jtilert conversion (jtilert.convert): the converted checkpoint loads to exactly what loading the HF
folder gives, at tp=1, 2 and 8; plain orbax restores it; chunks within one device's shard, with TensorStore's
encoding and a checked CRC-32C; loading onto another tp; weight-format changes; layer subsets; verify; the
synthetic generator; full-size plans."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

import jtilert
from jtilert.store import arrays, checkpoint, hf
from jtilert.store.convert.plan import plan
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
    assert meta["tp"] == 2 and meta["layout_version"] == 4 and meta["weight_format"] == "fp32"
    assert sorted(p.name for p in dst.iterdir()) == ["generation_config.json", "jtilert.json", "params"]
    assert sorted(p.name for p in (dst / "params").iterdir()) == sorted(["_METADATA", *meta["params"]])
    assert meta["params"]["layers.self_attn.q_b_proj.weight"][0][0] == 3  # the 3 layers, stacked
    assert not list(tmp_path.glob(".c.*")) and not list(dst.rglob("*.__lock"))


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


def test_fp8_tp_layouts_load_exactly_and_agree(fp8_src, converted):
    scores = {}
    for tp, dst in converted.items():
        mesh = jtilert.make_mesh(tp) if tp > 1 else None
        m = jtilert.load(dst, mesh=mesh)
        assert_same_params(m, checkpoint.load_hf(fp8_src, mesh=mesh))
        w = m.moe.experts.down.weight[...]
        assert w.dtype == jax.numpy.float8_e4m3fn
        assert w.addressable_shards[0].data.shape[1:] == (8, 256, 1024 // tp)
        if tp != 2:   # tp=2 splits the fp8 blocks as tp=8 does (whole blocks per rank): the same code
            scores[tp] = jtilert.score(jtilert.load(dst, mesh=mesh, dtype="float32"), IDS, mesh=mesh, prefill=10)
    assert np.isfinite(scores[1]).all() and scores[1].std() > 0.1
    # the same logits up to the order of the all-reduce sums
    np.testing.assert_allclose(scores[8], scores[1], atol=2e-3, rtol=1e-3)


def test_chunks_lie_within_one_shard(converted):
    """Every chunk of a converted checkpoint is one layer of a stack and lies within one device's shard."""
    meta = json.loads((converted[8] / "jtilert.json").read_text())
    cfg = jtilert.ModelConfig.from_json_dict(meta["config"])
    for name, (shape, _) in meta["params"].items():
        arr = arrays.open_array(converted[8] / "params", name)
        chunk = tuple(arr.chunk_layout.read_chunk.shape)
        assert tuple(arr.shape) == tuple(shape), name
        if checkpoint.layer_names(cfg, name):
            assert chunk[0] == 1, name
        split = checkpoint.sharding.split_axis(tuple(name.split(".")))
        if split is not None:
            assert (shape[split] // 8) % chunk[split] == 0, (name, chunk)
    gate = arrays.open_array(converted[8] / "params", "moe.experts.gate.weight")
    assert tuple(gate.chunk_layout.read_chunk.shape) == (1, 8, 128, 256)  # [layer, experts, a shard's rows, in]


def test_a_shard_reads_only_its_chunks(converted, tmp_path):
    """With the chunk files of shards 1-7 of a split stack deleted, shard 0 still reads: its box touches its
    own chunks only."""
    dst = tmp_path / "c"
    shutil.copytree(converted[8], dst)
    name = "moe.experts.down.weight"  # [layer, expert, hidden, width], the width split
    full = arrays.open_array(converted[8] / "params", name)
    split, local = 3, full.shape[3] // 8
    for f in (dst / "params" / name / "c").rglob("*"):
        if f.is_file() and int(f.name) * full.chunk_layout.read_chunk.shape[split] >= local:
            f.unlink()
    arr = arrays.open_array(dst / "params", name)
    np.testing.assert_array_equal(np.asarray(arr[..., :local].read().result()).view(np.uint8),
                                  np.asarray(full[..., :local].read().result()).view(np.uint8))
    with pytest.raises(ValueError, match="is missing"):
        arr[..., local:2 * local].read().result()


def test_any_mesh_loads_any_conversion(converted):
    """A checkpoint converted for one tp degree loads onto a mesh of another (or none)."""
    mesh = jtilert.make_mesh(2)
    assert_same_params(jtilert.load(converted[8], mesh=mesh), jtilert.load(converted[2], mesh=mesh))
    assert_same_params(jtilert.load(converted[2]), jtilert.load(converted[1]))
    mesh8 = jtilert.make_mesh(8)
    assert_same_params(jtilert.load(converted[1], mesh=mesh8), jtilert.load(converted[8], mesh=mesh8))


def test_loading_checks_fp8_block_alignment(tmp_path):
    src = jtilert.random_checkpoint("tiny", tmp_path / "tiny")  # fp8, widths not multiples of 128
    dst = jtilert.convert(src, tmp_path / "t", tp=1)
    with pytest.raises(ValueError, match=r"parameter layers.self_attn.o_proj.weight of shape \(5, 128, 128\): fp8 "
                                         r"block scales need each of the tp=2 slices"):
        jtilert.load(dst, mesh=jtilert.make_mesh(2))
    with pytest.raises(ValueError, match=r"parameter layers.0.self_attn.o_proj.weight of shape \(128, 128\): fp8 "
                                         r"block scales need each of the tp=2 slices of axis 1 \(128 / 2\)"):
        jtilert.convert(src, tmp_path / "t2", tp=2)
    assert not (tmp_path / "t2").exists() and not list(tmp_path.glob(".t2*"))


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


def test_quantising_chunked_for_tp8_matches_tp1(tmp_path):
    """bf16 → fp8 with the rows of each shard read in turn (expert by expert) and the width-split scales
    filled together: the same arrays as one shard."""
    src = jtilert.random_checkpoint(ALIGNED, tmp_path / "bf16", fmt="bf16")
    a, b = (checkpoint.flat_params(jtilert.load(jtilert.convert(src, tmp_path / f"q{tp}", tp=tp, dtype="fp8")))
            for tp in (8, 1))
    for k in a:
        assert np.array_equal(np.asarray(a[k]).view(np.uint8), np.asarray(b[k]).view(np.uint8)), k
    q, s = quantize_weight(checkpoint.load_hf(src).moe.experts.down.weight[...])
    assert np.array_equal(np.asarray(a["moe.experts.down.weight"]).view(np.uint8), np.asarray(q).view(np.uint8))
    assert np.array_equal(np.asarray(a["moe.experts.down.scale"]), np.asarray(s))


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


# Restores a converted checkpoint onto an 8-device mesh with orbax alone (argv: the checkpoint, each array's
# split axis); prints each array's SHA-256 and one device's shard shape.
PLAIN_ORBAX = """
import hashlib, json, sys
import jax, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

path, splits = sys.argv[1], json.loads(sys.argv[2])
meta = json.load(open(path + "/jtilert.json"))
mesh = Mesh(np.array(jax.devices()), ("tp",))
target = {}
for name, (shape, dtype) in meta["params"].items():
    spec = [None] * len(shape)
    if splits[name] is not None:
        spec[splits[name]] = "tp"
    *parents, leaf = name.split(".")
    d = target
    for k in parents:
        d = d.setdefault(k, {})
    d[leaf] = jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype), sharding=NamedSharding(mesh, P(*spec)))
restored = ocp.StandardCheckpointer().restore(path + "/params", target)
out = {}
for keys, x in jax.tree_util.tree_leaves_with_path(restored):
    name = ".".join(k.key for k in keys)
    out[name] = [hashlib.sha256(np.asarray(x).tobytes()).hexdigest(), list(x.addressable_shards[0].data.shape)]
assert not any(m.startswith("jtilert") for m in sys.modules)
print(json.dumps(out))
"""


def test_plain_orbax_restores_a_conversion_onto_a_mesh(converted):
    dst = converted[8]
    names = json.loads((dst / "jtilert.json").read_text())["params"]
    splits = {n: checkpoint.sharding.split_axis(tuple(n.split("."))) for n in names}
    env = {"PATH": os.environ["PATH"], "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run([sys.executable, "-c", PLAIN_ORBAX, str(dst), json.dumps(splits)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    model = jtilert.load(dst, mesh=jtilert.make_mesh(8))
    want = {k: [hashlib.sha256(np.asarray(x).tobytes()).hexdigest(), list(x.addressable_shards[0].data.shape)]
            for k, x in checkpoint.flat_params(model).items()}
    assert got == want
    assert got["moe.experts.gate.weight"][1] == [2, 8, 128, 256]  # each device a 1/8 of the rows


def test_a_damaged_chunk_fails_the_load_in_one_line(converted, tmp_path):
    dst = tmp_path / "d"
    shutil.copytree(converted[2], dst)
    f = dst / "params/moe.experts.up.weight/c/1/0/1/0"
    data = bytearray(f.read_bytes())
    data[777] ^= 0x10
    f.write_bytes(bytes(data))

    def load_error():
        with pytest.raises(ValueError) as e:
            jtilert.load(dst, mesh=jtilert.make_mesh(2))
        return str(e.value)

    assert load_error() == f"{f}: checksum mismatch (CRC-32C) (run `jtilert verify` on the checkpoint to list " \
                           f"every damaged chunk)"
    f.unlink()
    assert load_error().startswith(f"{f}: missing")


def test_chunk_files_are_tensorstores_own(converted, tmp_path):
    """The converter writes each chunk file itself (O_DIRECT): byte for byte what TensorStore writes for the
    same array and chunk shape, metadata included."""
    src = converted[2] / "params"
    for name in ("moe.experts.down.weight", "layers.self_attn.q_b_proj.scale", "embed_tokens"):
        a = arrays.open_array(src, name)
        x = np.asarray(a.read().result())
        arrays.write_arrays(tmp_path, {name: (x, tuple(a.chunk_layout.read_chunk.shape))})
        files = sorted(f.relative_to(src / name) for f in (src / name).rglob("*") if f.is_file())
        assert files == sorted(f.relative_to(tmp_path / name) for f in (tmp_path / name).rglob("*") if f.is_file())
        assert len(files) > 1
        for f in files:
            assert (src / name / f).read_bytes() == (tmp_path / name / f).read_bytes(), (name, f)


def test_verify_finds_damage(fp8_src, converted, tmp_path):
    dst = tmp_path / "v"
    shutil.copytree(converted[2], dst)
    report = jtilert.verify(dst, against=fp8_src)
    assert report["arrays"] > 0 and report["chunks"] > report["arrays"] and report["spot_checked"] > 0
    assert report["tp"] == 2
    f = dst / "params/moe.experts.gate.weight/c/0/0/1/0"  # layer 0, all experts, shard 1
    data = bytearray(f.read_bytes())
    data[12345] ^= 0x01
    f.write_bytes(bytes(data))
    g = dst / "params/embed_tokens/c/0/0"
    size = g.stat().st_size
    g.write_bytes(g.read_bytes()[:-2])
    (dst / "params/lm_head.weight/c/1/0").unlink()
    h = dst / "params/norm.weight/c/0"
    h.write_bytes(h.read_bytes() + b"\0")
    with pytest.raises(ValueError, match="4 problem") as e:
        jtilert.verify(dst)
    msg = str(e.value)
    assert "moe.experts.gate.weight/c/0/0/1/0: checksum mismatch (CRC-32C) (parameter moe.experts.gate.weight)" in msg
    assert f"embed_tokens/c/0/0: {size - 2} bytes, the chunk needs {size}" in msg
    assert "lm_head.weight/c/1/0: missing" in msg
    assert f"norm.weight/c/0: {h.stat().st_size} bytes, the chunk needs {h.stat().st_size - 1}" in msg


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


def test_full_size_deepseek_plan_at_tp8(tmp_path, monkeypatch):
    """The real DeepSeek-V3.2 shapes (61 layers + MTP, 686 GB of fp8) plan cleanly at tp=8 and 16, and a
    tp that splits fp8 blocks is refused by name (the data is sparse: headers only)."""
    import functools

    from jtilert.store import synthetic
    from jtilert.store.convert import plan as plan_module
    # the full-size abstract model (seconds to trace) once for the folder and both plans, which only read it
    shapes = functools.cache(plan_module.abstract_model)
    monkeypatch.setattr(synthetic, "abstract_model", shapes)
    monkeypatch.setattr(plan_module, "abstract_model", shapes)
    src = jtilert.random_checkpoint("deepseek-v3.2", tmp_path / "dsv32", sparse=True)
    p = plan(src, tp=8)
    assert len(p.files) == 161 and 680e9 < p.nbytes < 690e9
    experts = next(i for i in p.items if i.name == "layers.60.mlp.experts.gate.weight")
    assert experts.local_shape == (256, 256, 7168) and len(experts.mats) == 256
    assert experts.array == "moe.experts.gate.weight" and experts.layer == 57
    assert p.arrays["moe.experts.gate.weight"].chunk == (1, 16, 256, 7168)   # 29 MB within one shard
    assert p.arrays["moe.experts.down.weight"].chunk == (1, 2, 7168, 256)    # 1/8 of the budget: width split
    assert next(i for i in p.items if i.name == "mtp.layer.self_attn.o_proj.weight").local_shape == (7168, 2048)
    chunks = sum(int(np.prod([-(-n // c) for n, c in zip(a.shape, a.chunk)])) for a in p.arrays.values())
    assert 50_000 < chunks < 100_000, chunks  # files: one per chunk
    with pytest.raises(ValueError, match=r"parameter layers.0.mlp.down_proj.weight of shape \(7168, 18432\): fp8 "
                                         r"block scales need each of the tp=32 slices of axis 1 \(18432 / 32\)"):
        plan(src, tp=32)
