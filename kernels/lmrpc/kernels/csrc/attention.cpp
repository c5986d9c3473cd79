// Paged attention (see attention.h; RoPE and the cache writes: rope.cpp).
//
// Each query is computed on its own, in the same order whatever the batch, the chunk or the thread: scores of its
// keys in blocks of 16 (each a sum over head_dim, even and odd dimensions in two sums), the maximum, exp and a
// 16-lane sum of the weights added pairwise, then the values accumulated key by key. A prompt token computed in a
// long prefill chunk, alone, or as the last token after a prefix-cache hit gives the same bits.
#include "attention.h"

#include <algorithm>
#include <vector>

#include "attention_avx2.h"
#include "attention_cache.h"
#include "common.h"

namespace lmrpc {

namespace {

using namespace attention_detail;

// ---- attention of one query group (the query heads sharing one kv head) -------------------------------------

// scores[g][ctx] = scale * q_g . k_j for j < ctx (16 keys at a time; dims even/odd in two sums).
template <typename S>
void scores_generic(const float* const* q, int groups, const CacheView& c, const int32_t* pages, int64_t kvh,
                    int64_t ctx, float scale, float* scores, int64_t stride) {
  const int64_t hd = c.head_dim, P = c.page_size;
  for (int64_t base = 0; base < ctx; base += 16) {
    const S* kb = key_block<S>(c, pages[base / P], kvh) + base % P;
    for (int g = 0; g < groups; ++g) {
      float even[16] = {0}, odd[16] = {0};
      for (int64_t d = 0; d < hd; ++d) {
        float* acc = (d & 1) ? odd : even;
        for (int l = 0; l < 16; ++l) acc[l] = std::fma(q[g][d], load_as<S>(kb[d * P + l]), acc[l]);
      }
      for (int l = 0; l < 16 && base + l < ctx; ++l) scores[g * stride + base + l] = (even[l] + odd[l]) * scale;
    }
  }
}

#if LMRPC_AVX512
#endif

#if LMRPC_AVX512 || LMRPC_AVX2
// One query over kv heads [h0, h1), G query heads each (q[(h - h0) * kMaxGroup + g], out likewise), with the group
// size fixed at compile time so accumulators stay in registers. Pages are the outer loop: a page holds all kv
// heads' keys (and values) next to each other, so several heads read one contiguous run per page, which the
// hardware prefetcher follows, where one head reads a 2 KiB block and jumps. A sequence's pages lie anywhere in the
// pool, so each head's next block (its keys', then its values') is asked into L2 while the current one is read.
// Each head's sums still take its keys in order. `work` holds (h1 - h0) * G * (stride + head_dim + 1) floats. False
// when there is no specialization for the head width.
template <typename S, int G>
bool query_paged(const float* const* q, int64_t h0, int64_t h1, const CacheView& c, const int32_t* pages,
                 int64_t ctx, float scale, float* work, int64_t stride, float* const* out) {
  const int64_t hd = c.head_dim, P = c.page_size, nh = h1 - h0, n = (ctx + P - 1) / P;
#if LMRPC_AVX512
  if (hd != 64 && hd != 128) return false;
#else
  if (!attention_avx2::takes(hd)) return false;
#endif
  float* scores = work;                   // [nh][G][stride]
  float* sums = work + nh * G * stride;   // [nh][G][head_dim]
  float* totals = sums + nh * G * hd;     // [nh][G]
  // Block i of the read order (n key blocks, then n value blocks) of head h, or null past the end.
  auto block = [&](int64_t i, int64_t h) -> const char* {
    if (i < n) return block_bytes(key_block<S>(c, pages[i], h0 + h));
    return i < 2 * n ? block_bytes(value_block<S>(c, pages[i - n], h0 + h)) : nullptr;
  };
  for (int64_t p = 0; p < n; ++p) {
    const int64_t k0 = p * P, k1 = std::min(ctx, k0 + P);
    for (int64_t h = 0; h < nh; ++h) {
#if LMRPC_AVX512
      scores_avx512<S, G>(q + h * kMaxGroup, c, pages, h0 + h, k0, k1, scale, scores + h * G * stride, stride,
                          block(p + 1, h));
#else
      float* rows[G];
      for (int g = 0; g < G; ++g) rows[g] = scores + (h * G + g) * stride + k0;
      attention_avx2::page_scores<S, G>(q + h * kMaxGroup, key_block<S>(c, pages[p], h0 + h), k1 - k0, hd, P, scale,
                                        rows, block(p + 1, h));
#endif
    }
  }
  for (int64_t r = 0; r < nh * G; ++r) totals[r] = softmax_weights(scores + r * stride, ctx);
  std::fill(sums, sums + nh * G * hd, 0.0f);
  for (int64_t p = 0; p < n; ++p) {
    const int64_t k0 = p * P, k1 = std::min(ctx, k0 + P);
    for (int64_t h = 0; h < nh; ++h) {
      float* w = scores + h * G * stride;
      const char* next = block(n + p + 1, h);
#if LMRPC_AVX512
      if (hd == 64) values_avx512<S, G, 4>(w, stride, c, pages, h0 + h, k0, k1, sums + h * G * hd, next);
      else values_avx512<S, G, 8>(w, stride, c, pages, h0 + h, k0, k1, sums + h * G * hd, next);
#else
      const float* weights[G];
      float* running[G];
      for (int g = 0; g < G; ++g) {
        weights[g] = w + g * stride + k0;
        running[g] = sums + (h * G + g) * hd;
      }
      attention_avx2::page_values<S, G>(weights, value_block<S>(c, pages[p], h0 + h), k1 - k0, hd, running, next);
#endif
    }
  }
  for (int64_t r = 0; r < nh * G; ++r) {
    const float inv = 1.0f / totals[r];
    const float* s = sums + r * hd;
    float* o = out[r / G * kMaxGroup + r % G];
#if LMRPC_AVX512
    const __m512 vinv = _mm512_set1_ps(inv);
    for (int64_t i = 0; i < hd; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), vinv));
#else
    attention_avx2::scaled_row(s, hd, inv, o);
#endif
  }
  return true;
}

