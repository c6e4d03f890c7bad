"""The converter's memory bound: peak RSS stays within RSS-after-import + 6·chunk_bytes (+ slack for the
metadata), measured in a child process converting a synthetic checkpoint many times that size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import jtilert

CHUNK = 4 << 20
SLACK = 16 << 20  # plan and metadata, thread stacks, allocator rounding

# Wide experts and a large bf16 vocabulary (row-chunked embedding / head): ≈ 480 MB of safetensors.
CFG = jtilert.preset("tiny").replace(
    hidden_size=1024, intermediate_size=2048, moe_intermediate_size=1024, num_attention_heads=16, q_lora_rank=256,
    kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_routed_experts=16,
    num_experts_per_tok=2, n_group=4, topk_group=2, vocab_size=16384, num_hidden_layers=6, first_k_dense_replace=1,
    index_n_heads=4, index_head_dim=64, index_topk=16)

CHILD = """
import json, sys
from jtilert.store import convert

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS
convert.convert(sys.argv[1], sys.argv[2], tp=int(sys.argv[3]), dtype=sys.argv[4] or None, chunk_bytes=int(sys.argv[5]))
print(json.dumps({"base": base, "peak": status("VmHWM")}))
"""


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return jtilert.random_checkpoint(CFG, tmp_path_factory.mktemp("big") / "src", max_file_bytes=128 << 20)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc peak-RSS reset")
@pytest.mark.parametrize("tp,dtype", [(2, ""), (1, "bf16")])
def test_peak_rss_is_bounded(big, tmp_path, tp, dtype):
    size = sum(f.stat().st_size for f in big.glob("*.safetensors"))
    bound = 6 * CHUNK + SLACK
    assert size > 10 * bound
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", CHILD, str(big), str(tmp_path / "dst"), str(tp), dtype, str(CHUNK)],
                         env=env, check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    grew = r["peak"] - r["base"]
    written = sum(f.stat().st_size for f in (tmp_path / "dst" / "params").rglob("*") if f.is_file())
    print(f"tp={tp} {dtype or 'fp8'}: converted {size / 1e6:.0f} MB → {written / 1e6:.0f} MB; RSS after import "
          f"{r['base'] / 1e6:.0f} MB, peak +{grew / 1e6:.1f} MB (bound {bound / 1e6:.0f} MB)")
    assert grew <= bound, f"peak RSS grew by {grew / 1e6:.1f} MB, over the {bound / 1e6:.0f} MB bound"
    assert written >= size * (0.8 if not dtype else 1.5)  # (the source also holds the MTP's embed/head copies)
