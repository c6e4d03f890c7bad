"""bench/clocks.py: nvidia-smi's samples while a block runs, summarised; nothing where there is no GPU."""

from __future__ import annotations

import os
import stat
import time
import types

from bench import clocks

GPU = types.SimpleNamespace(platform="gpu", local_hardware_id=1)


def _fake_smi(folder, lines):
    """An `nvidia-smi` that prints `lines` (one every 10 ms), then waits to be stopped; it records its
    arguments."""
    exe = folder / "nvidia-smi"
    body = "".join(f'echo "{line}"; sleep 0.01\n' for line in lines)
    exe.write_text(f'#!/bin/sh\necho "$@" > "{folder}/args"\n{body}exec sleep 30\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_the_block_is_sampled_and_summarised(tmp_path, monkeypatch):
    _fake_smi(tmp_path, ["1980, 3201, 612.5, 55", "1755, 3201, 640.0, 56", "[N/A], 3201, 600.0, 55",
                         "1980, 3201, 650.0, 57"])
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    got = {}
    with clocks.sampled(got, "loop", GPU):
        time.sleep(0.5)
    assert got["loop"] == {"samples": 3, "sm_mhz_median": 1980.0, "mem_mhz_median": 3201.0, "power_w_median": 640.0,
                           "temp_c_median": 56.0, "sm_mhz_min": 1755.0}
    args = (tmp_path / "args").read_text()
    assert "--id=6" in args and "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu" in args


def test_without_a_gpu_or_nvidia_smi_it_says_so(tmp_path, monkeypatch):
    got = {}
    monkeypatch.setenv("PATH", str(tmp_path))
    with clocks.sampled(got, "a", GPU):
        pass
    assert got == {"a": {"unavailable": "nvidia-smi not found"}}
    _fake_smi(tmp_path, [])
    with clocks.sampled(got, "b", types.SimpleNamespace(platform="cpu")):
        pass
    assert got["b"] == {"unavailable": "not a GPU"}
