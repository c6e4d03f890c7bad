"""Per-kernel timeline of one decode step: when each kernel starts and ends on the GPU, where the
GPU idles, and which kernels of a layer run one after another.

`bench.decode --timeline` runs one call of its device loop (4 steps) under JAX's profiler
(`trace_step`); this module reads the profiler's perfetto trace:

- `kernel_events`: the GPU's kernel / memcpy / memset records in the trace;
- `one_step`: those of one whole step, cut at the step's last kernel (`MARKER`, one per step);
- `summary`: the step's span, busy and idle time, its kernels in layers (`LAYER_START` opens each
  layer), per-kernel starts and durations for a few layers, the gaps where the GPU was idle, and a
  chain of kernels that ran one after another through the step (the likely critical path);
- `plot`: a Gantt chart of some layers of that summary;
- `trace_step`: one call under JAX's profiler, read into that summary.

What the trace holds (XLA's profiler, read from its source: tsl/profiler/convert/
trace_events_to_json.cc, xplane_to_trace_events.cc; xla/backends/profiler/gpu/cupti_collector.cc):
- every "X" event has `ts` and `dur` in microseconds since the profile started;
- metadata events ("ph": "M") name the processes (`process_name`) and their threads (`thread_name`):
  each GPU is a process named "/device:GPU:<n>" (pid 1 + n), the host's threads are one process
  "/host:CPU" (pid 701), TraceMe annotations and CUDA API calls (cuLaunchKernel, cuGraphLaunch, ...);
- on a GPU process each line (tid) is a CUDA stream, named "Stream #<id>(<record kinds>)" (e.g.
  "Stream #14(MemcpyD2D,Compute)"), and each event a CUPTI activity record: a kernel carries the
  arg `kernel_details` (registers, shared memory, grid, block), a copy `memcpy_details`, a memset
  `memset_details`; lines of other records ("CUPTI overhead") and events without those args are
  left out here; a record of a CUDA graph's node carries `cuda_graph_node_id`;
- kernels of a CUDA graph (XLA's command buffers) are recorded one by one, per graph node; CUPTI
  puts each branch of the graph on a stream id of its own (a step has dozens of them), so a stream is
  no lane of the program;
- a command buffer XLA makes anew under an active profiler (its graphs were evicted when another
  program's were made) it runs thunk by thunk, one kernel after another on one stream, not as a
  graph (xla_enable_command_buffers_during_profiling among the program's compile options does not
  change that); one whose graph is live runs as the graph: trace a program right after its untraced
  calls. summary's graph_records tells.

What the profiler does to the step: the traced step is slower than the timed one (each captured
loop iteration waits before its first kernel) (CUPTI's per-kernel records; the run's untraced_step_us beside the span says by how much),
and CUPTI can drop records (see `trace_step`): `step_kernel_counts` tells a step that lost some.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import os
import pathlib
import statistics

MARKER = "jtilert_lm_head_topk"   # the lm head's top-k: the last kernel of every decode step, one per step
LAYER_START = "jtilert_mla_prep"  # the attention's first kernel: one per layer, the first of each layer
GPU_PROCESS = "/device:GPU:"      # the process name prefix of a GPU in the trace
# the arg each kind of CUPTI record carries on a GPU line: how a kernel is told from a copy or a memset
KIND_ARGS = (("kernel_details", "kernel"), ("memcpy_details", "memcpy"), ("memset_details", "memset"))
DETAIL_LAYERS = (4, 12)  # the layers trace_step's summary lists kernel by kernel (4 to 11: two loop iterations
                         # of 4 layers, past DeepSeek's 3 dense layers)


def load_trace(folder) -> list[dict]:
    """The events of the newest perfetto_trace.json.gz under `folder` (what
    `jax.profiler.trace(folder, create_perfetto_trace=True)` writes)."""
    path = max(pathlib.Path(folder).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    with gzip.open(path) as f:
        return _events(json.load(f))


def _events(trace) -> list[dict]:
    """The event list of a trace as loaded from JSON (an object with "traceEvents", or the list itself)."""
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def process_names(trace) -> dict:
    """{pid: process name} from the trace's process_name metadata events."""
    return {e["pid"]: e.get("args", {}).get("name", "") for e in _events(trace)
            if e.get("ph") == "M" and e.get("name") == "process_name"}


