// Paged attention's cache access (attention.h has the layout) and the parts of a query's attention that more than one
// source file runs: rope.cpp, attention.cpp (a query at a time) and attention_few.cpp (few queries, heads shared).
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention_avx2.h"

#include "attention.h"
#include "common.h"

namespace lmrpc::attention_detail {

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

constexpr int kMaxGroup = 8;  // query heads per kv head handled in registers

// scores row [ctx] -> weights exp(s - max) in place; returns their sum (16 lanes, added pairwise).
inline float softmax_weights(float* s, int64_t ctx) {
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

// Few queries on AVX512 (attention_few.cpp): every query of the step, the threads sharing each kv head's keys and
// values; the same bits as a query at a time. Only where attention_few_has_kernel (this build, the head width and
// the group size).
bool attention_few_has_kernel(const CacheView& c, int groups, int threads);
void attention_few(const AttentionArgs& a, const CacheView& c, int groups, int threads);

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

// sums[g][:] += w[g][j] v_j for keys j in [k0, k1) in order; NV vectors of 16 per head from vector i0 (a slice of
// head_dim; 0 and all of it in attention.cpp). The running sums pass through memory between ranges unchanged, so
// splitting the keys into ranges, or the dims into slices, changes no bit. `next`: the value block read next, asked
// into L2 a key's row per key (as scores_avx512 does).
template <typename S, int G, int NV>
void values_avx512(const float* w, int64_t stride, const CacheView& c, const int32_t* pages, int64_t kvh, int64_t k0,
                   int64_t k1, float* sums, const char* next, int64_t i0 = 0) {
  const int64_t hd = c.head_dim, P = c.page_size;
  __m512 acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_loadu_ps(sums + g * hd + 16 * (i0 + i));
  for (int64_t j = k0; j < k1; ++j) {
    const S* v = value_block<S>(c, pages[j / P], kvh) + (j % P) * hd;
    if (next != nullptr) {
      const char* row = next + (j - k0) * hd * static_cast<int64_t>(sizeof(S));
      for (int64_t b = 0; b < hd * static_cast<int64_t>(sizeof(S)); b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    }
    for (int i = 0; i < NV; ++i) {
      const __m512 vi = load16<S>(v + 16 * (i0 + i));
      for (int g = 0; g < G; ++g) acc[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * stride + j]), vi, acc[g][i]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(sums + g * hd + 16 * (i0 + i), acc[g][i]);
}
#endif

}  // namespace lmrpc::attention_detail
