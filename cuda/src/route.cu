// The MoE router's selection (DeepSeek-V3 / GLM-5 "noaux_tc") in one launch,
// exactly jtilert.ops.reference.select_experts of the router's fp32 logits:
//   s = sigmoid(logit), b = s + bias[*layer + *layer_offset]; with
//   n_group > 1 each group of E / n_group experts scores the sum of its two
//   largest b, the topk_group best groups stay and the other experts' b
//   become -inf; the k largest b are chosen, in descending order, ties to
//   the lower index; their unbiased s, normalised to sum 1 (norm != 0), times
//   `scaling`, are the weights.
// The selection of one token is one CTA's, one thread per expert (E <= 1024).
// Ranks are counted over every pair, four values per shared-memory load (E
// comparisons per thread): no sort, and each rank's expert writes its own
// output slot. Groups of 32 experts (one per warp) take their two largest by
// two warp max-reductions.
//
// route_select_kernel runs it from the router GEMV's fp32 split-K partial
// logits [S, T, E] (summed here, s = 0, 1, .. in order, so the GEMV needs no
// finishing kernel), one CTA per token. A thread issues its partial loads (up
// to kPartialsBatch) and its bias load at once, so the sum waits for one round
// trip to L2.
//
// norm_route_kernel is a MoE layer's whole router in one launch: the layer's
// RMSNorm of x (f, written out for the experts), the logits f . gate^T (bf16
// weights, fp32 sums) and the selection. Each CTA owns `epc` experts: it asks
// for their weight rows first (all its loads in flight at once), norms x while
// they land, and writes its logits to a device-global scratch. The last CTA to
// finish (an arrival counter: a release by each CTA, an acquire by the last,
// which finds the count at gridDim - 1 and sets it back to 0 for the next call)
// runs select_token on every token. The scratch and the counter are the
// library's device globals: calls on one device must not overlap (a decode
// step's MoE layers are a chain).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "jtilert/engine.h"

