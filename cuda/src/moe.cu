// A MoE layer's experts for one decode token in one launch:
//   out = residual + sum_j w_j Down[id_j] h_j + SharedDown h_s,
//   h_e = bf16(silu(bf16(f Gate_e^T)) * bf16(f Up_e^T))
// for the k chosen experts and the shared one (fp8 weights, 128 x 128 block
// scales; f the normed input, bf16), with the rounding of
// jtilert.ops.reference's swiglu_hidden.
//
// One persistent launch of kCtas CTAs (one per SM, all resident), two phases:
//   1. gate/up: the (k + 1) * I (gate row, up row) pairs split evenly over
//      the CTAs; each CTA writes its pairs' h into a scratch vector, every
//      element tagged with the call's epoch (fp32 value | tag << 32 in one
//      64-bit store, so a reader that sees the tag sees the value);
//   2. down: the H output rows split evenly; each CTA polls the whole h vector
//      until every tag is the call's, reduces its rows over the k + 1 expert
//      segments and writes residual + sum (bf16).
// The weights of both phases are known at the launch (the expert ids are read
// first), so one producer warp streams every chunk of both phases, in order,
// into a ring of shared-memory slots (cp.async.bulk, an mbarrier pair per
// slot): phase 2's weights arrive while the CTAs wait for each other's h.
// A chunk is one bulk copy: phase 1, one gate or up row (H bytes); phase 2,
// 8 consecutive rows of one expert's down (8 x I bytes). The slots are 16
// bytes longer than 8 KB, so 8 consecutive slots' rows fall on different
// banks. A tile is 8 weight rows: phase 1, 8 consecutive chunks; phase 2, the
// k + 1 chunks of 8 rows, one per expert. Two groups of 8 consumer warps take
// the tiles in turn; each warp reduces its share of the tile's 128-column scale
// blocks with fp8 tensor-core MMAs (m16n8k32, e4m3): A holds the input as two
// e4m3 rows, hi and lo (x ~ hi * s_hi + lo * s_lo, scales per 128-column
// block), B 8 weight rows, so the fp32 result's two rows are the 8 rows' dot
// products with hi and lo; the warps' partial sums are added in a fixed order
// (the result does not depend on the warps' timing). Everything a phase needs
// that does not depend on the other CTAs (scales, ids, routing weights) is in
// shared memory before it waits.
//
// The scratch vector and the epoch are the library's device globals: the
// calls on one device must not overlap (a decode step's MoE layers are a
// chain). The last CTA to finish publishes the epoch.
#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "jtilert/engine.h"

