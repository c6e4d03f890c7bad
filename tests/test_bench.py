"""The decode benchmark runs end to end on the CPU (tiny numbers, the real code path)."""

import json

import jax
import jax.numpy as jnp
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
    stages = run["compile_stages"]   # the first compile's stages add up to it
    assert set(stages) == {"trace_s", "kernels_s", "lower_s", "xla_compile_s", "first_call_s"}
    assert all(v >= 0 for v in stages.values()) and stages["trace_s"] > 0 and stages["xla_compile_s"] > 0
    assert abs(sum(stages.values()) - run["compile_s"]) < 1e-6
    assert "call_overhead_ms" in run and run["timing"]
    assert run["xla_options"] == {"xla_gpu_command_buffer_unroll_loops": True}
    assert run["layer_loop"] == "loop" and run["layers_per_iteration"] == 8   # DecodeConfig's default
    assert run["l2_prefetch"] is False and run["engine_moe"] is False
    # no GPU, no token ring: its two forms are left out
    assert set(run["call_variants"]) == {"host_output_pinned"}
    assert all(v["enqueue_ms"] > 0 and v["host_loop_ms"] > 0 and v["steps_per_call"] == 1
               for v in run["call_variants"].values())
    assert run["call_variants"]["host_output_pinned"]["host_trace"]
    assert run["steps_per_call"] == 1 and "advancing_step_ms" in run and "fed_token_step_ms" in run   # no ring here
    assert run["served_step_ms"] > 0 and run["host_over_served_frac"] < 1
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
    router = moe_layers * cfg.n_routed_experts * cfg.hidden_size * 2   # read in bf16: half its fp32 bytes
    assert b["weights"] == all_params - skipped - router
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


def _perfetto_trace() -> dict:
    """A trace as XLA's profiler writes it (perfetto_trace.json.gz; bench/timeline.py's docstring):
    GPU 0 (pid 1) with two streams and a CUPTI overhead line, the host's threads (pid 701). Four
    steps end with the lm head's top-k at 100, 300, 500, 700 µs; the step read (the second whole
    one, 310–510 µs) has a head (sampling, a copy), three layers (each opened by mla_prep, with
    kernels on the second stream overlapping), idle gaps of 3, 10, 1, 5 and 20 µs, and a kernel that
    starts while the top-k runs."""
    def meta(pid, name, tid=None):
        e = {"ph": "M", "pid": pid, "name": "thread_name" if tid is not None else "process_name",
             "args": {"name": name}}
        return e if tid is None else {**e, "tid": tid}

    def gpu(name, ts, dur, tid=14, arg="kernel_details"):   # a node of a CUDA graph, but for the copy
        return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name,
                "args": {arg: "regs:32 static_shared:0 grid:1,1,1 block:128,1,1", "correlation_id": "7",
                         **({} if arg == "memcpy_details" else {"cuda_graph_node_id": "12"})}}
    topk, prep = "jtilert_lm_head_topk_mosaic_gpu_kernel", "jtilert_mla_prep_mosaic_gpu_kernel"
    events = [meta(1, "/device:GPU:0"), meta(701, "/host:CPU"), meta(1, "Stream #14(MemcpyD2D,Compute)", 14),
              meta(1, "Stream #15(Compute)", 15), meta(1, "CUPTI overhead", 99), meta(701, "Host Threads/7", 7)]
    events += [gpu(prep, 20, 10), gpu(topk, 100, 10),                      # step 0
               gpu("loop_or_fusion", 120, 5), gpu(topk, 300, 10),
               gpu("loop_or_fusion", 310, 1),                                # starts as the top-k ends: step 0's
               gpu("loop_multiply_fusion", 312, 3),                          # the step read: head
               gpu("MemcpyD2D", 315, 2, arg="memcpy_details"),
               gpu(prep, 320, 10), gpu("jtilert_index_prep_mosaic_gpu_kernel", 321, 5, tid=15),       # layer 0
               gpu("jtilert_sparse_mla_mosaic_gpu_kernel", 330, 20), gpu("jtilert_gemv_wgmma_mosaic_gpu_kernel", 360, 10),
               gpu(prep, 370, 10),                                                                     # layer 1
               gpu("void jt::(anonymous namespace)::topk_cluster_kernel<jt::(anonymous namespace)::Sel>(float const*, int)",
                   372, 4, tid=15),
               gpu("jtilert_moe_down_mosaic_gpu_kernel", 381, 19),
               gpu(prep, 400, 50), gpu("loop_add_fusion", 455, 5), gpu("input_reduce_fusion", 460, 20),  # layer 2
               gpu(topk, 500, 10), gpu("loop_convert_fusion", 505, 4, tid=15),                         # tail
               gpu("loop_multiply_fusion", 512, 3), gpu(topk, 700, 10)]                                # step 3
    # not GPU records: host events (TraceMe, CUDA API) with kernel names, one even with a kernel's
    # arg, in the step read; a CUPTI overhead record on the GPU; the writer's closing {}
    events += [{"ph": "X", "pid": 701, "tid": 7, "ts": 330, "dur": 3, "name": prep, "args": {"hlo_op": "custom-call"}},
               {"ph": "X", "pid": 701, "tid": 7, "ts": 340, "dur": 3, "name": topk, "args": {"kernel_details": "x"}},
               {"ph": "X", "pid": 701, "tid": 7, "ts": 350, "dur": 1, "name": "cuGraphLaunch"},
               {"ph": "X", "pid": 1, "tid": 99, "ts": 352, "dur": 2, "name": "CUPTI overhead"}, {}]
    return {"displayTimeUnit": "ns", "traceEvents": events}


