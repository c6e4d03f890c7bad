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
// Two kernels run it:
// - route_select_kernel: from the router GEMV's fp32 split-K partial logits
//   [S, T, E] (summed here, s = 0, 1, .. in order, so the GEMV needs no
//   finishing kernel), one CTA per token. A thread issues its partial loads
//   (up to kPartialsBatch) and its bias load at once, so the sum waits for one
//   round trip to L2.
// - norm_gemv_kernel with a selection (k > 0): the whole router of a MoE layer
//   in one launch (jt_norm_route), from the layer's input x [T, H] bf16:
//   f = rms_norm(x) (written out: the experts' input), logits = f . gate^T in
//   fp32, then the selection of every token.
//
// norm_gemv_kernel: y = rms_norm(x) . W^T in fp32 for a small W [N, H] (bf16
// or fp32; without a selection it is the indexer's head weights,
// jt_norm_gemv). Each CTA takes R rows of W (NT / R threads a row, every load
// of its rows issued before it norms x), norms x itself into shared memory (x
// is 14 KB a token, read from L2 by every CTA), reduces its rows in a fixed
// order and writes them. With a selection, the last CTA to finish (an arrival
// counter: each CTA's logits are stored and fenced before it counts) reads
// every logit back from L2 and selects. The counter wraps to zero at the last
// arrival (atomicInc), so every launch starts from zero; it is a device
// global, so the calls on one device must not overlap (a step's MoE layers are
// a chain).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "jtilert/engine.h"

namespace jt {
namespace {

constexpr int kPartialsBatch = 16;  // partial loads in flight per thread
constexpr int kNormGemvCtas = 128;   // norm_gemv: CTAs at most (one wave)
constexpr int kNormGemvBatch = 16;   // norm_gemv: 16-byte weight loads in flight per thread
constexpr int kNormGemvMaxRows = 8;  // norm_gemv: rows per CTA at most

__device__ unsigned int g_norm_route_arrivals = 0;  // CTAs of the running norm_route call done

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

// 8 bf16 of a 16-byte word as floats.
__device__ __forceinline__ void bf16x8(const uint4& v, float* out) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    out[2 * j] = f.x;
    out[2 * j + 1] = f.y;
  }
}

// The weights of one 16-byte chunk of a row of W as floats: 8 bf16 or 4 fp32.
template <typename W>
__device__ __forceinline__ void chunk_floats(const uint4& v, float* out);
template <>
__device__ __forceinline__ void chunk_floats<__nv_bfloat16>(const uint4& v, float* out) {
  bf16x8(v, out);
}
template <>
__device__ __forceinline__ void chunk_floats<float>(const uint4& v, float* out) {
  out[0] = __uint_as_float(v.x);
  out[1] = __uint_as_float(v.y);
  out[2] = __uint_as_float(v.z);
  out[3] = __uint_as_float(v.w);
}

