// What a persistent kernel with a weight stream that runs ahead of the
// activations buys over one launch per GEMV (GPU only; issue 14's question).
//
// The chain: P dependent fp8 GEMVs y_p = diag(scale_p) W_p y_{p-1}, the shapes
// alternating SMALL x BIG and BIG x SMALL (by default 32 of 2048 x 7168, 14.7
// MB each, every W distinct, so the chain streams 470 MB from HBM; --dims
// 1024,1024 --gemvs 128: 1 MB GEMVs, where the per-GEMV fixed cost shows), x
// the fp32 output of the GEMV before.
// One kernel body, five ways to run it, each captured in one CUDA graph:
//   launches    one launch per GEMV (the step's form today; each streams its
//               weights from its start, its input being there);
//   persistent  one launch for the chain, CTAs meeting at a counter per GEMV,
//               each CTA's weight loads for GEMV p issued once GEMV p's input
//               is there (a launch boundary without the launch);
//   prefetch    the same, the weight loads issued as soon as ring space frees,
//               so GEMV p+1's weights stream in while the CTAs wait for GEMV
//               p's last rows (what the fused layer kernels would do);
//   tags        prefetch, each CTA learning that its input is complete from
//               the input's own tags instead of a fence and a counter;
//   flags       prefetch, each CTA raising a flag of its own once its rows are
//               written (a fence and a release store, no atomic), readers
//               polling the 128 flags with acquire loads, then reading the
//               input as plain fp32 (half the bytes of a tagged element);
//   ring        tags with no arithmetic: the weight stream and the handoffs
//               alone, the floor of this kernel's structure;
//   ring-flags  the same with flags;
//   stream      the weight stream alone: no inputs, no outputs, no handoffs.
// Every persistent form loads a GEMV's row scales before it waits for its input.
// Against the copy rate of the same bytes (cudaMemcpy device to device).
//
// Kernel: 128 CTAs (one per SM), each owning N/128 rows of every GEMV (a
// contiguous slab of the row-major W). The last warp issues the slab's chunks
// (whole rows, <= 8 KB) into a ring of kSlots shared-memory slots with
// cp.async.bulk, one full and one empty mbarrier per slot. Two groups of 8
// consumer warps stage the GEMV's input in shared memory, keep their part of
// it in registers, and take the GEMV's chunks in turn, reducing each chunk's
// rows (fp8 -> fp32, one row split over 8/R warps) into per-row sums; then
// they write the CTA's rows, tagged.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a
//        bench/experiments/gemv_chain.cu -o gemv_chain && ./gemv_chain [--json out.json]
// (bench/gpu_session.sh part `chain`)
#include <cuda/ptx>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

namespace ptx = cuda::ptx;

constexpr int kCtas = 128;
constexpr int kGroups = 2;      // consumer warp groups, taking a GEMV's chunks in turn
constexpr int kGroupWarps = 8;  // the warps of a group, sharing one chunk
constexpr int kConsumers = kGroups * kGroupWarps * 32;
constexpr int kThreads = kConsumers + 32;  // and the producer warp
constexpr int kSlots = 24;
constexpr int kSlotBytes = 8192;
constexpr int kMaxPhases = 128;
constexpr int kBig = 7168;  // the widest x and the most rows a GEMV may have
constexpr int kMaxRowsPerCta = kBig / kCtas;
constexpr int kMaxWords = 8;                 // 4-byte weight words a lane reduces in a row
constexpr int kStage = kBig / kConsumers;    // x elements a consumer thread stages
static_assert(kMaxRowsPerCta <= kConsumers, "a consumer thread writes at most one row");
static_assert(kCtas <= kConsumers, "a consumer thread polls at most one flag");

#define CHECK(x)                                                              \
  do {                                                                        \
    cudaError_t e_ = (x);                                                     \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,          \
                   cudaGetErrorString(e_));                                   \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

// Every activation element is 8 bytes: its fp32 value (low word) and the tag
// of the GEMV that wrote it (high word), stored and loaded as one 64-bit
// access, which is single-copy atomic: a reader that sees the tag sees the
// value, with no fence between them.
struct Chain {
  const uint8_t* w[kMaxPhases];       // [N_p, K_p] e4m3, row-major
  const float* scale[kMaxPhases];     // [N_p]
  unsigned long long* y[kMaxPhases + 1];  // y[0] = x; y[p + 1] = GEMV p's output
  float* yf[kMaxPhases + 1];          // the same untagged (the flags sync)
  unsigned* done;                     // [phases] CTAs that wrote GEMV p's rows (the counter sync)
  unsigned* flags;                    // [phases][kCtas] the tag of the GEMV a CTA last wrote (the flags sync)
  const unsigned* epoch;              // one per run of the chain: tags never repeat
  int n[kMaxPhases], k[kMaxPhases];
};

