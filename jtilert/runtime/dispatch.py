"""PjRt's GPU dispatch thread: where a program's launch runs on the host.

A call of a compiled step normally does all of its launch on the caller's thread: PjRt handles the
arguments, then XLA walks the program's thunks twice (prepare, initialize; every Pallas kernel's
prepare takes a process-wide lock) and launches its CUDA graph. With the dispatch thread on, PjRt's GPU
client hands everything after the arguments to a thread of its own, so the call returns once its
arguments are handled and the caller can read the previous step's token while the next one launches.
It is PjRt's setting `PJRT_GPU_ENABLE_ASYNC_DISPATCH=1`, read once, when JAX makes its GPU client;
jax does not turn it on.

One hazard, found on the GPU with jax 0.11.2: a program that writes an output into pinned host memory
is read too early (stale values) or crashes the process under the dispatch thread. jtilert's steps
keep their tokens in device memory (or the token ring) when it is on (`Engine`); code of the caller's
own that writes pinned host outputs meets the same hazard.
"""

from __future__ import annotations

import os

from jax._src import xla_bridge

ENV = "PJRT_GPU_ENABLE_ASYNC_DISPATCH"


def on() -> bool:
    """Whether the GPU client runs (or will run, when made) its launches on the dispatch thread."""
    return os.environ.get(ENV, "").strip() == "1"


def clients_made() -> bool:
    """Whether JAX has made its clients, after which the dispatch thread can no longer change."""
    return xla_bridge.backends_are_initialized()


def use_dispatch_thread() -> None:
    """Turn the dispatch thread on for this process. It must come before JAX makes its clients (before
    the first array, device query or compile); after that the setting can no longer change and this
    raises, unless the thread is on already (`PJRT_GPU_ENABLE_ASYNC_DISPATCH=1` in the environment)."""
    if on():
        return
    if clients_made():
        raise RuntimeError(f"use_dispatch_thread: JAX's clients are made already, so the dispatch thread can no "
                           f"longer be turned on; call it before anything else uses JAX, or start the process "
                           f"with {ENV}=1")
    os.environ[ENV] = "1"
