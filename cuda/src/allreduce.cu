// NVLink all-reduce over peer pointers: one-shot and two-shot, LL transport.
//
// One-shot: every rank stores its whole input into every peer's inbox, then
// each rank sums all ranks' inputs in rank order 0..W-1 in fp32. Every rank
// runs the same arithmetic on the same values, so the results are
// bit-identical. Latency: one NVLink write.
//
// Two-shot: the message is cut into W chunks; rank c owns chunk c. Stage 1
// sends every chunk to its owner, the owner sums in rank order, converts to the
// output dtype and stage 2 sends those bits to every peer. Half the bytes of
// one-shot per link for W >= 4, at two NVLink writes of latency.
#include "common.cuh"
#include "group.h"

namespace jt {
namespace {

// ---- payload lines: 8 bytes of x at line i (zero padded past the end) ----

__device__ __forceinline__ uint2 load_line(const unsigned char* x, long long i,
                                           long long nbytes) {
  long long off = i * 8;
  if (off + 8 <= nbytes) return *reinterpret_cast<const uint2*>(x + off);
  uint32_t w[2] = {0u, 0u};
  for (int b = 0; b < 8 && off + b < nbytes; ++b)
    w[b >> 2] |= (uint32_t)x[off + b] << (8 * (b & 3));
  return make_uint2(w[0], w[1]);
}

__device__ __forceinline__ void store_line(unsigned char* y, long long i,
                                           long long nbytes, uint2 v) {
  long long off = i * 8;
  if (off + 8 <= nbytes) {
    *reinterpret_cast<uint2*>(y + off) = v;
    return;
  }
  uint32_t w[2] = {v.x, v.y};
  for (int b = 0; b < 8 && off + b < nbytes; ++b)
    y[off + b] = (unsigned char)(w[b >> 2] >> (8 * (b & 3)));
}

// Accumulator for one line: 4 bf16/f16 elements or 2 f32 elements.
template <int DT>
struct LineAcc {
  float a[4] = {0.f, 0.f, 0.f, 0.f};
  __device__ __forceinline__ void add(uint2 v) {
    if constexpr (DT == JT_BF16) {
      a[0] += bf16_lo(v.x);
      a[1] += bf16_hi(v.x);
      a[2] += bf16_lo(v.y);
      a[3] += bf16_hi(v.y);
    } else if constexpr (DT == JT_F16) {
      float2 p = h2_to_f2(v.x), q = h2_to_f2(v.y);
      a[0] += p.x;
      a[1] += p.y;
      a[2] += q.x;
      a[3] += q.y;
    } else {
      a[0] += __uint_as_float(v.x);
      a[1] += __uint_as_float(v.y);
    }
  }
  __device__ __forceinline__ uint2 pack() const {
    if constexpr (DT == JT_BF16) {
      return make_uint2(pack_bf16x2(a[0], a[1]), pack_bf16x2(a[2], a[3]));
    } else if constexpr (DT == JT_F16) {
      return make_uint2(pack_f16x2(a[0], a[1]), pack_f16x2(a[2], a[3]));
    } else {
      return make_uint2(__float_as_uint(a[0]), __float_as_uint(a[1]));
    }
  }
};

constexpr int kCache = 4;  // lines per thread kept in registers

template <int DT>
__global__ void __launch_bounds__(1024)
    ar_oneshot_kernel(CommParams c, const unsigned char* __restrict__ x,
                      unsigned char* __restrict__ y, long long nbytes) {
  __shared__ unsigned s_epoch;
  const unsigned epoch = read_epoch(c, &s_epoch);
  const unsigned par = epoch & 1u;
  const long long L = (nbytes + 7) / 8;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;

  uint2 own[kCache];
#pragma unroll
  for (int j = 0; j < kCache; ++j) {
    long long i = t + j * stride;
    own[j] = make_uint2(0u, 0u);
    if (i < L) {
      own[j] = load_line(x, i, nbytes);
      for (int p = 1; p < c.world; ++p) {
        int dst = c.rank + p;
        if (dst >= c.world) dst -= c.world;
        ll_store(region(c, dst, par, 0, c.rank) + i, own[j].x, own[j].y, epoch);
      }
    }
  }
  for (long long i = t + kCache * stride; i < L; i += stride) {
    uint2 v = load_line(x, i, nbytes);
    for (int p = 1; p < c.world; ++p) {
      int dst = c.rank + p;
      if (dst >= c.world) dst -= c.world;
      ll_store(region(c, dst, par, 0, c.rank) + i, v.x, v.y, epoch);
    }
  }

#pragma unroll
  for (int j = 0; j < kCache; ++j) {
    long long i = t + j * stride;
    if (i < L) {
      LineAcc<DT> acc;
      for (int s = 0; s < c.world; ++s) {
        uint2 v = (s == c.rank)
                      ? own[j]
                      : ll_load(c, region(c, c.rank, par, 0, s) + i, epoch,
                                kOpAllReduce, s, i);
        acc.add(v);
      }
      store_line(y, i, nbytes, acc.pack());
    }
  }
  for (long long i = t + kCache * stride; i < L; i += stride) {
    LineAcc<DT> acc;
    for (int s = 0; s < c.world; ++s) {
      uint2 v = (s == c.rank) ? load_line(x, i, nbytes)
                              : ll_load(c, region(c, c.rank, par, 0, s) + i,
                                        epoch, kOpAllReduce, s, i);
      acc.add(v);
    }
    store_line(y, i, nbytes, acc.pack());
  }
}

template <int DT>
__global__ void __launch_bounds__(1024)
    ar_twoshot_kernel(CommParams c, const unsigned char* __restrict__ x,
                      unsigned char* __restrict__ y, long long nbytes) {
  __shared__ unsigned s_epoch;
  const unsigned epoch = read_epoch(c, &s_epoch);
  const unsigned par = epoch & 1u;
  const int W = c.world;
  const long long L = (nbytes + 7) / 8;
  // chunks are whole lines; chunk size rounded so every chunk is aligned
  const long long C = (L + W - 1) / W;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;

  // stage 1: send chunk `dst` of my input to its owner `dst`
  for (long long j = t; j < C; j += stride) {
    for (int p = 1; p < W; ++p) {
      int dst = c.rank + p;
      if (dst >= W) dst -= W;
      long long i = dst * C + j;
      if (i < L) {
        uint2 v = load_line(x, i, nbytes);
        ll_store(region(c, dst, par, 0, c.rank) + j, v.x, v.y, epoch);
      }
    }
  }
  // reduce my chunk in rank order; stage 2: send the result to every peer
  for (long long j = t; j < C; j += stride) {
    long long i = c.rank * C + j;
    if (i >= L) break;
    LineAcc<DT> acc;
    for (int s = 0; s < W; ++s) {
      uint2 v = (s == c.rank) ? load_line(x, i, nbytes)
                              : ll_load(c, region(c, c.rank, par, 0, s) + j,
                                        epoch, kOpAllReduce, s, i);
      acc.add(v);
    }
    uint2 r = acc.pack();
    for (int p = 1; p < W; ++p) {
      int dst = c.rank + p;
      if (dst >= W) dst -= W;
      ll_store(region(c, dst, par, 1, c.rank) + j, r.x, r.y, epoch);
    }
    store_line(y, i, nbytes, r);
  }
  // gather the other owners' results
  for (long long j = t; j < C; j += stride) {
    for (int p = 1; p < W; ++p) {
      int src = c.rank + p;
      if (src >= W) src -= W;
      long long i = src * C + j;
      if (i < L) {
        uint2 r = ll_load(c, region(c, c.rank, par, 1, src) + j, epoch,
                          kOpAllReduce, src, i);
        store_line(y, i, nbytes, r);
      }
    }
  }
}

// Single-rank group: plain copy (keeps the epoch protocol trivially).
__global__ void copy_kernel(const unsigned char* __restrict__ x,
                            unsigned char* __restrict__ y, long long nbytes) {
  const long long L = (nbytes + 7) / 8;
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < L;
       i += stride)
    store_line(y, i, nbytes, load_line(x, i, nbytes));
}

template <int DT>
cudaError_t launch_dt(const CommParams& c, cudaStream_t stream, const void* x,
                      void* y, long long nbytes, int algo, int blocks,
                      int threads) {
  const unsigned char* xb = static_cast<const unsigned char*>(x);
  unsigned char* yb = static_cast<unsigned char*>(y);
  if (algo == JT_AR_TWOSHOT) {
    ar_twoshot_kernel<DT><<<blocks, threads, 0, stream>>>(c, xb, yb, nbytes);
  } else {
    ar_oneshot_kernel<DT><<<blocks, threads, 0, stream>>>(c, xb, yb, nbytes);
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace jt

extern "C" cudaError_t jt_all_reduce(int gid, int rank, cudaStream_t stream,
                                     const void* x, void* y, int64_t n,
                                     int dtype, int algo, int blocks,
                                     int threads) {
  long long esize = dtype == JT_F32 ? 4 : 2;
  if (dtype != JT_F32 && dtype != JT_BF16 && dtype != JT_F16)
    return cudaErrorInvalidValue;
  if (blocks < 1 || threads < 32 || threads > 1024 || threads % 32 != 0)
    return cudaErrorInvalidValue;
  long long nbytes = n * esize;
  if (nbytes <= 0) return cudaSuccess;
  jt::CommParams c;
  if (!jt::make_comm(gid, rank, &c)) return cudaErrorInvalidResourceHandle;
  long long lines = (nbytes + 7) / 8;
  if (lines > c.cap_lines) return cudaErrorInvalidValue;
  if (c.world == 1) {
    jt::copy_kernel<<<blocks, threads, 0, stream>>>(
        static_cast<const unsigned char*>(x), static_cast<unsigned char*>(y),
        nbytes);
    return cudaGetLastError();
  }
  switch (dtype) {
    case JT_BF16:
      return jt::launch_dt<JT_BF16>(c, stream, x, y, nbytes, algo, blocks,
                                    threads);
    case JT_F16:
      return jt::launch_dt<JT_F16>(c, stream, x, y, nbytes, algo, blocks,
                                   threads);
    default:
      return jt::launch_dt<JT_F32>(c, stream, x, y, nbytes, algo, blocks,
                                   threads);
  }
}