def test_timeline_names_slow_runs_and_what_ran_beside_them():
    """`slow_runs`: a kernel's runs past 1.4 × its median + 1 µs, with the records that overlapped each;
    kernels with fewer than four runs in the layers, the head's and the tail's records are not judged;
    `launch_details` reads CUPTI's launch record."""
    from bench import timeline

    def rec(name, layer, start, dur):
        return {"name": f"jtilert_{name}_mosaic_gpu_kernel", "layer": layer, "start_us": start, "dur_us": dur}
    kl = [rec("x_proj", n, 100.0 * n, 10.0) for n in range(5)] + [rec("index_weights", 3, 299.0, 4.0)]
    kl[3]["dur_us"] = 21.0                                               # layer 3's x_proj, beside the head weights
    kl += [rec("mla_prep", n, 100.0 * n + 50, 5.0 + 20 * (n == 1)) for n in range(3)]   # three runs: not judged
    kl += [rec("x_proj", "tail", 900.0, 40.0)]                           # not a layer's
    (r,) = timeline.slow_runs(kl)
    assert (r["kernel"], r["runs"], r["median_us"], r["lost_us"]) == ("x_proj", 5, 10.0, 11.0)
    assert r["slow"] == [{"layer": 3, "start_us": 300.0, "dur_us": 21.0, "beside": [["index_weights", -1.0, 4.0]]}]
    assert timeline.launch_details("regs:168 static_shared:0 dynamic_shared:111672 grid:35,4,1 block:128,1,1 "
                                   "occ_pct:12.5") == {"regs": 168, "static_shared": 0, "dynamic_shared": 111672,
                                                       "grid": (35, 4, 1), "block": (128, 1, 1), "occ_pct": 12.5}
    assert timeline.launch_details(None) == {} and timeline.launch_details("x") == {}


