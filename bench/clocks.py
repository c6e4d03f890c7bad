"""The GPU's clocks, power and temperature while a part of a benchmark runs.

`sampled(into, name, device)` runs `nvidia-smi` in the background while its block runs (one query
every `PERIOD_MS`; reading the clocks changes nothing on the GPU) and stores the medians in
`into[name]`. Latency-bound kernels (one CTA, a few) slow down with the SM clock while memory-bound
ones follow the memory clock, so a part whose small kernels run longer than another's (bench/RESULTS.md,
session 38: the served steps against the timing loop) can be read against its SM clock.

    clocks = {}
    with sampled(clocks, "timing_loop", jax.devices()[0]):
        ...
    clocks["timing_loop"]   # {"samples", "sm_mhz_median", "sm_mhz_min", "mem_mhz_median", ...}
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import threading

FIELDS = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
NAMES = ("sm_mhz", "mem_mhz", "power_w", "temp_c")
PERIOD_MS = 20


def smi_index(device) -> int:
    """nvidia-smi's index of a JAX GPU device: its ordinal, through CUDA_VISIBLE_DEVICES where that
    lists plain indices."""
    ordinal = int(getattr(device, "local_hardware_id", 0) or 0)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and all(v.isdigit() for v in visible) and ordinal < len(visible):
        return int(visible[ordinal])
    return ordinal


def summarize(rows: list[tuple[float, ...]]) -> dict:
    """The number of samples, each field's median and the SM clock's lowest."""
    if not rows:
        return {"samples": 0}
    return {"samples": len(rows), **{f"{n}_median": statistics.median(r[i] for r in rows) for i, n in enumerate(NAMES)},
            "sm_mhz_min": min(r[0] for r in rows)}


@contextlib.contextmanager
def sampled(into: dict, name: str, device, command: str = "nvidia-smi"):
    """Samples GPU `device`'s FIELDS while the block runs; `into[name]` = their summary (or why none:
    not a GPU, no nvidia-smi)."""
    exe = shutil.which(command)
    if getattr(device, "platform", "gpu") != "gpu" or exe is None:
        yield
        into[name] = {"unavailable": "not a GPU" if exe else f"{command} not found"}
        return
    proc = subprocess.Popen([exe, f"--id={smi_index(device)}", f"--query-gpu={','.join(FIELDS)}",
                             "--format=csv,noheader,nounits", f"-lms={PERIOD_MS}"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    rows: list[tuple[float, ...]] = []

    def read():
        for line in proc.stdout:
            try:
                values = tuple(float(v) for v in line.split(","))
            except ValueError:   # "[N/A]" or a message: not a sample
                continue
            if len(values) == len(FIELDS):
                rows.append(values)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(timeout=5)
    into[name] = summarize(rows)