// norm_gemv_kernel, one CTA of NT threads (a multiple of 256, >= E with a
// selection, <= 512), C CTAs, R rows each (R divides NT: NT / R threads a row,
// a multiple of 32); E the rows of W (the experts). k == 0: no selection (bias,
// f_out, out_w and out_ids unused; f_out may be null anyway). Shared memory:
// f [T, H] bf16, then select_smem_floats(E, n_group, k) floats, then the
// reductions' [NT / 32, T] floats and 1/rms [T].
template <typename W>
__global__ void __launch_bounds__(JT_NORM_ROUTE_MAX_EXPERTS) norm_gemv_kernel(const __nv_bfloat16* __restrict__ x,
                                  const void* __restrict__ norm_weight, int norm_f32,
                                  const W* __restrict__ w, const float* __restrict__ bias,
                                  const int32_t* __restrict__ layer,
                                  const int32_t* __restrict__ layer_offset, int T, int H,
                                  int E, int R, float eps, int n_group, int topk_group, int k,
                                  float scaling, int norm, __nv_bfloat16* __restrict__ f_out,
                                  float* logits, float* out_w, int32_t* out_ids) {
  constexpr int kCols = 16 / sizeof(W);  // W's columns in a 16-byte chunk
  extern __shared__ float4 sm4[];
  __nv_bfloat16* f = reinterpret_cast<__nv_bfloat16*>(sm4);  // [T, H]
  float* sel = reinterpret_cast<float*>(f + (size_t)T * H);    // 16-byte aligned: H % 8 == 0
  const int nwarps = blockDim.x >> 5;
  float* red = sel + ((select_smem_floats(E, n_group, k) + 3) & ~3);  // [nwarps, T]
  float* rstd = red + nwarps * JT_ROUTE_MAX_TOKENS;                   // [T]
  __shared__ bool last;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int L = layer[0] + layer_offset[0];
  const int tpr = blockDim.x / R;  // threads of a row
  const int row = blockIdx.x * R + tid / tpr, at = tid % tpr;
  const bool has_row = row < E;
  const int chunks = H / kCols;  // 16-byte chunks of a row of W
  const uint4* wrow = reinterpret_cast<const uint4*>(w + ((size_t)L * E + (has_row ? row : 0)) * H);
  // (the selection's bias, read now: its load is not on the last CTA's path)
  const float bias_i = k > 0 && tid < E ? __ldg(bias + (size_t)L * E + tid) : 0.f;

  // 1. this thread's first chunks of its row of W in flight while x is normed
  uint4 chunk[kNormGemvBatch];
#pragma unroll
  for (int m = 0; m < kNormGemvBatch; ++m) {
    const int c = at + m * tpr;
    if (has_row && c < chunks) chunk[m] = __ldg(wrow + c);
  }

  // 2. 1/rms of every token: the sum of squares in fp32, its mean, + eps
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const int xchunks = H / 8;
  for (int t = 0; t < T; ++t) {
    float ss = 0.f;
    for (int c = tid; c < xchunks; c += blockDim.x) {
      float v[8];
      bf16x8(__ldg(x4 + (size_t)t * xchunks + c), v);
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += v[j] * v[j];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) red[warp * JT_ROUTE_MAX_TOKENS + t] = ss;
  }
  __syncthreads();
  if (tid < T) {
    float ss = 0.f;
    for (int j = 0; j < nwarps; ++j) ss += red[j * JT_ROUTE_MAX_TOKENS + tid];
    rstd[tid] = rsqrtf(ss / (float)H + eps);
  }
  __syncthreads();

  // 3. f = bf16(weight) * bf16(x * 1/rms), rounded as the reference rounds it, into
  // shared memory; the first CTA writes it out
  const size_t nrow = (size_t)L * H;
  for (int t = 0; t < T; ++t) {
    const float rs = rstd[t];
    for (int c = tid; c < xchunks; c += blockDim.x) {
      float v[8], nw[8];
      bf16x8(__ldg(x4 + (size_t)t * xchunks + c), v);
      if (norm_f32) {
        const float4* n4 = reinterpret_cast<const float4*>(static_cast<const float*>(norm_weight) + nrow) + 2 * c;
        const float4 a = __ldg(n4), b = __ldg(n4 + 1);
        const float n8[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) nw[j] = __bfloat162float(__float2bfloat16_rn(n8[j]));
      } else {
        bf16x8(__ldg(reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(norm_weight) + nrow) + c),
               nw);
      }
      uint4 out;
      __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&out);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        o[j] = __float2bfloat16_rn(nw[j] * __bfloat162float(__float2bfloat16_rn(v[j] * rs)));
      reinterpret_cast<uint4*>(f)[(size_t)t * xchunks + c] = out;
      if (blockIdx.x == 0 && f_out != nullptr) reinterpret_cast<uint4*>(f_out)[(size_t)t * xchunks + c] = out;
    }
  }
  __syncthreads();

  // 4. this thread's share of its row's dot products with every token's f
  float acc[JT_ROUTE_MAX_TOKENS];
