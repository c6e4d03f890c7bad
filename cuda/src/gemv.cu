// Persistent GEMV + all-reduce: y = sum over ranks of W_r @ x_r.
//
// Expert-down mode (TileRT's ExpertDownAllReduce) is the same GEMV over a K
// axis made of segments: the routed experts' hidden vectors h_e, each scaled
// by its routing weight, then the shared expert's hidden vector. Segment e
// reads Down[ids[e]] ([N, I] of the stacked [E, N, I] tensor; the id is read
// on the device), the last segment the shared expert's own [N, Is] weight, so
// y = sum over ranks of (sum_e Down[ids[e]] (w_e h_e) + SharedDown h_s) is
// one launch with one all-reduce.
//
// Stacked layers (the *_layer entry points): the weights and scales of every
// layer sit in one [L, ...] array and the layer index is base + offset, two
// int32s in device memory (a layer loop's counter and its call site's place in
// the loop's trip). Each CTA reads them first and offsets its weight and scale
// pointers by layer * (per-layer stride), so a traced layer loop passes the
// whole stack with no copy of the layer's slice, no host read of the index and
// no index arithmetic before the launch; every launch of a call site stays
// identical (command buffers).
//
// One CTA per task list of the host-built task table (jtilert/ffi/plan.py).
// Warps 0..nwc-1 stream weight rows (16-byte non-caching loads, RPW rows x U
// chunks in flight per lane) and write each tile's fp32 partial to shared
// memory, then arrive on that tile's mbarrier. Warp nwc is the communication
// warp: as soon as a tile's partial is complete it stores it into every peer's
// inbox (LL lines: the per-tile event lives in the flags of the lines), and it
// reduces the previous tile (own partial + every peer's, in rank order 0..W-1,
// fp32), so the exchange of tile i overlaps the weight streaming of tile i+1.
// Only the last tile's round trip is exposed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstring>

#include "common.cuh"
#include "group.h"

