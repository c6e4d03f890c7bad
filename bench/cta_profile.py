"""Mosaic-GPU's on-device profiler, CTA by CTA: where each CTA of a kernel starts, what its named
phases take, and when it ends.

`kernel_profiles(path)` makes every Mosaic-GPU kernel built inside record, per warpgroup, the entry and
exit of each `jax.named_scope` in its body (SM cycles, `%clock`) and its start on the global timer (ns),
and write one JSON trace per kernel call under `path` (jax's `CompilerParams.profile_space`). The
kernel's body is wrapped in a scope named after the kernel (`kernel_name`), so a trace says which
kernel it is and every CTA's range covers its whole run. The kernels add their own phases with
`hw.phase` / `jax.named_scope` (the GEMV's: x_wait, x_prep, step, epilogue); without a profile those
scopes emit nothing. `read_trace` turns a trace into per-CTA ranges.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu

import jtilert.pallas._hopper as hw


@contextlib.contextmanager
def kernel_profiles(path: str, events: int = 64):
    """Mosaic-GPU kernels built inside collect an on-device profile of up to `events` ranges per
    warpgroup, their body in a range named after the kernel, and write it under `path`."""
    build, limit = plgpu.kernel, hw.SMEM_BYTES

    def kernel(body, *args, compiler_params=None, kernel_name=None, **kwargs):
        params = dataclasses.replace(compiler_params or plgpu.CompilerParams(), profile_space=events,
                                     profile_dir=path)
        name = kernel_name or getattr(body, "__name__", "kernel")

        def named(*refs, **kw):
            with jax.named_scope(name):
                return body(*refs, **kw)

        return build(named, *args, compiler_params=params, kernel_name=kernel_name, **kwargs)

    # Mosaic puts the profile buffer (events 32-bit entries per warp, up to 16 warps) after the
    # kernel's own shared memory, on a 1 KiB boundary: the kernels that size themselves to the limit
    # (the GEMV's pipeline depth) are given that much less.
    plgpu.kernel, hw.SMEM_BYTES = kernel, limit - (events * 4 * 16 + hw.SMEM_ALIGN)
    try:
        yield
    finally:
        plgpu.kernel, hw.SMEM_BYTES = build, limit


@dataclasses.dataclass
class Cta:
    """One CTA's (warpgroup's) trace: its start on the global timer (µs) and its ranges (name, begin,
    end) in SM cycles since its first event."""

    start_us: float
    ranges: list

    @property
    def span(self) -> float:
        return max(e for _, _, e in self.ranges)

    def total(self, name: str) -> float:
        return sum(e - b for n, b, e in self.ranges if n == name)

    def all(self, name: str) -> list:
        return sorted((b, e) for n, b, e in self.ranges if n == name)


def cta(events: list[dict]) -> Cta:
    """Mosaic's Chrome-trace events of one CTA, in order (ts = the CTA's global-timer start in µs plus
    its cycles since its first event / 1000) → its ranges."""
    t0 = events[0]["ts"]
    opened, ranges = {}, []
    for e in events:
        at = (e["ts"] - t0) * 1e3
        if e["ph"] == "B":
            opened.setdefault(e["name"], []).append(at)
        else:
            ranges.append((e["name"], opened[e["name"]].pop(), at))
    return Cta(t0, ranges)


def read_trace(path: str) -> tuple[str, list[Cta]]:
    """(the kernel's name: its CTAs' outermost range, its CTAs) of one trace file."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    by_tid = {}
    for e in events:
        by_tid.setdefault(e["tid"], []).append(e)
    ctas = [cta(ev) for _, ev in sorted(by_tid.items())]
    return (events[0]["name"] if events else ""), ctas


def sm_clock_mhz() -> float | None:
    """The SM clock nvidia-smi reports now (MHz), or None without nvidia-smi."""
    try:
        txt = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return float(txt.split()[0])
    except Exception:  # noqa: BLE001 - cycles only
        return None