def test_timeline_reads_gpu_records_of_one_step(tmp_path):
    import gzip
    from bench import timeline
    folder = tmp_path / "plugins" / "profile" / "2026_01_01_00_00_00"
    folder.mkdir(parents=True)
    with gzip.open(folder / "perfetto_trace.json.gz", "wt") as f:
        json.dump(_perfetto_trace(), f)
    events = timeline.kernel_events(timeline.load_trace(tmp_path))
    assert len(events) == 21 and [e["start_us"] for e in events] == sorted(e["start_us"] for e in events)
    assert {e["kind"] for e in events} == {"kernel", "memcpy"}
    assert [e["name"] for e in events if e["kind"] == "memcpy"] == ["MemcpyD2D"]
    assert all(e["device"] == "/device:GPU:0" and e["stream"].startswith("Stream #") for e in events)

    step = timeline.one_step(events)   # the second whole step: after 310 µs, up to the top-k ending at 510
    assert (min(e["start_us"] for e in step), len(step)) == (312, 14)
    assert [e["start_us"] for e in timeline.one_step(events, index=0)] == [120, 300, 310]
    assert [e["start_us"] for e in timeline.one_step(events, index=2)] == [512, 700]
    with pytest.raises(ValueError, match="needs 5"):
        timeline.one_step(events, index=3)
    assert timeline.step_kernel_counts(events) == [3, 13, 2]
    r = timeline.read_step(events)
    assert (r["step_index"], r["step_kernels"], r["trace_kernels"], r["markers"], r["kernels"]) == (1, [3, 13, 2], 20, 4, 13)
    assert len(r["kernel_list"]) == 4   # the head and the tail: layers 4-11 only by default
    assert r["note"].startswith("1 of 14 records ran outside CUDA graphs")   # the copy
    r = timeline.read_step(events, index=0)   # fewer kernels than step 1: records dropped, step 1 read
    assert r["step_index"] == 1 and r["span_us"] == 198 and r["note"].startswith("step 0 has 3 kernels, step 1 13")
    assert timeline.read_step(events, index=3)["kernels"] == 0
    assert timeline.read_step([e for e in events if e["kind"] == "memcpy"]) == {
        "kernels": 0, "note": "no GPU kernel events in the trace"}

    s = timeline.summary(step)
    assert (s["span_us"], s["busy_us"], s["idle_us"]) == (198, 159, 39)
    assert (s["records"], s["kernels"], s["memcpy"], s["memset"], s["graph_records"]) == (14, 13, 1, 0, 13)
    assert s["streams"] == ["Stream #14(MemcpyD2D,Compute)", "Stream #15(Compute)"]
    assert [k["idle_before_us"] for k in s["kernel_list"]] == [0, 0, 3, 0, 0, 10, 0, 0, 1, 0, 5, 0, 20, 0]
    assert [k["layer"] for k in s["kernel_list"]] == ["head"] * 2 + [0] * 4 + [1] * 3 + [2] * 3 + ["tail"] * 2
    assert [(k["start_us"], k["dur_us"]) for k in s["kernel_list"][:3]] == [(0, 3), (3, 2), (8, 10)]
    assert [{k: layer[k] for k in ("layer", "start_us", "span_us", "records", "idle_us")} for layer in s["layers"]] == [
        {"layer": 0, "start_us": 8, "span_us": 50, "records": 4, "idle_us": 13},
        {"layer": 1, "start_us": 58, "span_us": 30, "records": 3, "idle_us": 1},
        {"layer": 2, "start_us": 88, "span_us": 100, "records": 3, "idle_us": 5}]   # to the top-k's start
    assert s["layers"][1]["sequence"] == [["mla_prep", 0, 10], ["topk_cluster_kernel", 2, 4], ["moe_down", 11, 19]]
    assert (s["layers_found"], s["layer_span_us_median"]) == (3, 50)
    assert s["head"] == {"records": 2, "span_us": 8} and s["tail"] == {"records": 2, "span_us": 10}
    # the chain back from the top-k: every record but the three that overlapped others
    assert s["chain"] == {"records": 11, "busy_us": 159, "wait_us": 39}
    assert [k["name"][:22] for k in s["kernel_list"] if not k["on_chain"]] == [
        "jtilert_index_prep_mos", "void jt::(anonymous na", "loop_convert_fusion"]
    assert s["launches"]["mla_prep"] == {"regs": 32, "static_shared": 0, "grid": (1, 1, 1), "block": (128, 1, 1),
                                         "ctas": 1}
    assert s["slow"] == []   # no kernel runs four times in three layers
    assert s["idle_gaps"][0] == {"before": "lm_head_topk", "layer": "tail", "at_us": 188, "idle_us": 20}
    assert [g["idle_us"] for g in s["idle_gaps"]] == [20, 10, 5, 3, 1]
    assert s["idle_by_kernel"][:2] == [{"kernel": "lm_head_topk", "count": 1, "idle_us": 20},
                                       {"kernel": "gemv_wgmma", "count": 1, "idle_us": 10}]
    json.dumps(s)

    # the detail layers only: their kernels and sequences, the head and the tail
    d = timeline.summary(step, detail=(1, 2))
    assert [k["layer"] for k in d["kernel_list"]] == ["head"] * 2 + [1] * 3 + ["tail"] * 2
    assert ["sequence" in layer for layer in d["layers"]] == [False, True, False]
    assert d["layers"][1] == {k: v for k, v in s["layers"][1].items()}

    timeline.plot(s, tmp_path / "t.png", layers=(0, 3))
    assert (tmp_path / "t.png").stat().st_size > 1000
    timeline.plot({"kernels": 0, "note": "no GPU kernel events in the trace"}, tmp_path / "none.png")
    assert (tmp_path / "none.png").stat().st_size > 1000