namespace jt {
namespace {

namespace ptx = cuda::ptx;

constexpr int kCtas = JT_MOE_CTAS;
constexpr int kGroups = 2;      // consumer warp groups, taking the chunks in turn
constexpr int kGroupWarps = 8;  // the warps of a group, one scale block of a chunk each
constexpr int kConsumers = kGroups * kGroupWarps * 32;
constexpr int kThreads = kConsumers + 32;  // and the producer warp
constexpr int kSlots = 24;
constexpr int kSlotBytes = 8192;               // a chunk's bytes at most
constexpr int kSlotPitch = kSlotBytes + 16;    // consecutive slots 4 banks apart
constexpr int kTile = 8;                       // weight rows of a tile (the MMA's N)
constexpr int kMaxVec = JT_MOE_MAX_VEC;        // H and (k + 1) * I
constexpr int kMaxSegments = JT_MOE_MAX_SEGMENTS;  // k + 1
constexpr int kMaxPairs = 24;                  // gate/up pairs of a CTA
constexpr int kMaxRows = 64;                   // output rows of a CTA
constexpr int kBlock = 128;                    // fp8 scale block
constexpr int kMaxIBlocks = 8;                 // I / 128
constexpr float kE4m3Max = 448.f;

__device__ unsigned long long g_hidden[kMaxVec];  // phase 1's h, tagged
__device__ unsigned g_epoch;                     // the last call's tag
__device__ unsigned g_done;                      // CTAs that finished this call

struct Shapes {
  int L, E, H, I, k;
  int pairs;  // gate/up pairs of a CTA
  int rows;   // output rows of a CTA (a multiple of kTile)
  long long timeout_ns;  // the longest a CTA waits for the others' h
};

struct Smem {
  uint8_t ring[kSlots][kSlotPitch];
  uint8_t x8[2][kMaxVec];                  // the phase's input as e4m3 hi and lo rows
  float x_scale[2][kMaxVec / kBlock];      // their block scales
  float up_gate_scale[2 * kMaxPairs][kMaxVec / kBlock];  // row 2q + up of pair q: its H / 128 block scales
  float down_scale[kMaxSegments][2][kMaxIBlocks];        // [segment][row block][I block]
  float acc[kMaxRows];                     // the CTA's row sums
  float part[kGroups][kGroupWarps][kTile]; // a tile's partial sums, by warp
  float weight[kMaxSegments];              // routing weights (1 for the shared expert)
  int id[kMaxSegments];                    // expert ids (clamped), -1 for the shared expert
  uint64_t full[kSlots], empty[kSlots];
};

static_assert(sizeof(Smem) <= 227 * 1024, "the shared memory of one CTA an SM");
static_assert(kSlotPitch % 16 == 0, "bulk copies: 16-byte addresses");
static_assert(kSlots % kTile == 0, "phase-1 tiles of 8 consecutive slots");
static_assert(2 * kMaxSegments <= kSlots, "both groups' phase-2 tiles in the ring at once");

__device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long* a) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
  return v;
}
__device__ __forceinline__ void store_relaxed(unsigned long long* a, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ long long global_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  while (!ptx::mbarrier_try_wait_parity(b, parity)) {
  }
}
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// Segment s's weights of layer `layer`: expert id[s], or the shared expert (id -1).
__device__ __forceinline__ const uint8_t* gate_row(const JtMoeArgs& a, const Shapes& s, int layer, int id, bool up,
                                                   int i) {
  if (id < 0) return (up ? a.shared_up : a.shared_gate) + ((size_t)layer * s.I + i) * s.H;
  return (up ? a.up : a.gate) + (((size_t)layer * s.E + id) * s.I + i) * s.H;
}
__device__ __forceinline__ const float* gate_scales(const JtMoeArgs& a, const Shapes& s, int layer, int id, bool up,
                                                    int i) {
  const int ib = s.I / kBlock, hb = s.H / kBlock;
  if (id < 0) return (up ? a.shared_up_scale : a.shared_gate_scale) + ((size_t)layer * ib + i / kBlock) * hb;
  return (up ? a.up_scale : a.gate_scale) + (((size_t)layer * s.E + id) * ib + i / kBlock) * hb;
}
__device__ __forceinline__ const uint8_t* down_row(const JtMoeArgs& a, const Shapes& s, int layer, int id, int n) {
  if (id < 0) return a.shared_down + ((size_t)layer * s.H + n) * s.I;
  return a.down + (((size_t)layer * s.E + id) * s.H + n) * s.I;
}
__device__ __forceinline__ const float* down_scales(const JtMoeArgs& a, const Shapes& s, int layer, int id, int n) {
  const int ib = s.I / kBlock, hb = s.H / kBlock;
  if (id < 0) return a.shared_down_scale + ((size_t)layer * hb + n / kBlock) * ib;
  return a.down_scale + (((size_t)layer * s.E + id) * hb + n / kBlock) * ib;
}

// The phase's input, n elements (n a multiple of 128), as two e4m3 rows in
// x8 with a scale per 128-block each: hi = e4m3(x / s_hi), s_hi = max|x| /
// 448, then the rest the same way (lo), so hi * s_hi + lo * s_lo keeps about 8
// significant bits of each element near its block's largest. One warp a
// block; load(i) gives elements 4i .. 4i + 3.
template <class Load>
__device__ __forceinline__ void quantize_input(Smem& sm, int n, int warp, int lane, Load load) {
  for (int b = warp; b < n / kBlock; b += kConsumers / 32) {
    const float4 v = load(b * (kBlock / 4) + lane);
    float r[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int part = 0; part < 2; ++part) {
      float m = fmaxf(fmaxf(fabsf(r[0]), fabsf(r[1])), fmaxf(fabsf(r[2]), fabsf(r[3])));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float sc = m > 0.f ? m / kE4m3Max : 1.f, inv = 1.f / sc;
      const __nv_fp8x2_storage_t q01 = __nv_cvt_float2_to_fp8x2(make_float2(r[0] * inv, r[1] * inv), __NV_SATFINITE, __NV_E4M3);
      const __nv_fp8x2_storage_t q23 = __nv_cvt_float2_to_fp8x2(make_float2(r[2] * inv, r[3] * inv), __NV_SATFINITE, __NV_E4M3);
      reinterpret_cast<uint32_t*>(sm.x8[part] + b * kBlock)[lane] = (uint32_t)q01 | (uint32_t)q23 << 16;
      if (lane == 0) sm.x_scale[part][b] = sc;
      const __half2_raw h01 = __nv_cvt_fp8x2_to_halfraw2(q01, __NV_E4M3), h23 = __nv_cvt_fp8x2_to_halfraw2(q23, __NV_E4M3);
      const float2 f01 = __half22float2(*reinterpret_cast<const __half2*>(&h01));
      const float2 f23 = __half22float2(*reinterpret_cast<const __half2*>(&h23));
      r[0] -= f01.x * sc, r[1] -= f01.y * sc, r[2] -= f23.x * sc, r[3] -= f23.y * sc;
    }
  }
}

