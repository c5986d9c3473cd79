// Paged attention of few queries (a decode step of one or two sequences) on AVX512: the threads share each kv head.
//
// With more threads than (query, kv head) pairs, attention.cpp would split a kv head's query heads between items, and
// every item read the head's keys and values again: at one stream over 1,040 keys (the bundled model, 3 query heads
// a kv head) a quarter of a decode step. Here the threads share a head's work instead, in three passes: the scores
// of disjoint runs of keys, all query heads of the kv head at once; each query head's softmax; the values, disjoint
// slices of head_dim, all query heads at once. So each key and value is read once per kv head. A number comes from
// the same operations as in attention.cpp (a key's score is the same whichever run computes it; a lane of the value
// sums takes the keys in order whichever slice it is in), so a query gives the same bits here as there.
#include <algorithm>
#include <cassert>
#include <cstdint>
#include <vector>

#include "attention.h"
#include "attention_cache.h"
#include "common.h"

namespace lmrpc::attention_detail {

#if LMRPC_AVX512
namespace {

constexpr int64_t kSliceVectors = 2;  // 16-float vectors of head_dim per value item: a bf16 row's 64-byte line

// Where a step's queries keep their scores: query t's are [kv_heads][G][stride t] from at[t].
struct ScoreLayout {
  std::vector<int64_t> at;      // [t + 1] float offsets
  std::vector<int64_t> stride;  // [t] keys rounded up to 16
};

// out[g][16 i0 ... 16 (i0 + NV)) = (1 / total[g]) * sum_j w[g][j] v_j over those dims, keys in order, page by page
// (values_avx512 over the slice, then query_paged's scaling).
template <typename S, int G, int NV>
void value_slice(const float* w, int64_t stride, const float* totals, const CacheView& c, const int32_t* pages,
                 int64_t kvh, int64_t ctx, int64_t i0, float* const* out) {
  const int64_t hd = c.head_dim, P = c.page_size, n = (ctx + P - 1) / P;
  alignas(64) float sums[kMaxGroup * 128];  // [G][hd]: this slice's lanes only are used
  for (int g = 0; g < G; ++g) std::fill(sums + g * hd + 16 * i0, sums + g * hd + 16 * (i0 + NV), 0.0f);
  for (int64_t p = 0; p < n; ++p) {
    const char* next = p + 1 < n ? block_bytes(value_block<S>(c, pages[p + 1], kvh)) : nullptr;
    values_avx512<S, G, NV>(w, stride, c, pages, kvh, p * P, std::min(ctx, (p + 1) * P), sums, next, i0);
  }
  for (int g = 0; g < G; ++g) {
    const __m512 vinv = _mm512_set1_ps(1.0f / totals[g]);
    for (int i = 0; i < NV; ++i) {
      const int64_t at = 16 * (i0 + i);
      _mm512_storeu_ps(out[g] + at, _mm512_mul_ps(_mm512_loadu_ps(sums + g * hd + at), vinv));
    }
  }
}

template <typename S, int G>
void few(const AttentionArgs& a, const CacheView& c, int threads) {
  const int64_t kvh = c.kv_heads, hd = c.head_dim, P = c.page_size, heads = a.heads;
  // The calling thread's, reused from layer to layer; the team reads them through lay, sc and tot below.
  thread_local ScoreLayout layout;
  thread_local std::vector<float> scores, totals;
  layout.at.assign(a.t + 1, 0);
  layout.stride.resize(a.t);
  int64_t most_pages = 0;
  for (int64_t t = 0; t < a.t; ++t) {
    layout.stride[t] = (a.token_ctx[t] + 15) / 16 * 16;
    layout.at[t + 1] = layout.at[t] + heads * layout.stride[t];
    most_pages = std::max<int64_t>(most_pages, (a.token_ctx[t] + P - 1) / P);
  }
  scores.resize(layout.at[a.t]);
  totals.resize(a.t * heads);
  // Runs of pages per (query, kv head) in the scores pass: enough items for every thread to take about four.
  const int64_t heads_total = a.t * kvh, runs = std::max<int64_t>(1, (4 * threads + heads_total - 1) / heads_total);
  const int64_t run_pages = std::max<int64_t>(1, (most_pages + runs - 1) / runs);
  const int64_t slices = hd / (16 * kSliceVectors);
  const ScoreLayout* lay = &layout;
  float* sc = scores.data();
  float* tot = totals.data();
#pragma omp parallel num_threads(threads)
  {
    // Scores: item = (query, kv head, run of pages).
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < heads_total * runs; ++item) {
      const int64_t t = item / (kvh * runs), h = item / runs % kvh, run = item % runs;
      const int64_t ctx = a.token_ctx[t], n = (ctx + P - 1) / P;
      const int32_t* pages = a.block_table + static_cast<int64_t>(a.token_seq[t]) * a.table_width;
      const float* q[kMaxGroup];
      for (int g = 0; g < G; ++g) q[g] = a.q + (t * heads + h * G + g) * hd;
      float* out = sc + lay->at[t] + h * G * lay->stride[t];
      for (int64_t p = run * run_pages; p < std::min(n, (run + 1) * run_pages); ++p) {
        const char* next = p + 1 < n ? block_bytes(key_block<S>(c, pages[p + 1], h)) : nullptr;
        scores_avx512<S, G>(q, c, pages, h, p * P, std::min(ctx, (p + 1) * P), a.scale, out, lay->stride[t], next);
      }
    }
    // Softmax: item = (query, query head).
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < a.t * heads; ++item) {
      const int64_t t = item / heads, head = item % heads;
      tot[item] = softmax_weights(sc + lay->at[t] + head * lay->stride[t], a.token_ctx[t]);
    }
    // Values: item = (query, kv head, slice of head_dim).
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < heads_total * slices; ++item) {
      const int64_t t = item / (kvh * slices), h = item / slices % kvh, slice = item % slices;
      const int32_t* pages = a.block_table + static_cast<int64_t>(a.token_seq[t]) * a.table_width;
      float* out[kMaxGroup];
      for (int g = 0; g < G; ++g) out[g] = a.out + (t * heads + h * G + g) * hd;
      value_slice<S, G, kSliceVectors>(sc + lay->at[t] + h * G * lay->stride[t], lay->stride[t],
                                       tot + t * heads + h * G, c, pages, h, a.token_ctx[t],
                                       slice * kSliceVectors, out);
    }
  }
}

