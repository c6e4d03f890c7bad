"""The decode benchmark runs end to end on the CPU (tiny numbers, the real code path)."""

import json

import numpy as np

import pytest

from bench import decode


@pytest.fixture(autouse=True)
def small_copy(monkeypatch):
    """The benches' CPU bandwidth pass over 8 MiB instead of 256 MiB (seconds of an unvectorised loop
    at the tests' XLA -O0): the same code, a figure nothing here reads but its sign."""
    monkeypatch.setattr(decode, "CPU_COPY_BYTES", 8 << 20)


def test_decode_bench_writes_every_field(tmp_path, monkeypatch):
    monkeypatch.setenv("JTILERT_COMMIT", "abc123")   # what gpu_session.sh's caller names
    out = tmp_path / "r.json"
    # tiny's 2-layer fp8 model, as the prefill bench, test_generate and test_compile_cache make it: its
    # builders compile once per process
    decode.main(["--preset", "tiny", "--layers", "2", "--fmt", "fp8", "--context", "40", "--steps", "2",
                 "--samples", "2", "--xla-option", "xla_gpu_command_buffer_unroll_loops=true", "--call-variants",
                 "--out", str(out), "--plot", str(tmp_path / "c.png")])
    r = json.loads(out.read_text())
    for k in ("date", "device", "preset", "layers", "context", "bytes_per_step", "copy_bandwidth_GBs", "floor_ms"):
        assert k in r
    assert r["commit"] == "abc123" and "-m bench.decode --preset tiny" in r["command"] and str(out) in r["command"]
    assert r["bytes_per_step"]["total"] > r["bytes_per_step"]["weights"] > 0
    run = r["runs"][0]
    for k in ("step_ms_median", "step_ms_p90", "tok_s", "host_overhead_ms", "compile_s", "peak_device_bytes",
              "step_over_floor", "speedup_vs_reference"):
        assert k in run
    assert run["step_ms_p90"] >= run["step_ms_median"] > 0 and run["steps_timed"] == 12
    assert "call_overhead_ms" in run and run["timing"]
    assert run["xla_options"] == {"xla_gpu_command_buffer_unroll_loops": True}
    assert run["layer_loop"] == "loop" and run["layers_per_iteration"] == 4   # DecodeConfig's default
    assert set(run["call_variants"]) == {"shipped", "no_host_output", "host_output_on_device"}
    assert all(v["enqueue_ms"] > 0 and v["host_loop_ms"] > 0 for v in run["call_variants"].values())
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
    prefill.main(["--preset", "tiny", "--layers", "2", "--fmt", "fp8", "--lengths", "40", "--chunks", "8+4",
                  "--moe", "grouped,dense", "--samples", "1", "--backend", "reference", "--out", str(out)])
    r = json.loads(out.read_text())
    assert r["weight_bytes"] > 0 and r["copy_bandwidth_GBs"] > 0 and r["device"] and r["commit"]
    assert "-m bench.prefill --preset tiny" in r["command"]
    assert [(run["moe"], run["chunk"]) for run in r["runs"]] == [("grouped", "8+4"), ("dense", "8+4")]
    for run in r["runs"]:
        assert "error" not in run, run
        assert run["chunks"] == 5 and run["prefill_s_median"] > 0 and run["ttft_s"] > 0 and run["over_floor"] > 0


