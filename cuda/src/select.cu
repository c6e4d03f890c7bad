// Exact top-k of fp32 score rows in one kernel launch (issue 5: the DSA
// indexer's top-2048 over up to ~160K cache positions, T <= 8 tokens).
//
// Result: EXACTLY the (index, value) pairs `lax.top_k` returns. Scores are
// ordered by the total order of their bits (XLA's TopK comparator: -0.0 <
// +0.0, -inf below every finite score, NaN with the sign bit below -inf and
// without it above +inf); equal scores go to the lower position. With
// JT_TOPK_CANONICAL_ZERO, -0.0 counts as (and comes back as) +0.0, the order
// of merge_topk. Output order: by (score desc, position asc) with
// JT_TOPK_SORTED, else by position.
//
// Algorithm. Each row is cut into G chunks, one CTA each; a CTA keeps its
// chunk as order-preserving uint32 keys in shared memory (the scores are read
// once). The key of the k-th largest score is found digit by digit, most
// significant first (11 + 11 + 10 bits): every CTA builds a shared-memory
// histogram of the current digit over its keys that match the prefix found
// so far, adds it to the row's histogram in global memory, and after a
// barrier of the row's CTAs every CTA finds the same digit in the global
// histogram. The search stops early once the whole current bucket is taken.
// Then keys above the bucket are selected, plus the first `need` keys of the
// bucket in position order: each CTA publishes its two counts, and after one
// more barrier knows how many selected entries lie before its chunk, so it
// writes its own in position order. Sorted output: the k selected entries are
// staged in global memory; after a last barrier each CTA loads them and
// places its 1/G share at their rank (entries before it in (score desc,
// position asc) order, counted over all k).
//
// Barriers: the CTAs of a row meet at a sense-reversing barrier in global
// memory (arrival counter + generation word). The launch is cooperative, so
// all CTAs are resident; a wait still gives up after the timeout and traps
// with a status record, like the engine's other waits. Between calls only the
// barrier generation changes (each call reads it at its start); the arrival
// counters and the global histograms are back at zero when a call ends (the
// CTAs clear the histograms after their last read): every launch is
// identical, safe in CUDA graphs.
//
// Scratch (histograms, per-CTA counts, staging, barrier words, a host-mapped
// status) is allocated once per device by jt_topk_prepare; calls on one
// device must be stream-ordered (XLA's compute stream).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "common.cuh"