template <typename S>
void dispatch_few(const AttentionArgs& a, const CacheView& c, int groups, int threads) {
  switch (groups) {
    case 2: return few<S, 2>(a, c, threads);
    case 3: return few<S, 3>(a, c, threads);
    case 4: return few<S, 4>(a, c, threads);
    case 5: return few<S, 5>(a, c, threads);
    case 6: return few<S, 6>(a, c, threads);
    case 7: return few<S, 7>(a, c, threads);
    case 8: return few<S, 8>(a, c, threads);
  }
}

}  // namespace
#endif

bool attention_few_has_kernel(const CacheView& c, int groups, int threads) {
#if LMRPC_AVX512
  return (c.head_dim == 64 || c.head_dim == 128) && threads >= 2 && groups >= 2 && groups <= kMaxGroup;
#else
  (void)c, (void)groups, (void)threads;
  return false;
#endif
}

void attention_few(const AttentionArgs& a, const CacheView& c, int groups, int threads) {
  assert(attention_few_has_kernel(c, groups, threads));
#if LMRPC_AVX512
  if (c.bf16) dispatch_few<uint16_t>(a, c, groups, threads); else dispatch_few<float>(a, c, groups, threads);
#else
  (void)a;
#endif
}

}  // namespace lmrpc::attention_detail