def test_prefill_bench_moe_variants_trace_different_programs(tiny_random, monkeypatch):
    """`--moe dense` runs the dense MoE: the prefill chunk's program differs from the grouped one
    (lowered text and program-cache key), the dense function is what the step traces, the logits
    agree, and the table is the library's again afterwards."""
    import jtilert
    from bench import prefill
    from jtilert.ops import reference, table
    calls = []
    monkeypatch.setitem(prefill.MOE_VARIANTS, "dense",
                        lambda *a: calls.append(a[2].shape) or prefill.dense_moe(*a))
    ids = np.arange(3, 35, dtype=np.int32)   # 32 tokens x 4 choices >= 16 experts: the grouped path
    text, key, logits = {}, {}, {}
    for v in ("grouped", "dense"):
        with prefill.moe_variant(v):
            gen = jtilert.Generator(tiny_random, max_seq_len=40, prefill_chunk=32)
            eng = gen.engine
            cache = eng.new_cache(gen.rows)
            args = (eng.state, cache, eng.place(ids), eng.place(np.int32(0)))
            text[v] = eng.forward.lower(*args).as_text()
            key[v] = eng.program_identity("forward")
            logits[v] = np.asarray(eng.forward(*args)[0])
    assert calls and all(shape == (32, 4) for shape in calls)   # traced through the dense variant only
    assert text["grouped"] != text["dense"] and key["grouped"] != key["dense"]
    np.testing.assert_allclose(logits["dense"], logits["grouped"], rtol=2e-4, atol=2e-4)
    assert table.OPS["moe_experts"].reference is reference.moe_experts


def test_latency_combines_decode_mtp_and_prefill():
    """latency-61.json's fields from the two benches' JSON (their layout, made up numbers), and the tiny
    model's MTP acceptance measured."""
    from bench import latency
    run = lambda backend, mtp, ms: {"backend": backend, "mtp": mtp, "step_ms_median": ms}
    decode_json = {"device": "H200", "date": "2026-12-02", "preset": "dsv32-tp8-shard", "layers": 61,
                   "context": 4096, "floor_ms": 2.0,
                   "runs": [run("reference", False, 17.0), run("pallas", False, 12.0), run("pallas", True, 16.0)]}
    prefill_json = {"runs": [{"length": 1024, "chunk": "64", "moe": "grouped", "prefill_s_median": 2.0,
                              "prompt_tok_s": 512.0, "ttft_s": 2.1},
                             {"length": 1024, "chunk": "1024+64", "moe": "grouped", "prefill_s_median": 0.25,
                              "prompt_tok_s": 4096.0, "ttft_s": 0.3},
                             {"length": 1024, "chunk": "1024+64", "moe": "dense", "prefill_s_median": 0.1,
                              "prompt_tok_s": 10240.0, "ttft_s": 0.1},
                             {"length": 32768, "chunk": "2048", "error": "out of memory"}]}
    r = latency.combine(decode_json, prefill_json, 0.75)
    assert (r["plain_step_ms"], r["mtp_step_ms"]) == (12.0, 16.0)
    assert r["tokens_per_s"]["plain"] == 1e3 / 12.0 and r["tokens_per_s"]["mtp@0.8"] == 1.8e3 / 16.0
    assert r["tokens_per_s"]["mtp@0.75"] == 1.75e3 / 16.0
    # the fastest chunk of the library's (grouped) MoE; a failed run is no figure
    assert (r["prefill_tok_s_1k"], r["prefill_chunk_1k"], r["ttft_s_1k"]) == (4096.0, "1024+64", 0.3)
    assert r["prefill_s_32k"] is None
    assert 0 < latency.tiny_acceptance(40) <= 1


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


def test_decode_bench_cache_lets_the_indexer_kernel_apply():
    """The bench's cache rows at the 61-layer runs' sizes are ones the indexer kernel takes (a row count
    it refuses sends the pallas path to the reference with a warning, and the timing measures XLA)."""
    import jax
    import jax.numpy as jnp
    from jtilert.pallas import indexer
    for context, steps, samples in ((4096, 10, 6), (4096, 10, 10), (32768, 10, 8), (40, 2, 2)):
        rows = decode.cache_rows(context, steps * (samples + 1))
        assert rows % 64 == 0 and rows >= context + 2 * steps * (samples + 1)
        k = jax.ShapeDtypeStruct((rows, 128), jnp.float8_e4m3fn)
        assert indexer.unsupported(1, 64, k, jax.ShapeDtypeStruct((rows,), jnp.float32)) is None
    k = jax.ShapeDtypeStruct((4252, 128), jnp.float8_e4m3fn)   # the unrounded row count of a GPU run
    assert indexer.unsupported(1, 64, k, jax.ShapeDtypeStruct((4252,), jnp.float32)) is not None
