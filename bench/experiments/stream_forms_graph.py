"""On a machine without a GPU: the CUDA graphs XLA declares for the stream's program in four of
`stream_step`'s forms (`stream`, `stream_no_ring`, `stream_no_cond`, `stream_no_ring_no_cond`; each step's
tokens written at its end), compiled for the compile-only H200 (`bench.xla_kernels`). On an H100 the
first and the last ran 0.13-0.15 ms a step slower than the two others (bench/RESULTS.md, session 47):
does the graph XLA declares differ the same way? Prints each program's kernels a call, its loops and
conditionals, then the differences of the thunk sequences (after XLA's thunk passes: each thunk with its
predecessors and successors in the graph) between the forms with and without the ring write, with the
thunk numbers taken out.

    JAX_PLATFORMS=cpu .venv-xla/bin/python -m bench.experiments.stream_forms_graph [--layers 36]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import pathlib
import re
import tempfile
from unittest import mock

from bench import xla_kernels
from bench.experiments import stream_step
from jtilert.ffi import ring
from jtilert.model.presets import preset
from jtilert.model.transformer import Transformer

FORMS = {"stream": (False, False), "stream_no_ring": (True, False), "stream_no_cond": (False, True),
         "stream_no_ring_no_cond": (True, True)}   # name: (no ring write, no conditionals)


def normalized(thunks: str) -> list[str]:
    """The thunk sequence without thunk numbers (and fusion name suffixes), so two programs line up."""
    out = []
    for line in thunks.splitlines():
        line = re.sub(r"^( *)\d+: ", r"\1", line)
        line = re.sub(r"(prev|next)=\d+", r"\1", line)
        out.append(re.sub(r"_\d+ grid", " grid", line))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=36)
    a = p.parse_args(argv)
    cfg = preset("dsv32-tp8-shard", num_hidden_layers=a.layers)
    seqs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (no_ring, no_cond) in FORMS.items():
            with contextlib.ExitStack() as stack:
                if no_ring:
                    stack.enter_context(mock.patch.object(ring, "write", stream_step.no_ring_write))
                if no_cond:
                    stack.enter_context(mock.patch.object(Transformer, "next_token",
                                                          stream_step.next_token_without_conditionals))
                [r] = xla_kernels.compile_programs(cfg, context=4096, backend="pallas", mtp=False, loop=False,
                                                   want={"decode_stream"}, options={}, ring=True,
                                                   ring_write_behind=False, dump=f"{tmp}/{name}")
            [thunks] = pathlib.Path(tmp, name, "decode_stream").glob("*.thunk_sequence_after_thunk_passes.txt")
            seqs[name] = normalized(thunks.read_text())
            loops = ", ".join(f"{x['loop']} {x['trips']} × {x['kernels_per_trip']}" for x in r["loops"])
            print(f"{name}: {r['kernels']} kernels a call; loops {loops}; conditionals {r['conditionals']}; "
                  f"graph {r['graph']}", flush=True)
    for with_ring, without in (("stream", "stream_no_ring"), ("stream_no_cond", "stream_no_ring_no_cond")):
        print(f"\n--- {with_ring} → {without}: the thunk sequences' differences")
        print("\n".join(d for d in difflib.unified_diff(seqs[with_ring], seqs[without], lineterm="", n=0)
                        if not d.startswith(("---", "+++"))))
    return seqs


if __name__ == "__main__":
    main()
