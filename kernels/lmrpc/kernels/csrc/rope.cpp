// RoPE and the cache writes of a step's keys and values (attention.h).
#include <cstdint>

#include "attention.h"
#include "attention_cache.h"
#include "common.h"

namespace lmrpc {

namespace {

using namespace attention_detail;

// One head: optional RMSNorm, then x * cos + rotate_half(x) * sin (sin signed), into out [head_dim]. `scratch`
// [head_dim] holds the normed head. Two loops (the halves swap) instead of an index modulo: they vectorize.
void rotate_head(const float* x, int64_t hd, const float* cos, const float* sin, const float* norm, float eps,
                 float* scratch, float* out) {
  if (norm != nullptr) {
    const float inv = row_inv_rms(x, hd, eps);
    for (int64_t i = 0; i < hd; ++i) scratch[i] = x[i] * inv * norm[i];
    x = scratch;
  }
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = std::fma(x[i + half], sin[i], x[i] * cos[i]);
  for (int64_t i = half; i < hd; ++i) out[i] = std::fma(x[i - half], sin[i], x[i] * cos[i]);
}

template <typename S>
void rope_store_impl(const RopeArgs& a, const CacheView& c) {
  const int64_t hd = c.head_dim, kvh = c.kv_heads, P = c.page_size;
  const int64_t parts = a.t >= 16 ? omp_get_max_threads() : 1;
#pragma omp parallel num_threads(parts)
  {
    AlignedBuffer<float> buffer;
    buffer.resize(2 * hd);
    float* scratch = buffer.data();
    float* k = buffer.data() + hd;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < a.t; ++t) {
      const float* row = a.qkv + t * a.qkv_stride;
      const float* cos = a.cos + a.positions[t] * hd;
      const float* sin = a.sin + a.positions[t] * hd;
      for (int64_t h = 0; h < a.heads; ++h) {
        rotate_head(row + h * hd, hd, cos, sin, a.q_norm, a.eps, scratch, a.q_out + (t * a.heads + h) * hd);
      }
      const int64_t page = a.slots[t] / P, off = a.slots[t] % P;
      for (int64_t h = 0; h < kvh; ++h) {
        rotate_head(row + (a.heads + h) * hd, hd, cos, sin, a.k_norm, a.eps, scratch, k);
        S* kb = key_block<S>(c, page, h);
        for (int64_t i = 0; i < hd; ++i) kb[i * P + off] = store_as<S>(k[i]);
        const float* v = row + (a.heads + kvh + h) * hd;
        S* vb = value_block<S>(c, page, h) + off * hd;
        for (int64_t i = 0; i < hd; ++i) vb[i] = store_as<S>(v[i]);
      }
    }
  }
}

}  // namespace

void rope_store(const RopeArgs& a, const CacheView& cache) {
  if (cache.bf16) rope_store_impl<uint16_t>(a, cache); else rope_store_impl<float>(a, cache);
}

}  // namespace lmrpc
