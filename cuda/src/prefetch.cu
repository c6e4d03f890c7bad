// L2 prefetch of one layer's slice of up to JT_PREFETCH_MAX_ARRAYS stacked
// weight arrays, in one launch.
//
// Why: at batch 1 a decode layer's GEMVs stream their weights from HBM, while
// the attention chain before them (indexer, top-k, sparse MLA) is latency
// bound and leaves HBM mostly idle. Issuing the next GEMVs' weight reads into
// L2 at the start of that chain lets those GEMVs read from L2 instead, if the
// lines are still resident when they run.
//
// What: array a is a stack [L_a, ...] (base address, L_a layers of
// layer_bytes[a] bytes each); the kernel reads the layer index on the device
// as the sum of two int32s (a traced loop counter and the call site's offset
// from it: the launch is the same for every layer, so it can be captured in
// a CUDA graph), takes it like jnp's w[layer] (negative from
// the end, then clamped into [0, L_a)) and prefetches bytes
// [layer · layer_bytes, (layer + 1) · layer_bytes) of every array into L2.
//
// How: the 16-byte-aligned interior of each slice is cut into chunks of
// kChunk bytes; each thread issues one `cp.async.bulk.prefetch.L2.global` per
// chunk (a hint to the bulk copy engine of its SM: no destination, no
// completion, the thread moves on at once). CTAs are one warp so that a
// layer's ~1000 chunks spread over many SMs' copy engines. An unaligned head
// or tail (< 16 bytes) is covered by a plain `prefetch.global.L2` of the line
// holding its first / last byte.
//
// Protocol: nothing is waited for; the kernel ends once the requests are
// issued and the lines land in L2 while later kernels run. Thread 0 writes
// token[0] = 0: the token is the call's only output, so a consumer that
// depends on it (jtilert.ffi.prefetch.ordered) is ordered after the launch,
// and XLA keeps the call as long as the token is used. The prefetch never
// changes any result: it is a cache hint only.
#include <cuda_runtime.h>

#include <cstdint>

#include "jtilert/engine.h"

namespace jt {
namespace {

constexpr int kThreads = 32;           // one warp per CTA
constexpr uint64_t kChunk = 16 << 10;  // bytes of one bulk prefetch
static_assert(kChunk % 16 == 0, "bulk prefetch sizes are multiples of 16");
constexpr int kMaxCtas = 1024;         // beyond: grid-stride

struct PrefetchArgs {
  const char* base[JT_PREFETCH_MAX_ARRAYS];
  uint64_t layer_bytes[JT_PREFETCH_MAX_ARRAYS];
  uint64_t chunks_end[JT_PREFETCH_MAX_ARRAYS];  // chunks of arrays 0..a
  int32_t layers[JT_PREFETCH_MAX_ARRAYS];
  int32_t n;
};

__device__ __forceinline__ void bulk_prefetch_l2(uintptr_t addr,
                                                 uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(addr),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void line_prefetch_l2(uintptr_t addr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(addr) : "memory");
}

__global__ void __launch_bounds__(kThreads)
    prefetch_l2_kernel(const __grid_constant__ PrefetchArgs args,
                       const int32_t* __restrict__ layer,
                       const int32_t* __restrict__ layer_offset,
                       int32_t* token) {
  const int32_t raw = *layer + *layer_offset;
  const uint64_t total = args.chunks_end[args.n - 1];
  const uint64_t stride = (uint64_t)gridDim.x * kThreads;
  if (blockIdx.x == 0 && threadIdx.x == 0) token[0] = 0;
  int a = 0;
  for (uint64_t g = (uint64_t)blockIdx.x * kThreads + threadIdx.x; g < total;
       g += stride) {
    while (g >= args.chunks_end[a]) ++a;  // g only grows: a never goes back
    const uint64_t c = g - (a > 0 ? args.chunks_end[a - 1] : 0);
    const int32_t L = args.layers[a];
    int32_t l = raw < 0 ? raw + L : raw;
    l = l < 0 ? 0 : (l >= L ? L - 1 : l);
    const uintptr_t lo =
        (uintptr_t)args.base[a] + (uint64_t)l * args.layer_bytes[a];
    const uintptr_t hi = lo + args.layer_bytes[a];
    const uintptr_t alo = (lo + 15) & ~(uintptr_t)15, ahi = hi & ~(uintptr_t)15;
    if (c == 0) {  // the unaligned ends: the lines of the first and last byte
      if (alo != lo || ahi <= alo) line_prefetch_l2(lo);
      if (ahi != hi || ahi <= alo) line_prefetch_l2(hi - 1);
    }
    // the chunk count is ceil(layer_bytes / kChunk), enough for the aligned
    // interior at any alignment; the last chunks may be short or empty
    const uintptr_t start = alo + c * kChunk;
    if (start < ahi) {
      const uintptr_t end = start + kChunk < ahi ? start + kChunk : ahi;
      bulk_prefetch_l2(start, (uint32_t)(end - start));
    }
  }
}

}  // namespace
}  // namespace jt

extern "C" cudaError_t jt_prefetch_l2(cudaStream_t stream,
                                      const int32_t* layer,
                                      const int32_t* layer_offset, int n,
                                      const void* const* bases,
                                      const int64_t* layer_bytes,
                                      const int32_t* layers, int32_t* token) {
  if (n < 1 || n > JT_PREFETCH_MAX_ARRAYS || layer == nullptr ||
      layer_offset == nullptr || token == nullptr)
    return cudaErrorInvalidValue;
  jt::PrefetchArgs args = {};
  uint64_t chunks = 0;
  for (int a = 0; a < n; ++a) {
    if (layer_bytes[a] < 0 || layers[a] < 1 ||
        (layer_bytes[a] > 0 && bases[a] == nullptr))
      return cudaErrorInvalidValue;
    args.base[a] = static_cast<const char*>(bases[a]);
    args.layer_bytes[a] = (uint64_t)layer_bytes[a];
    args.layers[a] = layers[a];
    chunks += (args.layer_bytes[a] + jt::kChunk - 1) / jt::kChunk;
    args.chunks_end[a] = chunks;
  }
  args.n = n;
  // at least one CTA: thread 0 writes the token even with nothing to fetch
  uint64_t ctas = (chunks + jt::kThreads - 1) / jt::kThreads;
  ctas = ctas < 1 ? 1 : (ctas > (uint64_t)jt::kMaxCtas ? jt::kMaxCtas : ctas);
  jt::prefetch_l2_kernel<<<(unsigned)ctas, jt::kThreads, 0, stream>>>(
      args, layer, layer_offset, token);
  return cudaGetLastError();
}