// One 128-column block: the dot products of 8 weight rows (row g's 128 bytes
// at w + g * pitch) with the input's hi and lo rows at columns x_col.., four
// MMAs of 32 columns. Returns, in lanes 0..3, the sums of rows 2 * lane and
// 2 * lane + 1 (hi * s_hi + lo * s_lo; the weights' scale not applied).
__device__ __forceinline__ float2 block_dot(const Smem& sm, const uint8_t* w, int pitch, int x_col, int lane) {
  const int g = lane >> 2, t = lane & 3;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s4 = 0; s4 < kBlock / 32; ++s4) {
    const int k = s4 * 32 + t * 4;
    const uint32_t a0 = g < 2 ? *reinterpret_cast<const uint32_t*>(sm.x8[g & 1] + x_col + k) : 0u;
    const uint32_t a2 = g < 2 ? *reinterpret_cast<const uint32_t*>(sm.x8[g & 1] + x_col + k + 16) : 0u;
    const uint32_t b0 = *reinterpret_cast<const uint32_t*>(w + g * pitch + k);
    const uint32_t b1 = *reinterpret_cast<const uint32_t*>(w + g * pitch + k + 16);
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
  }
  // lanes 0..3 hold row hi, lanes 4..7 row lo, columns (weight rows) 2t and 2t + 1
  const float sc = sm.x_scale[g & 1][x_col / kBlock];
  float2 v = make_float2(c[0] * sc, c[1] * sc);
  v.x += __shfl_xor_sync(0xffffffffu, v.x, 4);
  v.y += __shfl_xor_sync(0xffffffffu, v.y, 4);
  return v;
}

