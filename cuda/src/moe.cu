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
// slot): phase 2's weights arrive while the CTAs wait for each other's h. Two
// groups of 8 consumer warps take the chunks in turn. A chunk is `rows` rows
// of one weight matrix (phase 1: one row of H bytes; phase 2: R rows of I
// bytes of one expert's down); a warp step is 32 lanes x 4 bytes, 128 columns:
// one fp8 scale block. Everything a phase needs that does not depend on the
// other CTAs (scales, ids, routing weights) is in shared memory before it
// waits.
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
constexpr int kGroupWarps = 8;  // the warps of a group, sharing one chunk
constexpr int kConsumers = kGroups * kGroupWarps * 32;
constexpr int kThreads = kConsumers + 32;  // and the producer warp
constexpr int kSlots = 20;
constexpr int kSlotBytes = 8192;
constexpr int kMaxVec = JT_MOE_MAX_VEC;        // H and (k + 1) * I
constexpr int kMaxSegments = JT_MOE_MAX_SEGMENTS;  // k + 1
constexpr int kMaxPairs = 24;                  // gate/up pairs of a CTA
constexpr int kMaxRows = 64;                   // output rows of a CTA
constexpr int kBlock = 128;                    // fp8 scale block
constexpr int kMaxIBlocks = 8;                 // I / 128
constexpr int kStage = (kMaxVec + kConsumers - 1) / kConsumers;
constexpr int kMaxPer = 8;  // scale blocks a warp reduces in one row of a chunk

__device__ unsigned long long g_hidden[kMaxVec];  // phase 1's h, tagged
__device__ unsigned g_epoch;                     // the last call's tag
__device__ unsigned g_done;                      // CTAs that finished this call

struct Shapes {
  int L, E, H, I, k;
  int pairs;  // gate/up pairs of a CTA
  int rows;   // output rows of a CTA
  int rpc;    // rows of a phase-2 chunk
};

struct Smem {
  uint8_t ring[kSlots][kSlotBytes];
  float x[kMaxVec];                        // f (phase 1), then h (phase 2)
  float up_gate_scale[2 * kMaxPairs][kMaxVec / kBlock];  // a row's H / 128 block scales
  float down_scale[kMaxSegments][2][kMaxIBlocks];        // [segment][row block][I block]
  float acc[kMaxRows];                     // the CTA's row sums
  float weight[kMaxSegments];              // routing weights (1 for the shared expert)
  int id[kMaxSegments];                    // expert ids (clamped), -1 for the shared expert
  uint64_t full[kSlots], empty[kSlots];
};

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

// sum over 4 fp8 weights of w * x (x: 4 consecutive floats in shared memory)
__device__ __forceinline__ float dot4(uint32_t q, float4 x) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)q, __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(q >> 16), __NV_E4M3);
  const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  return a.x * x.x + a.y * x.y + b.x * x.z + b.y * x.w;
}