namespace jt {
namespace {

// table layout (int32): [0] num_ctas C, [1] tile_rows T, [2..2+C] offsets
// (C+1 values) into the task list, [3+C ...] first row of every task.
constexpr int kTableHeader = 2;

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
  uint4 v;
  asm volatile(
      "ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(
                   smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "JT_WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
      "@!p bra JT_WAIT_%=;\n\t}" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

template <int WDT>
struct WTraits;
template <>
struct WTraits<JT_BF16> {
  static constexpr int kElems = 8;  // elements per 16-byte chunk
};
template <>
struct WTraits<JT_F8E4M3> {
  static constexpr int kElems = 16;
};

// x lives in shared memory as fp32 in a swizzled order: float4 part q of the
// 16-byte weight chunk ch sits at float4 index ((ch / 32) * (EPC / 4) + q) * 32
// + ch % 32, so the 32 lanes of a warp (ch % 32 = lane) read 32 consecutive
// float4 for every part: no bank conflicts.
__device__ __forceinline__ float dot_bf16x8(uint4 w, const float4* x4) {
  const float4 a = x4[0];
  const float4 b = x4[32];
  float s = bf16_lo(w.x) * a.x;
  s = fmaf(bf16_hi(w.x), a.y, s);
  s = fmaf(bf16_lo(w.y), a.z, s);
  s = fmaf(bf16_hi(w.y), a.w, s);
  s = fmaf(bf16_lo(w.z), b.x, s);
  s = fmaf(bf16_hi(w.z), b.y, s);
  s = fmaf(bf16_lo(w.w), b.z, s);
  s = fmaf(bf16_hi(w.w), b.w, s);
  return s;
}

__device__ __forceinline__ float2 e4m3x2(uint32_t u16) {
  __half2_raw r =
      __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(u16 & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(r));
}

__device__ __forceinline__ float dot_word_e4m3(uint32_t w, float4 a) {
  float2 lo = e4m3x2(w);
  float2 hi = e4m3x2(w >> 16);
  float s = lo.x * a.x;
  s = fmaf(lo.y, a.y, s);
  s = fmaf(hi.x, a.z, s);
  s = fmaf(hi.y, a.w, s);
  return s;
}

__device__ __forceinline__ float dot_e4m3x16(uint4 w, const float4* x4) {
  float s = dot_word_e4m3(w.x, x4[0]);
  s += dot_word_e4m3(w.y, x4[32]);
  s += dot_word_e4m3(w.z, x4[64]);
  s += dot_word_e4m3(w.w, x4[96]);
  return s;
}

// Swizzled float index of element e of x (see above).
template <int EPC>
__device__ __forceinline__ int x_swizzle(int e) {
  const int ch = e / EPC;
  const int within = e - ch * EPC;
  const int q = within >> 2;
  return ((((ch >> 5) * (EPC / 4) + q) << 5) + (ch & 31)) * 4 + (within & 3);
}

struct GemvArgs {
  const uint16_t* x;  // bf16 x[K]; expert mode: routed hidden h[nsel, I]
  const uint4* w;     // W[N, K]; expert mode: stacked experts [E, N, I]
  const float* scale;  // [ceil(N/128), KB]; expert mode: [E, ceil(N/128), ceil(I/128)]
  const int* table;
  // stacked layers: the layer index, *layer + *layer_offset, in device memory
  // (null: w, scale, ws and ss are one layer's; the layer count is L below);
  // one layer of w is N x K (expert mode: E x N x I, of ws N x Is), scales
  // likewise
  const int* layer;
  const int* layer_offset;
  uint16_t* y;  // bf16 bits
  int N, K, KB, nwc, max_tasks, comm;
  // expert-down mode only (K = nsel * I + Is)
  const float* rw;   // routing weights [nsel]
  const int* ids;    // expert ids [nsel]
  const uint16_t* xs;  // shared expert's hidden h_s[Is], bf16
  const uint4* ws;   // shared expert's W [N, Is]
  const float* ss;   // its scales [ceil(N/128), ceil(Is/128)]
  int nsel, I, E;
  int L;  // stacked layers: the layer count
};

// The layer the kernel runs on: read from device memory in the stacked form,
// negative counting from the end, then clamped into [0, L) like XLA's dynamic
// slice, so the result is that of jnp's w[layer]; 0 otherwise.
__device__ __forceinline__ int layer_index(const GemvArgs& g) {
  if (g.layer == nullptr) return 0;
  int v = __ldg(g.layer) + __ldg(g.layer_offset);
  if (v < 0) v += g.L;
  return min(max(v, 0), g.L - 1);
}

// Where 16-byte chunk ch of the K axis comes from in expert-down mode: row
// `row` of its weight is at w + row * wstride, the fp8 scale at
// s + (row / 128) * sstride. Built once per CTA after reading the expert ids,
// so the weight stream itself needs no division or id lookup.
struct ChunkSrc {
  const uint4* w;
  const float* s;
  int wstride;  // 16-byte chunks per weight row
  int sstride;  // scale blocks per scale row
};

__device__ __forceinline__ float bf16_to_f32(uint16_t b) {
  return __uint_as_float((uint32_t)b << 16);
}

// Fills the chunk sources (expert mode): the routed segments at the expert
// the router chose (clamped into [0, E) like an XLA gather), then the shared
// expert's segment.
template <int EPC>
__device__ void fill_chunk_sources(const GemvArgs& g, ChunkSrc* src, int KC) {
  const int ic = g.I / EPC;  // chunks per routed segment
  const int is = (g.K - g.nsel * g.I) / EPC;
  const long long nb = (g.N + 127) / 128;
  const int ib = (g.I + 127) / 128;
  const int isb = (is * EPC + 127) / 128;
  // stacked form: layer l's routed experts are experts l * E .. l * E + E - 1
  // of the [L * E, N, I] stack, its shared expert layer l of [L, N, Is]
  const int l = layer_index(g);
  const long long e0 = (long long)l * g.E;
  for (int ch = threadIdx.x; ch < KC; ch += blockDim.x) {
    const int seg = ch / ic;
    ChunkSrc s;
    if (seg < g.nsel) {
      const long long id = e0 + min(max(__ldg(g.ids + seg), 0), g.E - 1);
      const int local = ch - seg * ic;
      s.w = g.w + id * g.N * ic + local;
      s.s = g.scale ? g.scale + id * nb * ib + ((local * EPC) >> 7) : nullptr;
      s.wstride = ic;
      s.sstride = ib;
    } else {
      const int local = ch - g.nsel * ic;
      s.w = g.ws + (long long)l * g.N * is + local;
      s.s = g.ss ? g.ss + (long long)l * nb * isb + ((local * EPC) >> 7)
                 : nullptr;
      s.wstride = is;
      s.sstride = isb;
    }
    src[ch] = s;
  }
}

template <int WDT, int RPW, int U, bool EXPERT>
__global__ void __launch_bounds__(544, 1)
    gemv_ar_kernel(CommParams c, GemvArgs g) {
  constexpr int EPC = WTraits<WDT>::kElems;
  extern __shared__ __align__(16) unsigned char smem[];

  // dense mode, stacked form: the layer's weights and scales (the layer index
  // is read first: every weight address depends on it); expert mode resolves
  // its weights in fill_chunk_sources
  const uint4* w_l = g.w;
  const float* s_l = g.scale;
  if constexpr (!EXPERT) {
    if (g.layer != nullptr) {
      const long long l = layer_index(g);
      w_l += l * g.N * (g.K / EPC);
      if (s_l != nullptr)
        s_l += l * ((g.N + 127) / 128) * ((g.K + 127) / 128);
    }
  }
  const int C = g.table[0];
  const int T = g.table[1];
  const int t0 = g.table[kTableHeader + blockIdx.x];
  const int ntask = g.table[kTableHeader + blockIdx.x + 1] - t0;
  const int* tasks = g.table + kTableHeader + C + 1 + t0;

  // shared memory: mbarriers | task rows | x (swizzled fp32) | partials |
  // chunk sources (expert mode)
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem);
  int* task_s = reinterpret_cast<int*>(smem + g.max_tasks * 8);
  float* x_s = reinterpret_cast<float*>(
      smem + ((g.max_tasks * 12 + 15) / 16) * 16);
  const int KC = g.K / EPC;       // 16-byte chunks per row
  const int LC = (KC + 31) >> 5;  // chunks per lane
  float* part_s = x_s + LC * 32 * EPC;
  ChunkSrc* src_s = reinterpret_cast<ChunkSrc*>(part_s + g.max_tasks * T);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const long long row_chunks = KC;
  const int NB = (LC + U - 1) / U;  // load batches per tile
  const int total = ntask * NB;

  struct Batch {
    uint4 v[RPW][U];
  };
  auto wptr = [&](int ch, int row) -> const uint4* {
    if constexpr (EXPERT) {
      return src_s[ch].w + (long long)row * src_s[ch].wstride;
    } else {
      return w_l + (long long)row * row_chunks + ch;
    }
  };
  auto sptr = [&](int ch, int row) -> const float* {
    if constexpr (EXPERT) {
      return src_s[ch].s + (row >> 7) * src_s[ch].sstride;
    } else {
      return s_l + (long long)(row >> 7) * g.KB + ((ch * EPC) >> 7);
    }
  };
  // load batch `bi` (tile bi / NB, chunk group bi % NB) of this warp's rows
  auto load = [&](Batch& b, int bi, int row0) {
    const int kb = bi % NB;
#pragma unroll
    for (int r = 0; r < RPW; ++r) {
      const int row = row0 + warp * RPW + r;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int ch = (kb * U + u) * 32 + lane;
        b.v[r][u] = (row < g.N && ch < KC) ? ldg_stream(wptr(ch, row))
                                           : make_uint4(0u, 0u, 0u, 0u);
      }
    }
  };

