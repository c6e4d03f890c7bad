"""What a user waits for, in one JSON (issue 15): the plain and MTP speculative decode steps, tokens per
second as a function of MTP acceptance, prefill of a 1K and a 32K prompt, time to first token.

    PYTHONPATH=. python3 -m bench.latency --decode decode-mtp.json --prefill prefill.json \
        --out bench/results/latency-61.json

Reads what `bench.decode --mtp` and `bench.prefill` wrote in the same session (their card, date and
commands are kept) and measures the acceptance of the embedded tiny model's MTP block (greedy, on its
own training text). An MTP step (verify 2 tokens + draft the next) yields 1 + a tokens on average at
acceptance a, so its tokens per second are (1 + a) / mtp_step; the plain step yields 1.
"""

from __future__ import annotations

import argparse
import json

import jax

import jtilert

from bench import provenance


def tiny_acceptance(tokens: int = 200) -> float:
    """Acceptance of the embedded tiny model's MTP drafts over `tokens` greedy tokens."""
    model = jtilert.load("tiny")
    tok = jtilert.tokenizer("tiny")
    gen = jtilert.Generator(model, max_seq_len=tokens + 64, mtp=True)
    gen.generate(tok.encode("The quick brown fox jumps over the lazy dog. "), max_new_tokens=tokens)
    return float(gen.stats["acceptance"])


def combine(decode: dict, prefill: dict, acceptance: float, backend: str = "pallas") -> dict:
    plain = next(r for r in decode["runs"] if r["backend"] == backend and not r["mtp"])
    mtp = next(r for r in decode["runs"] if r["backend"] == backend and r["mtp"])

    def best(length: int) -> dict | None:   # the fastest chunk size for this prompt length
        runs = [r for r in prefill["runs"] if r["length"] == length and r.get("moe", "grouped") == "grouped"
                and "prefill_s_median" in r]
        return min(runs, key=lambda r: r["prefill_s_median"]) if runs else None

    p1k, p32k = best(1024), best(32768)
    out = {"device": decode["device"], "date": decode["date"], "commit": provenance.commit(), "preset": decode["preset"],
           "layers": decode["layers"], "context": decode["context"], "backend": backend,
           "plain_step_ms": plain["step_ms_median"], "mtp_step_ms": mtp["step_ms_median"],
           "floor_ms": decode["floor_ms"],
           "tokens_per_s": {"plain": 1e3 / plain["step_ms_median"]},
           "mtp_acceptance_tiny": acceptance,
           "prefill_tok_s_1k": p1k and p1k["prompt_tok_s"], "prefill_chunk_1k": p1k and p1k["chunk"],
           "ttft_s_1k": p1k and p1k["ttft_s"],
           "prefill_s_32k": p32k and p32k["prefill_s_median"], "prefill_chunk_32k": p32k and p32k["chunk"],
           "prefill_runs": prefill["runs"]}
    for a in sorted({0.0, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, round(acceptance, 3)}):
        out["tokens_per_s"][f"mtp@{a}"] = (1 + a) * 1e3 / mtp["step_ms_median"]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode", required=True, help="bench.decode JSON with --mtp runs")
    p.add_argument("--prefill", required=True, nargs="+", help="bench.prefill JSON files (their runs are pooled)")
    p.add_argument("--backend", default="pallas")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    with open(a.decode) as f:
        decode = json.load(f)
    prefill = {"runs": []}
    for path in a.prefill:   # a prefill part that did not run leaves its figures empty (null)
        try:
            with open(path) as f:
                prefill["runs"] += json.load(f)["runs"]
        except FileNotFoundError:
            print(f"bench.latency: no {path}", flush=True)
    out = combine(decode, prefill, tiny_acceptance(), a.backend)
    out["jax"] = jax.__version__
    print(json.dumps({k: v for k, v in out.items() if k != "prefill_runs"}, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