template <typename S>
bool dispatch_query(int groups, const float* const* q, int64_t h0, int64_t h1, const CacheView& c,
                    const int32_t* pages, int64_t ctx, float scale, float* work, int64_t stride, float* const* out) {
  switch (groups) {
    case 1: return query_paged<S, 1>(q, h0, h1, c, pages, ctx, scale, work, stride, out);
    case 2: return query_paged<S, 2>(q, h0, h1, c, pages, ctx, scale, work, stride, out);
    case 3: return query_paged<S, 3>(q, h0, h1, c, pages, ctx, scale, work, stride, out);
    case 4: return query_paged<S, 4>(q, h0, h1, c, pages, ctx, scale, work, stride, out);
    case 5: return query_paged<S, 5>(q, h0, h1, c, pages, ctx, scale, work, stride, out);
    case 6: return query_paged<S, 6>(q, h0, h1, c, pages, ctx, scale, work, stride, out);
    case 7: return query_paged<S, 7>(q, h0, h1, c, pages, ctx, scale, work, stride, out);
    case 8: return query_paged<S, 8>(q, h0, h1, c, pages, ctx, scale, work, stride, out);
    default: return false;
  }
}
#endif

// out[g][:] = sum_j w[g][j] v_j * (1 / total[g]), keys in order.
template <typename S>
void weighted_values(const float* w, int groups, int64_t stride, const float* totals, const CacheView& c,
                     const int32_t* pages, int64_t kvh, int64_t ctx, float* const* out) {
  const int64_t hd = c.head_dim, P = c.page_size;
  for (int g = 0; g < groups; ++g) {
    std::vector<float> acc(hd, 0.0f);
    for (int64_t j = 0; j < ctx; ++j) {
      const S* v = value_block<S>(c, pages[j / P], kvh) + (j % P) * hd;
      for (int64_t i = 0; i < hd; ++i) acc[i] = std::fma(w[g * stride + j], load_as<S>(v[i]), acc[i]);
    }
    const float inv = 1.0f / totals[g];
    for (int64_t i = 0; i < hd; ++i) out[g][i] = acc[i] * inv;
  }
}

// How a step's queries are shared out as work items: each item is one query over `span` kv heads and one of `splits`
// parts of their query heads.
struct Items {
  int64_t span;
  int splits;
};