  Batch A, B;
  const bool computes = warp < g.nwc;
  if constexpr (EXPERT) {
    // the weight addresses depend on the expert ids: resolve them first
    fill_chunk_sources<EPC>(g, src_s, KC);
    __syncthreads();
  }
  // issue the first weight loads before x is staged: they do not depend on it
  if (computes && total > 0) load(A, 0, tasks[0]);
  for (int e = tid; e < g.K; e += blockDim.x) {
    float v;
    if constexpr (EXPERT) {
      // x = (w_0 h_0, ..., w_{k-1} h_{k-1}, h_s): the routing weights folded
      // into x in fp32
      const int kr = g.nsel * g.I;
      v = e < kr ? bf16_to_f32(g.x[e]) * __ldg(g.rw + e / g.I)
                 : bf16_to_f32(g.xs[e - kr]);
    } else {
      v = bf16_to_f32(g.x[e]);
    }
    x_s[x_swizzle<EPC>(e)] = v;
  }
  if (tid == 0) {
    for (int i = 0; i < ntask; ++i) mbar_init(&bars[i], (unsigned)g.nwc);
  }
  for (int i = tid; i < ntask; i += blockDim.x) task_s[i] = tasks[i];
  __syncthreads();

  if (computes) {
    // ---------------- compute warps: double-buffered weight stream ----------
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
    const float4* x4 = reinterpret_cast<const float4*>(x_s);
    auto consume = [&](const Batch& b, int bi) {
      const int ti = bi / NB;
      const int kb = bi - ti * NB;
      const int row0 = task_s[ti];
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        const int row = row0 + warp * RPW + r;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int g32 = kb * U + u;  // chunk group: ch = g32 * 32 + lane
          const int ch = g32 * 32 + lane;
          if (row < g.N && ch < KC) {
            const float4* xp = x4 + g32 * (EPC / 4) * 32 + lane;
            if constexpr (WDT == JT_BF16) {
              acc[r] += dot_bf16x8(b.v[r][u], xp);
            } else {
              const float sc = __ldg(sptr(ch, row));
              acc[r] = fmaf(dot_e4m3x16(b.v[r][u], xp), sc, acc[r]);
            }
          }
        }
      }
      if (kb == NB - 1) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
#pragma unroll
          for (int o = 16; o > 0; o >>= 1)
            acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        }
        if (lane == 0) {
#pragma unroll
          for (int r = 0; r < RPW; ++r) part_s[ti * T + warp * RPW + r] = acc[r];
          mbar_arrive(&bars[ti]);
        }
        __syncwarp();
#pragma unroll
        for (int r = 0; r < RPW; ++r) acc[r] = 0.f;
      }
    };
    for (int bi = 0; bi < total; bi += 2) {
      if (bi + 1 < total) load(B, bi + 1, task_s[(bi + 1) / NB]);
      consume(A, bi);
      if (bi + 1 >= total) break;
      if (bi + 2 < total) load(A, bi + 2, task_s[(bi + 2) / NB]);
      consume(B, bi + 1);
    }
  } else if (warp == g.nwc) {
    // ---------------- communication warp ----------------
    unsigned epoch = 0u;
    if (g.comm) {
      if (lane == 0) {
        epoch = load_epoch(c);
        publish_epoch(c, epoch);
      }
      epoch = __shfl_sync(0xffffffffu, epoch, 0);
    }
    const unsigned par = epoch & 1u;
    const int half = T >> 1;
    auto reduce_tile = [&](int ti) {
      const int row0 = task_s[ti];
      for (int j = lane; j < half; j += 32) {
        const long long line = (row0 >> 1) + j;
        const int r0 = row0 + 2 * j;
        if (r0 >= g.N) break;
        float a0 = 0.f, a1 = 0.f;
        for (int s = 0; s < c.world; ++s) {
          float v0, v1;
          if (s == c.rank || !g.comm) {
            v0 = part_s[ti * T + 2 * j];
            v1 = part_s[ti * T + 2 * j + 1];
          } else {
            uint2 v = ll_load(c, region(c, c.rank, par, 0, s) + line, epoch,
                              kOpGemv, s, line);
            v0 = __uint_as_float(v.x);
            v1 = __uint_as_float(v.y);
          }
          a0 += v0;
          a1 += v1;
          if (!g.comm) break;
        }
        if (r0 + 1 < g.N) {
          *reinterpret_cast<uint32_t*>(g.y + r0) = pack_bf16x2(a0, a1);
        } else {
          g.y[r0] = (uint16_t)f32_to_bf16_bits(a0);
        }
      }
    };
    // every tile: as soon as it is complete, push it to the peers, then wait
    // for theirs and reduce it, while the compute warps stream the next tile
    for (int ti = 0; ti < ntask; ++ti) {
      mbar_wait(&bars[ti], 0u);
      if (g.comm) {
        const int row0 = task_s[ti];
        for (int j = lane; j < half; j += 32) {
          const long long line = (row0 >> 1) + j;
          if (row0 + 2 * j >= g.N) break;
          const uint32_t d0 = __float_as_uint(part_s[ti * T + 2 * j]);
          const uint32_t d1 = __float_as_uint(part_s[ti * T + 2 * j + 1]);
          for (int p = 1; p < c.world; ++p) {
            int dst = c.rank + p;
            if (dst >= c.world) dst -= c.world;
            ll_store(region(c, dst, par, 0, c.rank) + line, d0, d1, epoch);
          }
        }
      }
      reduce_tile(ti);
    }
  }
}

