"""On a GPU, under PjRt's dispatch thread (PJRT_GPU_ENABLE_ASYNC_DISPATCH=1): Generator.stream's forms,
each in a process of its own (a crash ends only its own form), with the program cache on and off.
Forms: "ring" (the token ring's stream), "returning" (the steps that return their token, as the Engine
builds them under the thread: in device memory), and "pinned" (those steps forced to write the token
into pinned host memory, as without the thread: jax 0.11.2 reads it before the step writes it, or
crashes). "ring" and "returning" must give the tokens that the returning steps give without the thread;
"pinned" is reported, for the day jax mends it."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

FORMS = ("ring", "returning", "pinned")


def one(form: str) -> dict:
    import jtilert
    from jtilert.ops.table import DecodeConfig
    from jtilert.runtime.generate import Compiled

    cfg = dataclasses.replace(DecodeConfig(backend="pallas"), token_ring=form == "ring")
    gen = jtilert.Generator(jtilert.load("tiny"), max_seq_len=1024, config=cfg)
    if form == "pinned":
        eng = gen.engine
        host = eng.sharding.with_memory_kind("pinned_host")
        eng.decode = Compiled(eng._wrap(eng._decode), (1, 2, 3, 4), "decode_pinned", eng, eng.step_options,
                              out_shardings=(None,) * 4 + (host,))
    prompt = jtilert.tokenizer("tiny").encode("The if statement")
    out = []
    for _ in range(2):
        t0 = time.perf_counter()
        ids = list(gen.stream(prompt, 120, sampling=jtilert.Sampling(temperature=0.0)))
        out.append({"ids": ids, "s": time.perf_counter() - t0})
    return {"requests": out, "ms_per_token": gen.stats.get("ms_per_token")}


def run(form: str, env: dict) -> dict:
    p = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "--form", form], env=env,
                       capture_output=True, text=True, timeout=240)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    res = json.loads(lines[-1]) if p.returncode == 0 and lines else None
    tail = [x for x in p.stderr.splitlines() if "arning" not in x][-12:]
    return {"rc": p.returncode, "result": res, "stderr_tail": tail if p.returncode else []}


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--form":
        print(json.dumps(one(sys.argv[2])))
        return
    base = {k: v for k, v in os.environ.items() if k != "PJRT_GPU_ENABLE_ASYNC_DISPATCH"}
    want = run("returning", dict(base, JTILERT_PROGRAM_CACHE="off"))["result"]
    results, bad = {"without_thread": want}, want is None
    for cache in ("on", "off"):
        for form in FORMS:
            key = f"{form}/cache_{cache}"
            r = results[key] = run(form, dict(base, PJRT_GPU_ENABLE_ASYNC_DISPATCH="1", JTILERT_PROGRAM_CACHE=cache))
            same = r["result"] is not None and want is not None and [a["ids"] for a in r["result"]["requests"]] == [
                a["ids"] for a in want["requests"]]
            r["same_tokens"] = same
            bad += form != "pinned" and not same
            print(key, "rc", r["rc"], "same tokens as without the thread:", same, "ms/token",
                  r["result"] and r["result"]["ms_per_token"], flush=True)
            if r["rc"]:
                print("\n".join(r["stderr_tail"]), flush=True)
    if len(sys.argv) > 1:
        json.dump(results, open(sys.argv[1], "w"), indent=1)
    print("OK" if not bad else "FAILED")
    sys.exit(bool(bad))


if __name__ == "__main__":
    main()
