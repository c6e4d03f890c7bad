// A one-CTA exact top-k for rows of up to 8,192 scores, by bisection on the
// scores' order keys (GPU only; a candidate for the indexer's decode top-k,
// 2,048 of 4,096 positions, which the engine's cluster select takes ~9 us for).
//
// The contract is the engine's select in by-position mode (cuda/src/select.cu):
// the k largest scores by the total order of their bits, equal scores to the
// lower position, the selected positions written in position order, a position
// whose score is not above -inf written as -1.
//
// Why it may be faster: the cluster select spends its time in cluster barriers
// and distributed-shared-memory round trips (three digit levels, ~8 of them),
// and a one-CTA radix select in shared-memory atomics on a few hot bins. Here
// there are no atomics and no cluster: 1,024 threads hold R <= 8 keys each (a
// contiguous run of positions); the threshold key T (the largest key with at
// least k keys >= it) is found two bits per round, 16 rounds, each round three
// counts (warp reductions, one barrier, the 32 warp sums read by every thread).
// Then two block scans: the ties at T before each thread (the lowest `need`
// ties are taken) and the selected entries before it (its output offset).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a
//        bench/experiments/topk_bisect.cu -o topk_bisect && ./topk_bisect
// checks every case against a host reference, then times rows of 4,096 and
// 8,192 scores (k = 2,048) as 100 launches in one CUDA graph, beside an empty
// kernel's launch in the same graph form.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#define CK(x)                                                          \
  do {                                                                 \
    cudaError_t e_ = (x);                                              \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__,           \
                   cudaGetErrorString(e_));                            \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

// fp32 bits -> uint32 with the same order (the total order of the bits).
__host__ __device__ inline uint32_t order_key(float f) {
#ifdef __CUDA_ARCH__
  const uint32_t u = __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
#endif
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The number of this CTA's keys >= each of three candidates, for every thread:
// per-warp sums by redux, one barrier, then each thread adds the 32 warp sums.
// `buf` alternates between calls so that one barrier per round suffices.
template <int R>
__device__ __forceinline__ void count3(const uint32_t (&key)[R], int valid,
                                       uint32_t c1, uint32_t c2, uint32_t c3,
                                       uint4* buf, uint32_t* out) {
  uint32_t n1 = 0, n2 = 0, n3 = 0;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    const bool v = j < valid;
    n1 += v && key[j] >= c1;
    n2 += v && key[j] >= c2;
    n3 += v && key[j] >= c3;
  }
  n1 = __reduce_add_sync(0xffffffffu, n1);
  n2 = __reduce_add_sync(0xffffffffu, n2);
  n3 = __reduce_add_sync(0xffffffffu, n3);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) buf[warp] = make_uint4(n1, n2, n3, 0);
  __syncthreads();
  uint32_t s1 = 0, s2 = 0, s3 = 0;
#pragma unroll 8
  for (int w = 0; w < kWarps; ++w) {
    const uint4 x = buf[w];
    s1 += x.x;
    s2 += x.y;
    s3 += x.z;
  }
  out[0] = s1;
  out[1] = s2;
  out[2] = s3;
}

// Exclusive prefix sum of v over the CTA (ws: kWarps + 1 words); *total: the sum.
__device__ uint32_t block_scan(uint32_t v, uint32_t* ws, uint32_t* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) ws[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const uint32_t w = ws[lane];
    uint32_t s = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    ws[lane] = s - w;
    if (lane == 31) ws[kWarps] = s;
  }
  __syncthreads();
  const uint32_t r = ws[warp] + x - v;
  *total = ws[kWarps];
  __syncthreads();
  return r;
}

