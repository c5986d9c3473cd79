// Paged attention and RoPE + cache writes (see attention.h).
//
// Each query is computed on its own, in the same order whatever the batch, the chunk or the thread: scores of its
// keys in blocks of 16 (each a sum over head_dim, even and odd dimensions in two sums), the maximum, exp and a
// 16-lane sum of the weights added pairwise, then the values accumulated key by key. A prompt token computed in a
// long prefill chunk, alone, or as the last token after a prefix-cache hit gives the same bits.
#include "attention.h"

#include <algorithm>
#include <vector>

#include "attention_avx2.h"
#include "common.h"

namespace lmrpc {

namespace {

// ---- cache access ----------------------------------------------------------------------------------------------

template <typename S>
inline S* key_block(const CacheView& c, int64_t page, int64_t kvh) {  // [head_dim][P]
  return static_cast<S*>(c.keys) + (page * c.kv_heads + kvh) * c.head_dim * c.page_size;
}

template <typename S>
inline S* value_block(const CacheView& c, int64_t page, int64_t kvh) {  // [P][head_dim]
  return static_cast<S*>(c.values) + (page * c.kv_heads + kvh) * c.page_size * c.head_dim;
}

template <typename S>
inline const char* block_bytes(const S* block) {
  return reinterpret_cast<const char*>(block);
}

template <typename S>
inline S store_as(float v) {
  if constexpr (sizeof(S) == 2) return f32_to_bf16(v); else return v;
}

template <typename S>
inline float load_as(S v) {
  if constexpr (sizeof(S) == 2) return bf16_to_f32(v); else return v;
}

// ---- RoPE ----------------------------------------------------------------------------------------------------

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

// ---- attention of one query group (the query heads sharing one kv head) -------------------------------------

constexpr int kMaxGroup = 8;  // query heads per kv head handled in registers

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

float softmax_weights(float* s, int64_t ctx);

#if LMRPC_AVX512
template <typename S>
inline __m512 load16(const S* p) {
  if constexpr (sizeof(S) == 2) return load_bf16x16(p); else return _mm512_loadu_ps(p);
}

// scores[g][j] = scale * q_g . k_j for keys j in [k0, k1), k0 a multiple of 16 (16 keys at a time, dims even/odd in
// two sums): the same operations for a key whichever range it is computed in. `next`, when not null, is the block
// this head reads next (the sequence's next key page, or after the last its first value page), asked into L2 a line
// per step of the last 16 keys: a sequence's pages lie anywhere in the pool, where the hardware prefetchers, which
// follow runs of addresses, cannot guess the next one. Measured here, 30 layers of 32 decode queries over ~192 keys
// (medians of 30 passes, the variants interleaved in one run): pages shuffled, 12.3 ms without, 10.4 into L1 (T0),
// 7.2 into L2 (T1); pages in order, 6.4, 6.5 and 5.9. Into L1 they hold the miss buffers the loads need. Fetching
// the first value page too: 6.3 against 6.5 shuffled, 5.5 against 5.7 in order. A prefetch reads nothing into a
// result.
template <typename S, int G>
void scores_avx512(const float* const* q, const CacheView& c, const int32_t* pages, int64_t kvh, int64_t k0,
                   int64_t k1, float scale, float* scores, int64_t stride, const char* next) {
  const int64_t hd = c.head_dim, P = c.page_size;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t base = k0; base < k1; base += 16) {
    const S* kb = key_block<S>(c, pages[base / P], kvh) + base % P;
    const char* ahead = k1 - base <= 16 ? next : nullptr;  // the last 16 keys of the page
    __m512 acc[G][2];
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < hd; d += 2) {
      if (ahead != nullptr) _mm_prefetch(ahead + d * P * sizeof(S), _MM_HINT_T1);
      const __m512 k0v = load16<S>(kb + d * P), k1v = load16<S>(kb + (d + 1) * P);
      for (int g = 0; g < G; ++g) {
        acc[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[g][d]), k0v, acc[g][0]);
        acc[g][1] = _mm512_fmadd_ps(_mm512_set1_ps(q[g][d + 1]), k1v, acc[g][1]);
      }
    }
    const int64_t n = std::min<int64_t>(16, k1 - base);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g) {
      _mm512_mask_storeu_ps(scores + g * stride + base, mask,
                            _mm512_mul_ps(_mm512_add_ps(acc[g][0], acc[g][1]), vscale));
    }
  }
}