template <int WDT, int RPW, int U>
void* kernel_ptr(bool expert) {
  return expert ? reinterpret_cast<void*>(&gemv_ar_kernel<WDT, RPW, U, true>)
                : reinterpret_cast<void*>(&gemv_ar_kernel<WDT, RPW, U, false>);
}

template <int WDT>
void* select_rpw(int rpw, bool expert) {
  switch (rpw) {
    case 1: return kernel_ptr<WDT, 1, 8>(expert);
    case 2: return kernel_ptr<WDT, 2, 4>(expert);
    case 4: return kernel_ptr<WDT, 4, 2>(expert);
    case 8: return kernel_ptr<WDT, 8, 1>(expert);
    default: return nullptr;
  }
}

void* select_kernel(int wdtype, int rpw, bool expert) {
  if (wdtype == JT_BF16) return select_rpw<JT_BF16>(rpw, expert);
  if (wdtype == JT_F8E4M3) return select_rpw<JT_F8E4M3>(rpw, expert);
  return nullptr;
}

int64_t smem_bytes(int K, int tile_rows, int max_tasks, bool expert) {
  // x is padded to whole groups of 32 chunks (512 elements covers bf16 and fp8)
  const int64_t kpad = ((int64_t)K + 511) / 512 * 512;
  return ((int64_t)max_tasks * 12 + 15) / 16 * 16 + kpad * 4 +
         (int64_t)max_tasks * tile_rows * 4 +
         (expert ? kpad / 8 * (int64_t)sizeof(ChunkSrc) : 0);
}