namespace jt {
namespace {

constexpr int kPartialsBatch = 16;  // partial loads in flight per thread

// An order-preserving unsigned key of a float (larger float, larger key) and
// back: warp max-reductions work on unsigned integers.
__device__ __forceinline__ uint32_t float_key(float f) {
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Places before v in descending order among vals[0..n) (ties: lower index
// first). vals is 16-byte aligned; with n % 4 == 0 it is read as float4, so
// the loads are independent of each other and of the counting.
__device__ __forceinline__ int rank_of(const float* vals, int n, float v, int i) {
  int r = 0, j = 0;
  if ((n & 3) == 0) {
    const float4* v4 = reinterpret_cast<const float4*>(vals);
#pragma unroll 8
    for (; j < n; j += 4) {
      const float4 x = v4[j >> 2];
      r += (x.x > v) || (x.x == v && j < i);
      r += (x.y > v) || (x.y == v && j + 1 < i);
      r += (x.z > v) || (x.z == v && j + 2 < i);
      r += (x.w > v) || (x.w == v && j + 3 < i);
    }
  }
  for (; j < n; ++j) r += (vals[j] > v) || (vals[j] == v && j < i);
  return r;
}

// Shared memory (floats) of select_token: biased [E] (16-byte aligned),
// group sums [n_group], the chosen experts' scores [k].
__host__ __device__ inline int select_smem_floats(int E, int n_group, int k) {
  return ((E + 3) & ~3) + n_group + k;
}

// One token's selection, by every thread of the CTA (it has barriers): thread
// i < E holds expert i's logit (the others take no part but the barriers);
// smem as select_smem_floats; writes weights out_w[0..k) and ids out_ids[0..k).
__device__ void select_token(float logit, float bias_i, int E, int n_group, int topk_group, int k,
                             float scaling, int norm, float* smem, float* out_w, int32_t* out_ids) {
  float* biased = smem;                           // [E]
  float* group_score = biased + ((E + 3) & ~3);   // [n_group], 16-byte aligned
  float* chosen = group_score + n_group;           // [k]: s of the expert at each rank
  const int i = threadIdx.x;
  const bool expert = i < E;
  const float s = 1.f / (1.f + expf(-logit));
  float b = expert ? s + bias_i : -INFINITY;
  if (expert) biased[i] = b;
  __syncthreads();
  const int gs = E / n_group;
  if (n_group > 1) {
    if (gs == 32) {  // group i / 32 is warp i / 32: its two largest, the first max's lane left out
      const unsigned full = 0xffffffffu;
      const uint32_t key = float_key(b);
      const uint32_t m1 = __reduce_max_sync(full, key);
      const int first = __ffs(__ballot_sync(full, key == m1)) - 1;
      const uint32_t m2 = __reduce_max_sync(full, (i & 31) == first ? 0u : key);
      if ((i & 31) == 0 && (i >> 5) < n_group) group_score[i >> 5] = key_float(m1) + key_float(m2);
    } else if (i < n_group) {  // the sum of group i's two largest (ties need no order)
      float m1 = -INFINITY, m2 = -INFINITY;
      for (int j = i * gs; j < (i + 1) * gs; ++j) {
        const float x = biased[j];
        if (x > m1) {
          m2 = m1;
          m1 = x;
        } else if (x > m2) {
          m2 = x;
        }
      }
      group_score[i] = gs > 1 ? m1 + m2 : m1;
    }
    __syncthreads();
    // (the group sums read biased[] before the barrier above: it may be overwritten now)
    const int g = i / gs;
    if (expert && rank_of(group_score, n_group, group_score[g], g) >= topk_group) b = -INFINITY;
    if (expert) biased[i] = b;
    __syncthreads();
  }
  // An expert of a dropped group ranks after every kept one; when the kept
  // groups hold at least k experts it cannot be chosen, so it skips its count
  // (whole warps do, where a group is a multiple of 32 experts).
  const bool out_of_reach = b == -INFINITY && topk_group * gs >= k;
  const int r = !expert || out_of_reach ? k : rank_of(biased, E, b, i);
  if (r < k) {
    out_ids[r] = i;
    chosen[r] = s;
  }
  __syncthreads();
  if (i < k) {
    float w = chosen[i];
    if (norm) {
      float sum = 0.f;
      for (int j = 0; j < k; ++j) sum += chosen[j];
      w = w / (sum + 1e-20f);
    }
    out_w[i] = w * scaling;
  }
  __syncthreads();  // chosen[] and biased[] are free for the next token
}

__global__ void route_select_kernel(const float* __restrict__ partials, int S,
                                    const float* __restrict__ bias,
                                    const int32_t* __restrict__ layer,
                                    const int32_t* __restrict__ layer_offset,
                                    int T, int E, int n_group, int topk_group, int k,
                                    float scaling, int norm, float* out_w,
                                    int32_t* out_ids) {
  extern __shared__ float4 sm4[];
  const int t = blockIdx.x, i = threadIdx.x;
  const float bias_i = bias[(size_t)(layer[0] + layer_offset[0]) * E + i];
  float logit = 0.f;
  for (int p0 = 0; p0 < S; p0 += kPartialsBatch) {
    float part[kPartialsBatch];
#pragma unroll
    for (int j = 0; j < kPartialsBatch; ++j)
      part[j] = p0 + j < S ? partials[((size_t)(p0 + j) * T + t) * E + i] : 0.f;
#pragma unroll
    for (int j = 0; j < kPartialsBatch; ++j)
      if (p0 + j < S) logit += part[j];  // in the order of s, as the reference adds them
  }
  select_token(logit, bias_i, E, n_group, topk_group, k, scaling, norm, reinterpret_cast<float*>(sm4),
               out_w + (size_t)t * k, out_ids + (size_t)t * k);
}

constexpr int kRouteThreads = 256;                 // threads of a norm_route CTA
constexpr int kRouteChunks = JT_ROUTE_MAX_HIDDEN / (8 * kRouteThreads);  // 8 bf16 each, per thread
constexpr int kRouteMaxEpc = 4;                     // experts of a CTA
constexpr int kRouteMaxTokens = JT_ROUTE_MAX_TOKENS;
static_assert(JT_ROUTE_MAX_ROUTER_EXPERTS <= kRouteThreads, "select_token: a thread an expert");

__device__ float g_route_logits[kRouteMaxTokens * JT_ROUTE_MAX_EXPERTS];
__device__ unsigned g_route_arrived;  // CTAs of the running call that wrote their logits

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16(v)); }

// The CTA's sum of v (every thread calls it; red: kRouteThreads / 32 floats of
// shared memory, free again on return).
__device__ __forceinline__ float cta_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) red[warp] = v;
  __syncthreads();
  float s = 0.f;
#pragma unroll
  for (int w = 0; w < kRouteThreads / 32; ++w) s += red[w];  // the same order in every thread
  __syncthreads();
  return s;
}