namespace jt {
namespace {

constexpr int kNT = 512;            // threads per CTA
constexpr int kWarps = kNT / 32;
constexpr int kBins = 2048;         // widest digit: 11 bits
constexpr int kLevels = 3;          // digits: bits 31..21, 20..10, 9..0
constexpr int kMaxChunk = 16384;    // keys per CTA (64 KiB of shared memory)
constexpr int kMaxCtas = 1024;      // CTAs per row
constexpr int kSyncWords = 32;      // per row: [0] arrivals, [16] generation
constexpr unsigned kOpTopkSelect = 4;  // JtStatus.op of a timed-out barrier

struct SelectParams {
  const float* scores;     // [T, n]
  int32_t* out_idx;        // [T, k]
  float* out_val;          // [T, k]
  uint32_t* hist;          // [JT_TOPK_MAX_ROWS][kLevels][kBins], zero between calls
  uint32_t* counts;        // [JT_TOPK_MAX_ROWS][2][kMaxCtas]
  unsigned long long* stage;  // [JT_TOPK_MAX_ROWS][JT_TOPK_MAX_K]
  unsigned* sync;          // [JT_TOPK_MAX_ROWS][kSyncWords]
  JtStatus* status;        // host-mapped
  long long timeout_ns;
  int n, k, chunk, mode;
};

// fp32 bits -> uint32 with the same order (total order of the bits).
__device__ __forceinline__ uint32_t order_key(float f, bool canonical_zero) {
  uint32_t u = __float_as_uint(f);
  if (canonical_zero && u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// The bucket is the set of keys whose bits above `lo` equal `pre`.
__device__ __forceinline__ bool in_bucket(uint32_t key, uint32_t pre, int lo) {
  return lo >= 32 || (key >> lo) == pre;
}
__device__ __forceinline__ bool above_bucket(uint32_t key, uint32_t pre,
                                             int lo) {
  return lo < 32 && (key >> lo) > pre;
}

// Exclusive prefix sum of v over the CTA's threads; *total gets the sum.
// `ws` holds kWarps + 1 words of shared memory.
__device__ uint32_t block_exclusive_scan(uint32_t v, uint32_t* ws,
                                         uint32_t* total) {
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
    const uint32_t w = lane < kWarps ? ws[lane] : 0u;
    uint32_t s = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const uint32_t y = __shfl_up_sync(0xffffffffu, s, o);
      if (lane >= o) s += y;
    }
    if (lane < kWarps) ws[lane] = s - w;
    if (lane == kWarps - 1) ws[kWarps] = s;
  }
  __syncthreads();
  const uint32_t r = ws[warp] + x - v;
  *total = ws[kWarps];
  __syncthreads();  // ws can be reused
  return r;
}

// In hist[0..nb): the largest digit d with #(digits >= d) >= need. Writes
// {d, #(digits > d), hist[d]} to out (shared memory), visible on return.
__device__ void find_digit(const uint32_t* hist, int nb, uint32_t need,
                           uint32_t* ws, uint32_t* out) {
  const int per = (nb + kNT - 1) / kNT;
  const int lo = threadIdx.x * per, hi = min(nb, lo + per);
  uint32_t s = 0;
  for (int b = lo; b < hi; ++b) s += hist[b];
  uint32_t total;
  const uint32_t before = block_exclusive_scan(s, ws, &total);
  uint32_t cum = total - before - s;  // keys in the bins above this thread's
  for (int b = hi - 1; b >= lo; --b) {
    const uint32_t h = hist[b];
    if (cum < need && cum + h >= need) {  // exactly one bin crosses `need`
      out[0] = (uint32_t)b;
      out[1] = cum;
      out[2] = h;
    }
    cum += h;
  }
  __syncthreads();
}

// Barrier of the gridDim.x CTAs of this row (see the file comment). `where`
// names the barrier in a timeout record. `gen` (thread 0's) is the row's
// generation word as it stands until this CTA arrives: read once at kernel
// start, then known (each barrier advances it by one), so no load of it is
// on the barrier's path. The arrival counter starts every call at 0 and
// counts on through the call's barriers (round j: j*G .. j*G + G-1, all CTAs
// meet the same barriers); the last arrival at the call's `last` barrier
// sets it back to 0, as the next call may have another G.
__device__ void row_barrier(const SelectParams& p, unsigned* sync, int where,
                            unsigned* gen, bool last) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned g0 = *gen;
    __threadfence();
    if ((atomicAdd(sync, 1u) + 1u) % gridDim.x == 0u) {
      if (last) atomicExch(sync, 0u);
      __threadfence();
      atomicAdd(sync + 16, 1u);
    } else {
      const unsigned long long t0 = globaltimer();
      unsigned spins = 0;
      while (*(volatile unsigned*)(sync + 16) == g0) {
        if (++spins == 256u) {
          spins = 0;
          if ((long long)(globaltimer() - t0) > p.timeout_ns)
            fail_timeout(p.status, (int)blockIdx.y, kOpTopkSelect,
                         (int)blockIdx.x, where, g0);
        }
      }
    }
    *gen = g0 + 1u;
    __threadfence();
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kNT) topk_select_kernel(SelectParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ uint32_t ws[kWarps + 1];
  __shared__ uint32_t found[3];
  const int row = blockIdx.y, g = blockIdx.x, G = gridDim.x;
  const int tid = threadIdx.x;
  const bool sorted = (p.mode & JT_TOPK_SORTED) != 0;
  const int k = p.k;
  const int base = g * p.chunk;
  const int cnt = min(p.chunk, p.n - base);
  const int region = (max(p.chunk * 4, sorted ? k * 8 : 0) + 15) & ~15;
  uint32_t* keys = reinterpret_cast<uint32_t*>(smem);
  uint32_t* hist = reinterpret_cast<uint32_t*>(smem + region);
  uint32_t* ghist = p.hist + (size_t)row * kLevels * kBins;
  uint32_t* counts = p.counts + (size_t)row * 2 * kMaxCtas;
  unsigned* sync = p.sync + row * kSyncWords;

  // stable until this CTA arrives at its first barrier (see row_barrier)
  unsigned gen = threadIdx.x == 0 ? *(volatile unsigned*)(sync + 16) : 0u;
  const float* src = p.scores + (size_t)row * p.n + base;
  const bool canonical_zero = (p.mode & JT_TOPK_CANONICAL_ZERO) != 0;
  for (int i = tid; i < cnt; i += kNT) keys[i] = order_key(src[i], canonical_zero);
  __syncthreads();

  // ---- the k-th largest key, digit by digit
  const int vpt = (cnt + kNT - 1) / kNT;  // same trip count for every thread
  uint32_t pre = 0, need = (uint32_t)k;
  int lo = 32;
  for (int lvl = 0; lvl < kLevels; ++lvl) {
    const int shift = lvl == 0 ? 21 : (lvl == 1 ? 10 : 0);
    const int nb = 1 << (lo - shift);
    for (int b = tid; b < nb; b += kNT) hist[b] = 0;
    __syncthreads();
    for (int j = 0; j < vpt; ++j) {
      const int i = j * kNT + tid;
      uint32_t d = 0xffffffffu;  // not counted
      if (i < cnt && in_bucket(keys[i], pre, lo)) d = (keys[i] >> shift) & (nb - 1);
      // one shared atomic per distinct digit in the warp: top digits of
      // similar scores collide a lot
      const unsigned peers = __match_any_sync(0xffffffffu, d);
      if (d != 0xffffffffu && (tid & 31) == __ffs(peers) - 1)
        atomicAdd(&hist[d], (uint32_t)__popc(peers));
    }
    __syncthreads();
    for (int b = tid; b < nb; b += kNT)
      if (hist[b] != 0) atomicAdd(&ghist[lvl * kBins + b], hist[b]);
    row_barrier(p, sync, lvl, &gen, false);
    for (int b = tid; b < nb; b += kNT) hist[b] = __ldcg(&ghist[lvl * kBins + b]);
    __syncthreads();
    find_digit(hist, nb, need, ws, found);
    const uint32_t above = found[1], in_d = found[2];
    pre = (pre << (lo - shift)) | found[0];
    lo = shift;
    need -= above;
    if (in_d == need) break;  // the whole bucket is taken
  }

  // ---- how many selected entries lie before this chunk
  uint32_t n_gt = 0, n_eq = 0;
  for (int i = tid; i < cnt; i += kNT) {
    n_gt += above_bucket(keys[i], pre, lo);
    n_eq += in_bucket(keys[i], pre, lo);
  }
  uint32_t tot_gt, tot_eq;
  block_exclusive_scan(n_gt, ws, &tot_gt);
  block_exclusive_scan(n_eq, ws, &tot_eq);
  if (tid == 0) {
    counts[g] = tot_gt;
    counts[kMaxCtas + g] = tot_eq;
  }
  row_barrier(p, sync, kLevels, &gen, !sorted);
  // every CTA has read the histograms: clear this CTA's share for the next call
  for (int b = g * kNT + tid; b < kLevels * kBins; b += G * kNT) ghist[b] = 0;
  uint32_t gt_before = 0, eq_before = 0;
  for (int c = tid; c < g; c += kNT) {
    gt_before += __ldcg(&counts[c]);
    eq_before += __ldcg(&counts[kMaxCtas + c]);
  }
  block_exclusive_scan(gt_before, ws, &gt_before);
  block_exclusive_scan(eq_before, ws, &eq_before);
  // bucket entries are taken in position order: the first `need` of the row
  const uint32_t offset = gt_before + min(eq_before, need);
  const uint32_t take = need > eq_before ? min(need - eq_before, tot_eq) : 0u;

  // ---- write this chunk's selected entries in position order; each thread
  // walks a contiguous run of the chunk
  const int r0 = min(cnt, tid * vpt), r1 = min(cnt, r0 + vpt);
  uint32_t my_eq = 0;
  for (int i = r0; i < r1; ++i) my_eq += in_bucket(keys[i], pre, lo);
  uint32_t unused;
  const uint32_t eq0 = block_exclusive_scan(my_eq, ws, &unused);
  uint32_t my_sel = 0, e = eq0;
  for (int i = r0; i < r1; ++i) {
    if (above_bucket(keys[i], pre, lo)) {
      ++my_sel;
    } else if (in_bucket(keys[i], pre, lo)) {
      my_sel += e < take;
      ++e;
    }
  }
  uint32_t slot = offset + block_exclusive_scan(my_sel, ws, &unused);
  e = eq0;
  int32_t* oi = p.out_idx + (size_t)row * k;
  float* ov = p.out_val + (size_t)row * k;
  unsigned long long* stage = p.stage + (size_t)row * JT_TOPK_MAX_K;
  for (int i = r0; i < r1; ++i) {
    bool sel = above_bucket(keys[i], pre, lo);
    if (!sel && in_bucket(keys[i], pre, lo)) sel = e++ < take;
    if (!sel) continue;
    if (sorted) {
      stage[slot] = ((unsigned long long)keys[i] << 32) | (uint32_t)(base + i);
    } else {
      oi[slot] = base + i;
      ov[slot] = key_value(keys[i]);
    }
    ++slot;
  }
  if (!sorted) return;

  // ---- sorted output: rank this CTA's share of the k staged entries
  row_barrier(p, sync, kLevels + 1, &gen, true);
  unsigned long long* st = reinterpret_cast<unsigned long long*>(smem);
  const uint32_t* st_key = reinterpret_cast<const uint32_t*>(smem) + 1;  // high words
  for (int i = tid; i < k; i += kNT) st[i] = __ldcg(&stage[i]);
  const int per = (k + G - 1) / G;
  const int s0 = min(k, g * per), ne = min(k, s0 + per) - s0;
  uint32_t* rank = hist + kBins;
  for (int i = tid; i < ne; i += kNT) rank[i] = 0;
  __syncthreads();
  if (ne == 0) return;
  // threads split the k entries to compare against into `parts` ranges
  const int parts = max(1, kNT / ne);
  for (int w = tid; w < ne * parts; w += kNT) {
    const int el = w % ne, part = w / ne;
    const int slot_x = s0 + el;
    const uint32_t kx = st_key[2 * slot_x];
    const int y0 = (int)((long long)k * part / parts);
    const int y1 = (int)((long long)k * (part + 1) / parts);
    // staged entries are in position order: those before slot_x win ties
    const int a = min(max(slot_x, y0), y1);
    const int b = max(a, min(slot_x + 1, y1));
    uint32_t c = 0;
    for (int y = y0; y < a; ++y) c += st_key[2 * y] >= kx;
    for (int y = b; y < y1; ++y) c += st_key[2 * y] > kx;
    atomicAdd(&rank[el], c);
  }
  __syncthreads();
  for (int i = tid; i < ne; i += kNT) {
    const unsigned long long v = st[s0 + i];
    const uint32_t r = rank[i];
    oi[r] = (int32_t)(uint32_t)v;
    ov[r] = key_value((uint32_t)(v >> 32));
  }
}

struct Scratch {
  bool ready;
  uint32_t* hist;
  uint32_t* counts;
  unsigned long long* stage;
  unsigned* sync;
  JtStatus* status;
  long long timeout_ns;
  int sms;
  int max_smem;
  bool cooperative;  // JTILERT_TOPK_COOPERATIVE=0: plain launches
};

constexpr int kMaxDevices = 64;
Scratch g_scratch[kMaxDevices];
std::mutex g_mu;

struct Plan {
  int ctas;   // G, CTAs per row
  int chunk;  // positions per CTA
  size_t smem;
};

// Grid for T rows of n scores: `ctas` CTAs per row (0: about one CTA per SM
// in all), chunks a multiple of 32 positions, at most kMaxChunk; false if the
// grid cannot be co-resident.
bool make_plan(const Scratch& s, int T, int n, int k, int mode, int ctas,
               Plan* p) {
  if (T < 1 || T > JT_TOPK_MAX_ROWS || n < 1 || k < 1 || k > n ||
      k > JT_TOPK_MAX_K || ctas < 0)
    return false;
  int G = ctas > 0 ? ctas : std::max(1, s.sms / T);
  G = std::min(G, (n + 31) / 32);
  int chunk = (n + G - 1) / G;
  chunk = std::min(kMaxChunk, (chunk + 31) / 32 * 32);
  G = (n + chunk - 1) / chunk;
  if (G > kMaxCtas) return false;
  const bool sorted = (mode & JT_TOPK_SORTED) != 0;
  const size_t region = ((size_t)std::max(chunk * 4, sorted ? k * 8 : 0) + 15) & ~(size_t)15;
  const size_t smem = region + kBins * 4 + (sorted ? (size_t)((k + G - 1) / G) * 4 : 0);
  if (smem > (size_t)s.max_smem) return false;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, topk_select_kernel,
                                                    kNT, smem) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  if ((long long)T * G > (long long)per_sm * s.sms) return false;
  p->ctas = G;
  p->chunk = chunk;
  p->smem = smem;
  return true;
}

}  // namespace
}  // namespace jt

