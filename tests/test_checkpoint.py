import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jtilert
from jtilert.store import checkpoint
from jtilert.store.hf import SafetensorsFile

IDS = np.random.RandomState(3).randint(0, 256, 36)


@pytest.fixture(scope="module")
def saved(tiny_random, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    jtilert.save(tiny_random, path, tokenizer="bytes")
    return path


def test_round_trip_is_bit_exact(tiny_random, saved):
    loaded = jtilert.load(saved)
    a, b = checkpoint.flat_params(tiny_random), checkpoint.flat_params(loaded)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
    assert sorted(p.name for p in saved.iterdir()) == ["jtilert.json", "params"]
    assert not list(saved.parent.glob(".tiny.tmp*"))


def test_save_writes_chunk_checksums(tiny_random, saved, tmp_path):
    """`save` writes layout 4: every chunk with its CRC-32C, which `verify` reads back (and a load checks)."""
    assert checkpoint.read_meta(saved)["layout_version"] == 4
    report = jtilert.verify(saved)
    assert report["arrays"] == len(checkpoint.flat_params(tiny_random)) and report["chunks"] > report["arrays"]
    assert report["tp"] is None
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    f = next(f for f in (bad / "params/moe.experts.gate.weight/c").rglob("*") if f.is_file())
    data = bytearray(f.read_bytes())
    data[3] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"1 problem\(s\):\n  .*moe.experts.gate.weight/c/[0-9/]+: checksum mismatch"):
        jtilert.verify(bad)
    with pytest.raises(ValueError, match=r"jtilert.save wrote it\); --against compares a converted checkpoint"):
        jtilert.verify(saved, against="tests/golden/dsv32")


def test_a_damaged_chunk_is_one_cli_line(saved, tmp_path, cli_here):
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    f = bad / "params/layers.self_attn.q_b_proj.weight/c/2/0/0"
    data = bytearray(f.read_bytes())
    data[-9] ^= 0x04
    f.write_bytes(bytes(data))
    r = cli_here("generate", "--model", str(bad), "--prompt", "x", "--max-new-tokens", "2")
    assert r.returncode == 2
    assert r.stderr == f"jtilert: error: {f}: checksum mismatch (CRC-32C) (run `jtilert verify` on the checkpoint " \
                       f"to list every damaged chunk)\n"


def test_zero_arrays_are_stored(tiny_random, tmp_path):
    """A parameter of zeros has its chunk files too (TensorStore would skip chunks equal to the fill value)."""
    model = jtilert.random_model("tiny", fmt="fp32")
    norm = model.layers.input_layernorm.weight
    norm[...] = jax.numpy.zeros_like(norm[...])
    path = jtilert.save(model, tmp_path / "z")
    assert list((path / "params/layers.input_layernorm.weight/c").rglob("*"))
    assert not np.asarray(jtilert.load(path).layers.input_layernorm.weight[...]).any()
    jtilert.verify(path)


def nest(flat: dict) -> dict:
    """{"a.b": x} as {"a": {"b": x}}: the tree orbax saves."""
    out: dict = {}
    for name, x in flat.items():
        *parents, leaf = name.split(".")
        d = out
        for p in parents:
            d = d.setdefault(p, {})
        d[leaf] = x
    return out


def test_orbax_storage_checkpoints_still_load(tiny_random, saved, tmp_path):
    """Layout 3: the stacked tree in orbax's own storage (what `save` wrote before chunk checksums)."""
    old = tmp_path / "old"
    shutil.copytree(saved, old, ignore=shutil.ignore_patterns("params"))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(old / "params", nest(checkpoint.flat_params(tiny_random)))
    meta = json.loads((old / "jtilert.json").read_text())
    del meta["checksums"]   # as written before file checksums
    (old / "jtilert.json").write_text(json.dumps(dict(meta, layout_version=3)))
    assert (old / "params/manifest.ocdbt").exists()
    with pytest.warns(UserWarning, match="written without checksums"):
        b = checkpoint.flat_params(jtilert.load(old, mesh=jtilert.make_mesh(2)))
    a = checkpoint.flat_params(tiny_random)
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
    with pytest.raises(ValueError, match="written without checksums"):
        jtilert.verify(old)