__device__ __forceinline__ void unpack8(const uint4& u, float* v) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    v[2 * j] = __uint_as_float(w[j] << 16);
    v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
  }
}

__global__ void __launch_bounds__(kRouteThreads) norm_route_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ norm_w,
    const __nv_bfloat16* __restrict__ gate, const float* __restrict__ bias,
    const int32_t* __restrict__ layer, const int32_t* __restrict__ layer_offset, int T, int E, int H, int epc,
    float eps, int n_group, int topk_group, int k, float scaling, int norm, __nv_bfloat16* out_f, float* out_w,
    int32_t* out_ids) {
  extern __shared__ float4 sm4[];
  float* smem = reinterpret_cast<float*>(sm4);  // select_token's, then the reductions'
  __shared__ float red[kRouteThreads / 32];
  __shared__ bool last;
  const int tid = threadIdx.x, chunks = H / 8;
  const int64_t l = layer[0] + layer_offset[0];
  const int e0 = blockIdx.x * epc;
  // the CTA's weight rows, every load issued before any is used
  uint4 w[kRouteMaxEpc][kRouteChunks];
#pragma unroll
  for (int e = 0; e < kRouteMaxEpc; ++e)
#pragma unroll
    for (int c = 0; c < kRouteChunks; ++c) {
      const int j = c * kRouteThreads + tid;
      w[e][c] = e < epc && e0 + e < E && j < chunks
                    ? __ldg(reinterpret_cast<const uint4*>(gate + ((l * E + e0 + e) * H)) + j)
                    : make_uint4(0u, 0u, 0u, 0u);
    }
  for (int t = 0; t < T; ++t) {
    // f = bf16(w_norm * bf16(x * rsqrt(mean(x^2) + eps))), as reference.rms_norm rounds it
    float xv[kRouteChunks][8], ss = 0.f;
#pragma unroll
    for (int c = 0; c < kRouteChunks; ++c) {
      const int j = c * kRouteThreads + tid;
      const uint4 u = j < chunks ? reinterpret_cast<const uint4*>(x + (size_t)t * H)[j] : make_uint4(0u, 0u, 0u, 0u);
      unpack8(u, xv[c]);
#pragma unroll
      for (int q = 0; q < 8; ++q) ss += xv[c][q] * xv[c][q];
    }
    const float inv = rsqrtf(cta_sum(ss, red) / (float)H + eps);
    float acc[kRouteMaxEpc] = {};
#pragma unroll
    for (int c = 0; c < kRouteChunks; ++c) {
      const int j = c * kRouteThreads + tid;
      if (j >= chunks) continue;
      float nw[8], f[8];
      unpack8(reinterpret_cast<const uint4*>(norm_w + l * H)[j], nw);
#pragma unroll
      for (int q = 0; q < 8; ++q) f[q] = bf16_round(nw[q] * bf16_round(xv[c][q] * inv));
      if (blockIdx.x == 0) {
        uint32_t p[4];
#pragma unroll
        for (int q = 0; q < 4; ++q)
          p[q] = (__float_as_uint(f[2 * q]) >> 16) | (__float_as_uint(f[2 * q + 1]) & 0xffff0000u);
        reinterpret_cast<uint4*>(out_f + (size_t)t * H)[j] = make_uint4(p[0], p[1], p[2], p[3]);
      }
#pragma unroll
      for (int e = 0; e < kRouteMaxEpc; ++e) {
        float g[8];
        unpack8(w[e][c], g);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[e] = fmaf(f[q], g[q], acc[e]);
      }
    }
#pragma unroll
    for (int e = 0; e < kRouteMaxEpc; ++e) {
      if (e >= epc) break;
      const float logit = cta_sum(acc[e], red);
      if (tid == 0 && e0 + e < E) g_route_logits[t * E + e0 + e] = logit;
    }
  }
  // the last CTA to arrive selects (threadfence reduction)
  if (tid == 0) {
    __threadfence();  // this CTA's logits before its arrival
    last = atomicAdd(&g_route_arrived, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // every CTA's logits after their arrivals
  const float bias_i = tid < E ? bias[l * E + tid] : 0.f;
  for (int t = 0; t < T; ++t) {
    const float logit = tid < E ? __ldcg(&g_route_logits[t * E + tid]) : 0.f;
    select_token(logit, bias_i, E, n_group, topk_group, k, scaling, norm, smem, out_w + (size_t)t * k,
                 out_ids + (size_t)t * k);
  }
  if (tid == 0) g_route_arrived = 0u;  // every CTA of this call has arrived
}

}  // namespace
}  // namespace jt