using jt::g_scratch;

extern "C" int jt_topk_prepare(int dev, int64_t timeout_ms, char* err,
                               int errlen) {
  std::lock_guard<std::mutex> lock(jt::g_mu);
  if (dev < 0 || dev >= jt::kMaxDevices) {
    if (err && errlen > 0) std::snprintf(err, (size_t)errlen, "bad device %d", dev);
    return -1;
  }
  jt::Scratch& s = g_scratch[dev];
  if (s.ready) return 0;
  int prev = 0;
  cudaGetDevice(&prev);
  const size_t hist_b = (size_t)JT_TOPK_MAX_ROWS * jt::kLevels * jt::kBins * 4;
  const size_t counts_b = (size_t)JT_TOPK_MAX_ROWS * 2 * jt::kMaxCtas * 4;
  const size_t stage_b = (size_t)JT_TOPK_MAX_ROWS * JT_TOPK_MAX_K * 8;
  const size_t sync_b = (size_t)JT_TOPK_MAX_ROWS * jt::kSyncWords * 4;
  void* buf = nullptr;
  cudaError_t e = cudaSetDevice(dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&s.sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess)
    e = cudaDeviceGetAttribute(&s.max_smem,
                               cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  // the kernel also has a few bytes of static shared memory
  if (e == cudaSuccess) s.max_smem -= 1024;
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(reinterpret_cast<const void*>(&jt::topk_select_kernel),
                             cudaFuncAttributeMaxDynamicSharedMemorySize,
                             s.max_smem);
  if (e == cudaSuccess) e = cudaMalloc(&buf, hist_b + counts_b + stage_b + sync_b);
  if (e == cudaSuccess) e = cudaMemset(buf, 0, hist_b + counts_b + stage_b + sync_b);
  if (e == cudaSuccess)
    e = cudaHostAlloc((void**)&s.status, sizeof(JtStatus),
                      cudaHostAllocMapped | cudaHostAllocPortable);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (buf != nullptr) cudaFree(buf);
    if (err && errlen > 0)
      std::snprintf(err, (size_t)errlen, "topk prepare device %d: %s", dev,
                    cudaGetErrorString(e));
    return -1;
  }
  std::memset((void*)s.status, 0, sizeof(JtStatus));
  char* b = static_cast<char*>(buf);
  s.hist = reinterpret_cast<uint32_t*>(b);
  s.stage = reinterpret_cast<unsigned long long*>(b + hist_b);
  s.counts = reinterpret_cast<uint32_t*>(b + hist_b + stage_b);
  s.sync = reinterpret_cast<unsigned*>(b + hist_b + stage_b + counts_b);
  s.timeout_ns = (long long)timeout_ms * 1000000LL;
  // a way out should a driver refuse cooperative kernels in CUDA graphs; the
  // grid still fits on the GPU (make_plan), so it runs co-resident when the
  // GPU has nothing else running, and a barrier wait times out otherwise
  const char* coop = std::getenv("JTILERT_TOPK_COOPERATIVE");
  s.cooperative = coop == nullptr || std::strcmp(coop, "0") != 0;
  s.ready = true;
  return 0;
}

