"""jtilert against transformers on one HF checkpoint, the same measurement on both sides (issue 15).

    python3 -m bench.vs_transformers --side jtilert CK --context 1024 --new 64 --backend pallas,reference --out jt.json
    python3 -m bench.vs_transformers --side transformers CK --context 1024 --new 64 --compile off --out hf.json
    python3 -m bench.vs_transformers --combine jt.json hf.json [hf2.json ...] --out vs.json

Each side runs in its own process (transformers' side imports no jax and no jtilert, so it runs in a
torch-only environment). Both read the checkpoint folder CK, take the same prompt (`context` token ids
drawn from a seeded generator, so the first decode step attends `context` cached positions), generate
`new` tokens greedily at batch 1 and write one JSON with the card, date, commit, command and versions.

- wall clock: steady ms per output token of the library's own generate loop, the first token (the
  prompt's prefill) excluded, after `warmup` untimed calls; median and p90 over `samples` calls.
  jtilert: `Generator.generate` (the device loop) and `Generator.stream` (one step per call), their
  `stats["ms_per_token"]`. transformers: `model.generate` with a static cache and a streamer that
  timestamps the tokens as generate hands them over (generate reads every token on the host).
- device time per step, at position context + new - 2 (the last decode step generate runs):
  jtilert as bench.decode measures it (a jitted loop of steps, the cache random; on a GPU also the
  CUPTI kernel sum of one step). transformers: the decode step its generate ran last, replayed with
  the static cache rewound after each step: its CUDA kernels summed by torch.profiler, and, where the
  step can be captured, CUDA events around replays of a CUDA graph of it. Pairs: graph replay ↔
  jitted loop (both include the gaps between kernels), kernel sum ↔ CUPTI kernel sum.
  On the CPU neither exists: the JSON says "not available on cpu".
- combine: the ratios transformers / jtilert of each pair, one JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np

from bench import provenance


# --- shared by both sides (numpy and the standard library only) -----------------------------------------
def prompt_ids(folder: str, context: int, seed: int = 0) -> np.ndarray:
    """The prompt both sides decode after: `context` token ids in [0, vocab) from a seeded generator."""
    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return np.random.default_rng(seed).integers(0, vocab, context).astype(np.int64)


def summary(values) -> dict:
    """median and p90 (ms) of per-token or per-step samples, and the samples themselves."""
    v = [float(x) for x in values]
    return {"median": float(np.median(v)), "p90": float(np.percentile(v, 90)), "samples": v}


def _run(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_state():
    """What nvidia-smi says the GPUs are doing (None without one): read before this process starts JAX or
    torch, which take memory and start kernels of their own."""
    return _run("nvidia-smi", "--query-gpu=index,name,utilization.gpu,memory.used", "--format=csv,noheader")


def stamp(card: str, versions: dict, a) -> dict:
    """Where and how this JSON was made: card, UTC time, commit (`bench.provenance`), the command line,
    library versions, and on a GPU what nvidia-smi said before this process started its library."""
    return {"card": card, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": provenance.commit(), "command": provenance.command("bench.vs_transformers", a.argv),
            "host": platform.node(), "python": platform.python_version(), "versions": versions,
            "gpu_before": a.gpu_before}


def write(result: dict, path: str | None) -> None:
    print(json.dumps(result), flush=True)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


# --- jtilert ----------------------------------------------------------------------------------------------
def jtilert_side(a) -> dict:
    import jax
    import jaxlib
    import jtilert
    from bench import decode

    model = jtilert.load(a.folder)
    prompt = prompt_ids(a.folder, a.context, a.seed)
    result = {"side": "jtilert", **stamp(jax.devices()[0].device_kind,
                                               {"jax": jax.__version__, "jaxlib": jaxlib.__version__}, a),
              "folder": a.folder, "context": a.context, "new": a.new, "seed": a.seed,
              "layers": model.cfg.num_hidden_layers,
              "runs": []}
    for backend in a.backend.split(","):
        gen = jtilert.Generator(model, max_seq_len=a.context + a.new, backend=backend)
        run = {"backend": backend}
        # the two loops a user calls; stop_tokens=[]: always `new` tokens, like min_new_tokens on the other side
        for name, call in (("generate", lambda: gen.generate(prompt, a.new, stop_tokens=[])),
                           ("stream", lambda: list(gen.stream(prompt, a.new, stop_tokens=[])))):
            for _ in range(a.warmup):
                call()
            per_token = []
            for _ in range(a.samples):
                tokens = call()
                per_token.append(gen.stats["ms_per_token"])
            run[name] = {"ms_per_token": summary(per_token), "ttft_ms": gen.stats["ttft_s"] * 1e3}
            run.setdefault("tokens", tokens)
        # device time per step: bench.decode's jitted loop (and CUPTI kernel sum on a GPU), at the
        # position of transformers' replayed step: generate's last decode step
        pos = a.context + a.new - 2
        d = decode.bench_backend(model, backend, pos, False, a.steps, a.samples, host=False, kernels=True)
        run["device"] = {"method": f"jitted loop of steps ({d['timing']})", "position": pos,
                         "step_ms": d["step_ms_median"], "step_ms_p90": d["step_ms_p90"]}
        prof = d.get("kernel_profile")
        run["device"]["kernel_sum_ms"] = prof["busy_ms"] if prof else "not available on cpu"
        if prof:
            run["device"]["kernels_per_step"] = prof["kernels"]
        result["runs"].append(run)
        write(result, a.out)
    return result


# --- transformers -----------------------------------------------------------------------------------------
def transformers_side(a) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = AutoModelForCausalLM.from_pretrained(a.folder, dtype=torch.bfloat16).to(a.device).eval()
    if a.compile not in ("off", "auto"):
        model.forward = torch.compile(model.forward, mode=a.compile)
    ids = torch.from_numpy(prompt_ids(a.folder, a.context, a.seed))[None].to(a.device)
    card = torch.cuda.get_device_name() if cuda else platform.processor() or "cpu"
    result = {"side": "transformers", **stamp(card, {"torch": torch.__version__,
                                                          "transformers": transformers.__version__,
                                                          "cuda": torch.version.cuda}, a),
              "folder": a.folder, "context": a.context, "new": a.new, "seed": a.seed,
              "layers": model.config.num_hidden_layers,
              "compile": a.compile, "attn_implementation": model.config._attn_implementation,
              "experts_implementation": getattr(model.config, "_experts_implementation", None)}

    class Clock:
        """A generate streamer: the time each put arrives and how many tokens it holds. generate's first
        put is the prompt; the ones after it hold the generated tokens."""

        def __init__(self):
            self.puts = []

        def put(self, value):
            sync()   # generate has read the token to the host already; this makes sure of it
            self.puts.append((time.perf_counter(), value.numel()))

        def end(self):
            pass

    # what generate passes the model at its last decode step (its input names differ between versions)
    last_step = {}
    prepare = model.prepare_inputs_for_generation

    def recording_prepare(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        if inputs.get("input_ids") is not None and inputs["input_ids"].shape[-1] == 1:
            last_step.update(inputs)
        return inputs
    model.prepare_inputs_for_generation = recording_prepare

    def generate():
        """(generated ids, ms per token after the first) of one greedy generate call."""
        clock = Clock()
        # pad_token_id: the checkpoint has no end-of-sequence token for generate to borrow one from;
        # disable_compile: "off" is eager, a --compile mode has compiled model.forward already
        out = model.generate(ids, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False,
                             cache_implementation="static", pad_token_id=0, streamer=clock,
                             disable_compile=a.compile != "auto")
        gen = clock.puts[1:]   # [(time, tokens)] of the generated tokens, the first in gen[0]
        assert sum(n for _, n in gen) == a.new, gen
        return out[0, a.context:].tolist(), (gen[-1][0] - gen[0][0]) / (a.new - gen[0][1]) * 1e3

    try:
        with torch.inference_mode():
            for _ in range(a.warmup):
                generate()
            per_token = []
            for _ in range(a.samples):
                tokens, ms = generate()
                per_token.append(ms)
            result["generate"] = {"ms_per_token": summary(per_token), "timing": "streamer timestamps: (time of the "
                                  "last token - time of the first) / tokens after the first"}
            # transformers' own choice under "auto": it compiles the decode step where it can
            result["generate"]["compiled_by_generate"] = hasattr(model, "_compiled_call")
            result["tokens"] = tokens
            write(result, a.out)
            try:   # on the CPU too: the step must replay at one position
                step, result["replay_position"], token = replayable_step(model, last_step)
                result["replay_chose_last_token"] = token == tokens[-1]   # it is the step generate ran
                result["device"] = device_time(step, a, torch) if cuda else "not available on cpu"
            except Exception as e:   # the wall-clock figures stand without it
                result["device"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    except Exception as e:   # keep what was measured and say what failed
        result["error"] = f"{type(e).__name__}: {e}"
        write(result, a.out)
        raise
    write(result, a.out)
    return result


def replayable_step(model, inputs: dict):
    """The decode step generate ran last (its inputs as generate passed them), as a function that runs
    it again at the same position: the static cache (full: it holds no row past that step's) is rewound
    by one row before each step with tensor ops, so a captured graph rewinds too (`rewind_one`). Runs the
    step once; returns (the step, the cache row it writes, the token it chose)."""
    fwd = getattr(model, "_compiled_call", None) or model   # under "auto", what generate called
    cache = next(v for v in inputs.values() if hasattr(v, "get_seq_length"))
    rewind = rewind_one(cache)

    def step():
        rewind()
        return fwd(**inputs, return_dict=True).logits[:, -1].argmax(-1)

    row = int(cache.get_seq_length()) - 1
    token = int(step().flatten()[0])
    if int(cache.get_seq_length()) != row + 1:
        raise RuntimeError("the rewind does not undo a step's cache write in this transformers version")
    return step, row, token


def rewind_one(cache):
    """A function that moves `cache`'s write position back by one row: `crop(-1)` where every layer of
    the cache can crop; else (static layers, e.g. transformers 5's DSA `StaticIndexedLayer`) each layer's
    length counters, the tensor ones (which steer the writes, also inside a captured graph) in place and
    the host-side int (which `get_seq_length` reports). The replayed step then writes the same row again."""
    layers = getattr(cache, "layers", [])
    if layers and all(hasattr(layer, "crop") for layer in layers):
        return lambda: cache.crop(-1)
    counters = [(layer, name) for layer in layers
                for name in ("cumulative_length", "indexer_cumulative_length", "cumulative_length_int")
                if hasattr(layer, name)]
    if not counters:
        raise RuntimeError(f"no way to rewind a {type(cache).__name__} by one row in this transformers version")

    def rewind():
        for layer, name in counters:
            value = getattr(layer, name)
            if isinstance(value, int):
                setattr(layer, name, value - 1)
            else:
                value.sub_(1)
    return rewind


def device_time(step, a, torch) -> dict:
    """Device ms per decode step: the profiler's kernel sum, and CUDA-graph replays where capture works."""
    out = {}
    # 1. torch.profiler: the durations of the step's device events (kernels, copies) summed, each once
    # (the device events only: a CPU op's device time repeats its kernels'); no gaps between them
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    sums = []
    for _ in range(a.samples):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                step()
            torch.cuda.synchronize()
        us = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
        sums.append(us / 1e3 / a.steps)
    out["kernel_sum"] = {"method": "torch.profiler: CUDA kernel and copy durations per step, summed", **summary(sums)}
    # 2. a CUDA graph of the step, replayed between CUDA events (last: a failed capture may upset the context)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(a.samples):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(a.steps):
                graph.replay()
            t1.record()
            t1.synchronize()
            times.append(t0.elapsed_time(t1) / a.steps)
        out["graph_replay"] = {"method": "CUDA events around CUDA-graph replays of the step", **summary(times)}
    except Exception as e:
        out["graph_replay"] = {"error": f"capture failed: {type(e).__name__}: {e}"[:500]}
    return out


# --- the comparison ---------------------------------------------------------------------------------------
def combine(jt_path: str, hf_paths: list[str]) -> dict:
    """transformers / jtilert for each jtilert backend and transformers run: wall clock (generate vs
    generate and vs stream) and device time (graph replay vs jitted loop, kernel sum vs kernel sum)."""
    with open(jt_path) as f:
        jt = json.load(f)
    hfs = []
    for p in hf_paths:
        with open(p) as f:
            hfs.append(json.load(f))

    def ratio(x, y):
        return x / y if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y > 0 else None

    def agree(x, y):   # leading generated tokens the two sides agree on (same weights, same prompt)
        n = 0
        for u, v in zip(x or [], y or []):
            if u != v:
                break
            n += 1
        return n

    rows = []
    for hf in hfs:
        for run in jt["runs"]:
            same = ("folder", "context", "new", "seed")
            if [hf[k] for k in same] != [jt[k] for k in same]:
                raise SystemExit(f"{same} = {[hf[k] for k in same]}: not what {jt_path} measured")
            hf_ms = hf.get("generate", {}).get("ms_per_token", {}).get("median")
            dev = hf.get("device") if isinstance(hf.get("device"), dict) else {}
            # why a transformers device figure is missing: "not available on cpu", or the error
            note = hf.get("device") if isinstance(hf.get("device"), str) else dev.get("error") or \
                dev.get("graph_replay", {}).get("error")
            graph = dev.get("graph_replay", {}).get("median")
            ksum = dev.get("kernel_sum", {}).get("median")
            rows.append({
                "jtilert_backend": run["backend"], "transformers_compile": hf.get("compile"),
                "transformers_error": hf.get("error"),
                "wall_ms_per_token": {"transformers generate": hf_ms,
                                      "jtilert generate": run["generate"]["ms_per_token"]["median"],
                                      "jtilert stream": run["stream"]["ms_per_token"]["median"]},
                "wall_ratio_vs_generate": ratio(hf_ms, run["generate"]["ms_per_token"]["median"]),
                "wall_ratio_vs_stream": ratio(hf_ms, run["stream"]["ms_per_token"]["median"]),
                "device_ms_per_step": {"transformers graph replay": graph, "jtilert jitted loop": run["device"]["step_ms"],
                                       "transformers kernel sum": ksum,
                                       "jtilert kernel sum": run["device"]["kernel_sum_ms"]},
                "device_ratio_graph_vs_loop": ratio(graph, run["device"]["step_ms"]),
                "device_ratio_kernel_sums": ratio(ksum, run["device"]["kernel_sum_ms"]),
                "device_note": note,
                "same_leading_tokens": agree(hf.get("tokens"), run.get("tokens")),
            })
    return {"ratios": "transformers / jtilert (above 1: jtilert faster)", "folder": jt["folder"],
            "context": jt["context"], "new": jt["new"], "jtilert": jt_path, "transformers": hf_paths,
            "cards": sorted({jt["card"], *(h["card"] for h in hfs)}), "rows": rows}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", help="the HF checkpoint folder both sides load")
    p.add_argument("--side", choices=["jtilert", "transformers"])
    p.add_argument("--combine", nargs="+", metavar="JSON", help="the jtilert JSON, then transformers JSONs")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (cached positions at the first step)")
    p.add_argument("--new", type=int, default=64, help="tokens to generate per call")
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="steps per device-time sample")
    p.add_argument("--seed", type=int, default=0, help="the prompt's seed")
    p.add_argument("--backend", default="pallas,reference", help="jtilert: comma-separated decode backends")
    p.add_argument("--compile", default="off", choices=["off", "auto", "default", "reduce-overhead",
                                                        "max-autotune-no-cudagraphs"],
                   help="transformers: off (eager), auto (generate's own choice: with a static cache on a GPU "
                        "it compiles the decode step), or a torch.compile mode for model.forward")
    p.add_argument("--device", default="cuda", help="transformers: torch device")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else list(argv)   # for the JSON's command
    a.gpu_before = gpu_state()
    if a.combine:
        if len(a.combine) < 2:
            p.error("--combine JTILERT_JSON TRANSFORMERS_JSON [...]")
        result = combine(a.combine[0], a.combine[1:])
        write(result, a.out)
        return result
    if not (a.folder and a.side):
        p.error("give FOLDER and --side, or --combine")
    if a.new < 3:
        p.error("--new must be at least 3 (tokens after the first are timed)")
    return jtilert_side(a) if a.side == "jtilert" else transformers_side(a)


if __name__ == "__main__":
    main()