extern "C" cudaError_t jt_norm_route(cudaStream_t stream, const void* x, const void* norm_w, const void* gate,
                                     const float* bias, const int32_t* layer, const int32_t* layer_offset,
                                     int T, int E, int H, float eps, int n_group, int topk_group, int k,
                                     float scaling, int norm, void* out_f, float* out_w, int32_t* out_ids) {
  if (T < 1 || T > JT_ROUTE_MAX_TOKENS || E < 1 || E > JT_ROUTE_MAX_ROUTER_EXPERTS || H < 8 || H % 8 != 0 ||
      H > JT_ROUTE_MAX_HIDDEN || k < 1 || k > E || n_group < 1 || E % n_group != 0 || topk_group < 1 ||
      topk_group > n_group)
    return cudaErrorInvalidValue;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const int n_sm = jt_sm_count(dev);
  if (n_sm < 1) return cudaErrorInvalidDevice;
  const int epc = (E + n_sm - 1) / n_sm;
  if (epc > jt::kRouteMaxEpc) return cudaErrorInvalidValue;
  const int ctas = (E + epc - 1) / epc;
  const size_t smem = (size_t)jt::select_smem_floats(E, n_group, k) * sizeof(float);
  jt::norm_route_kernel<<<ctas, jt::kRouteThreads, smem, stream>>>(
      static_cast<const __nv_bfloat16*>(x), static_cast<const __nv_bfloat16*>(norm_w),
      static_cast<const __nv_bfloat16*>(gate), bias, layer, layer_offset, T, E, H, epc, eps, n_group, topk_group,
      k, scaling, norm, static_cast<__nv_bfloat16*>(out_f), out_w, out_ids);
  return cudaGetLastError();
}

extern "C" cudaError_t jt_route_select(cudaStream_t stream, const float* partials,
                                       int S, const float* bias,
                                       const int32_t* layer,
                                       const int32_t* layer_offset, int T, int E,
                                       int n_group, int topk_group, int k,
                                       float scaling, int norm, float* out_w,
                                       int32_t* out_ids) {
  if (S < 1 || T < 1 || E < 1 || E > JT_ROUTE_MAX_EXPERTS || k < 1 || k > E ||
      n_group < 1 || E % n_group != 0 || topk_group < 1 || topk_group > n_group)
    return cudaErrorInvalidValue;
  const size_t smem = (size_t)jt::select_smem_floats(E, n_group, k) * sizeof(float);
  jt::route_select_kernel<<<T, E, smem, stream>>>(partials, S, bias, layer, layer_offset,
                                                  T, E, n_group, topk_group, k, scaling,
                                                  norm, out_w, out_ids);
  return cudaGetLastError();
}