enum Sync { kCounter, kTags, kFlags, kNone };

__host__ __device__ inline int rows_per_chunk(int k) {
  int r = kSlotBytes / k;
  return r >= 8 ? 8 : r >= 4 ? 4 : r >= 2 ? 2 : 1;
}
__host__ __device__ inline unsigned tag_of(unsigned epoch, int p) { return epoch * (kMaxPhases + 1) + p; }

__device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long* a) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
  return v;
}
__device__ __forceinline__ void store_relaxed(unsigned long long* a, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(a), "l"(v) : "memory");
}
__device__ __forceinline__ unsigned load_acquire(const unsigned* a) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(a) : "memory");
  return v;
}
__device__ __forceinline__ void store_release(unsigned* a, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(a), "r"(v) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  while (!ptx::mbarrier_try_wait_parity(b, parity)) {
  }
}
__device__ __forceinline__ void consumers_sync() {  // the consumer warps only
  asm volatile("bar.sync 1, %0;" ::"n"(kConsumers) : "memory");
}

// GEMVs [p0, p1) of the chain.
//   lookahead  the producer may run into GEMVs whose input is not there yet;
//   sync       how a CTA learns that GEMV p's input is complete: kCounter, a
//              counter every CTA adds to after a fence; kTags, the input's own
//              tags (each thread re-polls the elements it stages); kFlags, a
//              flag per CTA; kNone, no input and no output (the stream alone);
//   math       false: the consumers release each chunk unread (the ring alone).
// GEMV p0's input is complete at the launch (stream order): nobody waits for it.
__global__ void __launch_bounds__(kThreads, 1)
chain_kernel(const Chain* __restrict__ chain, int p0, int p1, int lookahead, int sync, int math) {
  const Chain& c = *chain;  // in device memory: too large for the kernel's parameters
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* ring = smem;                                              // kSlots x kSlotBytes
  float* xs = reinterpret_cast<float*>(ring + kSlots * kSlotBytes);  // [kBig] the staged input
  float* acc = xs + kBig;                                            // [kMaxRowsPerCta] row sums
  float* scales = acc + kMaxRowsPerCta;                              // [kMaxRowsPerCta] their scales
  uint64_t* full = reinterpret_cast<uint64_t*>(scales + kMaxRowsPerCta);
  uint64_t* empty = full + kSlots;
  volatile int* started = reinterpret_cast<volatile int*>(empty + kSlots);  // GEMV the consumers are on
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, cta = blockIdx.x;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kSlots; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], kGroupWarps);
    }
    *started = p0 - 1;
    ptx::fence_mbarrier_init(ptx::sem_release, ptx::scope_cluster);
  }
  for (int i = threadIdx.x; i < kMaxRowsPerCta; i += kThreads) acc[i] = 0.f;
  const unsigned epoch = *c.epoch;
  __syncthreads();

  if (warp == kGroups * kGroupWarps) {  // the producer: every chunk of every GEMV, in order
    if (lane != 0) return;
    int slot = 0, round = 0;
    for (int p = p0; p < p1; ++p) {
      if (!lookahead)
        while (*started < p) {
        }
      const int n = c.n[p], k = c.k[p], rows = n / kCtas, rpc = rows_per_chunk(k);
      const uint8_t* slab = c.w[p] + (size_t)cta * rows * k;
      for (int r = 0; r < rows; r += rpc) {
        if (round > 0) mbar_wait(&empty[slot], (round - 1) & 1);
        const unsigned bytes = (unsigned)(rpc * k);
        ptx::mbarrier_arrive_expect_tx(ptx::sem_release, ptx::scope_cta, ptx::space_shared, &full[slot], bytes);
        ptx::cp_async_bulk(ptx::space_cluster, ptx::space_global, ring + slot * kSlotBytes, slab + (size_t)r * k,
                           bytes, &full[slot]);
        if (++slot == kSlots) {
          slot = 0;
          ++round;
        }
      }
    }
    return;
  }

  const int group = warp / kGroupWarps, gw = warp % kGroupWarps;
  int chunk0 = 0;  // the chain's chunks before GEMV p's (chunk g sits in slot g % kSlots)
  for (int p = p0; p < p1; ++p) {
    const int n = c.n[p], k = c.k[p], rows = n / kCtas, rpc = rows_per_chunk(k), chunks = rows / rpc;
    const int wpr = kGroupWarps / rpc, span = k / wpr, words = span / 128;  // a row is wpr warps' spans
    const bool wait = p > p0;
    const int row0 = cta * rows;
    // the scale of this thread's row, loaded before the wait (rows <= kConsumers)
    const float row_scale = sync != kNone && threadIdx.x < rows ? c.scale[p][row0 + threadIdx.x] : 0.f;
    const unsigned want = tag_of(epoch, p);
    if (wait && sync == kCounter && threadIdx.x == 0) {
      while (*(volatile unsigned*)&c.done[p - 1] < (unsigned)kCtas) {
      }
      __threadfence();
    }
    if (wait && sync == kFlags && threadIdx.x < kCtas) {
      while (load_acquire(c.flags + (p - 1) * kCtas + threadIdx.x) != want) {
      }
    }
    if (sync == kCounter || sync == kFlags) consumers_sync();
    // stage GEMV p's input: every load in flight before any is checked
    if (sync == kFlags) {
      // L2 loads (ld.global.cg), four elements each, ordered after the flags by the barrier above
#pragma unroll
      for (int j = 0; j < kStage / 4 + 1; ++j) {
        const int i = threadIdx.x + j * kConsumers;
        if (4 * i < k) reinterpret_cast<float4*>(xs)[i] = __ldcg(reinterpret_cast<const float4*>(c.yf[p]) + i);
      }
    } else if (sync != kNone) {
      unsigned long long v[kStage];
#pragma unroll
      for (int s = 0; s < kStage; ++s)
        if (threadIdx.x + s * kConsumers < k) v[s] = load_relaxed(c.y[p] + threadIdx.x + s * kConsumers);
#pragma unroll
      for (int s = 0; s < kStage; ++s) {
        const int i = threadIdx.x + s * kConsumers;
        if (i < k) {
          while (wait && sync == kTags && (unsigned)(v[s] >> 32) != want) v[s] = load_relaxed(c.y[p] + i);
          xs[i] = __uint_as_float((unsigned)v[s]);
        }
      }
    }
    if (threadIdx.x < rows) scales[threadIdx.x] = row_scale;  // out of the registers the chunks need
    consumers_sync();
    if (threadIdx.x == 0) *started = p;
    // this warp's part of a row: words consecutive-lane 4-byte words, x in registers for the whole GEMV
    const int row_in_chunk = gw / wpr, part = gw % wpr;
    float xr[4 * kMaxWords];
#pragma unroll
    for (int w = 0; w < kMaxWords; ++w)
      if (w < words) {
        const float4 t = reinterpret_cast<const float4*>(xs + part * span)[lane + 32 * w];
        xr[4 * w] = t.x, xr[4 * w + 1] = t.y, xr[4 * w + 2] = t.z, xr[4 * w + 3] = t.w;
      }
    for (int ch = group; ch < chunks; ch += kGroups) {
      const int g = chunk0 + ch, slot = g % kSlots;
      mbar_wait(&full[slot], (g / kSlots) & 1);
      if (math) {
        const uint8_t* wrow = ring + slot * kSlotBytes + (size_t)row_in_chunk * k + part * span;
        float v0 = 0.f, v1 = 0.f;  // two chains of dependent adds
#pragma unroll
        for (int w = 0; w < kMaxWords; ++w)
          if (w < words) {
            const uint32_t q = reinterpret_cast<const uint32_t*>(wrow)[lane + 32 * w];
            const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)q, __NV_E4M3);
            const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(q >> 16), __NV_E4M3);
            const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
            const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
            v0 += a.x * xr[4 * w] + a.y * xr[4 * w + 1];
            v1 += b.x * xr[4 * w + 2] + b.y * xr[4 * w + 3];
          }
        float s = v0 + v1;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) atomicAdd(&acc[ch * rpc + row_in_chunk], s);
      }
      __syncwarp();
      if (lane == 0) (void)ptx::mbarrier_arrive(&empty[slot]);
    }
    chunk0 += chunks;
    consumers_sync();
    if (sync == kNone) continue;
    // this CTA's rows (tagged, or then flagged); each thread zeroes the sum it read (the
    // next GEMV's adds come after its staging barrier)
    const unsigned next = tag_of(epoch, p + 1);
    if (threadIdx.x < rows) {
      const float y = acc[threadIdx.x] * scales[threadIdx.x];
      if (sync == kFlags) c.yf[p + 1][row0 + threadIdx.x] = y;
      else store_relaxed(c.y[p + 1] + row0 + threadIdx.x, (unsigned long long)next << 32 | __float_as_uint(y));
      acc[threadIdx.x] = 0.f;
    }
    if (sync == kFlags) {
      consumers_sync();
      if (threadIdx.x == 0) {
        __threadfence();
        store_release(c.flags + p * kCtas + cta, next);
      }
    }
    if (sync == kCounter) {
      __threadfence();
      consumers_sync();
      if (threadIdx.x == 0) atomicAdd(&c.done[p], 1u);
    }
  }
}

