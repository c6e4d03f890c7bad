"""The token ring: a decode step's new tokens for the host at a fixed address (cuda/src/ring.cu).

A step that returns its token as an output gets a new output buffer on every call, and XLA updates its
command buffer for the moved address before each launch. ``write(pos, values, count)`` instead has one
kernel copy the step's tokens into a slot of pinned host memory that the CUDA engine allocated once per
device (slot ``pos`` mod SLOTS, keyed by ``pos``), and returns the next step's position, ``pos +
count``: the step carries that position, which keeps the call in the program, so every output of the
step is a donated carried array. (The call is not side-effecting: a side-effecting FFI call costs
every launch of the step about a millisecond more, bench/RESULTS.md session 36.)
``TokenRing(device).read(pos)`` waits on the host until the slot's key is ``pos`` and returns the
values. The write needs the engine (a GPU): elsewhere it does not lower, and ``TokenRing`` raises.
"""

from __future__ import annotations

import ctypes
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from jtilert.ffi import _lib
from jtilert.ffi import ops as _ops

SLOTS, SLOT_INTS = 64, 8            # JT_RING_SLOTS, JT_RING_SLOT_INTS
MAX_VALUES = SLOT_INTS - 2          # JT_RING_MAX_VALUES

token_ring_p = Primitive("jtilert_token_ring")


def _abstract(pos, values, count):
    # int32 [1]; inside shard_map varying along every axis an operand varies along
    return _ops._out_aval(pos, None, shape=(1,), dtype=np.int32,  # noqa: SLF001
                          extra_vma=_ops._vma(values) | _ops._vma(count))  # noqa: SLF001


token_ring_p.def_abstract_eval(_abstract)
token_ring_p.def_impl(jax.jit(lambda *args: token_ring_p.bind(*args)))


def _no_engine(ctx, *operands):
    raise NotImplementedError("token_ring: the step's tokens go to the host through the CUDA engine, "
                              "which runs on a GPU only")


def _lower_cuda(ctx, pos, values, count):
    if not _ops.EMIT_WITHOUT_GPU:  # noqa: SLF001
        lib, why = _lib.load()
        if lib is None:
            raise NotImplementedError(f"token_ring: the CUDA engine is not loaded ({why})")
    # The next position is written over the key's buffer: a loop that carries it then needs no copy into
    # the carried buffer after the write (a memcpy node on which the next step would wait).
    return jax.ffi.ffi_lowering("jtilert_token_ring", operand_output_aliases={0: 0})(ctx, pos, values, count)


mlir.register_lowering(token_ring_p, _no_engine)
mlir.register_lowering(token_ring_p, _lower_cuda, platform="cuda")


def write(pos, values, count=None):
    """Writes ``values`` (int32 [k], 1 ≤ k ≤ MAX_VALUES) and ``count`` (how many of them the host should
    take; default k; 0 writes nothing) into the token ring under the key ``pos`` (an int32 scalar or [1]:
    the step's position, which only grows within a generation). Returns the next position, ``pos +
    count``, in ``pos``'s shape: carry it to the next step (an unused result lets JAX and XLA drop the
    write)."""
    values = jnp.ravel(jnp.asarray(values, jnp.int32))
    if not 1 <= values.shape[0] <= MAX_VALUES:
        raise ValueError(f"token_ring: 1 to {MAX_VALUES} values, got {values.shape[0]}")
    count = jnp.int32(values.shape[0]) if count is None else count
    as_one = lambda v: jnp.reshape(jnp.asarray(v, jnp.int32), (1,))
    return jnp.reshape(token_ring_p.bind(as_one(pos), values, as_one(count)), jnp.shape(pos))


_lock = threading.Lock()
_in_use: set[int] = set()   # the devices whose ring an open stream reads


def acquire(rings) -> bool:
    """Takes the devices of `rings` (`TokenRing`s) for one stream: False (nothing taken) where an open
    stream holds any of them. A stream's steps write into the ring of every device they run on, and two
    streams writing into one ring would share its keys."""
    devices = {r.device.id for r in rings}
    with _lock:
        if devices & _in_use:
            return False
        _in_use.update(devices)
        return True


def release(rings) -> None:
    """Gives back what `acquire(rings)` took."""
    with _lock:
        _in_use.difference_update(r.device.id for r in rings)


class TokenRing:
    """A device's token ring as the host reads it (the engine allocates it on first use); a stream takes
    it with `acquire` first."""

    def __init__(self, device: jax.Device):
        lib, why = _lib.load()
        if lib is None:
            raise RuntimeError(f"token ring: the CUDA engine is not loaded ({why})")
        self.device = device
        addr = lib.token_ring(int(device.local_hardware_id))
        self.slots = np.ctypeslib.as_array((ctypes.c_int32 * (SLOTS * SLOT_INTS)).from_address(addr))
        self.slots = self.slots.reshape(SLOTS, SLOT_INTS)

    def clear(self) -> None:
        """Every key -1: call it before a generation starts, with no step of an earlier one running."""
        self.slots[:, 0] = -1

    def read(self, pos: int, timeout_s: float = 60.0) -> np.ndarray:
        """The values of the step keyed ``pos`` (as many as its count), once its slot holds them."""
        slot = self.slots[pos % SLOTS]
        spins = 0
        deadline = None
        while slot[0] != pos:   # the key is written last (ring.cu's protocol)
            spins += 1
            if spins % 4096 == 0:
                now = time.perf_counter()
                deadline = deadline or now + timeout_s
                if now > deadline:
                    keys = sorted(int(k) for k in self.slots[:, 0] if k >= 0)
                    raise TimeoutError(f"token ring: no step wrote position {pos} within {timeout_s} s "
                                       f"(its slot holds key {int(slot[0])}; the ring's keys: {keys})")
        return slot[2:2 + int(slot[1])].copy()