def test_decode_bench_timeline_on_the_cpu(tiny_fp8):
    """The traced call of bench_backend on the CPU: no GPU records, a summary that says so."""
    r = decode.bench_backend(tiny_fp8, "reference", 40, False, 2, 1, host=False, trace_timeline=True)
    assert {k: r["timeline"][k] for k in ("kernels", "note")} == {"kernels": 0, "note": "no GPU kernel events in the trace"}
    assert r["timeline"]["untraced_step_us"] == r["step_ms_median"] * 1e3
    assert "timeline" not in decode.bench_backend(tiny_fp8, "reference", 40, False, 2, 1, host=False)


def test_decode_bench_timeline_flag(tmp_path, monkeypatch):
    """--timeline: the first pallas run (not the reference, not MTP) traces; its summary under the
    run's "timeline" in the JSON, its chart in <out stem>-timeline.png; --timeline-layers picks the layers
    it lists kernel by kernel (a range that is not LO < HI is refused)."""
    from bench import timeline
    calls = []
    summary = timeline.summary(timeline.one_step(timeline.kernel_events(_perfetto_trace())), detail=(0, 3))

    def fake_backend(model, backend, context, mtp, *args, trace_timeline=False, timeline_layers=None, **kw):
        calls.append((backend, mtp, trace_timeline))
        assert timeline_layers == (0, 2)
        r = {"backend": backend, "layer_loop": "loop", "all_reduce": "psum", "mtp": mtp, "step_ms_median": 1.0,
             "step_ms_p90": 1.0, "tok_s": 1e3, "host_overhead_frac": 0.0, "compile_s": 0.0}
        return {**r, "timeline": summary} if trace_timeline else r
    monkeypatch.setattr(decode, "bench_backend", fake_backend)
    out = tmp_path / "t.json"
    decode.main(["--preset", "tiny", "--layers", "2", "--fmt", "fp8", "--context", "40", "--steps", "2", "--samples", "2",
                 "--backend", "reference,pallas", "--all-reduce", "psum,engine", "--mtp", "--timeline",
                 "--timeline-layers", "0:2", "--out", str(out)])
    assert calls == [("reference", False, False), ("reference", True, False), ("reference", False, False),
                     ("reference", True, False), ("pallas", False, True), ("pallas", True, False),
                     ("pallas", False, False), ("pallas", True, False)]
    runs = json.loads(out.read_text())["runs"]
    assert [("timeline" in r) for r in runs] == [False] * 4 + [True] + [False] * 3
    assert runs[4]["timeline"]["span_us"] == 198
    assert (tmp_path / "t-timeline.png").stat().st_size > 1000
    for bad in ("2:2", "3", "a:4"):
        with pytest.raises(SystemExit):
            decode.main(["--preset", "tiny", "--timeline", "--timeline-layers", bad])


@pytest.mark.parametrize("flag, field", [("--l2-prefetch", "l2_prefetch"), ("--engine-moe", "engine_moe")])
def test_decode_config_flag_reaches_the_engine(monkeypatch, flag, field):
    """A DecodeConfig switch's flag: every run's Engine gets DecodeConfig(field=True); without it, False."""
    seen = []

    class FakeEngine:
        def __init__(self, model, mesh=None, config=None):
            seen.append(getattr(config, field))
            raise RuntimeError("stop here")   # the config is what this test reads
    monkeypatch.setattr(decode, "Engine", FakeEngine)
    for flags, want in (([], False), ([flag], True)):
        with pytest.raises(RuntimeError, match="stop here"):
            decode.main(["--preset", "tiny", "--layers", "2", "--fmt", "fp8", "--context", "40", "--steps", "2",
                         "--samples", "2", "--backend", "pallas", *flags])
        assert seen[-1] is want


def test_compile_breakdown_profiles_the_xla_compile():
    """compile_breakdown's stages, and with profile=True the host events of XLA's compile by name."""
    f = jax.jit(lambda x: jnp.sin(x) * 2 + 1)
    stages = decode.compile_breakdown(f, (jnp.arange(7.0),), profile=True)
    assert [k for k in stages if k.endswith("_s")] == ["trace_s", "kernels_s", "lower_s", "xla_compile_s"]
    events = stages["xla_compile_events"]
    assert events and all(len(e) == 3 and e[1] >= 0 for e in events)
    assert events == sorted(events, key=lambda e: -e[1])   # the largest first