#pragma unroll
  for (int t = 0; t < JT_ROUTE_MAX_TOKENS; ++t) acc[t] = 0.f;
  for (int c0 = 0; c0 < chunks; c0 += kNormGemvBatch * tpr) {
    if (c0 > 0) {
#pragma unroll
      for (int m = 0; m < kNormGemvBatch; ++m) {
        const int c = c0 + at + m * tpr;
        if (has_row && c < chunks) chunk[m] = __ldg(wrow + c);
      }
    }
#pragma unroll
    for (int m = 0; m < kNormGemvBatch; ++m) {
      const int c = c0 + at + m * tpr;
      if (!has_row || c >= chunks) continue;
      float wv[kCols];
      chunk_floats<W>(chunk[m], wv);
#pragma unroll
      for (int t = 0; t < JT_ROUTE_MAX_TOKENS; ++t) {  // compile-time indices keep acc[] in registers
        if (t >= T) break;
        float fv[8];
        if (kCols == 8) {
          bf16x8(reinterpret_cast<const uint4*>(f + (size_t)t * H)[c], fv);
        } else {  // 4 columns: half of a 16-byte f chunk
          const uint2 h = reinterpret_cast<const uint2*>(f + (size_t)t * H)[c];
          bf16x8(make_uint4(h.x, h.y, 0u, 0u), fv);
        }
        float a = acc[t];
#pragma unroll
        for (int j = 0; j < kCols; ++j) a += fv[j] * wv[j];
        acc[t] = a;
      }
    }
  }

  // 5. the row's sum over its threads (a fixed order: the result does not
  // depend on timing), its logits out
#pragma unroll
  for (int t = 0; t < JT_ROUTE_MAX_TOKENS; ++t) {
    if (t >= T) break;
    float a = acc[t];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
    if (lane == 0) red[warp * JT_ROUTE_MAX_TOKENS + t] = a;
  }
  __syncthreads();
  if (at < T && has_row) {
    const int w0 = (tid / tpr) * (tpr >> 5);
    float a = 0.f;
    for (int j = 0; j < (tpr >> 5); ++j) a += red[(w0 + j) * JT_ROUTE_MAX_TOKENS + at];
    logits[(size_t)at * E + row] = a;
    if (k > 0) __threadfence();  // in L2 before this CTA counts its arrival
  }
  if (k == 0) return;

  // 6. the last CTA to arrive selects: every CTA's logits are in L2 before it counts
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    last = atomicInc(&g_norm_route_arrivals, gridDim.x - 1) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int t = 0; t < T; ++t) {
    const float logit = tid < E ? __ldcg(logits + (size_t)t * E + tid) : 0.f;
    select_token(logit, bias_i, E, n_group, topk_group, k, scaling, norm, sel, out_w + (size_t)t * k,
                 out_ids + (size_t)t * k);
  }
}

// norm_gemv's launch shape: R rows a CTA (the fewest, a power of two, that
// keep the CTAs to one wave), ceil(E / R) CTAs, NT threads (a multiple of 256
// that covers the E experts of a selection).
struct NormGemvShape {
  int rows, ctas, threads;
  size_t smem;
};

NormGemvShape norm_gemv_shape(int T, int H, int E, int n_group, int k) {
  NormGemvShape s;
  s.rows = 1;
  while ((E + s.rows - 1) / s.rows > kNormGemvCtas) s.rows *= 2;
  s.ctas = (E + s.rows - 1) / s.rows;
  s.threads = k > 0 ? ((E + 255) / 256) * 256 : 256;
  const int floats = ((select_smem_floats(E, n_group, k) + 3) & ~3) +
                     (s.threads / 32) * JT_ROUTE_MAX_TOKENS + JT_ROUTE_MAX_TOKENS;
  s.smem = (size_t)T * H * 2 + (size_t)floats * sizeof(float);
  return s;
}

template <typename W>
cudaError_t launch_norm_gemv(cudaStream_t stream, const __nv_bfloat16* x, const void* norm_weight,
                             int norm_f32, const W* w, const float* bias, const int32_t* layer,
                             const int32_t* layer_offset, int T, int H, int E, float eps,
                             int n_group, int topk_group, int k, float scaling, int norm,
                             __nv_bfloat16* f_out, float* logits, float* out_w,
                             int32_t* out_ids) {
  const NormGemvShape s = norm_gemv_shape(T, H, E, n_group, k);
  if (s.rows > kNormGemvMaxRows || s.smem > (size_t)JT_NORM_GEMV_MAX_SMEM) return cudaErrorInvalidValue;
  norm_gemv_kernel<W><<<s.ctas, s.threads, s.smem, stream>>>(
      x, norm_weight, norm_f32, w, bias, layer, layer_offset, T, H, E, s.rows, eps, n_group,
      topk_group, k, scaling, norm, f_out, logits, out_w, out_ids);
  return cudaGetLastError();
}