// One chunk of `rows` rows of `blocks` scale blocks each, reduced by the 8
// warps of a group into acc[row0 + r] (times mult): a row split over
// 8 / rows warps where it has fewer than 8 rows, else whole rows per warp.
// scale(r, b) gives block b of row r; x holds the row's inputs.
template <class Scale>
__device__ __forceinline__ void reduce_chunk(const uint8_t* chunk, int rows, int blocks, const float* x, float* acc,
                                             float mult, int gw, int lane, Scale scale) {
  const int parts = rows >= kGroupWarps ? 1 : kGroupWarps / rows, per = blocks / parts;
  for (int item = gw; item < rows * parts; item += kGroupWarps) {
    const int r = item / parts, b0 = (item % parts) * per;
    const uint32_t* w = reinterpret_cast<const uint32_t*>(chunk + (size_t)r * blocks * kBlock);
    // every load of the item issued before the arithmetic (per <= kMaxPer)
    uint32_t q[kMaxPer];
    float4 xv[kMaxPer];
#pragma unroll
    for (int j = 0; j < kMaxPer; ++j)
      if (j < per) {
        q[j] = w[(b0 + j) * 32 + lane];
        xv[j] = reinterpret_cast<const float4*>(x + (b0 + j) * kBlock)[lane];
      }
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kMaxPer; ++j)
      if (j < per) sum += scale(r, b0 + j) * dot4(q[j], xv[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) atomicAdd(&acc[r], sum * mult);
  }
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

  const int p0 = cta * s.pairs, n0 = cta * s.rows, half_chunks = s.rows / s.rpc;
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
    for (int q = 0; q < s.pairs; ++q) {
      const int p = p0 + q, id = sm.id[p / s.I];
      push(gate_row(a, s, layer, id, false, p % s.I), s.H);
      push(gate_row(a, s, layer, id, true, p % s.I), s.H);
    }
    for (int seg = 0; seg < segments; ++seg)
      for (int c = 0; c < half_chunks; ++c)
        push(down_row(a, s, layer, sm.id[seg], n0 + c * s.rpc), s.rpc * s.I);
    return;
  }

  // ---- consumers: f and every scale into shared memory, before any wait ----
  const int hb = s.H / kBlock, ib = s.I / kBlock, rb0 = n0 / kBlock;
  for (int i = threadIdx.x; i < s.H; i += kConsumers) sm.x[i] = __bfloat162float(static_cast<const __nv_bfloat16*>(a.f)[i]);
  for (int i = threadIdx.x; i < 2 * s.pairs * hb; i += kConsumers) {
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

  const int group = warp / kGroupWarps, gw = warp % kGroupWarps;
  int g = 0;  // chunks taken so far (chunk g sits in slot g % kSlots)
  // phase 1: chunk 2q is pair q's gate row, 2q + 1 its up row
  for (; g < 2 * s.pairs; ++g) {
    if (g % kGroups != group) continue;
    const int slot = g % kSlots;
    mbar_wait(&sm.full[slot], (g / kSlots) & 1);
    const float* sc = sm.up_gate_scale[g];
    reduce_chunk(sm.ring[slot], 1, hb, sm.x, sm.acc + g, 1.f, gw, lane, [&](int, int b) { return sc[b]; });
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
  // phase 2: chunk (seg, c) holds rows n0 + c * rpc .. of segment seg's down
  for (int seg = 0; seg < segments; ++seg) {
    for (int c = 0; c < half_chunks; ++c, ++g) {
      if (g % kGroups != group) continue;
      const int slot = g % kSlots, r0 = c * s.rpc;
      mbar_wait(&sm.full[slot], (g / kSlots) & 1);
      reduce_chunk(sm.ring[slot], s.rpc, ib, sm.x + seg * s.I, sm.acc + r0, sm.weight[seg], gw, lane,
                   [&](int r, int b) { return sm.down_scale[seg][(n0 + r0 + r) / kBlock - rb0][b]; });
      __syncwarp();
      if (lane == 0) (void)ptx::mbarrier_arrive(&sm.empty[slot]);
    }
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
// Rows of a phase-2 chunk: the largest whole share of a CTA's H / kCtas rows
// that fits a slot; with fewer than 8 rows the warps split a row's I / 128
// blocks, which must then divide evenly (0: no such share).
int down_chunk_rows(int H, int I) {
  using namespace jt;
  const int rows = H / kCtas;
  for (int r = rows; r >= 1; --r)
    if (rows % r == 0 && r * I <= kSlotBytes)
      return r >= kGroupWarps || (kGroupWarps % r == 0 && (I / kBlock) % (kGroupWarps / r) == 0) ? r : 0;
  return 0;
}
}  // namespace

extern "C" const char* jt_moe_unsupported(int H, int I, int k) {
  using namespace jt;
  const int segments = k + 1;
  if (k < 1 || segments > kMaxSegments) return "k + 1 experts above JT_MOE_MAX_SEGMENTS";
  if (H % (kBlock * kGroupWarps) || H > kMaxVec) return "H not a multiple of 1024 up to JT_MOE_MAX_VEC";
  if (I % kBlock || I / kBlock > kMaxIBlocks) return "I not a multiple of 128 up to 1024";
  if (segments * I > kMaxVec) return "(k + 1) * I above JT_MOE_MAX_VEC";
  if ((segments * I) % kCtas || segments * I / kCtas > kMaxPairs) return "(k + 1) * I not split evenly over the CTAs";
  if (H % kCtas || H / kCtas > kMaxRows) return "H not split evenly over the CTAs";
  if (down_chunk_rows(H, I) == 0) return "no chunk of down rows fits a ring slot";
  return nullptr;
}

extern "C" cudaError_t jt_moe_decode(cudaStream_t stream, const JtMoeArgs* args, int L, int E, int H, int I, int k) {
  using namespace jt;
  if (jt_moe_unsupported(H, I, k) != nullptr || L < 1 || E < 1) return cudaErrorInvalidValue;
  const Shapes s{L, E, H, I, k, (k + 1) * I / kCtas, H / kCtas, down_chunk_rows(H, I)};
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