__device__ __forceinline__ void group_sync(int group) {  // the 8 warps of a consumer group
  asm volatile("bar.sync %0, %1;" ::"r"(2 + group), "n"(kGroupWarps * 32) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1) moe_decode_kernel(const JtMoeArgs a, const Shapes s) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, cta = blockIdx.x;
  const int segments = s.k + 1;
  int layer = __ldg(a.layer);
  if (layer < 0) layer += s.L;
  layer = min(max(layer, 0), s.L - 1);
  const unsigned tag = *(volatile unsigned*)&g_epoch + 1;
  if (threadIdx.x < segments) {  // expert ids clamped into [0, E) like an XLA gather
    const int j = threadIdx.x;
    sm.id[j] = j < s.k ? min(max(__ldg(a.ids + j), 0), s.E - 1) : -1;
    sm.weight[j] = j < s.k ? __ldg(a.weights + j) : 1.f;
  }
  if (threadIdx.x == 0) {
    for (int i = 0; i < kSlots; ++i) {
      ptx::mbarrier_init(&sm.full[i], 1);
      ptx::mbarrier_init(&sm.empty[i], kGroupWarps);
    }
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  __syncthreads();

  // phase 1: the CTA's 2 * pairs weight rows (row j: pair j / 2's gate or, odd j, up row), a
  // chunk each, in tiles of 8; phase 2: its output rows in tiles of 8, a chunk per expert
  const int p0 = cta * s.pairs, n0 = cta * s.rows, gu_rows = 2 * s.pairs;
  const int tiles1 = (gu_rows + kTile - 1) / kTile, tiles2 = s.rows / kTile;
  if (warp == kGroups * kGroupWarps) {  // the producer: every chunk of both phases, in order
    if (lane != 0) return;
    int slot = 0, round = 0;
    auto push = [&](const uint8_t* src, unsigned bytes) {
      if (round > 0) mbar_wait(&sm.empty[slot], (round - 1) & 1);
      ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &sm.full[slot], bytes);
      ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, sm.ring[slot], src, bytes, &sm.full[slot]);
      if (++slot == kSlots) {
        slot = 0;
        ++round;
      }
    };
    for (int j = 0; j < gu_rows; ++j) {
      const int p = p0 + j / 2;
      push(gate_row(a, s, layer, sm.id[p / s.I], j & 1, p % s.I), s.H);
    }
    for (int t = 0; t < tiles2; ++t)
      for (int seg = 0; seg < segments; ++seg) push(down_row(a, s, layer, sm.id[seg], n0 + t * kTile), kTile * s.I);
    return;
  }

  // ---- consumers: f and every scale into shared memory, before any wait ----
  const int hb = s.H / kBlock, ib = s.I / kBlock, rb0 = n0 / kBlock;
  for (int i = threadIdx.x; i < gu_rows * hb; i += kConsumers) {
    const int r = i / hb, b = i % hb, p = p0 + r / 2;
    sm.up_gate_scale[r][b] = __ldg(gate_scales(a, s, layer, sm.id[p / s.I], r & 1, p % s.I) + b);
  }
  for (int i = threadIdx.x; i < segments * 2 * ib; i += kConsumers) {
    const int seg = i / (2 * ib), rb = i / ib % 2, b = i % ib;
    const int n = min((rb0 + rb) * kBlock, s.H - 1);  // the CTA's rows span at most two row blocks
    sm.down_scale[seg][rb][b] = __ldg(down_scales(a, s, layer, sm.id[seg], n) + b);
  }
  quantize_input(sm, s.H, warp, lane, [&](int i) {
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(a.f) + i);  // 4 bf16
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
  });
  consumers_sync();

  const int group = warp / kGroupWarps, gw = warp % kGroupWarps;
  int chunk = 0;  // chunks of the tiles before (chunk c sits in slot c % kSlots)
  // A tile of `nc` chunks starting at chunk c0, reduced by group `owner`: each warp adds up its
  // blocks (block(i) for i = gw, gw + 8, .. < nblocks: the slot's row base, its pitch, the input
  // column, the 8 rows' weight scales), then warp 0 sums the 8 warps' parts in order into out[0..8).
  auto tile = [&](int owner, int c0, int nc, int nblocks, auto block, auto out) {
    if (owner != group) return;
    for (int c = c0; c < c0 + nc; ++c) mbar_wait(&sm.full[c % kSlots], (c / kSlots) & 1);
    float r0 = 0.f, r1 = 0.f;
    for (int i = gw; i < nblocks; i += kGroupWarps) {
      const uint8_t* w;
      int pitch, x_col;
      float s0, s1;
      block(i, w, pitch, x_col, s0, s1);
      const float2 v = block_dot(sm, w, pitch, x_col, lane);
      r0 += v.x * s0;
      r1 += v.y * s1;
    }
    if (lane < 4) sm.part[group][gw][2 * lane] = r0, sm.part[group][gw][2 * lane + 1] = r1;
    __syncwarp();
    if (lane == 0)
      for (int c = c0; c < c0 + nc; ++c) (void)ptx::mbarrier_arrive(&sm.empty[c % kSlots]);
    group_sync(group);
    if (gw == 0 && lane < kTile) {
      float sum = 0.f;
      for (int j = 0; j < kGroupWarps; ++j) sum += sm.part[group][j][lane];
      out(lane, sum);
    }
    group_sync(group);  // the parts are free again
  };
  int owner = 0;  // the tiles go to the groups in turn
  for (int t = 0; t < tiles1; ++t, owner ^= 1) {
    const int nr = min(kTile, gu_rows - t * kTile), c0 = chunk;
    tile(owner, c0, nr, hb,
         [&](int i, const uint8_t*& w, int& pitch, int& x_col, float& s0, float& s1) {
           // block i of all 8 rows: row g in slot c0 + g (rows past nr: another chunk, unused)
           w = sm.ring[c0 % kSlots] + i * kBlock;
           pitch = kSlotPitch;  // a phase-1 tile starts at a multiple of 8 chunks: it never wraps
           x_col = i * kBlock;
           const int j = t * kTile + 2 * (lane & 3);
           s0 = j < gu_rows ? sm.up_gate_scale[j][i] : 0.f;
           s1 = j + 1 < gu_rows ? sm.up_gate_scale[j + 1][i] : 0.f;
         },
         [&](int r, float v) {
           if (t * kTile + r < gu_rows) sm.acc[t * kTile + r] = v;
         });
    chunk += nr;
  }
  consumers_sync();
  if (threadIdx.x < s.pairs) {  // h of pair q, tagged
    const int q = threadIdx.x;
    const float gv = round_bf16(sm.acc[2 * q]), uv = round_bf16(sm.acc[2 * q + 1]);
    const float h = round_bf16(gv / (1.f + __expf(-gv)) * uv);
    store_relaxed(g_hidden + p0 + q, (unsigned long long)tag << 32 | __float_as_uint(h));
  }
  // phase 2's input: the whole h vector, each warp polling its blocks' elements until their tags
  // are the call's
  quantize_input(sm, segments * s.I, warp, lane, [&](int i) {
    unsigned long long e[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) e[u] = load_relaxed(g_hidden + 4 * i + u);
    const long long since = global_ns();
#pragma unroll
    for (int u = 0; u < 4; ++u)
      while ((unsigned)(e[u] >> 32) != tag) {  // backing off: the stragglers' streams share L2 with the polls
        __nanosleep(64);
        e[u] = load_relaxed(g_hidden + 4 * i + u);
        if (global_ns() - since > s.timeout_ns) __trap();  // a CTA that never came: a CUDA error, not a hang
      }
    return make_float4(__uint_as_float((unsigned)e[0]), __uint_as_float((unsigned)e[1]),
                       __uint_as_float((unsigned)e[2]), __uint_as_float((unsigned)e[3]));
  });
  consumers_sync();
  // phase 2: tile t's chunks hold rows n0 + 8t .. of each expert's down, 8 x I bytes
  for (int t = 0; t < tiles2; ++t, owner ^= 1) {
    const int c0 = chunk;
    tile(owner, c0, segments, segments * ib,
         [&](int i, const uint8_t*& w, int& pitch, int& x_col, float& s0, float& s1) {
           const int seg = i / ib, b = i % ib, r = t * kTile + 2 * (lane & 3);
           w = sm.ring[(c0 + seg) % kSlots] + b * kBlock;
           pitch = s.I;
           x_col = seg * s.I + b * kBlock;
           s0 = sm.weight[seg] * sm.down_scale[seg][(n0 + r) / kBlock - rb0][b];
           s1 = sm.weight[seg] * sm.down_scale[seg][(n0 + r + 1) / kBlock - rb0][b];
         },
         [&](int r, float v) { sm.acc[t * kTile + r] = v; });
    chunk += segments;
  }
  consumers_sync();
  if (threadIdx.x < s.rows) {
    const int n = n0 + threadIdx.x;
    const float r = __bfloat162float(static_cast<const __nv_bfloat16*>(a.residual)[n]);
    static_cast<__nv_bfloat16*>(a.out)[n] = __float2bfloat16(r + sm.acc[threadIdx.x]);
  }
  if (threadIdx.x == 0) {  // the last CTA to finish publishes the epoch (every CTA read it at entry)
    __threadfence();
    if (atomicAdd(&g_done, 1u) == kCtas - 1) {
      g_done = 0;
      *(volatile unsigned*)&g_epoch = tag;
      __threadfence();
    }
  }
}

}  // namespace

