"""Could XLA itself write each step's token to pinned host memory, with no custom call (the token
ring's write is one, and a custom call at the step's end costs the plain stream ~0.12 ms a step,
bench/RESULTS.md session 44)? A toy device loop, as `Engine.loop_options` compiles the stream's, whose
carried token buffer is in pinned host memory: each step's token goes there by a dynamic-update-slice
(JAX's `device_put` to `pinned_host` inside the loop). Compiled for the compile-only H200 of
bench/xla_kernels.py (no GPU needed); prints XLA's thunk sequence and what `xla_kernels.graph` reads
from it: whether the loop stays one CUDA graph with nothing outside (`--control`: the same loop with its
ring in device memory).

The compile-only device has no memory kinds, so JAX drops them while lowering: the memory kinds and
the placement annotation are written into the lowered module's text before XLA compiles it.

    JAX_PLATFORMS=cpu .venv-xla/bin/python -m bench.experiments.ring_host_copy [--control] [--dump DIR]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import compiler
from jax._src.interpreters import mlir
from jax._src.lib import xla_client as xc
from jax._src.lib.mlir import ir

from bench.xla_kernels import graph, h200
from jtilert.ops.table import STEP_XLA_OPTIONS

MARK = 1000   # added to each token: finds the token's value in the module's text


def toy_loop(x, ring):
    def step(i, carry):
        x, ring = carry
        x = jnp.tanh(x @ x) + i
        token = jnp.argmax(x[0]).astype(jnp.int32)[None] + MARK
        return x, jax.lax.dynamic_update_slice(ring, token, (i % ring.shape[0],))
    return jax.lax.fori_loop(0, 8, step, (x, ring))


def host_ring_module(text: str) -> str:
    """The lowered toy loop with its ring (argument and result 1) in pinned host memory and each token
    placed there before the dynamic-update-slice, as JAX lowers a `device_put` to `pinned_host`."""
    text = text.replace("%arg1: tensor<64xi32> {", '%arg1: tensor<64xi32> {mhlo.memory_kind = "pinned_host", ')
    text = re.sub(r'(tensor<64xi32> \{jax.result_info = "result\[1\]")', r'\1, mhlo.memory_kind = "pinned_host"', text)
    add = re.search(r"%(\d+) = stablehlo.add %\d+, %\w+ : tensor<1xi32>", text)
    token = add.group(1)
    place = (f"\n      %host{token} = stablehlo.custom_call @annotate_device_placement(%{token}) {{has_side_effect = true, "
             'mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}} : (tensor<1xi32>) -> tensor<1xi32>')
    text = text.replace(add.group(0), add.group(0) + place)
    return re.sub(rf"dynamic_update_slice (%iterArg_\d+), %{token},", rf"dynamic_update_slice \1, %host{token},", text)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--control", action="store_true", help="the ring in device memory")
    ap.add_argument("--dump", help="keep XLA's dump here (default: a temporary folder)")
    a = ap.parse_args(argv)
    dev = h200()
    lowered = jax.jit(toy_loop, donate_argnums=(0, 1)).trace(
        jax.ShapeDtypeStruct((64, 64), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.int32)).lower(
        lowering_platforms=("cuda",))
    text = lowered.as_text() if a.control else host_ring_module(lowered.as_text())
    module = ir.Module.parse(text, context=mlir.make_ir_context())
    with tempfile.TemporaryDirectory() as tmp:
        where = a.dump or tmp
        options = {**dict(STEP_XLA_OPTIONS), "xla_gpu_graph_min_graph_size": 1, "xla_dump_to": where}
        opts = compiler.get_compile_options(num_replicas=1, num_partitions=1, device_assignment=np.array([[dev.id]]),
                                            backend=dev.client, env_options_overrides=options)
        dev.client.compile(module, executable_devices=xc.DeviceList((dev,)), compile_options=opts)
        seq = next(pathlib.Path(where).glob("*thunk_sequence_after_thunk_passes.txt")).read_text()
    print(seq)
    launched = graph(seq)
    print(json.dumps(launched))
    return launched


if __name__ == "__main__":
    main()
