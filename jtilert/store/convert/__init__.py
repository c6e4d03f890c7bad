"""HF → jtilert conversion with bounded memory, progress, resumption and verification.

`convert(SRC, DST, tp=N)` reads an HF folder (index json + safetensors; fp8 with `weight_scale_inv`, bf16 or
fp32; the MTP layer; GLM-5.2 shared-indexer layers) and writes a jtilert checkpoint (layout 4,
`jtilert.store.arrays`): an orbax checkpoint of the stacked parameters whose chunks are whole rows of one layer
of one of N tensor-parallel shards, each with its CRC-32C, so `jtilert.load(DST, mesh=...)` (or plain orbax)
reads each device's shard straight onto it. `verify(DST, against=SRC)` reads every chunk back and spot-checks
values against the source.

  plan      the HF folder checked against its config; every parameter to write and the arrays holding them
  source    reading row ranges of the source files
  pipeline  read → convert → chunk → write, progress, resumption (`convert`)
  check     every chunk's size and checksum, values against the source (`verify`)
"""

from jtilert.store.convert.check import verify
from jtilert.store.convert.pipeline import CHUNK_BYTES, convert
from jtilert.store.convert.plan import ConvertError

__all__ = ["CHUNK_BYTES", "ConvertError", "convert", "verify"]