// Raises the kernel's dynamic shared-memory limit (jt_prepare_device, once a device).
int prepare_moe_kernels(int max_smem) {
  if ((int)sizeof(Smem) > max_smem) return (int)cudaErrorInvalidValue;
  return (int)cudaFuncSetAttribute(moe_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   (int)sizeof(Smem));
}

}  // namespace jt

extern "C" const char* jt_moe_unsupported(int H, int I, int k) {
  using namespace jt;
  const int segments = k + 1;
  if (k < 1 || segments > kMaxSegments) return "k not in 1 .. JT_MOE_MAX_SEGMENTS - 1";
  if (H % kBlock || H > kMaxVec) return "H not a multiple of 128 up to JT_MOE_MAX_VEC";
  if (I % kBlock || I / kBlock > kMaxIBlocks || kTile * I > kSlotBytes) return "I not a multiple of 128 up to 1024";
  if (H > kSlotBytes) return "H above 8192";
  if (segments * I > kMaxVec) return "(k + 1) * I above JT_MOE_MAX_VEC";
  if ((segments * I) % kCtas || segments * I / kCtas > kMaxPairs) return "(k + 1) * I not split evenly over the CTAs";
  if (H % (kCtas * kTile) || H / kCtas > kMaxRows) return "H not split over the CTAs in tiles of 8 rows";
  return nullptr;
}

extern "C" cudaError_t jt_moe_decode(cudaStream_t stream, const JtMoeArgs* args, int L, int E, int H, int I, int k,
                                     int64_t timeout_ms) {
  using namespace jt;
  if (jt_moe_unsupported(H, I, k) != nullptr || L < 1 || E < 1) return cudaErrorInvalidValue;
  const Shapes s{L, E, H, I, k, (k + 1) * I / kCtas, H / kCtas, (long long)timeout_ms * 1000000LL};
  moe_decode_kernel<<<kCtas, kThreads, sizeof(Smem), stream>>>(*args, s);
  return cudaGetLastError();
}