extern "C" int jt_topk_status(int dev, JtStatus* out) {
  if (dev < 0 || dev >= jt::kMaxDevices || !g_scratch[dev].ready || out == nullptr)
    return -1;
  std::memcpy(out, (const void*)g_scratch[dev].status, sizeof(JtStatus));
  return 0;
}

extern "C" int jt_topk_select_ctas(int dev, int T, int n, int k, int mode,
                                   int ctas) {
  if (dev < 0 || dev >= jt::kMaxDevices || !g_scratch[dev].ready) return -1;
  jt::Plan p;
  return jt::make_plan(g_scratch[dev], T, n, k, mode, ctas, &p) ? p.ctas : -1;
}

extern "C" cudaError_t jt_topk_select(int dev, cudaStream_t stream,
                                      const float* scores, int32_t* out_idx,
                                      float* out_val, int T, int n, int k,
                                      int mode, int ctas) {
  if (dev < 0 || dev >= jt::kMaxDevices || !g_scratch[dev].ready)
    return cudaErrorInvalidResourceHandle;
  const jt::Scratch& s = g_scratch[dev];
  jt::Plan plan;
  if (!jt::make_plan(s, T, n, k, mode, ctas, &plan))
    return cudaErrorInvalidValue;
  jt::SelectParams p;
  p.scores = scores;
  p.out_idx = out_idx;
  p.out_val = out_val;
  p.hist = s.hist;
  p.counts = s.counts;
  p.stage = s.stage;
  p.sync = s.sync;
  p.status = s.status;
  p.timeout_ns = s.timeout_ns;
  p.n = n;
  p.k = k;
  p.chunk = plan.chunk;
  p.mode = mode;
  // cooperative: the row barriers need every CTA resident
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)plan.ctas, (unsigned)T, 1);
  cfg.blockDim = dim3(jt::kNT, 1, 1);
  cfg.dynamicSmemBytes = plan.smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = s.cooperative ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, jt::topk_select_kernel, p);
}
