"""The decode benchmark runs end to end on the CPU (tiny numbers, the real code path)."""

import json

import numpy as np

from bench import decode


def test_decode_bench_writes_every_field(tmp_path):
    out = tmp_path / "r.json"
    decode.main(["--preset", "tiny", "--layers", "2", "--context", "40", "--steps", "2", "--samples", "2",
                 "--out", str(out), "--plot", str(tmp_path / "c.png")])
    r = json.loads(out.read_text())
    for k in ("date", "device", "preset", "layers", "context", "bytes_per_step", "copy_bandwidth_GBs", "floor_ms"):
        assert k in r
    assert r["bytes_per_step"]["total"] > r["bytes_per_step"]["weights"] > 0
    run = r["runs"][0]
    for k in ("step_ms_median", "step_ms_p90", "tok_s", "host_overhead_ms", "compile_s", "peak_device_bytes",
              "step_over_floor", "speedup_vs_reference"):
        assert k in run
    assert run["step_ms_p90"] >= run["step_ms_median"] > 0 and run["steps_timed"] == 12
    assert "call_overhead_ms" in run and run["timing"]
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_step_bytes_counts_only_chosen_experts(tiny_random):
    import jtilert
    model = tiny_random
    b = decode.step_bytes(model, context=100)
    cfg = model.cfg
    experts = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4  # one expert, fp32
    all_params = sum(int(np.prod(x.shape)) * 4 for n, x in jtilert.store.checkpoint.layer_params(model).items()
                     if not n.startswith("mtp."))
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    skipped = (moe_layers * (cfg.n_routed_experts - cfg.num_experts_per_tok) * experts
               + (cfg.vocab_size - 1) * cfg.hidden_size * 4)
    assert b["weights"] == all_params - skipped
    assert b["mla_kv"] == cfg.num_hidden_layers * cfg.index_topk * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert b["index_keys"] == cfg.num_hidden_layers * 101 * cfg.index_head_dim * 4


def test_prefill_bench_writes_every_field(tmp_path):
    from bench import prefill
    out = tmp_path / "p.json"
    prefill.main(["--preset", "tiny", "--layers", "2", "--lengths", "40", "--chunks", "16,8+4", "--moe", "grouped,dense",
                  "--samples", "1", "--backend", "reference", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["weight_bytes"] > 0 and r["copy_bandwidth_GBs"] > 0 and r["device"]
    assert [(run["moe"], run["chunk"]) for run in r["runs"]] == [("grouped", "16"), ("grouped", "8+4"), ("dense", "16"), ("dense", "8+4")]
    for run in r["runs"]:
        assert "error" not in run, run
        assert run["chunks"] == {"16": 3, "8+4": 5}[run["chunk"]] and run["prefill_s_median"] > 0 and run["ttft_s"] > 0 and run["over_floor"] > 0


def test_latency_combines_decode_mtp_and_prefill(tmp_path):
    from bench import latency, prefill
    d, p = tmp_path / "d.json", tmp_path / "p.json"
    decode.main(["--preset", "tiny", "--layers", "2", "--context", "40", "--steps", "2", "--samples", "2", "--mtp",
                 "--out", str(d)])
    prefill.main(["--preset", "tiny", "--layers", "2", "--lengths", "1024", "--chunks", "512", "--samples", "1",
                  "--backend", "reference", "--out", str(p)])
    out = tmp_path / "latency.json"
    r = latency.main(["--decode", str(d), "--prefill", str(p), "--backend", "reference", "--out", str(out)])
    assert json.loads(out.read_text())["mtp_step_ms"] == r["mtp_step_ms"] > 0
    assert r["plain_step_ms"] > 0 and r["prefill_tok_s_1k"] > 0 and r["ttft_s_1k"] > 0 and r["prefill_s_32k"] is None
    assert 0 < r["mtp_acceptance_tiny"] <= 1
    a = r["mtp_acceptance_tiny"]
    assert r["tokens_per_s"][f"mtp@{round(a, 3)}"] == (1 + round(a, 3)) * 1e3 / r["mtp_step_ms"]


def test_pdl_probe_lowers_both_mosaic_chains_and_runs_the_fusions():
    """The probe's Mosaic chains lower for the GPU (the PDL one marked for a PDL launch); on the CPU
    the fusion chain runs and the Mosaic ones are recorded as errors, not raised."""
    import jax
    import jax.numpy as jnp
    from bench import pdl_probe
    from jtilert.pallas import interpret as interp
    x = jax.ShapeDtypeStruct((pdl_probe.SIZE,), jnp.float32)
    with interp.compile_for_gpu():
        texts = [pdl_probe.chain(pdl_probe.mosaic_step(pdl), 3).trace(x).lower(lowering_platforms=("cuda",)).as_text()
                 for pdl in (False, True)]
    assert all(t.count("custom_call @mosaic_gpu") == 1 for t in texts)   # lowered once, called 3 times
    assert texts[0] != texts[1]
    r = pdl_probe.main(["--n", "3", "--calls", "2"])
    assert r["us_per_kernel"]["fusion"] > 0 and str(r["us_per_kernel"]["mosaic"]).startswith("error")
