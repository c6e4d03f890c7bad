// A MoE layer's experts for one decode token in one launch:
//   out = residual + sum_j w_j Down[id_j] h_j + SharedDown h_s,
//   h_e = bf16(silu(bf16(f Gate_e^T)) * bf16(f Up_e^T))
// for the k chosen experts and the shared one (fp8 weights, 128 x 128 block
// scales; f the normed input, bf16), with the rounding of
// jtilert.ops.reference's swiglu_hidden.
//
// One persistent launch of kCtas CTAs (one per SM, all resident), two phases:
//   1. gate/up: the (k + 1) * I (gate row, up row) pairs split evenly over
//      the CTAs; each CTA writes its pairs' h into a scratch vector, then adds
//      one to an arrival counter (a release: its h is visible to whoever sees
//      the count);
//   2. down: the H output rows in slices of kRows2 rows, one slice a CTA (the
//      first H / kRows2 CTAs); one thread of each waits until the counter
//      reaches the call's target (an acquire), then the CTA reads the whole h
//      vector, reduces its rows over the k + 1 expert segments and writes
//      residual + sum (bf16).
// One thread polls one word: polls from every warp of every CTA take the
// SMs' path to L2 from phase 2's weight copies, which then land late.
// The weights of both phases are known at the launch (the expert ids are read
// first), so one producer warp streams every chunk of both phases, in order,
// into a ring of shared-memory slots (cp.async.bulk, an mbarrier pair per
// slot): phase 2's weights, which fit the ring, arrive while the CTAs wait for
// each other's h. A chunk is one bulk copy (each costs the producer thread
// about as much as its bytes take to arrive, so chunks are large): phase 1,
// one gate or up row (H bytes); phase 2, R consecutive rows of one expert's
// down (R x I bytes, R = kSlotBytes / I up to kRows2). The slots are 16 bytes
// longer than 8 KB, so 8 consecutive slots' rows fall on different banks.
// A tile is 8 weight rows: phase 1, 8 consecutive chunks; phase 2, 8 rows of
// each of the k + 1 chunks of one row range. Two groups of 8 consumer warps take
// the tiles in turn; each warp reduces its share of the tile's 128-column scale
// blocks with fp8 tensor-core MMAs (block_dot); the warps' partial sums are
// added in a fixed order (the result does not depend on the warps' timing).
// Everything a phase needs that does not depend on the other CTAs (scales,
// ids, routing weights) is loaded with all its loads in flight at once.
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
constexpr int kRows2 = 64;                     // phase 2's output rows of a CTA
constexpr int kBlock = 128;                    // fp8 scale block
constexpr int kMaxIBlocks = 8;                 // I / 128
constexpr float kE4m3Max = 448.f;

__device__ float4 g_hidden[kMaxVec / 4];        // phase 1's h
__device__ unsigned g_arrived;                   // CTAs that wrote their h, over all calls (mod 2^32)
__device__ unsigned g_epoch;                     // the last call's number (mod 2^32)
__device__ unsigned g_done;                      // CTAs that finished this call

struct Shapes {
  int L, E, H, I, k;
  int pairs;  // gate/up pairs of a CTA
  int chunk_rows;  // phase 2: the down rows of one chunk (kTile .. kRows2, a power of two)
  long long timeout_ns;  // the longest a CTA waits for the others' h
};

struct Smem {
  uint8_t ring[kSlots][kSlotPitch];
  uint8_t x8[2][kMaxVec];                  // the phase's input as e4m3 hi and lo rows
  float x_scale[2][kMaxVec / kBlock];      // their block scales
  float up_gate_scale[2 * kMaxPairs][kMaxVec / kBlock];  // row 2q + up of pair q: its H / 128 block scales
  float down_scale[kMaxSegments][kMaxIBlocks];           // the CTA's rows' (one row block) [segment][I block]
  float acc[kRows2];                       // the CTA's row sums (phase 1: its gate/up rows)
  float part[kGroups][kGroupWarps][kTile]; // a tile's partial sums, by warp
  float weight[kMaxSegments];              // routing weights (1 for the shared expert)
  int id[kMaxSegments];                    // expert ids (clamped), -1 for the shared expert
  uint64_t full[kSlots], empty[kSlots];
};

static_assert(sizeof(Smem) <= 227 * 1024, "the shared memory of one CTA an SM");
static_assert(kSlotPitch % 16 == 0, "bulk copies: 16-byte addresses");
static_assert(kSlots % kTile == 0, "phase-1 tiles of 8 consecutive slots");
static_assert(2 * kMaxPairs <= kRows2, "phase 1's row sums in acc");
static_assert(kBlock % kRows2 == 0, "a CTA's phase-2 rows in one scale block");