Items items_of(int64_t t, int64_t kvh, int groups, int64_t threads) {
  // A work item is one query over `span` kv heads: all of them when there are queries enough to share out (a
  // contiguous read per page), else one (a single decode query still uses every thread). Either way each head's
  // numbers come from the same operations in the same order.
  const int64_t span = t >= 4 * threads ? kvh : 1;
  // Few items (a decode step of one or two sequences: 3 kv heads on 2 threads left one waiting a third of the
  // time): each kv head's query heads are split into `splits` parts too, one item each (each reading the head's keys
  // and values).
  const int64_t few = t * (kvh / span);
  const int splits = span == 1 && few < 4 * threads
                         ? static_cast<int>(std::min<int64_t>(groups, (4 * threads + few - 1) / few)) : 1;
  return {span, splits};
}

// The route for those items: where query heads would be split between items, on AVX512 the threads share each kv
// head instead, so its keys and values are read once, not once per split.
AttentionRoute route_of(const Items& items, const CacheView& c, int groups, int64_t threads) {
  return items.splits > 1 && attention_few_has_kernel(c, groups, static_cast<int>(threads))
             ? AttentionRoute::kFewQueries : AttentionRoute::kQueries;
}

template <typename S>
void attention_impl(const AttentionArgs& a, const CacheView& c) {
  const int64_t kvh = c.kv_heads, hd = c.head_dim;
  const int groups = static_cast<int>(a.heads / kvh);
  const int64_t threads = omp_get_max_threads();
  const Items shared = items_of(a.t, kvh, groups, threads);
  if (route_of(shared, c, groups, threads) == AttentionRoute::kFewQueries) {
    attention_few(a, c, groups, static_cast<int>(threads));
    return;
  }
  const auto [span, splits] = shared;
  const int64_t per_query = kvh / span * splits;
  const int64_t items = a.t * per_query;
  const int64_t parts = std::min<int64_t>(threads, items);
#pragma omp parallel num_threads(parts)
  {
    std::vector<float> work;
    std::vector<const float*> q(span * kMaxGroup);
    std::vector<float*> out(span * kMaxGroup);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t t = item / per_query, h0 = item % per_query / splits * span;
      int64_t g_begin, g_end;  // this item's query heads of each kv head
      split_range(groups, splits, static_cast<int>(item % splits), &g_begin, &g_end);
      const int64_t ctx = a.token_ctx[t];
      const int32_t* pages = a.block_table + static_cast<int64_t>(a.token_seq[t]) * a.table_width;
      const int64_t stride = (ctx + 15) / 16 * 16;
      work.resize(span * kMaxGroup * (stride + hd + 1));
      for (int g0 = static_cast<int>(g_begin); g0 < g_end; g0 += kMaxGroup) {
        const int gn = std::min<int>(kMaxGroup, static_cast<int>(g_end) - g0);
        for (int64_t h = 0; h < span; ++h) {
          for (int g = 0; g < gn; ++g) {
            const int64_t head = (h0 + h) * groups + g0 + g;
            q[h * kMaxGroup + g] = a.q + (t * a.heads + head) * hd;
            out[h * kMaxGroup + g] = a.out + t * a.heads * hd + head * hd;
          }
        }
#if LMRPC_AVX512 || LMRPC_AVX2
        if (dispatch_query<S>(gn, q.data(), h0, h0 + span, c, pages, ctx, a.scale, work.data(), stride, out.data()))
          continue;
#endif
        for (int64_t h = 0; h < span; ++h) {
          float* scores = work.data();
          float totals[kMaxGroup];
          scores_generic<S>(q.data() + h * kMaxGroup, gn, c, pages, h0 + h, ctx, a.scale, scores, stride);
          for (int g = 0; g < gn; ++g) totals[g] = softmax_weights(scores + g * stride, ctx);
          weighted_values<S>(scores, gn, stride, totals, c, pages, h0 + h, ctx, out.data() + h * kMaxGroup);
        }
      }
    }
  }
}

}  // namespace

AttentionRoute attention_route(int64_t t, int64_t heads, const CacheView& cache, int64_t threads) {
  const int groups = static_cast<int>(heads / cache.kv_heads);
  return route_of(items_of(t, cache.kv_heads, groups, threads), cache, groups, threads);
}

void paged_attention(const AttentionArgs& a, const CacheView& cache) {
  if (a.t == 0) return;
  if (cache.bf16) attention_impl<uint16_t>(a, cache); else attention_impl<float>(a, cache);
}

}  // namespace lmrpc
