"""The `jtilert` command: generate text, describe a checkpoint, convert and verify checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
import time


def _generate(args) -> None:
    import jtilert
    from jtilert.store import checkpoint
    from jtilert.runtime.tokenizer import load_tokenizer

    sampling = jtilert.Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    path = checkpoint.resolve(args.model)
    tok = load_tokenizer(path)
    ids = tok.encode(args.prompt)
    mesh = jtilert.make_mesh(args.tp) if args.tp > 1 else None
    model = jtilert.load(path, mesh=mesh)
    max_seq_len = args.max_seq_len or len(ids) + args.max_new_tokens
    gen = jtilert.Generator(model, max_seq_len=max_seq_len, sampling=sampling, mtp=args.mtp, backend=args.backend,
                            mesh=mesh)
    gen._check_prompt(ids, args.max_new_tokens)  # bad input fails before any device work
    decode = tok.decoder()
    print(args.prompt, end="", flush=True)
    t0 = time.perf_counter()
    n = 0
    for t in gen.stream(ids, args.max_new_tokens):
        n += 1
        print(decode([t]), end="", flush=True)
    total = time.perf_counter() - t0
    s = gen.stats
    decode_s = s.get("decode_s", 0.0)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    line = f"\n[{n} tokens in {total:.2f} s: prefill {s.get('prefill_s', 0):.2f} s, decode {rate:.1f} tokens/s"
    if args.mtp:
        acc = gen.acceptance
        line += f", MTP acceptance {acc:.2f}" if acc is not None else ", MTP acceptance n/a"
    print(line + "]")


def _info(args) -> None:
    from jtilert.store import checkpoint
    print(json.dumps(checkpoint.info(args.path), indent=1))


def _convert(args) -> None:
    from jtilert.store import convert
    convert.convert(args.src, args.dst, tp=args.tp, dtype=args.dtype, layers=args.layers, mtp=not args.no_mtp,
                  overwrite=args.overwrite, progress=not args.quiet, chunk_bytes=args.chunk_mb << 20)


def _verify(args) -> None:
    from jtilert.store import convert
    print(json.dumps(convert.verify(args.dst, against=args.against, samples=args.samples, progress=not args.quiet),
                     indent=1))


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

    v = sub.add_parser("verify", help="check a converted checkpoint's tensors and checksums")
    v.add_argument("dst")
    v.add_argument("--against", default=None, metavar="SRC", help="also spot-check values against the HF source")
    v.add_argument("--samples", type=int, default=2, help="rows spot-checked per matrix")
    v.add_argument("--quiet", action="store_true", help="no progress bar")
    v.set_defaults(run=_verify)

    args = p.parse_args(argv)
    try:
        args.run(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"jtilert: error: {e}", file=sys.stderr)
        # the error ends the command: the reads a failed orbax restore leaves unfinished would each print a
        # traceback when collected at exit
        sys.unraisablehook = lambda unraisable: None
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
