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
// A chunk is a tile of 8 weight rows x a slice of their K (phase 1: 896
// columns of 8 gate/up rows; phase 2: three experts' I columns of 8 down rows),
// each row copied to its own shared-memory row, the rows 16 bytes further
// apart than their length so that the tensor-core loads below hit 32 banks.
// Two groups of 8 consumer warps take the chunks in turn; a warp reduces one
// 128-column scale block of the tile with four fp8 tensor-core MMAs
// (m16n8k32, e4m3): A holds the input as two e4m3 rows, hi and lo (x ~ hi *
// s_hi + lo * s_lo, scales per 128-column block), B the 8 weight rows, so the
// fp32 result's two rows are the tile's dot products with hi and lo. Everything
// a phase needs that does not depend on the other CTAs (scales, ids, routing
// weights) is in shared memory before it waits.
//
// The scratch vector and the epoch are the library's device globals: the
// calls on one device must not overlap (a decode step's MoE layers are a
// chain). The last CTA to finish publishes the epoch.
#include <cuda/ptx>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include "jtilert/engine.h"

namespace jt {
namespace {

namespace ptx = cuda::ptx;

constexpr int kCtas = JT_MOE_CTAS;
constexpr int kGroups = 2;      // consumer warp groups, taking the chunks in turn
constexpr int kGroupWarps = 8;  // the warps of a group, one scale block of a chunk each
constexpr int kConsumers = kGroups * kGroupWarps * 32;
constexpr int kThreads = kConsumers + 32;  // and the producer warp
constexpr int kSlots = 20;
constexpr int kSlotBytes = 8192;
constexpr int kTile = 8;                       // weight rows of a chunk (the MMA's N)
constexpr int kPad = 16;                       // bytes between a chunk's rows in shared memory
constexpr int kMaxSlice = kSlotBytes / kTile - kPad;  // a chunk row's bytes
constexpr int kMaxVec = JT_MOE_MAX_VEC;        // H and (k + 1) * I
constexpr int kMaxSegments = JT_MOE_MAX_SEGMENTS;  // k + 1
constexpr int kMaxPairs = 24;                  // gate/up pairs of a CTA
constexpr int kMaxRows = 64;                   // output rows of a CTA
constexpr int kBlock = 128;                    // fp8 scale block
constexpr int kMaxIBlocks = 8;                 // I / 128
constexpr int kStage = (kMaxVec + kConsumers - 1) / kConsumers;
constexpr float kE4m3Max = 448.f;

__device__ unsigned long long g_hidden[kMaxVec];  // phase 1's h, tagged
__device__ unsigned g_epoch;                     // the last call's tag
__device__ unsigned g_done;                      // CTAs that finished this call

struct Shapes {
  int L, E, H, I, k;
  int pairs;   // gate/up pairs of a CTA
  int rows;    // output rows of a CTA (a multiple of kTile)
  int slice;   // phase 1: the columns of a chunk (a multiple of 128 dividing H)
  int spc;     // phase 2: the experts (segments) of a chunk
};

struct Smem {
  uint8_t ring[kSlots][kSlotBytes];
  float x[kMaxVec];                        // f (phase 1), then h (phase 2)
  uint8_t x8[2][kMaxVec];                  // the input as e4m3 hi and lo rows
  float x_scale[2][kMaxVec / kBlock];      // their block scales
  float up_gate_scale[2 * kMaxPairs][kMaxVec / kBlock];  // row 2q + up of pair q: its H / 128 block scales
  float down_scale[kMaxSegments][2][kMaxIBlocks];        // [segment][row block][I block]
  float acc[kMaxRows];                     // the CTA's row sums
  float weight[kMaxSegments];              // routing weights (1 for the shared expert)
  int id[kMaxSegments];                    // expert ids (clamped), -1 for the shared expert
  uint64_t full[kSlots], empty[kSlots];
};

static_assert(sizeof(Smem) <= 227 * 1024, "the shared memory of one CTA an SM");
static_assert(kMaxSlice % 16 == 0 && kPad % 16 == 0, "bulk copies: 16-byte sizes and addresses");

__device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long* a) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
  return v;
}
__device__ __forceinline__ void store_relaxed(unsigned long long* a, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
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

// x[0, n) (n a multiple of 128) as two e4m3 rows in x8 with a scale per
// 128-block each: hi = e4m3(x / s_hi), s_hi = max|x| / 448, then the rest the
// same way (lo), so hi * s_hi + lo * s_lo keeps about 8 significant bits of
// each element near its block's largest. One warp a block.
__device__ __forceinline__ void quantize_input(Smem& sm, int n, int warp, int lane) {
  for (int b = warp; b < n / kBlock; b += kConsumers / 32) {
    const float4 v = reinterpret_cast<const float4*>(sm.x + b * kBlock)[lane];
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

// One 128-column block of a chunk: the 8 rows' dot products with the input's
// hi and lo rows (columns x_col.. of x8), four MMAs of 32 columns. Returns,
// in lanes 0..3, the block's unscaled-by-weight sums of rows 2 * lane and
// 2 * lane + 1 (hi * s_hi + lo * s_lo).
__device__ __forceinline__ float2 block_dot(const Smem& sm, const uint8_t* rows, int pitch, int col, int x_col,
                                            int lane) {
  const int g = lane >> 2, t = lane & 3;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s4 = 0; s4 < kBlock / 32; ++s4) {
    const int k = s4 * 32 + t * 4;
    const uint32_t a0 = g < 2 ? *reinterpret_cast<const uint32_t*>(sm.x8[g & 1] + x_col + k) : 0u;
    const uint32_t a2 = g < 2 ? *reinterpret_cast<const uint32_t*>(sm.x8[g & 1] + x_col + k + 16) : 0u;
    const uint32_t b0 = *reinterpret_cast<const uint32_t*>(rows + g * pitch + col + k);
    const uint32_t b1 = *reinterpret_cast<const uint32_t*>(rows + g * pitch + col + k + 16);
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

  // phase 1: the CTA's 2 * pairs weight rows (row j: pair j / 2's gate or, odd j, up row) in tiles
  // of 8, each tile in slices of `slice` columns; phase 2: its output rows in tiles of 8, each tile
  // in groups of spc experts
  const int p0 = cta * s.pairs, n0 = cta * s.rows, gu_rows = 2 * s.pairs;
  const int tiles1 = (gu_rows + kTile - 1) / kTile, slices = s.H / s.slice, tiles2 = s.rows / kTile;
  const int groups2 = segments / s.spc, pitch1 = s.slice + kPad, pitch2 = s.spc * s.I + kPad;
  if (warp == kGroups * kGroupWarps) {  // the producer: every chunk of both phases, in order
    if (lane != 0) return;
    int slot = 0, round = 0;
    auto next_slot = [&](unsigned bytes) {
      if (round > 0) mbar_wait(&sm.empty[slot], (round - 1) & 1);
      ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &sm.full[slot], bytes);
    };
    auto copy = [&](uint8_t* dst, const uint8_t* src, unsigned bytes) {
      ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, dst, src, bytes, &sm.full[slot]);
    };
    auto done_slot = [&]() {
      if (++slot == kSlots) {
        slot = 0;
        ++round;
      }
    };
    for (int t = 0; t < tiles1; ++t) {
      const int nr = min(kTile, gu_rows - t * kTile);
      for (int sl = 0; sl < slices; ++sl) {
        next_slot(nr * s.slice);
        for (int r = 0; r < nr; ++r) {
          const int j = t * kTile + r, p = p0 + j / 2;
          copy(sm.ring[slot] + r * pitch1, gate_row(a, s, layer, sm.id[p / s.I], j & 1, p % s.I) + sl * s.slice,
               s.slice);
        }
        done_slot();
      }
    }
    for (int t = 0; t < tiles2; ++t)
      for (int c = 0; c < groups2; ++c) {
        next_slot(kTile * s.spc * s.I);
        for (int r = 0; r < kTile; ++r)
          for (int u = 0; u < s.spc; ++u)
            copy(sm.ring[slot] + r * pitch2 + u * s.I, down_row(a, s, layer, sm.id[c * s.spc + u], n0 + t * kTile + r),
                 s.I);
        done_slot();
      }
    return;
  }

  // ---- consumers: f and every scale into shared memory, before any wait ----
  const int hb = s.H / kBlock, ib = s.I / kBlock, rb0 = n0 / kBlock;
  for (int i = threadIdx.x; i < s.H; i += kConsumers) sm.x[i] = __bfloat162float(static_cast<const __nv_bfloat16*>(a.f)[i]);
  for (int i = threadIdx.x; i < gu_rows * hb; i += kConsumers) {
    const int r = i / hb, b = i % hb, p = p0 + r / 2;
    sm.up_gate_scale[r][b] = __ldg(gate_scales(a, s, layer, sm.id[p / s.I], r & 1, p % s.I) + b);
  }
  for (int i = threadIdx.x; i < segments * 2 * ib; i += kConsumers) {
    const int seg = i / (2 * ib), rb = i / ib % 2, b = i % ib;
    const int n = min((rb0 + rb) * kBlock, s.H - 1);  // the CTA's rows span at most two row blocks
    sm.down_scale[seg][rb][b] = __ldg(down_scales(a, s, layer, sm.id[seg], n) + b);
  }
  for (int i = threadIdx.x; i < kMaxRows; i += kConsumers) sm.acc[i] = 0.f;
  consumers_sync();
  quantize_input(sm, s.H, warp, lane);
  consumers_sync();

  const int group = warp / kGroupWarps, gw = warp % kGroupWarps;
  int g = 0;  // chunks taken so far (chunk g sits in slot g % kSlots)
  // phase 1: warp gw takes scale block gw of the slice
  for (int t = 0; t < tiles1; ++t)
    for (int sl = 0; sl < slices; ++sl, ++g) {
      if (g % kGroups != group) continue;
      const int slot = g % kSlots, b = sl * (s.slice / kBlock) + gw;
      mbar_wait(&sm.full[slot], (g / kSlots) & 1);
      if (gw < s.slice / kBlock) {
        const float2 v = block_dot(sm, sm.ring[slot], pitch1, gw * kBlock, b * kBlock, lane);
        const int j = t * kTile + 2 * lane;
        if (lane < 4 && j < gu_rows) atomicAdd(&sm.acc[j], v.x * sm.up_gate_scale[j][b]);
        if (lane < 4 && j + 1 < gu_rows) atomicAdd(&sm.acc[j + 1], v.y * sm.up_gate_scale[j + 1][b]);
      }
      __syncwarp();
      if (lane == 0) (void)ptx::mbarrier_arrive(&sm.empty[slot]);
    }
  consumers_sync();
  if (threadIdx.x < s.pairs) {  // h of pair q, tagged; its sums zeroed for phase 2
    const int q = threadIdx.x;
    const float gv = round_bf16(sm.acc[2 * q]), uv = round_bf16(sm.acc[2 * q + 1]);
    const float h = round_bf16(gv / (1.f + __expf(-gv)) * uv);
    store_relaxed(g_hidden + p0 + q, (unsigned long long)tag << 32 | __float_as_uint(h));
    sm.acc[2 * q] = sm.acc[2 * q + 1] = 0.f;
  }
  // phase 2's input: the whole h vector, every load in flight before any is checked
  const int vec = segments * s.I;
  unsigned long long v[kStage];
#pragma unroll
  for (int j = 0; j < kStage; ++j)
    if (threadIdx.x + j * kConsumers < vec) v[j] = load_relaxed(g_hidden + threadIdx.x + j * kConsumers);
#pragma unroll
  for (int j = 0; j < kStage; ++j) {
    const int i = threadIdx.x + j * kConsumers;
    if (i < vec) {
      while ((unsigned)(v[j] >> 32) != tag) {  // backing off: the stragglers' streams share L2 with the polls
        __nanosleep(64);
        v[j] = load_relaxed(g_hidden + i);
      }
      sm.x[i] = __uint_as_float((unsigned)v[j]);
    }
  }
  consumers_sync();
  quantize_input(sm, vec, warp, lane);
  consumers_sync();
  // phase 2: chunk (t, c) holds output rows n0 + 8t .. of experts c * spc ..; warp gw takes
  // block gw of the chunk's spc * I columns (expert c * spc + gw * 128 / I)
  for (int t = 0; t < tiles2; ++t)
    for (int c = 0; c < groups2; ++c, ++g) {
      if (g % kGroups != group) continue;
      const int slot = g % kSlots, col = gw * kBlock;
      mbar_wait(&sm.full[slot], (g / kSlots) & 1);
      if (col < s.spc * s.I) {
        const int seg = c * s.spc + col / s.I, b = col % s.I / kBlock;
        const float2 v = block_dot(sm, sm.ring[slot], pitch2, col, c * s.spc * s.I + col, lane);
        const int r = t * kTile + 2 * lane, rb = (n0 + r) / kBlock - rb0;
        const float w = sm.weight[seg];
        if (lane < 4) {
          atomicAdd(&sm.acc[r], v.x * w * sm.down_scale[seg][rb][b]);
          atomicAdd(&sm.acc[r + 1], v.y * w * sm.down_scale[seg][(n0 + r + 1) / kBlock - rb0][b]);
        }
      }
      __syncwarp();
      if (lane == 0) (void)ptx::mbarrier_arrive(&sm.empty[slot]);
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

}  // namespace jt

namespace {
// Phase 1's chunk columns: the widest multiple of 128 dividing H that fits a
// slot row (at most 8 blocks: a warp each).
int gate_up_slice(int H) {
  using namespace jt;
  for (int c = kMaxSlice / kBlock * kBlock; c >= kBlock; c -= kBlock)
    if (H % c == 0 && c / kBlock <= kGroupWarps) return c;
  return 0;
}
// Phase 2's experts a chunk: the most that divide k + 1 and fit a slot row.
int down_experts(int I, int segments) {
  using namespace jt;
  for (int e = segments; e >= 1; --e)
    if (segments % e == 0 && e * I <= kMaxSlice && e * I / kBlock <= kGroupWarps) return e;
  return 0;
}
}  // namespace

extern "C" const char* jt_moe_unsupported(int H, int I, int k) {
  using namespace jt;
  const int segments = k + 1;
  if (k < 1 || segments > kMaxSegments) return "k + 1 experts above JT_MOE_MAX_SEGMENTS";
  if (H % kBlock || H > kMaxVec) return "H not a multiple of 128 up to JT_MOE_MAX_VEC";
  if (I % kBlock || I > kMaxSlice) return "I not a multiple of 128 up to 896";
  if (segments * I > kMaxVec) return "(k + 1) * I above JT_MOE_MAX_VEC";
  if ((segments * I) % kCtas || segments * I / kCtas > kMaxPairs) return "(k + 1) * I not split evenly over the CTAs";
  if (H % (kCtas * kTile) || H / kCtas > kMaxRows) return "H not split over the CTAs in tiles of 8 rows";
  if (down_experts(I, segments) == 0) return "no group of experts' down rows fits a ring slot";
  return nullptr;
}

extern "C" cudaError_t jt_moe_decode(cudaStream_t stream, const JtMoeArgs* args, int L, int E, int H, int I, int k) {
  using namespace jt;
  if (jt_moe_unsupported(H, I, k) != nullptr || L < 1 || E < 1) return cudaErrorInvalidValue;
  const Shapes s{L, E, H, I, k, (k + 1) * I / kCtas, H / kCtas, gate_up_slice(H), down_experts(I, k + 1)};
  static std::mutex mu;  // the shared-memory limit, raised once per device
  static bool raised[64] = {};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess || dev < 0 || dev >= 64) return e != cudaSuccess ? e : cudaErrorInvalidDevice;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!raised[dev]) {
      e = cudaFuncSetAttribute(moe_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sizeof(Smem));
      if (e != cudaSuccess) return e;
      raised[dev] = true;
    }
  }
  moe_decode_kernel<<<kCtas, kThreads, sizeof(Smem), stream>>>(*args, s);
  return cudaGetLastError();
}
