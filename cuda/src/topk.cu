// Cross-GPU merge of per-rank top-k candidate lists into the global top-k.
//
// Every rank holds a list of k (score, index) pairs sorted by score desc, then
// index asc, -0.0 equal to +0.0 (what lax.top_k gives over a rank's own range of positions once the
// local positions are offset to global ones). Each rank stores its list into
// every peer's inbox (one LL line per pair), every CTA loads all W lists into
// shared memory as 64-bit keys ordered like (score desc, index asc), and the
// final position of every candidate is its position in its own list plus, for
// every other list, the number of that list's entries that precede it (binary
// search). Positions < k are written. The order is total, so all ranks write
// the same bits to the same places.
#include "common.cuh"
#include "group.h"

namespace jt {
namespace {

// 64-bit key, larger = earlier in the output: high word is the float score
// mapped to an order-preserving uint32, low word prefers the lower index.
// -0.0 is taken as +0.0 (they compare equal, so the lower index goes first);
// the output carries +0.0 for it.
__device__ __forceinline__ unsigned long long make_key(uint32_t score_bits,
                                                       uint32_t idx_bits) {
  if (score_bits == 0x80000000u) score_bits = 0u;
  uint32_t s = (score_bits & 0x80000000u) ? ~score_bits
                                          : (score_bits | 0x80000000u);
  uint32_t i = ~(idx_bits ^ 0x80000000u);
  return ((unsigned long long)s << 32) | i;
}
__device__ __forceinline__ void split_key(unsigned long long key,
                                          uint32_t* score_bits,
                                          uint32_t* idx_bits) {
  uint32_t s = (uint32_t)(key >> 32);
  *score_bits = (s & 0x80000000u) ? (s & 0x7fffffffu) : ~s;
  *idx_bits = (~(uint32_t)key) ^ 0x80000000u;
}

// number of entries of the descending list `a[0..k)` that are > key (strict)
// or >= key (inclusive).
__device__ __forceinline__ int count_before(const unsigned long long* a, int k,
                                            unsigned long long key,
                                            bool inclusive) {
  int lo = 0, hi = k;
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    unsigned long long v = a[mid];
    bool before = inclusive ? (v >= key) : (v > key);
    if (before) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

__global__ void __launch_bounds__(1024)
    merge_topk_kernel(CommParams c, const float* __restrict__ scores,
                      const int32_t* __restrict__ idx,
                      float* __restrict__ out_s, int32_t* __restrict__ out_i,
                      int m, int k) {
  extern __shared__ __align__(16) unsigned long long keys[];
  __shared__ unsigned s_epoch;
  const unsigned epoch = read_epoch(c, &s_epoch);
  const unsigned par = epoch & 1u;
  const int W = c.world;

  // send my slice of the list (m entries) to every peer
  const int per = (m + gridDim.x - 1) / gridDim.x;
  const int lo = blockIdx.x * per;
  const int hi = min(m, lo + per);
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    const uint32_t sb = __float_as_uint(scores[i]);
    const uint32_t ib = (uint32_t)idx[i];
    for (int p = 1; p < W; ++p) {
      int dst = c.rank + p;
      if (dst >= W) dst -= W;
      ll_store(region(c, dst, par, 0, c.rank) + i, sb, ib, epoch);
    }
  }
  // all lists -> shared memory
  const int total = W * m;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    const int s = e / m;
    const int i = e - s * m;
    uint2 v;
    if (s == c.rank) {
      v = make_uint2(__float_as_uint(scores[i]), (uint32_t)idx[i]);
    } else {
      v = ll_load(c, region(c, c.rank, par, 0, s) + i, epoch, kOpMergeTopk, s,
                  i);
    }
    keys[e] = make_key(v.x, v.y);
  }
  __syncthreads();
  // place this block's share of the candidates
  const int cper = (total + gridDim.x - 1) / gridDim.x;
  const int clo = blockIdx.x * cper;
  const int chi = min(total, clo + cper);
  for (int e = clo + threadIdx.x; e < chi; e += blockDim.x) {
    const int s = e / m;
    const int i = e - s * m;
    const unsigned long long key = keys[e];
    int pos = i;
    for (int s2 = 0; s2 < W && pos < k; ++s2) {
      if (s2 == s) continue;
      // ties between equal keys: the lower rank goes first
      pos += count_before(keys + (long long)s2 * m, m, key, s2 < s);
    }
    if (pos < k) {
      uint32_t sb, ib;
      split_key(key, &sb, &ib);
      out_s[pos] = __uint_as_float(sb);
      out_i[pos] = (int32_t)ib;
    }
  }
}

}  // namespace

int prepare_topk_kernels(int max_smem) {
  cudaError_t e = cudaFuncSetAttribute(
      reinterpret_cast<const void*>(&merge_topk_kernel),
      cudaFuncAttributeMaxDynamicSharedMemorySize, max_smem);
  return (int)e;
}

}  // namespace jt

extern "C" int jt_merge_topk_max_k(int dev, int world) {
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                             dev) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  if (world < 1) return -1;
  return (v - 1024) / (8 * world);
}

extern "C" cudaError_t jt_merge_topk(int gid, int rank, cudaStream_t stream,
                                     const float* scores,
                                     const int32_t* indices, float* out_scores,
                                     int32_t* out_indices, int m, int k,
                                     int blocks, int threads) {
  if (k < 1 || m < 1 || blocks < 1 || threads < 32 || threads > 1024 ||
      threads % 32 != 0)
    return cudaErrorInvalidValue;
  jt::CommParams c;
  if (!jt::make_comm(gid, rank, &c)) return cudaErrorInvalidResourceHandle;
  if (m > c.cap_lines || (long long)k > (long long)c.world * m)
    return cudaErrorInvalidValue;
  const size_t smem = (size_t)c.world * m * 8;
  jt::merge_topk_kernel<<<blocks, threads, smem, stream>>>(
      c, scores, indices, out_scores, out_indices, m, k);
  return cudaGetLastError();
}