def test_raw_shard_checkpoints_say_how_to_convert(saved, tmp_path):
    """Layout 2 (the converter's raw per-device files) is no longer read: the error gives the command."""
    old = tmp_path / "raw"
    shutil.copytree(saved, old)
    meta = json.loads((old / "jtilert.json").read_text())
    (old / "jtilert.json").write_text(json.dumps(dict(meta, layout_version=2, tp=8, source={"path": "/hf/dsv32"})))
    with pytest.raises(ValueError) as e:
        jtilert.load(old)
    assert str(e.value) == (f"{old} is a layout-2 converted checkpoint (raw per-device shard files), which this "
                            f"jtilert no longer reads; convert its source again: jtilert convert /hf/dsv32 {old} "
                            f"--tp 8 --overwrite")


def test_load_onto_mesh_shards_directly(tiny_random, saved):
    mesh = jtilert.make_mesh(8)
    m = jtilert.load(saved, mesh=mesh)
    w = m.moe.experts.gate.weight[...]     # [MoE layers, experts, width, hidden]
    assert w.sharding.spec == jax.P(None, None, "tp", None)
    assert w.addressable_shards[0].data.shape == (4, 16, 8, 128)
    np.testing.assert_allclose(jtilert.score(m, IDS, mesh=mesh), jtilert.score(tiny_random, IDS), atol=2e-5)


def test_load_on_another_machine_topology(tiny_random, saved, tmp_path):
    """A checkpoint written from 8 devices loads in a process that has one (orbax keeps the writer's
    shardings: the embedded checkpoint, written on a CPU, failed to load on a GPU)."""
    path = tmp_path / "from8"
    jtilert.save(jtilert.load(saved, mesh=jtilert.make_mesh(8)), path)
    code = ("import jax, numpy as np, jtilert; from jtilert.model.transformer import flat_params\n"
            f"m = jtilert.load({str(path)!r})\n"
            "w = flat_params(m)['moe.experts.gate.weight']\n"
            "print(len(jax.devices()), np.asarray(w, np.float32).sum())")
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    n, total = out.stdout.split()
    want = np.asarray(checkpoint.flat_params(tiny_random)["moe.experts.gate.weight"], np.float32).sum()
    assert n == "1" and np.isclose(float(total), want, rtol=1e-5)


def test_fp8_round_trip_and_compute_dtype(tiny_fp8, tmp_path):
    jtilert.save(tiny_fp8, tmp_path / "f8")
    loaded = jtilert.load(tmp_path / "f8", dtype="float32")
    w = loaded.layers.self_attn.q_b_proj
    assert w.weight[...].dtype == jax.numpy.float8_e4m3fn and w.scale[...].shape == (5, 2, 1)
    assert loaded.dtype == np.float32
    assert np.isfinite(jtilert.score(loaded, IDS[:20])).all()


def test_existing_destination_needs_overwrite(tiny_random, saved):
    with pytest.raises(FileExistsError, match="overwrite"):
        jtilert.save(tiny_random, saved)