// sums[g][:] += w[g][j] v_j for keys j in [k0, k1) in order; NV vectors of 16 per head. The running sums pass
// through memory between ranges unchanged, so splitting the keys into ranges changes no bit. `next`: the value block
// read next, asked into L2 a key's row per key (as scores_avx512 does).
template <typename S, int G, int NV>
void values_avx512(const float* w, int64_t stride, const CacheView& c, const int32_t* pages, int64_t kvh, int64_t k0,
                   int64_t k1, float* sums, const char* next) {
  const int64_t hd = c.head_dim, P = c.page_size;
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_loadu_ps(sums + g * hd + 16 * i);
  for (int64_t j = k0; j < k1; ++j) {
    const S* v = value_block<S>(c, pages[j / P], kvh) + (j % P) * hd;
    if (next != nullptr) {
      const char* row = next + (j - k0) * hd * static_cast<int64_t>(sizeof(S));
      for (int64_t b = 0; b < hd * static_cast<int64_t>(sizeof(S)); b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    }
    for (int i = 0; i < NV; ++i) {
      const __m512 vi = load16<S>(v + 16 * i);
      for (int g = 0; g < G; ++g) acc[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * stride + j]), vi, acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(sums + g * hd + 16 * i, acc[g][i]);
}

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

// scores row [ctx] -> weights exp(s - max) in place; returns their sum (16 lanes, added pairwise).
float softmax_weights(float* s, int64_t ctx) {
  float mx = s[0];
  for (int64_t j = 1; j < ctx; ++j) mx = std::max(mx, s[j]);
#if LMRPC_AVX512
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= ctx; j += 16) {
    const __m512 e = exp_vec(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmx));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < ctx) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (ctx - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(mask, exp_vec(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, s + j), vmx)));
    _mm512_mask_storeu_ps(s + j, mask, e);
    sum = _mm512_add_ps(sum, e);
  }
  return reduce_add(sum);
#elif LMRPC_AVX2
  float lanes[16];
  attention_avx2::exp_lanes(s, ctx, mx, lanes);
  return reduce_add16(lanes);
#else
  float lanes[16] = {0};
  for (int64_t j = 0; j < ctx; ++j) {
    s[j] = exp_scalar(s[j] - mx);
    lanes[j % 16] += s[j];
  }
  return reduce_add16(lanes);
#endif
}

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

template <typename S>
void attention_impl(const AttentionArgs& a, const CacheView& c) {
  const int64_t kvh = c.kv_heads, hd = c.head_dim;
  const int groups = static_cast<int>(a.heads / kvh);
  const int64_t threads = omp_get_max_threads();
  // A work item is one query over `span` kv heads: all of them when there are queries enough to share out (a
  // contiguous read per page), else one (a single decode query still uses every thread). Either way each head's
  // numbers come from the same operations in the same order.
  const int64_t span = a.t >= 4 * threads ? kvh : 1;
  // Few items (a decode step of one or two sequences: 3 kv heads on 2 threads left one waiting a third of the
  // time): each kv head's query heads are split into `splits` parts too, one item each.
  const int64_t few = a.t * (kvh / span);
  const int splits = span == 1 && few < 4 * threads
                         ? static_cast<int>(std::min<int64_t>(groups, (4 * threads + few - 1) / few)) : 1;
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

void rope_store(const RopeArgs& a, const CacheView& cache) {
  if (cache.bf16) rope_store_impl<uint16_t>(a, cache); else rope_store_impl<float>(a, cache);
}

void paged_attention(const AttentionArgs& a, const CacheView& cache) {
  if (a.t == 0) return;
  if (cache.bf16) attention_impl<uint16_t>(a, cache); else attention_impl<float>(a, cache);
}

}  // namespace lmrpc
