// Device-side building blocks shared by the engine's kernels.
//
// Transport: the "LL" (low-latency) line. A sender writes 8 bytes of payload
// and two copies of a 32-bit flag into one 16-byte line of the receiver's
// inbox with a single 16-byte volatile store: {d0, flag, d1, flag}. The
// receiver polls the line with 16-byte volatile loads until both flags equal
// the call's epoch; only 8-byte atomicity of the store is relied upon (hence
// the flag in each half). No fence and no separate flag write are needed, so
// the latency is one NVLink write.
//
// Epochs: every rank keeps an epoch counter in its own device memory. All
// blocks of a call read it at entry (epoch = counter + 1); the last block to
// have read it stores the new value (publish_epoch). Calls alternate between
// two inbox halves by the
// parity of the epoch. A rank can only reach call e+2 after it received data of
// call e+1 from every peer, which each peer sent after its call e had finished,
// so a half is never overwritten while it is still being read.
#ifndef JTILERT_COMMON_CUH_
#define JTILERT_COMMON_CUH_

#include <cuda_runtime.h>
#include <stdint.h>

#include "jtilert/engine.h"

namespace jt {

// Everything a kernel needs to talk to the peers of its group.
struct CommParams {
  uint4* inbox[JT_MAX_WORLD];  // inbox base of every rank (peer pointers)
  unsigned int* epoch_ctr;     // this rank's epoch counter
  unsigned int* done_ctr;      // this rank's blocks-finished counter
  JtStatus* status;            // host-mapped error record of this rank
  long long cap_lines;         // lines per (parity, stage, source) region
  long long timeout_ns;        // spin-wait limit
  int rank;
  int world;
};

enum OpId : unsigned { kOpAllReduce = 1, kOpGemv = 2, kOpMergeTopk = 3 };

// Inbox base of rank `r`. Selected with unrolled compares: indexing the
// kernel-parameter array with a run-time value would copy the whole parameter
// struct to the stack.
__device__ __forceinline__ uint4* inbox_of(const CommParams& c, int r) {
  uint4* p = c.inbox[0];
#pragma unroll
  for (int i = 1; i < JT_MAX_WORLD; ++i) p = (r == i) ? c.inbox[i] : p;
  return p;
}

// Region of the inbox of rank `dst` that receives stage `stage` data of source
// rank `src` in inbox half `parity`.
__device__ __forceinline__ uint4* region(const CommParams& c, int dst,
                                         unsigned parity, int stage, int src) {
  long long idx = ((long long)(parity * 2 + stage) * c.world + src);
  return inbox_of(c, dst) + idx * c.cap_lines;
}

__device__ __forceinline__ void ll_store(uint4* p, uint32_t d0, uint32_t d1,
                                         uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p),
               "r"(d0), "r"(flag), "r"(d1), "r"(flag)
               : "memory");
}

__device__ __forceinline__ uint4 ld_volatile16(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Records a lost peer in the host-mapped status and aborts the kernel (the
// error surfaces as a CUDA launch failure instead of a hang). Arguments are
// passed by value so that no kernel has to spill its parameters to the stack.
static __device__ __noinline__ void fail_timeout(JtStatus* status, int rank,
                                                 unsigned op, int src,
                                                 long long line,
                                                 unsigned epoch) {
  volatile JtStatus* s = status;
  if (s != nullptr) {
    s->rank = (uint32_t)rank;
    s->src = (uint32_t)src;
    s->epoch = epoch;
    s->line = (uint64_t)line;
    s->op = op;
    __threadfence_system();
    s->code = 1u;
    __threadfence_system();
  }
  __trap();
}

// Waits until the line at `p` carries `epoch` in both flags; returns payload.
__device__ __forceinline__ uint2 ll_load(const CommParams& c, const uint4* p,
                                         unsigned epoch, unsigned op, int src,
                                         long long line) {
  uint4 v = ld_volatile16(p);
  if (v.y == epoch && v.w == epoch) return make_uint2(v.x, v.z);
  unsigned long long t0 = globaltimer();
  unsigned spins = 0;
  while (true) {
    v = ld_volatile16(p);
    if (v.y == epoch && v.w == epoch) break;
    if (++spins == 256u) {
      spins = 0;
      if ((long long)(globaltimer() - t0) > c.timeout_ns)
        fail_timeout(c.status, c.rank, op, src, line, epoch);
    }
  }
  return make_uint2(v.x, v.z);
}

// Counts this block in: the last block of the grid to have read the epoch
// resets the done counter and publishes the epoch for the next call. Done
// right after the read (not at the end of the kernel), so the atomic's round
// trip overlaps the transfer instead of lengthening the tail. Safe: a block
// reads the epoch before it counts itself, so when the count reaches gridDim.x
// every block of this launch has its epoch; the next launch on the stream
// starts after this one has finished.
__device__ __forceinline__ void publish_epoch(const CommParams& c,
                                              unsigned epoch) {
  unsigned prev = atomicAdd(c.done_ctr, 1u);
  if (prev == gridDim.x - 1u) {
    *((volatile unsigned*)c.done_ctr) = 0u;
    *((volatile unsigned*)c.epoch_ctr) = epoch;
  }
}

__device__ __forceinline__ unsigned load_epoch(const CommParams& c) {
  unsigned e = *((volatile unsigned*)c.epoch_ctr) + 1u;
  return e == 0u ? 1u : e;  // never 0: fresh memory is zero
}

// Epoch of this call, read by thread 0 and broadcast through shared memory;
// thread 0 then counts the block in (publish_epoch).
__device__ __forceinline__ unsigned read_epoch(const CommParams& c,
                                               unsigned* smem_slot) {
  if (threadIdx.x == 0) *smem_slot = load_epoch(c);
  __syncthreads();
  const unsigned e = *smem_slot;
  if (threadIdx.x == 0) publish_epoch(c, e);
  return e;
}

// ---- dtype helpers (8-byte payload lines) ----

__device__ __forceinline__ float bf16_lo(uint32_t u) {
  return __uint_as_float(u << 16);
}
__device__ __forceinline__ float bf16_hi(uint32_t u) {
  return __uint_as_float(u & 0xffff0000u);
}

// round-to-nearest-even fp32 -> bf16 bits (NaN kept quiet)
__device__ __forceinline__ uint32_t f32_to_bf16_bits(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  u += 0x7fffu + ((u >> 16) & 1u);
  return u >> 16;
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  return f32_to_bf16_bits(lo) | (f32_to_bf16_bits(hi) << 16);
}

__device__ __forceinline__ float2 h2_to_f2(uint32_t u) {
  float2 r;
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(r.x), "=f"(r.y)
      : "r"(u));
  return r;
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t u;
  asm("{\n\t.reg .f16 l, h;\n\tcvt.rn.f16.f32 l, %1;\n\t"
      "cvt.rn.f16.f32 h, %2;\n\tmov.b32 %0, {l, h};\n\t}"
      : "=r"(u)
      : "f"(lo), "f"(hi));
  return u;
}

// two fp8 e4m3 (low 16 bits of `u16`) -> two floats
__device__ __forceinline__ float2 e4m3x2_to_f2(uint32_t u16) {
  uint32_t h2;
  asm("{\n\t.reg .b16 t;\n\tcvt.u16.u32 t, %1;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, t;\n\t}"
      : "=r"(h2)
      : "r"(u16));
  return h2_to_f2(h2);
}

}  // namespace jt

#endif  // JTILERT_COMMON_CUH_
