"""The `jtilert` command: generate text, describe a checkpoint, convert and verify checkpoints."""

from __future__ import annotations

import argparse
import json
import sys


def _generate(args) -> None:
    import jtilert
    from jtilert.parallel import sharding
    from jtilert.runtime import dispatch
    from jtilert.store import checkpoint
    from jtilert.runtime.tokenizer import load_tokenizer

    for flag, value, least in (("--tp", args.tp, 1), ("--max-new-tokens", args.max_new_tokens, 0),
                               ("--max-seq-len", args.max_seq_len, 0)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    # a process of its own runs jtilert's programs only, none with a pinned host output; called from a
    # process that uses JAX already (`jtilert.cli.main` from Python), the process keeps its setting
    if not args.no_dispatch_thread and not dispatch.clients_made():
        jtilert.use_dispatch_thread()
    sampling = jtilert.Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    path = checkpoint.resolve(args.model)
    cfg = checkpoint.config(path)
    sharding.check_tp(cfg, args.tp)
    tok = load_tokenizer(path)
    ids = tok.encode(args.prompt)
    # the cache holds the prompt and the new tokens: say so in the user's terms before loading anything
    need = len(ids) + args.max_new_tokens
    limit, what = ((args.max_seq_len, "--max-seq-len") if args.max_seq_len else
                   (cfg.max_position_embeddings, "the model's max_position_embeddings"))
    if need > limit:
        raise ValueError(f"the prompt ({len(ids)} tokens) and --max-new-tokens {args.max_new_tokens} need {need} "
                         f"positions, more than {what} ({limit})")
    mesh = jtilert.make_mesh(args.tp) if args.tp > 1 else None
    model = jtilert.load(path, mesh=mesh, check=not args.no_check)
    gen = jtilert.Generator(model, max_seq_len=args.max_seq_len or need, sampling=sampling, mtp=args.mtp,
                            backend=args.backend, mesh=mesh,
                            **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}))
    gen._check_prompt(ids, args.max_new_tokens)  # bad input fails before any device work
    decode = tok.decoder()
    print(args.prompt, end="", flush=True)
    n = 0
    for t in gen.stream(ids, args.max_new_tokens):
        n += 1
        print(decode([t]), end="", flush=True)
    print("\n" + _summary(n, gen.stats))


def _sizes(text: str) -> tuple[int, ...]:
    """"1024,64" → (1024, 64) (Generator checks the values)."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _summary(n: int, s: dict) -> str:
    """One line of what this generation measured: compilation, time to the first token, then the
    steady decode rate of the tokens after it."""
    line = (f"[{n} tokens: compile {s['compile_s']:.2f} s, first token {s['ttft_s']:.2f} s "
            f"({s['prompt_tokens']} prompt tokens)")
    if s.get("ms_per_token") is not None:
        line += f", then {s['ms_per_token']:.1f} ms/token ({s['tokens_per_s']:.1f} tokens/s)"
    if s.get("acceptance") is not None:
        line += f", MTP acceptance {s['acceptance']:.2f}"
    return line + "]"


def _info(args) -> None:
    from jtilert.store import checkpoint
    print(json.dumps(checkpoint.info(args.path), indent=1))


def _convert(args) -> None:
    from jtilert.store import convert
    convert.convert(args.src, args.dst, tp=args.tp, dtype=args.dtype, layers=args.layers, mtp=not args.no_mtp,
                  overwrite=args.overwrite, progress=not args.quiet, chunk_bytes=args.chunk_mb << 20)


def _verify(args) -> None:
    from jtilert.store import checkpoint
    print(json.dumps(checkpoint.verify(args.dst, against=args.against, samples=args.samples,
                                       progress=not args.quiet), indent=1))


def _message(e: BaseException) -> str:
    """One line for an error: an OSError as "file: reason" (its str is "[Errno 30] ...: 'file'")."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jtilert", description="Batch-1 decoding of DeepSeek-V3.2 / GLM-5 models in JAX")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="stream a continuation of a prompt")
    g.add_argument("--model", default="tiny", help="checkpoint path, HF folder, or embedded preset (default: tiny)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--mtp", action="store_true", help="speculative decoding with the MTP block")
    g.add_argument("--backend", default="reference", choices=["reference", "pallas"])
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (devices)")
    g.add_argument("--max-seq-len", type=int, default=0, help="cache size (default: prompt + new tokens)")
    g.add_argument("--prefill-chunk", type=_sizes, default=None, metavar="SIZES",
                   help="prompt tokens per prefill step, one size or several (each one compiled step); a prompt "
                        "runs in the chunks of least estimated cost (default 1024,128)")
    g.add_argument("--no-check", action="store_true",
                   help="load without comparing the checkpoint's files with their checksums")
    g.add_argument("--no-dispatch-thread", action="store_true",
                   help="launch each step from this thread, not PjRt's dispatch thread (jtilert.use_dispatch_thread, "
                        "on by default here: a call returns once its arguments are handled)")
    g.set_defaults(run=_generate)

    i = sub.add_parser("info", help="describe a checkpoint")
    i.add_argument("path")
    i.set_defaults(run=_info)

    c = sub.add_parser("convert", help="convert an HF folder into a jtilert checkpoint laid out for tp devices")
    c.add_argument("src", help="HF model folder (config.json + safetensors)")
    c.add_argument("dst", help="jtilert checkpoint folder to write")
    c.add_argument("--tp", type=int, default=1, help="tensor-parallel degree to lay the weights out for")
    c.add_argument("--dtype", choices=["fp8", "bf16", "fp32"], default=None,
                   help="weight format to write (default: the source's)")
    c.add_argument("--layers", default=None, metavar="A:B", help="keep decoder layers A..B-1 only")
    c.add_argument("--no-mtp", action="store_true", help="leave out the MTP block")
    c.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    c.add_argument("--chunk-mb", type=int, default=32,
                   help="chunk size C bounding host memory: peak RSS <= RSS after import + 6*C (MiB)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(run=_convert)

    v = sub.add_parser("verify", help="check a checkpoint's tensors and checksums")
    v.add_argument("dst")
    v.add_argument("--against", default=None, metavar="SRC", help="also spot-check values against the HF source")
    v.add_argument("--samples", type=int, default=2, help="rows spot-checked per matrix")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(run=_verify)

    args = p.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, OSError, MemoryError) as e:
        print(f"jtilert: error: {_message(e)}", file=sys.stderr)
        return 2
    return 0


def run() -> None:
    """The `jtilert` command."""
    sys.exit(main())


if __name__ == "__main__":
    run()
