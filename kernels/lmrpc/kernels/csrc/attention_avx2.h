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

// scores_generic's 16 keys of one block for G (<= 4) query heads: per head and key, the products of even and odd
// dimensions in two sums over d in order, then (even + odd) * scale. kb: the block's first key, dimension d at
// kb + d * P. Written to out[g][0 .. n).
template <typename S, int G>
inline void scores16(const float* const* q, const S* kb, int64_t hd, int64_t P, float scale, float* const* out,
                     int n) {
  alignas(32) float lanes[G][16];
  for (int h = 0; h < 2; ++h) {  // keys 8h .. 8h + 7
    __m256 even[G], odd[G];
    for (int g = 0; g < G; ++g) even[g] = odd[g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < hd; d += 2) {
      const __m256 k0 = load8<S>(kb + d * P + 8 * h), k1 = load8<S>(kb + (d + 1) * P + 8 * h);
      for (int g = 0; g < G; ++g) {
        even[g] = _mm256_fmadd_ps(_mm256_set1_ps(q[g][d]), k0, even[g]);
        odd[g] = _mm256_fmadd_ps(_mm256_set1_ps(q[g][d + 1]), k1, odd[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm256_store_ps(lanes[g] + 8 * h, _mm256_mul_ps(_mm256_add_ps(even[g], odd[g]), _mm256_set1_ps(scale)));
    }
  }
  for (int g = 0; g < G; ++g) std::copy(lanes[g], lanes[g] + n, out[g]);
}

// Whether these loops take a head of this width (pairs of dimensions for the scores, 8 for the values).
inline bool takes(int64_t hd) { return hd % 8 == 0; }

// weighted_values' sums of one head: acc[i] = fma(w_j, v_j[i], acc[i]) over keys j in order, then acc[i] * inv.
// value(j) gives key j's row.
template <typename S, typename Value>
inline void weighted_row(const float* w, int64_t ctx, int64_t hd, float inv, Value&& value, float* out) {
  for (int64_t i0 = 0; i0 < hd; i0 += 64) {  // 8 registers of sums at a time
    const int vectors = static_cast<int>(std::min<int64_t>(64, hd - i0) / 8);
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < ctx; ++j) {
      const S* v = value(j) + i0;
      const __m256 wj = _mm256_set1_ps(w[j]);
      for (int c = 0; c < vectors; ++c) acc[c] = _mm256_fmadd_ps(wj, load8<S>(v + 8 * c), acc[c]);
    }
    for (int c = 0; c < vectors; ++c) _mm256_storeu_ps(out + i0 + 8 * c, _mm256_mul_ps(acc[c], _mm256_set1_ps(inv)));
  }
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