def test_shape_mismatch_names_parameter_and_shapes(saved, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(saved, bad)
    meta = json.loads((bad / "jtilert.json").read_text())
    meta["config"]["q_lora_rank"] = 32
    (bad / "jtilert.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"parameter \S+ has shape \(5, \d+, 64\) float32 in the checkpoint, "
                                         r"the config needs \(5, \d+, 32\)"):
        jtilert.load(bad)


def test_per_layer_checkpoints_still_load(tiny_random):
    """Layout 1 (one orbax entry per layer, as the embedded tiny model is stored) is stacked at load."""
    assert checkpoint.read_meta(checkpoint.resolve("tiny"))["layout_version"] == 1
    m = jtilert.load("tiny")
    assert m.layers.self_attn.q_b_proj.weight[...].shape[0] == m.cfg.num_hidden_layers + 1
    assert len(jtilert.Generator(m, max_seq_len=64).generate(IDS[:10], 4, stop_tokens=[])) == 4


def test_missing_and_unknown_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at 'nowhere'"):
        jtilert.load("nowhere")
    with pytest.raises(FileNotFoundError, match="preset 'glm-5' has no embedded weights"):
        jtilert.load("glm-5")
    with pytest.raises(FileNotFoundError, match="neither"):
        jtilert.load(tmp_path)


def _hf_copy(tmp_path, name="dsv32"):
    dst = tmp_path / name
    shutil.copytree(f"tests/golden/{name}", dst)
    return dst


def test_hf_bad_inputs(tmp_path):
    # truncated safetensors
    d = _hf_copy(tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors: truncated"):
        checkpoint.load_hf(d)
    # an index naming a missing file
    d = _hf_copy(tmp_path / "b")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        checkpoint.load_hf(d)
    # a config that does not match the tensors
    d = _hf_copy(tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    cfg["kv_lora_rank"] = 16
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"kv_a_layernorm.weight has shape \(32,\), the config needs \(16,\)"):
        checkpoint.load_hf(d)
    # unknown model type
    cfg["model_type"] = "mistral"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mistral"):
        checkpoint.load_hf(d)


def test_hf_fp8_folder_loads(tmp_path):
    """An fp8 HF folder (weight + weight_scale_inv) dequantises to the same model as its source."""
    from safetensors.numpy import save_file

    from jtilert.ops.quant import dequantize, quantize_weight
    src = "tests/golden/dsv32"
    f = SafetensorsFile(f"{src}/model.safetensors")
    out = {}
    for k in f.keys():
        x = f.get(k)
        not_fp8 = ("weights_proj", "lm_head", "embed_tokens", "mlp.gate.weight")  # as in the real checkpoints
        if x.ndim == 2 and k.endswith(".weight") and not any(n in k for n in not_fp8):
            q, s = quantize_weight(x)
            out[k], out[k + "_scale_inv"] = np.asarray(q), np.asarray(s)
        else:
            out[k] = np.asarray(x)
    d = tmp_path / "fp8"
    d.mkdir()
    shutil.copy(f"{src}/config.json", d)
    save_file(out, str(d / "model.safetensors"))
    m = checkpoint.load_hf(d)
    q = m.layers.self_attn.q_a_proj
    assert q.weight[...].dtype == jax.numpy.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(dequantize(q.weight[...][0], q.scale[...][0], np.float32)),
                                  np.asarray(dequantize(*quantize_weight(f.get("model.layers.0.self_attn.q_a_proj.weight")),
                                                        np.float32)))
    assert np.isfinite(jtilert.score(m, IDS[:20] % 128)).all()


def test_info(saved):
    info = checkpoint.info(saved)
    assert info["kind"] == "jtilert" and info["layers"] == 4 and info["parameters"] > 0
    assert checkpoint.info("tests/golden/glm5")["model_type"] == "glm_moe_dsa"


def test_save_keeps_the_tokenizer_of_what_was_loaded(tmp_path):
    """`jtilert generate --model saved/` works on a model saved after loading: its tokenizer goes along."""
    from jtilert.runtime.tokenizer import ByteTokenizer, tokenizer
    jtilert.save(jtilert.load("tiny"), tmp_path / "again")
    assert isinstance(tokenizer(tmp_path / "again"), ByteTokenizer)
    jtilert.save(jtilert.random_model("tiny"), tmp_path / "random")   # made, not loaded: no tokenizer
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        tokenizer(tmp_path / "random")