// Checks the launch shape, sets up the group's parameters and launches.
cudaError_t launch(int gid, int rank, cudaStream_t stream, GemvArgs& g,
                   int wdtype, int rpw, int num_ctas, bool expert) {
  if (g.nwc < 1 || g.nwc > 16 || num_ctas < 1 || g.max_tasks < 1 ||
      g.N < 1 || g.K < 1)
    return cudaErrorInvalidValue;
  const int epc = wdtype == JT_F8E4M3 ? 16 : 8;
  if (g.K % epc != 0) return cudaErrorInvalidValue;
  if (wdtype == JT_F8E4M3 && g.scale == nullptr) return cudaErrorInvalidValue;
  if (g.layer != nullptr && (g.layer_offset == nullptr || g.L < 1))
    return cudaErrorInvalidValue;
  void* kern = select_kernel(wdtype, rpw, expert);
  if (kern == nullptr) return cudaErrorInvalidValue;
  const int T = g.nwc * rpw;
  if (T % 2 != 0) return cudaErrorInvalidValue;
  CommParams c;
  std::memset(&c, 0, sizeof(c));
  int comm = 0;
  if (gid >= 0) {
    if (!make_comm(gid, rank, &c)) return cudaErrorInvalidResourceHandle;
    if ((g.N + 1) / 2 > c.cap_lines) return cudaErrorInvalidValue;
    comm = c.world > 1 ? 1 : 0;
    if (!comm) {
      std::memset(&c, 0, sizeof(c));
      c.world = 1;
    }
  } else {
    c.world = 1;
  }
  g.KB = (g.K + 127) / 128;
  g.comm = comm;
  void* args[2] = {&c, &g};
  const size_t smem = (size_t)smem_bytes(g.K, T, g.max_tasks, expert);
  return cudaLaunchKernel(kern, dim3(num_ctas), dim3((g.nwc + 1) * 32), args,
                          smem, stream);
}