// One CTA per row of n <= R * 1024 scores; thread t holds positions
// t*R .. t*R + R - 1.
template <int R>
__global__ void __launch_bounds__(kThreads)
    topk_bisect_kernel(const float* __restrict__ scores, int n, int k,
                       int32_t* __restrict__ out) {
  __shared__ uint4 bufs[2][kWarps];
  __shared__ uint32_t ws[kWarps + 1];
  const float* row = scores + (size_t)blockIdx.x * n;
  int32_t* orow = out + (size_t)blockIdx.x * k;
  const int first = threadIdx.x * R;
  const int valid = max(0, min(R, n - first));
  uint32_t key[R];
#pragma unroll
  for (int j = 0; j < R; ++j) key[j] = j < valid ? order_key(row[first + j]) : 0u;

  // T: the largest key with at least k keys >= T, two bits a round.
  uint32_t t = 0, cnt[3];
#pragma unroll 1
  for (int b = 30; b >= 0; b -= 2) {
    const uint32_t c1 = t | (1u << b), c2 = t | (2u << b), c3 = t | (3u << b);
    count3<R>(key, valid, c1, c2, c3, bufs[(b >> 1) & 1], cnt);
    t = cnt[2] >= (uint32_t)k ? c3 : cnt[1] >= (uint32_t)k ? c2 : cnt[0] >= (uint32_t)k ? c1 : t;
  }
  // above T: taken; at T: the first `need` in position order
  uint32_t gt = 0, eq = 0;
#pragma unroll
  for (int j = 0; j < R; ++j) {
    gt += j < valid && key[j] > t;
    eq += j < valid && key[j] == t;
  }
  uint32_t total_gt, total_eq;
  // (block_scan's barriers also end every thread's reads of bufs)
  block_scan(gt, ws, &total_gt);
  const uint32_t ties_before = block_scan(eq, ws, &total_eq);
  const uint32_t need = (uint32_t)k - total_gt;
  uint32_t mine = gt + (ties_before < need ? min(eq, need - ties_before) : 0u);
  uint32_t total;
  uint32_t at = block_scan(mine, ws, &total);
  uint32_t tie = ties_before;
  const uint32_t neg_inf = order_key(-INFINITY);
#pragma unroll
  for (int j = 0; j < R; ++j) {
    if (j >= valid) break;
    const bool take = key[j] > t || (key[j] == t && tie++ < need);
    if (take) orow[at++] = key[j] > neg_inf ? first + j : -1;
  }
}

// ---------------- host ----------------

std::vector<int32_t> reference(const std::vector<float>& s, int k) {
  const int n = (int)s.size();
  std::vector<int> p(n);
  std::iota(p.begin(), p.end(), 0);
  std::stable_sort(p.begin(), p.end(), [&](int a, int b) { return order_key(s[a]) > order_key(s[b]); });
  p.resize(k);
  std::sort(p.begin(), p.end());
  std::vector<int32_t> out;
  for (int i : p) out.push_back(order_key(s[i]) > order_key(-INFINITY) ? i : -1);
  return out;
}

template <int R>
void launch(const float* s, int rows, int n, int k, int32_t* out, cudaStream_t st) {
  topk_bisect_kernel<R><<<rows, kThreads, 0, st>>>(s, n, k, out);
}

void run(const float* s, int rows, int n, int k, int32_t* out, cudaStream_t st) {
  if (n <= 1024) launch<1>(s, rows, n, k, out, st);
  else if (n <= 2048) launch<2>(s, rows, n, k, out, st);
  else if (n <= 4096) launch<4>(s, rows, n, k, out, st);
  else launch<8>(s, rows, n, k, out, st);
}

__global__ void empty_kernel(int32_t* out) {
  if (threadIdx.x == 0 && out == nullptr) out[0] = 0;
}

// kind 0: normal scores; 1: few distinct values (ties); 2: normal with the
// positions past `live` masked to -inf (a causal row); 3: all equal.
std::vector<float> make_row(int n, int kind, int live, std::mt19937& g) {
  std::normal_distribution<float> nd;
  std::vector<float> s(n);
  for (int i = 0; i < n; ++i) {
    float v = nd(g);
    if (kind == 1) v = std::round(v * 2.f) / 2.f;
    if (kind == 3) v = 1.5f;
    if (kind == 2 && i >= live) v = -INFINITY;
    s[i] = v;
  }
  if (kind == 0 && n > 8) s[3] = -0.0f, s[5] = 0.0f;
  return s;
}

