// AVX2 + FMA forms of attention.cpp's portable loops (CPUs without AVX512-BF16): the same operations per score,
// weight and output element, eight lanes per register, so the bits are the portable build's.
#pragma once

#include <algorithm>
#include <cstdint>

#include "common.h"

namespace lmrpc::attention_avx2 {

#if LMRPC_AVX2
// 8 cache values (float32, or bf16 codes) -> 8 floats.
template <typename S>
inline __m256 load8(const S* p) {
  if constexpr (sizeof(S) == 2) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(codes), 16));
  } else {
    return _mm256_loadu_ps(p);
  }
}

// Whether these loops take a head of this width (pairs of dimensions for the scores, 8 for the values).
inline bool takes(int64_t hd) { return hd % 8 == 0; }

// 16 keys' sums for G query heads, keys 8h .. 8h + 7 for each h in H: per head and key, the products of even and odd
// dimensions in two sums over d in order (acc[g][h][0] and [1]). kb: the block's first key, dimension d at kb + d * P.
// `ahead`, when not null, is asked into L2 a line per dimension (see page_scores).
template <typename S, int G, int H0, int H1>
LMRPC_INLINE void sums16(const float* const* q, const S* kb, int64_t hd, int64_t P, const char* ahead,
                         __m256 (&acc)[G][2][2]) {
  for (int g = 0; g < G; ++g)
    for (int h = H0; h < H1; ++h) acc[g][h][0] = acc[g][h][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d += 2) {
    if (ahead != nullptr) {
      _mm_prefetch(ahead + d * P * static_cast<int64_t>(sizeof(S)), _MM_HINT_T1);
      _mm_prefetch(ahead + (d + 1) * P * static_cast<int64_t>(sizeof(S)), _MM_HINT_T1);
    }
    __m256 k[2][2];  // [h][parity]
    for (int h = H0; h < H1; ++h) {
      k[h][0] = load8<S>(kb + d * P + 8 * h);
      k[h][1] = load8<S>(kb + (d + 1) * P + 8 * h);
    }
    for (int g = 0; g < G; ++g) {
      const __m256 q0 = _mm256_set1_ps(q[g][d]), q1 = _mm256_set1_ps(q[g][d + 1]);
      for (int h = H0; h < H1; ++h) {
        acc[g][h][0] = _mm256_fmadd_ps(q0, k[h][0], acc[g][h][0]);
        acc[g][h][1] = _mm256_fmadd_ps(q1, k[h][1], acc[g][h][1]);
      }
    }
  }
}

// Scores of one page's first n keys (kb: its key block, [head_dim][P]) for G query heads: out[g][j] = scale * q_g . k_j
// as (even + odd) * scale, 16 keys at a time. A head's sums are chains of dependent multiply-adds (the order of d is
// fixed), so up to two heads take both halves of 16 keys at once (four chains a head) and more heads one half at a
// time (two chains a head, within the 16 registers). `next`, when not null, is the block read next (the next page's
// keys, or after the last page the first values), asked into L2 over the last 16 keys: pages lie anywhere in the
// pool, where the hardware prefetchers cannot follow.
template <typename S, int G>
inline void page_scores(const float* const* q, const S* kb, int64_t n, int64_t hd, int64_t P, float scale,
                        float* const* out, const char* next) {
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t base = 0; base < n; base += 16) {
    const char* ahead = n - base <= 16 ? next : nullptr;
    __m256 acc[G][2][2];
    if constexpr (G <= 2) {
      sums16<S, G, 0, 2>(q, kb + base, hd, P, ahead, acc);
    } else {
      sums16<S, G, 0, 1>(q, kb + base, hd, P, ahead, acc);
      sums16<S, G, 1, 2>(q, kb + base, hd, P, nullptr, acc);
    }
    const int m = static_cast<int>(std::min<int64_t>(16, n - base));
    for (int g = 0; g < G; ++g) {
      alignas(32) float lanes[16];
      for (int h = 0; h < 2; ++h)
        _mm256_store_ps(lanes + 8 * h, _mm256_mul_ps(_mm256_add_ps(acc[g][h][0], acc[g][h][1]), vscale));
      std::copy(lanes, lanes + m, out[g] + base);
    }
  }
}

// sums[i] = fma(w[j], v_j[i], sums[i]) for dimensions [i0, i0 + 8V) of the first n rows (keys) at v, one row every
// hd values, in order. `next`, when not null, is asked into L2 a row per key (`row` bytes each).
template <typename S, int V>
LMRPC_INLINE void value_sums(const float* w, const S* v, int64_t n, int64_t hd, int64_t i0, float* sums,
                             const char* next, int64_t row) {
  __m256 acc[V];
  for (int c = 0; c < V; ++c) acc[c] = _mm256_loadu_ps(sums + i0 + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    if (next != nullptr)
      for (int64_t b = 0; b < row; b += 64) _mm_prefetch(next + j * row + b, _MM_HINT_T1);
    const __m256 wj = _mm256_set1_ps(w[j]);
    for (int c = 0; c < V; ++c) acc[c] = _mm256_fmadd_ps(wj, load8<S>(v + j * hd + i0 + 8 * c), acc[c]);
  }
  for (int c = 0; c < V; ++c) _mm256_storeu_ps(sums + i0 + 8 * c, acc[c]);
}

// sums[g][i] = fma(w[g][j], v_j[i], sums[g][i]) over one page's first n keys j in order (vb: its value block,
// [P][head_dim]; w[g] the page's weights of head g), 64 dimensions at a time. The running sums pass through memory
// between pages unchanged, so pages change no bit. `next`: the block to ask into L2, a key's row per key.
template <typename S, int G>
inline void page_values(const float* const* w, const S* vb, int64_t n, int64_t hd, float* const* sums,
                        const char* next) {
  const int64_t row = hd * static_cast<int64_t>(sizeof(S));
  for (int g = 0; g < G; ++g) {
    for (int64_t i0 = 0; i0 < hd;) {
      const char* ahead = g == 0 && i0 == 0 ? next : nullptr;  // once per page
      if (i0 + 64 <= hd) {
        value_sums<S, 8>(w[g], vb, n, hd, i0, sums[g], ahead, row);
        i0 += 64;
      } else {
        value_sums<S, 1>(w[g], vb, n, hd, i0, sums[g], ahead, row);
        i0 += 8;
      }
    }
  }
}

// out[i] = sums[i] * inv over a head.
inline void scaled_row(const float* sums, int64_t hd, float inv, float* out) {
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < hd; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(sums + i), vinv));
}

// softmax_weights' exp and its 16 lanes of sums (lane j % 16 takes key j, in order) over s[0 .. ctx): the weights
// written in place, the lanes to `lanes`.
inline void exp_lanes(float* s, int64_t ctx, float mx, float* lanes) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  const __m256 vmx = _mm256_set1_ps(mx);
  int64_t j = 0;
  for (; j + 16 <= ctx; j += 16) {
    const __m256 a = exp_vec8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmx));
    const __m256 b = exp_vec8(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), vmx));
    _mm256_storeu_ps(s + j, a);
    _mm256_storeu_ps(s + j + 8, b);
    lo = _mm256_add_ps(lo, a);
    hi = _mm256_add_ps(hi, b);
  }
  _mm256_storeu_ps(lanes, lo);
  _mm256_storeu_ps(lanes + 8, hi);
  for (; j < ctx; ++j) {
    s[j] = exp_scalar(s[j] - mx);
    lanes[j % 16] += s[j];
  }
}
#endif

}  // namespace lmrpc::attention_avx2