__device__ __forceinline__ unsigned load_acquire(const unsigned* a) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
  return v;
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

// The phase's input as two e4m3 rows in x8 with a scale per 128-block each:
// hi = e4m3(x / s_hi), s_hi = max|x| / 448, then the rest the same way (lo),
// so hi * s_hi + lo * s_lo keeps about 8 significant bits of each element near
// its block's largest. One warp a block: the warp's blocks are warp, warp +
// kWarps, .. < nb, and v[u] holds lane's elements 4 lane .. 4 lane + 3 of its
// u-th block (the caller loads them all before any is needed).
constexpr int kWarps = kConsumers / 32;
constexpr int kBlocksPerWarp = kMaxVec / kBlock / kWarps;
__device__ __forceinline__ void quantize_input(Smem& sm, int nb, int warp, int lane, const float4 (&v)[kBlocksPerWarp]) {
#pragma unroll
  for (int u = 0; u < kBlocksPerWarp; ++u) {
    const int b = warp + u * kWarps;
    if (b >= nb) break;
    float r[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
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
// fp8 tensor-core MMAs (m16n8k32, e4m3) of 32 columns. B holds the 8 rows
// (column g of B: row g); A's rows g and g + 8 hold hi and lo at the columns
// row g is read at, so the diagonal C[g][g] is row g's dot with hi and C[g +
// 8][g] with lo. That lets row g read its columns rotated by g * shift bytes
// within the block (a dot product does not depend on the order of its terms):
// where the rows' pitch is a multiple of 128 bytes (phase 2), shift 16 puts the
// 8 rows' 4-byte words on 32 different banks. Returns, in the lane holding
// row g = lane / 4 (lane % 4 == g / 2, `holds_row`), hi * s_hi + lo * s_lo
// (the weights' scale not applied); 0 in the other lanes.
__device__ __forceinline__ bool holds_row(int lane) { return (lane & 3) == (lane >> 3); }
__device__ __forceinline__ float block_dot(const Smem& sm, const uint8_t* w, int pitch, int x_col, int shift, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const uint8_t* hi = sm.x8[0] + x_col;
  const uint8_t* lo = sm.x8[1] + x_col;
  w += g * pitch;
  float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s4 = 0; s4 < kBlock / 32; ++s4) {
    const int k0 = (g * shift + s4 * 32 + t * 4) & (kBlock - 1), k1 = (k0 + 16) & (kBlock - 1);
    const uint32_t a0 = *reinterpret_cast<const uint32_t*>(hi + k0), a1 = *reinterpret_cast<const uint32_t*>(lo + k0);
    const uint32_t a2 = *reinterpret_cast<const uint32_t*>(hi + k1), a3 = *reinterpret_cast<const uint32_t*>(lo + k1);
    const uint32_t b0 = *reinterpret_cast<const uint32_t*>(w + k0), b1 = *reinterpret_cast<const uint32_t*>(w + k1);
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  // lane (g, t) holds C[g][2t], C[g][2t + 1] in c[0], c[1] and C[g + 8][2t], C[g + 8][2t + 1] in c[2], c[3]
  const int b = x_col / kBlock;
  return holds_row(lane) ? c[g & 1] * sm.x_scale[0][b] + c[2 + (g & 1)] * sm.x_scale[1][b] : 0.f;
}

__device__ __forceinline__ void group_sync(int group) {  // the 8 warps of a consumer group
  asm volatile("bar.sync %0, %1;" ::"r"(2 + group), "n"(kGroupWarps * 32) : "memory");
}

__global__ void __launch_bounds__(kThreads, 1) moe_decode_kernel(const JtMoeArgs a, const Shapes s) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, cta = blockIdx.x;
  const int segments = s.k + 1;
  int layer = __ldg(a.layer) + __ldg(a.layer_offset);
  if (layer < 0) layer += s.L;
  layer = min(max(layer, 0), s.L - 1);
  const unsigned call = *(volatile unsigned*)&g_epoch + 1;  // this call's number
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
  // chunk each, in tiles of 8; phase 2 (CTAs below H / kRows2): output rows n0 .. n0 + kRows2, in
  // chunk_rows-row chunks of each expert's down, the segments' chunks of one row range in turn
  const int p0 = cta * s.pairs, gu_rows = 2 * s.pairs, n0 = cta * kRows2;
  const bool down = n0 < s.H;
  const int tiles1 = (gu_rows + kTile - 1) / kTile, ranges = down ? kRows2 / s.chunk_rows : 0;
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
    for (int r = 0; r < ranges; ++r)
      for (int seg = 0; seg < segments; ++seg)
        push(down_row(a, s, layer, sm.id[seg], n0 + r * s.chunk_rows), s.chunk_rows * s.I);
    return;
  }

  // ---- consumers: phase 1's scales and input, every load in flight before the first is used ----
  const int hb = s.H / kBlock, ib = s.I / kBlock;
  {
    constexpr int kPer = 2 * kMaxPairs * (kMaxVec / kBlock) / kConsumers;
    float sc[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = threadIdx.x + u * kConsumers, r = min(i / hb, gu_rows - 1), p = p0 + r / 2;
      sc[u] = i < gu_rows * hb ? __ldg(gate_scales(a, s, layer, sm.id[p / s.I], r & 1, p % s.I) + i % hb) : 0.f;
    }
    float4 v[kBlocksPerWarp];
#pragma unroll
    for (int u = 0; u < kBlocksPerWarp; ++u) {
      const int b = warp + u * kWarps;
      if (b < hb) {
        const uint2 q = __ldg(reinterpret_cast<const uint2*>(a.f) + b * (kBlock / 4) + lane);  // 4 bf16
        const float2 x01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.x));
        const float2 x23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&q.y));
        v[u] = make_float4(x01.x, x01.y, x23.x, x23.y);
      }
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = threadIdx.x + u * kConsumers;
      if (i < gu_rows * hb) sm.up_gate_scale[i / hb][i % hb] = sc[u];
    }
    quantize_input(sm, hb, warp, lane, v);
  }
  consumers_sync();

  const int group = warp / kGroupWarps, gw = warp % kGroupWarps, g = lane >> 2;
  // A tile of 8 rows whose blocks are block(i, w, pitch, x_col, shift, scale) for i < nblocks (the
  // block's 8 rows at w, their pitch, the input's column, block_dot's rotation and row g's weight
  // scale), reduced by group `owner` once chunks c0 .. c0 + nc have landed: each warp adds up
  // blocks gw, gw + 8, .., then warp 0 sums the 8 warps' parts in order into out(row, sum). With
  // `release`, the chunks' slots go back to the producer.
  auto tile = [&](int owner, int c0, int nc, bool release, int nblocks, auto block, auto out) {
    if (owner != group) return;
    for (int c = c0; c < c0 + nc; ++c) mbar_wait(&sm.full[c % kSlots], (c / kSlots) & 1);
    float r = 0.f;
    for (int i = gw; i < nblocks; i += kGroupWarps) {
      const uint8_t* w;
      int pitch, x_col, shift;
      float scale;
      block(i, w, pitch, x_col, shift, scale);
      r += block_dot(sm, w, pitch, x_col, shift, lane) * scale;
    }
    if (holds_row(lane)) sm.part[group][gw][g] = r;
    __syncwarp();
    if (release && lane == 0)
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
    const int c0 = t * kTile, nr = min(kTile, gu_rows - c0);
    tile(owner, c0, nr, true, hb,
         [&](int i, const uint8_t*& w, int& pitch, int& x_col, int& shift, float& scale) {
           // block i of all 8 rows: row g in slot c0 + g (rows past nr: another chunk, unused)
           w = sm.ring[c0 % kSlots] + i * kBlock;
           pitch = kSlotPitch;  // a phase-1 tile starts at a multiple of 8 chunks: it never wraps
           x_col = i * kBlock;
           shift = 0;  // the slots' pitch already spreads the rows over the banks
           scale = c0 + g < gu_rows ? sm.up_gate_scale[c0 + g][i] : 0.f;
         },
         [&](int r, float v) {
           if (c0 + r < gu_rows) sm.acc[c0 + r] = v;
         });
  }
  consumers_sync();
  if (threadIdx.x < s.pairs) {  // h of pair q
    const int q = threadIdx.x;
    const float gv = round_bf16(sm.acc[2 * q]), uv = round_bf16(sm.acc[2 * q + 1]);
    reinterpret_cast<float*>(g_hidden)[p0 + q] = round_bf16(gv / (1.f + __expf(-gv)) * uv);
  }
  consumers_sync();
  if (threadIdx.x == 0) {  // the CTA's h, then its arrival (fence + relaxed add: a release)
    __threadfence();
    atomicAdd(&g_arrived, 1u);
  }
  if (down) {
    // phase 2's scales (the CTA's rows lie in one row block) while thread 0 waits for every CTA's
    // arrival in this call, then the whole h vector from L2
    for (int i = threadIdx.x; i < segments * ib; i += kConsumers)
      sm.down_scale[i / ib][i % ib] = __ldg(down_scales(a, s, layer, sm.id[i / ib], n0) + i % ib);
    if (threadIdx.x == 0) {
      const unsigned target = call * kCtas;
      const long long since = global_ns();
      while ((int)(load_acquire(&g_arrived) - target) < 0) {
        __nanosleep(128);
        if (global_ns() - since > s.timeout_ns) __trap();  // a CTA that never came: a CUDA error, not a hang
      }
    }
    consumers_sync();
    const int nb = segments * ib;
    float4 v[kBlocksPerWarp];
#pragma unroll
    for (int u = 0; u < kBlocksPerWarp; ++u) {
      const int b = warp + u * kWarps;
      if (b < nb) v[u] = __ldcg(g_hidden + b * (kBlock / 4) + lane);
    }
    quantize_input(sm, nb, warp, lane, v);
    consumers_sync();
    // phase 2: tile t is rows n0 + 8t .. of every segment, in range t * 8 / chunk_rows's chunks (which
    // stay in the ring: the producer pushes nothing after them)
    for (int t = 0; t < kRows2 / kTile; ++t, owner ^= 1) {
      const int range = t * kTile / s.chunk_rows, row = t * kTile % s.chunk_rows;
      const int c0 = gu_rows + range * segments;
      tile(owner, c0, segments, false, segments * ib,
           [&](int i, const uint8_t*& w, int& pitch, int& x_col, int& shift, float& scale) {
             const int seg = i / ib, b = i % ib;
             w = sm.ring[(c0 + seg) % kSlots] + row * s.I + b * kBlock;
             pitch = s.I;
             x_col = seg * s.I + b * kBlock;
             shift = 16;  // rows a multiple of 128 bytes apart: rotated onto different banks
             scale = sm.weight[seg] * sm.down_scale[seg][b];
           },
           [&](int r, float v) { sm.acc[t * kTile + r] = v; });
    }
    consumers_sync();
    if (threadIdx.x < kRows2) {
      const int n = n0 + threadIdx.x;
      const float r = __bfloat162float(static_cast<const __nv_bfloat16*>(a.residual)[n]);
      static_cast<__nv_bfloat16*>(a.out)[n] = __float2bfloat16(r + sm.acc[threadIdx.x]);
    }
  }
  if (threadIdx.x == 0) {  // the last CTA to finish publishes the call's number (every CTA read it at entry)
    __threadfence();
    if (atomicAdd(&g_done, 1u) == kCtas - 1) {
      g_done = 0;
      *(volatile unsigned*)&g_epoch = call;
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

// Phase 2's rows of one chunk: the most rows of one expert's down up to kRows2, a power of two, in a slot.
static int moe_chunk_rows(int I) {
  int r = jt::kRows2;
  while (r > jt::kTile && r * I > jt::kSlotBytes) r /= 2;
  return r;
}

extern "C" const char* jt_moe_unsupported(int H, int I, int k) {
  using namespace jt;
  const int segments = k + 1;
  if (k < 1 || segments > kMaxSegments) return "k not in 1 .. JT_MOE_MAX_SEGMENTS - 1";
  if (H % kBlock || H > kMaxVec || H > kCtas * kRows2) return "H not a multiple of 128 up to JT_MOE_MAX_VEC";
  if (I % kBlock || I / kBlock > kMaxIBlocks || kTile * I > kSlotBytes) return "I not a multiple of 128 up to 1024";
  if (H > kSlotBytes) return "H above 8192";
  if (segments * I > kMaxVec) return "(k + 1) * I above JT_MOE_MAX_VEC";
  if ((segments * I) % kCtas || segments * I / kCtas > kMaxPairs) return "(k + 1) * I not split evenly over the CTAs";
  if (kRows2 / moe_chunk_rows(I) * segments > kSlots) return "phase 2's weights of a CTA, (k + 1) x 64 rows x I, above the ring";
  return nullptr;
}

extern "C" cudaError_t jt_moe_decode(cudaStream_t stream, const JtMoeArgs* args, int L, int E, int H, int I, int k,
                                     int64_t timeout_ms) {
  using namespace jt;
  if (jt_moe_unsupported(H, I, k) != nullptr || L < 1 || E < 1) return cudaErrorInvalidValue;
  const Shapes s{L, E, H, I, k, (k + 1) * I / kCtas, moe_chunk_rows(I), (long long)timeout_ms * 1000000LL};
  moe_decode_kernel<<<kCtas, kThreads, sizeof(Smem), stream>>>(*args, s);
  return cudaGetLastError();
}