def test_gpu_session_empties_a_work_folder_left_by_an_earlier_call(tmp_path):
    # the device machines keep /tmp between leases: an earlier call's files must not be packed with this
    # call's, nor its compile cache make this call's cold compiles warm
    import subprocess  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    work = tmp_path / "w"
    (work / "xla_cache").mkdir(parents=True)
    (work / "decode.json").write_text("{}")
    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_session.sh"
    run = subprocess.run(["bash", str(script)], env={"PATH": "/usr/bin:/bin", "WORK": str(work)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in work.iterdir()) == ["session.txt"]
    assert "emptying" in run.stderr


def test_gpu_session_full_depth_runs_61_layers_with_half_the_experts_stored(tmp_path):
    # FULL_DEPTH on a card that cannot hold 61 layers (here: no nvidia-smi, as an H100 reads): the parts
    # run 61 layers of dsv32-tp8-shard storing 128 routed experts in groups of 32; without it, 36 layers
    # of the preset as it is. python3 is a stub that prints its arguments.
    import subprocess  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text('#!/bin/bash\necho "ARGS: $*"\n')
    stub.chmod(0o755)
    script = Path(__file__).resolve().parent.parent / "bench" / "gpu_session.sh"

    def commands(**env):
        run = subprocess.run(["bash", str(script), "queued", "recompile", "contexts"],
                             env={"PATH": f"{stub.parent}:/usr/bin:/bin", "WORK": str(tmp_path / "w"), **env},
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        return [line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith("ARGS: ")]

    full = commands(FULL_DEPTH="1", RECOMPILE_LOOPS="loop/4 loop/8")
    assert len(full) == 6, full
    store = "--set n_routed_experts=128 --set n_group=4 --set topk_group=2"
    assert all(f"--preset dsv32-tp8-shard {store}" in c and "--layers 61" in c for c in full), full
    assert ["--layer-loop loop/4" in c for c in full[2:4]] == [True, False]
    assert "--layer-loop loop/8" in full[3] and full[3].endswith("recompile_loop_8.json")
    plain = commands()
    assert len(plain) == 5, plain
    assert not any("--set" in c for c in plain), plain
    assert all("--layers 36" in c for c in plain[:2] + plain[3:]) and "--layers 61" in plain[2], plain


def test_the_fed_timing_loop_steps_on_the_given_tokens(tiny_random):
    """`device_loop` given ids: its step i reads ids[i % len(ids)], not the token the step before made: two
    fed steps write the same cache as two plain steps given those tokens one at a time (the plain
    loop's first step reads its token argument), and other ids write another cache."""
    import jtilert
    from jtilert.runtime.generate import Engine
    from jtilert.ops.table import DecodeConfig

    eng = Engine(tiny_random, config=DecodeConfig())
    params, key = eng.place(jtilert.Sampling().arrays()), eng.place(jax.random.PRNGKey(0))
    pos, one = eng.place(jnp.int32(5)), eng.place(jnp.int32(1))
    draft = eng.place(jnp.array([0], jnp.int32))
    fresh = lambda: decode.random_cache(eng, 16)   # noqa: E731  (each loop donates its cache)
    loop = decode.device_loop(eng, False, advance=True)
    ids = eng.place(jnp.array([7, 3], jnp.int32))
    got, _, _, _ = loop(eng.state, fresh(), eng.place(jnp.array([1], jnp.int32)), draft, pos, params, key,
                       eng.place(jnp.int32(2)), ids)
    want = fresh()
    for i, t in enumerate((7, 3)):
        want, _, _, _ = loop(eng.state, want, eng.place(jnp.array([t], jnp.int32)), draft,
                              eng.place(jnp.int32(5 + i)), params, key, one)
    other, _, _, _ = loop(eng.state, fresh(), eng.place(jnp.array([1], jnp.int32)), draft, pos, params, key,
                         eng.place(jnp.int32(2)), eng.place(jnp.array([9, 3], jnp.int32)))
    leaves = lambda c: [np.asarray(c[k], np.float32) for k in sorted(c)]   # noqa: E731
    assert all(np.array_equal(a, b) for a, b in zip(leaves(got), leaves(want)))
    assert not all(np.array_equal(a, b) for a, b in zip(leaves(got), leaves(other)))