__global__ void next_epoch(unsigned* epoch) { ++*epoch; }

constexpr size_t kSmemBytes = (size_t)kSlots * kSlotBytes + (kBig + 2 * kMaxRowsPerCta) * sizeof(float) +
                              2 * kSlots * sizeof(uint64_t) + 16;

unsigned host_bits(float v) {
  unsigned u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}
float host_float(unsigned u) {
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

float fp8_to_float(uint8_t b) {
  __nv_fp8_e4m3 v;
  v.__x = b;
  return (float)v;
}

}  // namespace

int main(int argc, char** argv) {
  const char* json = nullptr;
  int big = kBig, small = 2048, phases = 32;  // --dims BIG,SMALL --gemvs P
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
    else if (!std::strcmp(argv[i], "--dims") && i + 1 < argc) {
      if (std::sscanf(argv[++i], "%d,%d", &big, &small) != 2) {
        std::fprintf(stderr, "--dims %s: two numbers, BIG,SMALL\n", argv[i]);
        return 1;
      }
    }
    else if (!std::strcmp(argv[i], "--gemvs") && i + 1 < argc) phases = std::atoi(argv[++i]);
    else {
      std::fprintf(stderr, "%s: unknown argument (--dims BIG,SMALL --gemvs P --json FILE)\n", argv[i]);
      return 1;
    }
  }
  for (int p = 0; p < 2; ++p) {  // each shape (N, K): rows per CTA in whole chunks, a lane's part in whole words
    const int n = p ? big : small, k = p ? small : big, rpc = rows_per_chunk(k), span = k / (kGroupWarps / rpc);
    if (n < kCtas || n > kBig || k > kBig || n % kCtas || (n / kCtas) % rpc || span % 128 || span / 128 > kMaxWords) {
      std::fprintf(stderr, "--dims %d,%d: multiples of %d up to %d, in whole chunks of rows\n", big, small, kCtas, kBig);
      return 1;
    }
  }
  if (phases < 2 || phases > kMaxPhases || phases % 2) {
    std::fprintf(stderr, "--gemvs %d: even, 2..%d\n", phases, kMaxPhases);
    return 1;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  if (prop.multiProcessorCount < kCtas) {
    std::fprintf(stderr, "needs %d SMs, the GPU has %d\n", kCtas, prop.multiProcessorCount);
    return 1;
  }
  Chain c{};
  std::vector<std::vector<uint8_t>> hw(phases);
  std::vector<std::vector<float>> hs(phases);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  size_t total = 0;
  for (int p = 0; p < phases; ++p) {
    c.n[p] = p % 2 ? big : small;
    c.k[p] = p % 2 ? small : big;
    const size_t nk = (size_t)c.n[p] * c.k[p];
    hw[p].resize(nk);
    for (auto& b : hw[p]) b = __nv_fp8_e4m3(normal(rng)).__x;
    hs[p].resize(c.n[p]);
    for (auto& s : hs[p]) s = (1.f + 0.1f * normal(rng)) / std::sqrt((float)c.k[p]);
    uint8_t* dw;
    float* ds;
    CHECK(cudaMalloc(&dw, nk));
    CHECK(cudaMemcpy(dw, hw[p].data(), nk, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&ds, c.n[p] * sizeof(float)));
    CHECK(cudaMemcpy(ds, hs[p].data(), c.n[p] * sizeof(float), cudaMemcpyHostToDevice));
    c.w[p] = dw;
    c.scale[p] = ds;
    total += nk;
  }
  std::vector<float> hx(kBig);
  for (auto& v : hx) v = normal(rng);
  std::vector<unsigned long long> hx_tagged(kBig);  // tag 0: GEMV 0 never checks its input's tags
  for (int i = 0; i < kBig; ++i) hx_tagged[i] = host_bits(hx[i]);
  const size_t ybytes = kBig * sizeof(unsigned long long), yfbytes = kBig * sizeof(float);
  for (int p = 0; p <= phases; ++p) {
    CHECK(cudaMalloc(&c.y[p], ybytes));
    CHECK(cudaMalloc(&c.yf[p], yfbytes));
  }
  CHECK(cudaMemcpy(c.y[0], hx_tagged.data(), ybytes, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(c.yf[0], hx.data(), yfbytes, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&c.done, phases * sizeof(unsigned)));
  CHECK(cudaMalloc(&c.flags, phases * kCtas * sizeof(unsigned)));
  CHECK(cudaMemset(c.flags, 0, phases * kCtas * sizeof(unsigned)));  // no GEMV's tag is 0
  unsigned* epoch;
  const unsigned first_epoch = 1;  // y's zeroed tags are never a GEMV's
  CHECK(cudaMalloc(&epoch, sizeof(unsigned)));
  CHECK(cudaMemcpy(epoch, &first_epoch, sizeof(unsigned), cudaMemcpyHostToDevice));
  c.epoch = epoch;
  Chain* dc;
  CHECK(cudaMalloc(&dc, sizeof(Chain)));
  CHECK(cudaMemcpy(dc, &c, sizeof(Chain), cudaMemcpyHostToDevice));

  // the reference chain on the host (fp32 rows, double accumulation)
  float lut[256];  // e4m3 byte -> float
  for (int b = 0; b < 256; ++b) lut[b] = fp8_to_float((uint8_t)b);
  std::vector<std::vector<float>> ref(phases + 1);
  ref[0].assign(hx.begin(), hx.begin() + c.k[0]);
  for (int p = 0; p < phases; ++p) {
    ref[p + 1].resize(c.n[p]);
    for (int r = 0; r < c.n[p]; ++r) {
      double s = 0;
      const uint8_t* row = hw[p].data() + (size_t)r * c.k[p];
      for (int j = 0; j < c.k[p]; ++j) s += (double)lut[row[j]] * ref[p][j];
      ref[p + 1][r] = (float)(s * hs[p][r]);
    }
  }

  CHECK(cudaFuncSetAttribute(chain_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kSmemBytes));
  int per_sm = 0;  // the persistent forms need all kCtas CTAs resident at once (they spin on each other)
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, chain_kernel, kThreads, kSmemBytes));
  if (per_sm < 1) {
    std::fprintf(stderr, "chain_kernel does not fit an SM (%zu bytes of shared memory)\n", kSmemBytes);
    return 1;
  }
  cudaStream_t st;
  CHECK(cudaStreamCreate(&st));
  struct Form {
    const char* name;
    bool one_launch;
    int lookahead, sync, math;
  } forms[] = {{"launches", false, 1, kCounter, 1}, {"persistent", true, 0, kCounter, 1},
               {"prefetch", true, 1, kCounter, 1},  {"tags", true, 1, kTags, 1},
               {"flags", true, 1, kFlags, 1},       {"ring", true, 1, kTags, 0},
               {"ring-flags", true, 1, kFlags, 0},  {"stream", true, 1, kNone, 0}};
  std::string out = "{\"device\": \"" + std::string(prop.name) + "\", \"gemvs\": " + std::to_string(phases) +
                    ", \"dims\": [" + std::to_string(big) + ", " + std::to_string(small) + "]" +
                    ", \"mb_per_gemv\": " + std::to_string(total / phases / 1e6);
  bool ok = true;
  const int iters = 20;
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (const Form& f : forms) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemsetAsync(c.done, 0, phases * sizeof(unsigned), st));
    if (f.one_launch) {
      chain_kernel<<<kCtas, kThreads, kSmemBytes, st>>>(dc, 0, phases, f.lookahead, f.sync, f.math);
    } else {
      // each launch's input is there when it starts (lookahead 1: its weights stream from its start)
      for (int p = 0; p < phases; ++p)
        chain_kernel<<<kCtas, kThreads, kSmemBytes, st>>>(dc, p, p + 1, f.lookahead, f.sync, f.math);
    }
    next_epoch<<<1, 1, 0, st>>>(epoch);
    CHECK(cudaStreamEndCapture(st, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int p = 1; p <= phases; ++p) {
      CHECK(cudaMemset(c.y[p], 0, ybytes));
      CHECK(cudaMemset(c.yf[p], 0, yfbytes));
    }
    unsigned run_epoch;
    CHECK(cudaMemcpy(&run_epoch, epoch, sizeof(unsigned), cudaMemcpyDeviceToHost));
    CHECK(cudaGraphLaunch(ge, st));
    CHECK(cudaStreamSynchronize(st));
    double worst = 0;  // the forms without math compute nothing: their outputs are not checked
    for (int p = 1; p <= phases && f.math; ++p) {
      std::vector<unsigned long long> got(c.n[p - 1]);
      std::vector<float> gotf(c.n[p - 1]);
      CHECK(cudaMemcpy(got.data(), c.y[p], got.size() * sizeof(got[0]), cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(gotf.data(), c.yf[p], gotf.size() * sizeof(float), cudaMemcpyDeviceToHost));
      double num = 0, den = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        const float v = f.sync == kFlags ? gotf[i] : host_float((unsigned)got[i]);
        num += (v - ref[p][i]) * (double)(v - ref[p][i]);
        den += (double)ref[p][i] * ref[p][i];
        if (f.sync != kFlags && (unsigned)(got[i] >> 32) != tag_of(run_epoch, p)) num = NAN;  // untagged row
      }
      const double e = std::sqrt(num / den);
      if (!(e <= worst)) worst = e;  // a NaN stays
    }
    for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(ge, st));
    CHECK(cudaEventRecord(e0, st));
    for (int i = 0; i < iters; ++i) CHECK(cudaGraphLaunch(ge, st));
    CHECK(cudaEventRecord(e1, st));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    const double us = ms * 1e3 / iters / phases;
    const bool good = worst < 1e-4;
    ok &= good;
    if (f.math)
      std::printf("%-11s %7.2f us a GEMV   worst relative error %.2e %s\n", f.name, us, worst, good ? "" : "FAIL");
    else
      std::printf("%-11s %7.2f us a GEMV   (no math: not checked)\n", f.name, us);
    out += ", \"" + std::string(f.name) + "_us\": " + std::to_string(us) + ", \"" + f.name +
           "_rel_err\": " + (f.math && std::isfinite(worst) ? std::to_string(worst) : std::string("null"));
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
  }
  // the copy rate of the chain's bytes (one buffer to a second, device to device)
  uint8_t *a, *b;
  const size_t cb = std::max(total / 2, (size_t)512 << 20);  // well past the 50 MB L2
  CHECK(cudaMalloc(&a, cb));
  CHECK(cudaMalloc(&b, cb));
  CHECK(cudaMemcpyAsync(b, a, cb, cudaMemcpyDeviceToDevice, st));
  CHECK(cudaEventRecord(e0, st));
  for (int i = 0; i < 5; ++i) CHECK(cudaMemcpyAsync(b, a, cb, cudaMemcpyDeviceToDevice, st));
  CHECK(cudaEventRecord(e1, st));
  CHECK(cudaEventSynchronize(e1));
  float ms;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  // read + write bytes a second, as bench.decode.copy_bandwidth counts them; the floor is a GEMV's
  // bytes at that rate, as bench.decode's floor is the step's
  const double gbs = 2.0 * cb * 5 / (ms * 1e-3) / 1e9;
  const double floor_us = total / phases / (gbs * 1e9) * 1e6;
  std::printf("copy %.0f GB/s; a GEMV's bytes at that rate: %.2f us\n", gbs, floor_us);
  out += ", \"copy_GBs\": " + std::to_string(gbs) + ", \"floor_us\": " + std::to_string(floor_us) +
         ", \"ok\": " + (ok ? "true" : "false") + "}";
  if (json) {
    FILE* fp = std::fopen(json, "w");
    if (!fp || std::fprintf(fp, "%s\n", out.c_str()) < 0 || std::fclose(fp) != 0) {
      std::fprintf(stderr, "--json %s: cannot write the results\n", json);
      return 1;
    }
  }
  std::printf("%s\n", ok ? "ok" : "FAIL");
  return ok ? 0 : 1;
}