// Arguments common to both modes (expert fields zero).
GemvArgs dense_args(const void* x, const void* w, const float* scale,
                    const int32_t* table, void* y, int N, int K, int nwc,
                    int max_tasks) {
  GemvArgs g;
  std::memset(&g, 0, sizeof(g));
  g.x = static_cast<const uint16_t*>(x);
  g.w = static_cast<const uint4*>(w);
  g.scale = scale;
  g.table = table;
  g.y = static_cast<uint16_t*>(y);
  g.N = N;
  g.K = K;
  g.nwc = nwc;
  g.max_tasks = max_tasks;
  return g;
}

}  // namespace

int prepare_gemv_kernels(int max_smem) {
  for (int d : {JT_BF16, JT_F8E4M3}) {
    for (int r : {1, 2, 4, 8}) {
      for (bool expert : {false, true}) {
        cudaError_t e = cudaFuncSetAttribute(
            select_kernel(d, r, expert),
            cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
        if (e != cudaSuccess) return (int)e;
      }
    }
  }
  return 0;
}

}  // namespace jt

extern "C" int64_t jt_gemv_smem_bytes(int K, int tile_rows, int max_tasks) {
  return jt::smem_bytes(K, tile_rows, max_tasks, false);
}

namespace jt {
namespace {

cudaError_t gemv_call(int gid, int rank, cudaStream_t stream, const void* x,
                      const void* w, const float* scale, const int32_t* layer,
                      const int32_t* layer_offset, int L,
                      const int32_t* table, void* y, int N, int K, int wdtype,
                      int nwc, int rpw, int num_ctas, int max_tasks) {
  GemvArgs g = dense_args(x, w, scale, table, y, N, K, nwc, max_tasks);
  g.layer = layer;
  g.layer_offset = layer_offset;
  g.L = L;
  return launch(gid, rank, stream, g, wdtype, rpw, num_ctas, false);
}

cudaError_t expert_down_call(int gid, int rank, cudaStream_t stream,
                             const void* h, const float* weights,
                             const int32_t* ids, const void* w,
                             const float* scale, const void* shared_h,
                             const void* shared_w, const float* shared_scale,
                             const int32_t* layer, const int32_t* layer_offset,
                             int L, const int32_t* table, void* y, int N,
                             int nsel, int I, int E, int Is, int wdtype,
                             int nwc, int rpw, int num_ctas, int max_tasks) {
  const int epc = wdtype == JT_F8E4M3 ? 16 : 8;
  // every segment starts on a 16-byte chunk; fp8 needs both sets of scales
  if (nsel < 1 || E < 1 || I < epc || I % epc != 0 || Is < epc ||
      Is % epc != 0 || (wdtype == JT_F8E4M3 && shared_scale == nullptr))
    return cudaErrorInvalidValue;
  GemvArgs g =
      dense_args(h, w, scale, table, y, N, nsel * I + Is, nwc, max_tasks);
  g.rw = weights;
  g.ids = ids;
  g.xs = static_cast<const uint16_t*>(shared_h);
  g.ws = static_cast<const uint4*>(shared_w);
  g.ss = shared_scale;
  g.nsel = nsel;
  g.I = I;
  g.E = E;
  g.layer = layer;
  g.layer_offset = layer_offset;
  g.L = L;
  return launch(gid, rank, stream, g, wdtype, rpw, num_ctas, true);
}

}  // namespace
}  // namespace jt