def thread_names(trace) -> dict:
    """{(pid, tid): thread name} from the trace's thread_name metadata events (on a GPU: the streams)."""
    return {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in _events(trace)
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


def launch_details(details) -> dict:
    """A kernel record's `kernel_details` ("regs:168 static_shared:0 dynamic_shared:111672 grid:35,4,1
    block:128,1,1 ...") as {key: int, or a tuple of ints for grid and block}; {} where there is none.
    What decides how many CTAs an SM holds: registers a thread × threads a CTA, shared memory a CTA."""
    out = {}
    for item in str(details or "").split():
        key, _, value = item.partition(":")
        try:
            nums = tuple(float(v) if "." in v else int(v) for v in value.split(","))
        except ValueError:
            continue
        if key and nums:
            out[key] = nums if len(nums) > 1 else nums[0]
    return out


def kernel_events(trace) -> list[dict]:
    """The GPU records of a trace (loaded JSON or its event list), by start: {name, kind ("kernel",
    "memcpy", "memset"), start_us, dur_us, device (the process name), stream (the line's name), graph
    (a node of a CUDA graph), launch (`launch_details`)}. Host events and GPU records of other kinds are
    left out."""
    events = _events(trace)
    procs, threads = process_names(events), thread_names(events)
    gpus = {pid for pid, name in procs.items() if name.startswith(GPU_PROCESS)}
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in gpus:
            continue
        args = e.get("args") or {}
        kind = next((k for arg, k in KIND_ARGS if arg in args), None)
        if kind is None:
            continue
        out.append({"name": e.get("name", ""), "kind": kind, "start_us": float(e["ts"]),
                    "dur_us": float(e.get("dur", 0.0)), "device": procs[e["pid"]],
                    "stream": threads.get((e["pid"], e.get("tid")), str(e.get("tid"))),
                    "graph": "cuda_graph_node_id" in args, "launch": launch_details(args.get("kernel_details"))})
    out.sort(key=lambda k: (k["start_us"], k["dur_us"]))
    return out


def _end(e) -> float:
    return e["start_us"] + e["dur_us"]


def one_step(events, marker: str = MARKER, index: int = 1) -> list[dict]:
    """The records of one whole step: those that start strictly after the end of the `index`-th
    kernel named like `marker` (counting from 0) up to the end of the next one, that one included.
    The default, index 1, is the second complete step of the trace (the first may carry the
    profiler's start-up). Raises ValueError when the trace has fewer than index + 2 markers."""
    events = sorted(events, key=lambda k: (k["start_us"], k["dur_us"]))
    marks = [e for e in events if e["kind"] == "kernel" and marker in e["name"]]
    if len(marks) < index + 2:
        raise ValueError(f"{len(marks)} kernels named like {marker!r} in the trace: step {index} needs {index + 2}")
    lo, hi = _end(marks[index]), _end(marks[index + 1])
    return [e for e in events if lo < e["start_us"] <= hi]


def step_kernel_counts(events, marker: str = MARKER) -> list[int]:
    """The kernel count of every whole step of the trace (`one_step` with index 0, 1, ...): the same
    program runs every step, so a step with fewer kernels than the others lost records (CUPTI drops
    activity records when its buffers overflow)."""
    marks = sum(e["kind"] == "kernel" and marker in e["name"] for e in events)
    return [sum(e["kind"] == "kernel" for e in one_step(events, marker, i)) for i in range(marks - 1)]


def short_name(name: str) -> str:
    """A label for a kernel name: our Mosaic kernels without "jtilert_" and "_mosaic_gpu_kernel";
    demangled C++ names (the engine's CUDA kernels) as their function's name alone; XLA's fusions as
    they are."""
    n = name.strip()
    if "(" in n or "<" in n or "::" in n:   # "void jt::(anonymous namespace)::topk_kernel<...>(...)"
        n = n.replace("(anonymous namespace)", "anon")
        depth, outside = 0, []
        for ch in n:                          # drop template arguments and parameter lists
            depth += (ch in "<(") - (ch in ">)")
            if depth == 0 and ch not in ">)":
                outside.append(ch)
        words = "".join(outside).split()      # "void jt::anon::topk_kernel"
        n = words[-1].split("::")[-1] if words else n
    n = n.removeprefix("jtilert_").removesuffix("_mosaic_gpu_kernel")
    return n[:40]


def _union_us(intervals) -> float:
    """Length of the union of [start, end) intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + (cur_e - cur_s if cur_e is not None else 0.0)


def critical_chain(events) -> list[int]:
    """Indices (into `events`) of a chain of records that ran one after another through the step,
    last first: from the record that ends last, each step back goes to the record that ended last
    before it started (the dependency most likely to have held it back; the trace has no graph
    edges, so this is a reading of the times, not of the program)."""
    if not events:
        return []
    by_end = sorted(range(len(events)), key=lambda i: _end(events[i]))
    ends = [_end(events[i]) for i in by_end]
    cur = by_end[-1]
    chain = [cur]
    while True:
        j = bisect.bisect_right(ends, events[cur]["start_us"]) - 1
        if j < 0:
            return chain
        cur = by_end[j]
        chain.append(cur)


def _r(x: float) -> float:
    return round(x, 3)   # µs to the nanosecond: the JSON's precision


def summary(step_events, detail: tuple[int, int] | None = None, layer_start: str = LAYER_START,
            marker: str = MARKER, top: int = 20) -> dict:
    """The timeline of one step's records (`one_step`), JSON-serialisable, times in µs:
    - span_us (first start to last end), busy_us (union of the records' intervals), idle_us (span −
      busy: the GPU ran nothing); records, and of them kernels, memcpy, memset, graph_records (run as
      nodes of a CUDA graph); the streams;
    - layers: each kernel named like `layer_start` opens a layer; the records before the first are
      the "head" (embedding; the sampling after the last step's top-k), the `marker` kernel and those
      after it the "tail". Layer i spans from its first start to the next layer's first start (the
      last layer: to the marker's start). Per layer: its start, span, record count, idle_us (GPU idle
      before its records) and chain_us (its records' time on the chain); for the detail layers
      [detail[0], detail[1]) (None: all) also its sequence [short name, start, duration], times
      from the layer's start;
    - kernel_list: the records of the head, the detail layers and the tail: name, kind,
      layer (a number, "head" or "tail"), start (from the step's start), duration, idle_before_us (from
      the latest end of any record that started before it to its start, where positive: the GPU was
      idle; else 0), on_chain (`critical_chain`), stream;
    - chain: the chain's record count, its records' summed time (busy_us) and the rest of the span
      (wait_us: between dependent records, launch latency and idle);
    - idle_gaps: the `top` longest idle gaps; idle_by_kernel: idle time summed by the record after it;
    - launches: per kernel (short name), its launch as CUPTI records it (`launch_details`: grid, block,
      registers a thread, shared memory) and its CTAs;
    - slow: per kernel of the detail layers run at least 4 times there, its median duration and each
      run longer than 1.4 × that + 1 µs (layer, start, duration) with the records that overlapped it
      (short name, start relative to it, duration): a run that waited for SMs or shared them."""
    ev = sorted(step_events, key=lambda k: (k["start_us"], k["dur_us"]))
    if not ev:
        return {"kernels": 0, "note": "no GPU kernel events in the step"}
    t0 = ev[0]["start_us"]
    t1 = max(_end(e) for e in ev)
    busy = _union_us([(e["start_us"], _end(e)) for e in ev])
    on_chain = set(critical_chain(ev))

    idle_before, latest = [], ev[0]["start_us"]   # GPU fully idle before each record
    for e in ev:
        idle_before.append(max(0.0, e["start_us"] - latest))
        latest = max(latest, _end(e))

    # layers: [bounds[n], bounds[n + 1]) in start order; the head before bounds[0], the tail from bounds[-1]
    starts = [i for i, e in enumerate(ev) if layer_start in e["name"]]
    tail = next((i for i, e in enumerate(ev) if marker in e["name"]), len(ev))
    if starts:
        tail = max(tail, starts[-1] + 1)
    bounds = starts + [tail]
    layer_of: list = ["head"] * len(ev)
    layer_of[tail:] = ["tail"] * (len(ev) - tail)
    lo, hi = detail if detail is not None else (0, len(starts))
    layers = []
    for n, (a, b) in enumerate(zip(bounds, bounds[1:])):
        layer_of[a:b] = [n] * (b - a)
        end = ev[b]["start_us"] if b < len(ev) else t1
        layer = {"layer": n, "start_us": _r(ev[a]["start_us"] - t0), "span_us": _r(end - ev[a]["start_us"]),
                 "records": b - a, "idle_us": _r(sum(idle_before[a:b])),
                 "chain_us": _r(sum(ev[i]["dur_us"] for i in range(a, b) if i in on_chain))}
        if lo <= n < hi:
            layer["sequence"] = [[short_name(ev[i]["name"]), _r(ev[i]["start_us"] - ev[a]["start_us"]),
                                  _r(ev[i]["dur_us"])] for i in range(a, b)]
        layers.append(layer)

    kernel_list = [{"name": e["name"][:160], "kind": e["kind"],
                    "layer": layer_of[i], "start_us": _r(e["start_us"] - t0), "dur_us": _r(e["dur_us"]),
                    "idle_before_us": _r(idle_before[i]), "on_chain": i in on_chain, "stream": e["stream"]}
                   for i, e in enumerate(ev) if isinstance(layer_of[i], str) or lo <= layer_of[i] < hi]
    gaps = sorted((i for i in range(len(ev)) if idle_before[i] > 0), key=lambda i: -idle_before[i])[:top]
    by_kernel: dict = {}
    for i in range(len(ev)):
        if idle_before[i] > 0:
            g = by_kernel.setdefault(short_name(ev[i]["name"]), [0, 0.0])
            g[0] += 1
            g[1] += idle_before[i]
    launches = {}
    for e in ev:
        if e["kind"] == "kernel" and e.get("launch"):
            d = e["launch"]
            grid = d.get("grid", 1)
            launches.setdefault(short_name(e["name"]), {**d, "ctas": math.prod(grid) if isinstance(grid, tuple) else grid})
    chain_busy = sum(ev[i]["dur_us"] for i in on_chain)
    kinds = [e["kind"] for e in ev]
    spans = [layer["span_us"] for layer in layers]
    head_end = ev[starts[0]]["start_us"] if starts else (ev[tail]["start_us"] if tail < len(ev) else t1)
    return {
        "span_us": _r(t1 - t0), "busy_us": _r(busy), "idle_us": _r(t1 - t0 - busy),
        "records": len(ev), "kernels": kinds.count("kernel"), "memcpy": kinds.count("memcpy"),
        "memset": kinds.count("memset"), "graph_records": sum(bool(e.get("graph")) for e in ev),
        "streams": sorted({e["stream"] for e in ev}),
        "layers_found": len(starts), "layer_span_us_median": _r(statistics.median(spans)) if spans else None,
        "head": {"records": starts[0] if starts else tail, "span_us": _r(head_end - t0)},
        "tail": {"records": len(ev) - tail, "span_us": _r(t1 - ev[tail]["start_us"]) if tail < len(ev) else 0.0},
        "chain": {"records": len(on_chain), "busy_us": _r(chain_busy), "wait_us": _r(t1 - t0 - chain_busy)},
        "detail_layers": [lo, hi],
        "layers": layers,
        "kernel_list": kernel_list,
        "idle_gaps": [{"before": short_name(ev[i]["name"]), "layer": layer_of[i], "at_us": _r(ev[i]["start_us"] - t0),
                       "idle_us": _r(idle_before[i])} for i in gaps],
        "idle_by_kernel": [{"kernel": k, "count": c, "idle_us": _r(t)}
                           for k, (c, t) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]],
        "launches": launches,
        "slow": slow_runs(kernel_list),
    }


def slow_runs(kernel_list: list[dict], runs: int = 4, factor: float = 1.4, margin_us: float = 1.0) -> list[dict]:
    """`summary`'s "slow" from its kernel_list (the detail layers' records): per kernel run at least
    `runs` times in the layers, the runs longer than factor × its median + margin_us, each with the
    records that overlapped it; the kernels with slow runs only, the most time lost first."""
    by_name: dict = {}
    for k in kernel_list:
        if isinstance(k["layer"], int):
            by_name.setdefault(short_name(k["name"]), []).append(k)
    out = []
    for name, ks in by_name.items():
        if len(ks) < runs:
            continue
        median = statistics.median(k["dur_us"] for k in ks)
        slow = [k for k in ks if k["dur_us"] > factor * median + margin_us]
        if not slow:
            continue
        out.append({"kernel": name, "runs": len(ks), "median_us": _r(median),
                    "lost_us": _r(sum(k["dur_us"] - median for k in slow)),
                    "slow": [{"layer": k["layer"], "start_us": k["start_us"], "dur_us": k["dur_us"],
                              "beside": [[short_name(o["name"]), _r(o["start_us"] - k["start_us"]), o["dur_us"]]
                                         for o in kernel_list if o is not k and o["start_us"] < k["start_us"] + k["dur_us"]
                                         and o["start_us"] + o["dur_us"] > k["start_us"]]} for k in slow]})
    return sorted(out, key=lambda r: -r["lost_us"])


def _lanes(records, first: int = 0) -> list[int]:
    """A row per record (by start) so that records of one row do not overlap: the first row from
    `first` on whose last record has ended, else a new row."""
    ends: list[float] = []
    rows = []
    for k in records:
        row = next((r for r, e in enumerate(ends) if e <= k["start_us"]), len(ends))
        if row == len(ends):
            ends.append(0.0)
        ends[row] = k["start_us"] + k["dur_us"]
        rows.append(first + row)
    return rows


def plot(step_summary: dict, path, layers: tuple[int, int] = (4, 8)) -> None:
    """A Gantt chart of the layers [layers[0], layers[1]) of a `summary` (its kernel_list must hold
    them), saved as PNG at `path`: a panel per layer, times from the layer's first start; in each, the
    chain's records (`critical_chain`: one after another) on the top row, the records that ran beside
    them on rows below, each on the first row free at its start (not a row per stream: CUPTI gives each
    branch of a CUDA graph a stream of its own, dozens per step); bars labelled with short names, idle
    gaps shaded red. A summary without those kernels gives a chart that says so."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    per_layer = {n: sorted((k for k in step_summary.get("kernel_list", []) if k["layer"] == n),
                           key=lambda k: k["start_us"]) for n in range(*layers)}
    per_layer = {n: ks for n, ks in per_layer.items() if ks}
    if not per_layer:
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.axis("off")
        ax.text(0.5, 0.5, step_summary.get("note", f"no kernels of layers {layers[0]}–{layers[1] - 1} in the summary"),
                ha="center", va="center", wrap=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    spans = {layer["layer"]: layer for layer in step_summary["layers"]}
    names = sorted({short_name(k["name"]) for ks in per_layer.values() for k in ks})
    cmap = plt.get_cmap("tab20")
    color = {n: cmap(i % 20) for i, n in enumerate(names)}
    placed = {}
    for n, ks in per_layer.items():   # (record, row) per layer: the chain on row 0
        beside = [k for k in ks if not k["on_chain"]]
        placed[n] = [(k, 0) for k in ks if k["on_chain"]] + list(zip(beside, _lanes(beside, first=1)))
    rows = {n: 1 + max(r for _, r in p) for n, p in placed.items()}
    width = max(spans[n]["span_us"] for n in per_layer)
    fig, axes = plt.subplots(len(per_layer), 1, sharex=True, squeeze=False,
                             figsize=(max(12.0, min(30.0, width / 8)), sum(0.9 + 0.45 * r for r in rows.values())),
                             gridspec_kw={"height_ratios": [0.9 + 0.45 * r for r in rows.values()]})
    for ax, (n, p) in zip(axes[:, 0], placed.items()):
        t0 = spans[n]["start_us"]   # the layer's first start (both from the step's start)
        for k, row in p:
            x, label = k["start_us"] - t0, short_name(k["name"])
            ax.barh(row, k["dur_us"], left=x, height=0.8, color=color[label], edgecolor="black", linewidth=0.3)
            ax.text(x + k["dur_us"] / 2, row, label, ha="center", va="center", rotation=90, fontsize=5, clip_on=True)
            if k["idle_before_us"] > 0:
                ax.axvspan(x - k["idle_before_us"], x, color="tab:red", alpha=0.2, linewidth=0)
        ax.axvline(spans[n]["span_us"], color="gray", linestyle="--", linewidth=0.8)   # the next layer's start
        ax.set_yticks(range(rows[n]), ["chain"] + [f"beside {r}" for r in range(1, rows[n])], fontsize=6)
        ax.set_ylim(rows[n] - 0.4, -0.6)
        ax.set_ylabel(f"layer {n}\n{spans[n]['span_us']:.1f} µs", fontsize=7, rotation=0, ha="right", va="center")
    axes[-1, 0].set_xlabel("µs from the layer's first kernel (red: GPU idle; dashed: the next layer's first kernel)")
    axes[0, 0].set_title(f"decode step, layers {layers[0]}–{layers[1] - 1}: step span {step_summary['span_us']:.1f} µs, "
                         f"idle {step_summary['idle_us']:.1f} µs, {step_summary['kernels']} kernels", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def read_step(events, marker: str = MARKER, index: int = 1, detail: tuple[int, int] | None = DETAIL_LAYERS) -> dict:
    """The `summary` of step `index` of a trace's GPU records (`kernel_events`), with the trace's kernel
    and marker counts and every whole step's kernel count (step_kernels). Where step `index` has fewer
    kernels than another step (records dropped), the first step with the most is read instead, and a
    note says so. Without kernel records or without enough markers, a dict that says so
    ({"kernels": 0, "note": ...})."""
    kernels = sum(e["kind"] == "kernel" for e in events)
    if not kernels:
        return {"kernels": 0, "note": "no GPU kernel events in the trace"}
    marks = sum(e["kind"] == "kernel" and marker in e["name"] for e in events)
    if marks < index + 2:
        return {"kernels": 0, "trace_kernels": kernels, "markers": marks,
                "note": f"{marks} kernels named like {marker!r} in the trace: step {index} needs {index + 2} "
                        "(records dropped?)"}
    counts = step_kernel_counts(events, marker)
    read = index if counts[index] == max(counts) else counts.index(max(counts))
    out = summary(one_step(events, marker, read), detail=detail, marker=marker)
    out.update(trace_kernels=kernels, markers=marks, step_index=read, step_kernels=counts)
    notes = []
    if read != index:
        notes.append(f"step {index} has {counts[index]} kernels, step {read} {counts[read]}: records were dropped; "
                     f"step {read} read")
    if out["graph_records"] < out["records"]:
        notes.append(f"{out['records'] - out['graph_records']} of {out['records']} records ran outside CUDA graphs "
                     "(a command buffer XLA makes anew under the profiler runs thunk by thunk: trace right after "
                     "untraced calls of the same program)")
    if notes:
        out["note"] = "; ".join(notes)
    return out


def trace_step(call, folder, marker: str = MARKER, index: int = 1, detail: tuple[int, int] | None = DETAIL_LAYERS,
               options=None) -> dict:
    """Run `call()` (one decode call of at least index + 2 steps) under JAX's profiler, writing the
    trace under `folder`; its step `index` read (`read_step`). `options`: jax.profiler.ProfileOptions
    (None: no Python tracing, JAX's default host tracing).

    CUPTI (here through XLA's profiler) must have been attached to the process
    before the traced program's CUDA graphs were made, else it drops most of their kernels' records
    (bench.decode's copy bandwidth, measured first with Mosaic's CUPTI profiler, attaches it); the
    program's graphs must be live (its untraced calls just before, no other program's in between),
    else XLA runs its command buffers thunk by thunk; XLA's profiler detaches CUPTI when it stops
    (cuptiFinalize), after which a CUPTI profile of graphs made before drops records (Mosaic's
    profiler then aborts the process): no Mosaic CUPTI profile after this."""
    import jax
    # CUPTI's KERNEL activity serialises kernels; CONCURRENT_KERNEL (XLA's default in recent versions)
    # records them as they ran, overlapping. XLA reads this variable when the trace starts.
    os.environ.setdefault("TF_GPU_CUPTI_FORCE_CONCURRENT_KERNEL", "1")
    if options is None:
        options = jax.profiler.ProfileOptions()
        options.python_tracer_level = 0   # the call's Python is one line: its tracing only adds overhead
    with jax.profiler.trace(str(folder), create_perfetto_trace=True, profiler_options=options):
        jax.block_until_ready(call())
    return read_step(kernel_events(load_trace(folder)), marker, index, detail)
