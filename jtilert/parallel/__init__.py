"""Tensor parallelism: the device mesh and how each weight and cache is split over it (`sharding`).
The collectives a step runs are ops (`jtilert.ops.table.Ops.all_reduce`, the CUDA engine's fused
all-reduce in `jtilert.ffi`)."""