extern "C" cudaError_t jt_gemv_all_reduce(int gid, int rank,
                                          cudaStream_t stream, const void* x,
                                          const void* w, const float* scale,
                                          const int32_t* table, void* y, int N,
                                          int K, int wdtype, int nwc, int rpw,
                                          int num_ctas, int max_tasks) {
  return jt::gemv_call(gid, rank, stream, x, w, scale, nullptr, nullptr, 1,
                       table, y, N, K, wdtype, nwc, rpw, num_ctas, max_tasks);
}

extern "C" cudaError_t jt_gemv_all_reduce_layer(
    int gid, int rank, cudaStream_t stream, const void* x, const void* w,
    const float* scale, const int32_t* layer, const int32_t* layer_offset,
    int L, const int32_t* table, void* y, int N, int K, int wdtype, int nwc,
    int rpw, int num_ctas, int max_tasks) {
  if (layer == nullptr || layer_offset == nullptr) return cudaErrorInvalidValue;
  return jt::gemv_call(gid, rank, stream, x, w, scale, layer, layer_offset, L,
                       table, y, N, K, wdtype, nwc, rpw, num_ctas, max_tasks);
}

extern "C" cudaError_t jt_expert_down_all_reduce(
    int gid, int rank, cudaStream_t stream, const void* h,
    const float* weights, const int32_t* ids, const void* w,
    const float* scale, const void* shared_h, const void* shared_w,
    const float* shared_scale, const int32_t* table, void* y, int N, int nsel,
    int I, int E, int Is, int wdtype, int nwc, int rpw, int num_ctas,
    int max_tasks) {
  return jt::expert_down_call(gid, rank, stream, h, weights, ids, w, scale,
                              shared_h, shared_w, shared_scale, nullptr,
                              nullptr, 1, table, y, N, nsel, I, E, Is, wdtype, nwc, rpw,
                              num_ctas, max_tasks);
}

extern "C" cudaError_t jt_expert_down_all_reduce_layer(
    int gid, int rank, cudaStream_t stream, const void* h,
    const float* weights, const int32_t* ids, const void* w,
    const float* scale, const void* shared_h, const void* shared_w,
    const float* shared_scale, const int32_t* layer,
    const int32_t* layer_offset, int L, const int32_t* table, void* y, int N,
    int nsel, int I, int E, int Is, int wdtype, int nwc, int rpw, int num_ctas,
    int max_tasks) {
  if (layer == nullptr || layer_offset == nullptr) return cudaErrorInvalidValue;
  return jt::expert_down_call(gid, rank, stream, h, weights, ids, w, scale,
                              shared_h, shared_w, shared_scale, layer,
                              layer_offset, L, table, y, N, nsel, I, E, Is, wdtype, nwc, rpw,
                              num_ctas, max_tasks);
}