// Both calls' W operand (the router's gate), by its dtype code.
cudaError_t launch_norm_gemv_any(cudaStream_t stream, const void* x, const void* norm_weight,
                                 int norm_dtype, const void* w, int w_dtype, const float* bias,
                                 const int32_t* layer, const int32_t* layer_offset, int T, int H,
                                 int E, float eps, int n_group, int topk_group, int k,
                                 float scaling, int norm, void* f_out, float* logits,
                                 float* out_w, int32_t* out_ids) {
  if (T < 1 || T > JT_ROUTE_MAX_TOKENS || H < 8 || H % 8 != 0 || E < 1 ||
      (norm_dtype != JT_BF16 && norm_dtype != JT_F32) ||
      (w_dtype != JT_BF16 && w_dtype != JT_F32))
    return cudaErrorInvalidValue;
  const __nv_bfloat16* xb = static_cast<const __nv_bfloat16*>(x);
  __nv_bfloat16* fb = static_cast<__nv_bfloat16*>(f_out);
  const int nf32 = norm_dtype == JT_F32;
  if (w_dtype == JT_BF16)
    return launch_norm_gemv(stream, xb, norm_weight, nf32, static_cast<const __nv_bfloat16*>(w),
                            bias, layer, layer_offset, T, H, E, eps, n_group, topk_group, k,
                            scaling, norm, fb, logits, out_w, out_ids);
  return launch_norm_gemv(stream, xb, norm_weight, nf32, static_cast<const float*>(w), bias,
                          layer, layer_offset, T, H, E, eps, n_group, topk_group, k, scaling,
                          norm, fb, logits, out_w, out_ids);
}

}  // namespace

// Raises norm_gemv's dynamic shared-memory limit (jt_prepare_device, once a device).
int prepare_route_kernels(int max_smem) {
  const int smem = max_smem < JT_NORM_GEMV_MAX_SMEM ? max_smem : JT_NORM_GEMV_MAX_SMEM;
  cudaError_t e = cudaFuncSetAttribute(norm_gemv_kernel<__nv_bfloat16>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(norm_gemv_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  return (int)e;
}

}  // namespace jt

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

extern "C" cudaError_t jt_norm_route(cudaStream_t stream, const void* x,
                                     const void* norm_weight, int norm_dtype,
                                     const void* gate, int gate_dtype, const float* bias,
                                     const int32_t* layer, const int32_t* layer_offset,
                                     int T, int H, int E, float eps, int n_group,
                                     int topk_group, int k, float scaling, int norm,
                                     void* f_out, float* logits, float* out_w,
                                     int32_t* out_ids) {
  if (E > JT_NORM_ROUTE_MAX_EXPERTS || k < 1 || k > E || n_group < 1 || E % n_group != 0 ||
      topk_group < 1 || topk_group > n_group || f_out == nullptr)
    return cudaErrorInvalidValue;
  return jt::launch_norm_gemv_any(stream, x, norm_weight, norm_dtype, gate, gate_dtype, bias, layer,
                                  layer_offset, T, H, E, eps, n_group, topk_group, k, scaling, norm,
                                  f_out, logits, out_w, out_ids);
}

extern "C" cudaError_t jt_norm_gemv(cudaStream_t stream, const void* x, const void* norm_weight,
                                    int norm_dtype, const void* w, int w_dtype,
                                    const int32_t* layer, const int32_t* layer_offset, int T,
                                    int H, int N, float eps, float* out) {
  if (N > JT_NORM_GEMV_MAX_ROWS) return cudaErrorInvalidValue;
  return jt::launch_norm_gemv_any(stream, x, norm_weight, norm_dtype, w, w_dtype, nullptr, layer,
                                  layer_offset, T, H, N, eps, 1, 1, 0, 0.f, 0, nullptr, out,
                                  nullptr, nullptr);
}
