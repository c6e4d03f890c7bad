// The MoE router's selection (DeepSeek-V3 / GLM-5 "noaux_tc") in one launch:
// from fp32 logits [T, E] to (weights [T, k] fp32, expert ids [T, k] int32),
// exactly jtilert.ops.reference.select_experts:
//   s = sigmoid(logit), b = s + bias[layer]; with n_group > 1 each group of
//   E / n_group experts scores the sum of its two largest b, the topk_group
//   best groups stay and the other experts' b become -inf; the k largest b are
//   chosen, in descending order, ties to the lower index; their unbiased s,
//   normalised to sum 1 (norm != 0), times `scaling`, are the weights.
// One CTA per token row, one thread per expert (E <= 1024). Ranks are counted
// over every pair (E <= 1024 comparisons per thread, from shared memory): no
// sort, and each rank's expert writes its own output slot.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "jtilert/engine.h"

namespace jt {
namespace {

// Places before v in descending order among vals[0..n) (ties: lower index first).
__device__ __forceinline__ int rank_of(const float* vals, int n, float v, int i) {
  int r = 0;
  for (int j = 0; j < n; ++j) {
    const float x = vals[j];
    r += (x > v) || (x == v && j < i);
  }
  return r;
}

__global__ void route_select_kernel(const float* __restrict__ logits,
                                    const float* __restrict__ bias,
                                    const int32_t* __restrict__ layer, int E,
                                    int n_group, int topk_group, int k,
                                    float scaling, int norm, float* out_w,
                                    int32_t* out_ids) {
  extern __shared__ float sm[];
  float* biased = sm;              // [E]
  float* group_score = sm + E;     // [n_group]
  float* chosen = group_score + n_group;  // [k]: s of the expert at each rank
  const int t = blockIdx.x, i = threadIdx.x;
  const float s = 1.f / (1.f + expf(-logits[(size_t)t * E + i]));
  float b = s + bias[(size_t)layer[0] * E + i];
  biased[i] = b;
  __syncthreads();
  if (n_group > 1) {
    const int gs = E / n_group, g = i / gs;
    if (i < n_group) {  // the sum of group i's two largest (ties need no order)
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
    if (rank_of(group_score, n_group, group_score[g], g) >= topk_group) b = -INFINITY;
    biased[i] = b;
    __syncthreads();
  }
  const int r = rank_of(biased, E, b, i);
  if (r < k) {
    out_ids[(size_t)t * k + r] = i;
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
    out_w[(size_t)t * k + i] = w * scaling;
  }
}

}  // namespace
}  // namespace jt

extern "C" cudaError_t jt_route_select(cudaStream_t stream, const float* logits,
                                       const float* bias, const int32_t* layer,
                                       int T, int E, int n_group,
                                       int topk_group, int k, float scaling,
                                       int norm, float* out_w,
                                       int32_t* out_ids) {
  if (T < 1 || E < 1 || E > JT_ROUTE_MAX_EXPERTS || k < 1 || k > E ||
      n_group < 1 || E % n_group != 0 || topk_group < 1 || topk_group > n_group)
    return cudaErrorInvalidValue;
  const size_t smem = (size_t)(E + n_group + k) * sizeof(float);
  jt::route_select_kernel<<<T, E, smem, stream>>>(logits, bias, layer, E, n_group,
                                                  topk_group, k, scaling, norm,
                                                  out_w, out_ids);
  return cudaGetLastError();
}
