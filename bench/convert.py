"""Conversion throughput on a full-width synthetic checkpoint (run by hand; not part of the test suite).

    PYTHONPATH=. python bench/convert.py --preset deepseek-v3.2 --layers 2 --tp 8 --dir /tmp/bench-convert

Writes a synthetic HF folder (fp8 + scales, `--layers` decoder layers at full width, MTP off unless --mtp),
converts it (optionally after dropping the page cache, which needs root), verifies the result, and prints
GB/s and the converter's peak RSS (measured in a child process).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import json, resource, sys, time
from jtilert.store import convert

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024

base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS
t = time.perf_counter()
convert.convert(sys.argv[1], sys.argv[2], tp=int(sys.argv[3]), progress=True, chunk_bytes=int(sys.argv[4]))
dt = time.perf_counter() - t
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": dt, "rss_after_import_mb": base, "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
                  "peak_rss_mb": status("VmHWM")}))
"""


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="deepseek-v3.2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--mtp", action="store_true")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--chunk-mb", type=int, default=32)
    ap.add_argument("--dir", default="/tmp/bench-convert")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before converting (root)")
    args = ap.parse_args()

    import jtilert
    root = Path(args.dir)
    src, dst = root / "src", root / f"tp{args.tp}"
    cfg = jtilert.preset(args.preset)
    if not args.mtp:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    if not src.exists():
        t = time.perf_counter()
        jtilert.random_checkpoint(cfg, src, num_layers=args.layers, progress=True)
        print(f"generated {src} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    shutil.rmtree(dst, ignore_errors=True)
    src_bytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    cold = drop_caches() if args.cold else False
    out = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst), str(args.tp), str(args.chunk_mb << 20)],
                         check=True, stdout=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    r = json.loads(out.stdout.strip().splitlines()[-1])
    dst_bytes = sum(f.stat().st_size for f in (dst / "params").rglob("*") if f.is_file())
    t = time.perf_counter()
    jtilert.verify(dst)
    vt = time.perf_counter() - t
    print(json.dumps({"preset": args.preset, "layers": args.layers, "tp": args.tp, "page_cache": "dropped" if cold else "warm",
                      "source_gb": src_bytes / 1e9, "written_gb": dst_bytes / 1e9, "convert_s": round(r["seconds"], 2),
                      "gb_per_s": round(dst_bytes / 1e9 / r["seconds"], 3), "verify_s": round(vt, 2),
                      "cpu_user_s": round(r["user_s"], 1), "cpu_sys_s": round(r["sys_s"], 1),
                      "rss_after_import_mb": round(r["rss_after_import_mb"]), "peak_rss_mb": round(r["peak_rss_mb"]),
                      "chunk_mb": args.chunk_mb, "cpus": os.cpu_count()}, indent=1))
    if not args.keep:
        shutil.rmtree(dst)


if __name__ == "__main__":
    main()
