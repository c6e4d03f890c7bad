"""Time per output token of transformers' own DeepSeek-V3.2 / GLM-5 model on the same weights (issue 7).

    python3 -m bench.transformers_decode HF_FOLDER --context 1024 --new 64 [--compile [MODE]] [--out r.json]

What a user would otherwise run: `AutoModelForCausalLM` in bf16 on the GPU, greedy `generate` with
a static cache, optionally `torch.compile` (mode "default"; "reduce-overhead", which adds CUDA graphs,
fails in transformers 5.17's DeepSeek-V3.2 on the H200 image: its indexer cache bumps a counter
in place, which the graph trees reject with "Pointer argument must be either uint64 or have
data_ptr method"). TPOT =
(time of generate(new + 1) − time of generate(1)) / new, after a warm-up of each, synchronised.
Runs under the GPU image's torch + transformers; no jtilert import.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generate(model, ids, new: int) -> float:
    sync()
    t = time.perf_counter()
    # pad_token_id: the benchmark presets have no end-of-sequence token for generate to borrow one from
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
                   pad_token_id=0)
    sync()
    return time.perf_counter() - t


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--compile", nargs="?", const="default", default=None,
                   choices=["default", "reduce-overhead", "max-autotune-no-cudagraphs"], help="torch.compile mode")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda")
    a = p.parse_args(argv)

    model = AutoModelForCausalLM.from_pretrained(a.folder, dtype=torch.bfloat16).to(a.device).eval()
    if a.compile:
        model.forward = torch.compile(model.forward, mode=a.compile, fullgraph=False)
    ids = torch.randint(0, model.config.vocab_size, (1, a.context), device=a.device)
    with torch.inference_mode():
        timed_generate(model, ids, 1)
        timed_generate(model, ids, a.new + 1)
        one = [timed_generate(model, ids, 1) for _ in range(a.repeats)]
        many = [timed_generate(model, ids, a.new + 1) for _ in range(a.repeats)]
    tpot = (statistics.median(many) - statistics.median(one)) / a.new
    result = {"folder": a.folder, "context": a.context, "new": a.new, "compile": a.compile,
              "tpot_ms": tpot * 1e3, "tok_s": 1 / tpot,
              "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
              "torch": torch.__version__}
    print(json.dumps(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