int main() {
  std::mt19937 g(7);
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  int failures = 0, cases = 0;
  struct Case { int n, k, kind, live; };
  const Case cs[] = {{4096, 2048, 0, 0}, {4096, 2048, 1, 0}, {4096, 2048, 2, 1500}, {4096, 2048, 3, 0},
                     {8192, 2048, 0, 0}, {8192, 2048, 2, 5000}, {1000, 512, 1, 0}, {3000, 2048, 2, 2100},
                     {4096, 1, 0, 0}, {4096, 4096, 1, 0}, {777, 700, 2, 300}};
  for (const Case& c : cs) {
    const int rows = 3;
    std::vector<float> h;
    std::vector<std::vector<int32_t>> want;
    for (int r = 0; r < rows; ++r) {
      auto s = make_row(c.n, c.kind, c.live, g);
      want.push_back(reference(s, c.k));
      h.insert(h.end(), s.begin(), s.end());
    }
    float* d;
    int32_t* o;
    CK(cudaMalloc(&d, h.size() * 4));
    CK(cudaMalloc(&o, (size_t)rows * c.k * 4));
    CK(cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemset(o, 0x7f, (size_t)rows * c.k * 4));
    run(d, rows, c.n, c.k, o, st);
    CK(cudaStreamSynchronize(st));
    std::vector<int32_t> got((size_t)rows * c.k);
    CK(cudaMemcpy(got.data(), o, got.size() * 4, cudaMemcpyDeviceToHost));
    for (int r = 0; r < rows; ++r) {
      ++cases;
      std::vector<int32_t> gr(got.begin() + (size_t)r * c.k, got.begin() + (size_t)(r + 1) * c.k);
      if (gr != want[r]) {
        ++failures;
        std::printf("FAIL n=%d k=%d kind=%d row %d\n", c.n, c.k, c.kind, r);
      }
    }
    CK(cudaFree(d));
    CK(cudaFree(o));
  }
  std::printf("checks: %d of %d rows exact\n", cases - failures, cases);

  for (int n : {4096, 8192}) {
    const int k = 2048, reps = 100;
    auto s = make_row(n, 0, 0, g);
    float* d;
    int32_t* o;
    CK(cudaMalloc(&d, n * 4));
    CK(cudaMalloc(&o, k * 4));
    CK(cudaMemcpy(d, s.data(), n * 4, cudaMemcpyHostToDevice));
    for (int form = 0; form < 2; ++form) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < reps; ++i) {
        if (form == 0) run(d, 1, n, k, o, st);
        else empty_kernel<<<1, kThreads, 0, st>>>(o);
      }
      CK(cudaStreamEndCapture(st, &graph));
      CK(cudaGraphInstantiate(&exec, graph, 0));
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      std::vector<float> us;
      for (int trial = 0; trial < 7; ++trial) {
        CK(cudaEventRecord(a, st));
        CK(cudaGraphLaunch(exec, st));
        CK(cudaEventRecord(b, st));
        CK(cudaStreamSynchronize(st));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        if (trial > 0) us.push_back(ms * 1e3f / reps);
      }
      std::sort(us.begin(), us.end());
      std::printf("BENCH %s n=%d k=%d graph_us_per_call=%.3f\n", form == 0 ? "topk_bisect" : "empty_kernel", n, k,
                  us[us.size() / 2]);
      CK(cudaGraphExecDestroy(exec));
      CK(cudaGraphDestroy(graph));
    }
    CK(cudaFree(d));
    CK(cudaFree(o));
  }
  return failures ? 1 : 0;
}
