// K-scaled weights (GGUF K-quants, KScales in linear.h): their group sums folded per super-block, in one order on
// every route. Per row and output, group g's sum a enters the super-block's S = fma(a, sc_g, S) (sc exact in float32);
// at the super-block's end Y = fma(S, d, Y), then, with offsets, Y = -(M * dmin) + Y, where M = fma(sum of group g's
// inputs, m_g, M) over the super-block's groups in order (S and M start at 0 in each super-block, Y at 0). AVX512,
// AVX2 and portable kernels, one row or many, all do exactly these operations. Folding each group with d * sc and
// -(dmin * m) made and applied per group cost a one-row product 10-20% of its time; this converts d and dmin once per
// super-block and multiplies nothing per group.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear.h"
#include "linear_impl.h"

namespace lmrpc::linear_detail {

// The multiplier a group's sums are folded with: its fp16 scale, or for a K-scaled weight its sc (d comes later).
inline float lane_sum_scale(const GroupWeights& gw, int l) {
  if (gw.kd == nullptr) return half_to_f32(gw.scale[l]);
  return gw.ksigned ? static_cast<float>(static_cast<int8_t>(gw.ksc[l])) : static_cast<float>(gw.ksc[l]);
}

// Whether group g ends its super-block (only asked of K-scaled weights).
inline bool ks_super_end(const PackedWeight& w, int64_t g) {
  return ((g + 1) & ((int64_t{1} << w.ks.super_shift) - 1)) == 0;
}

// Lane l (16 * tile + output) of tile pair `pair` at the end of the super-block whose last group is g: y after
// folding the super-block's S, as above; `sums` the row's group sums of inputs (null without offsets).
inline float ks_fold_lane(float y, float s, const PackedWeight& w, int64_t pair, int64_t groups, int64_t g, int l,
                          const float* sums) {
  const GroupWeights last = group_weights(w, pair, groups, g, nullptr);
  y = std::fma(s, half_to_f32(last.kd[l]), y);
  if (last.kdmin == nullptr) return y;
  float m = 0.0f;
  for (int64_t j = g + 1 - (int64_t{1} << w.ks.super_shift); j <= g; ++j) {
    m = std::fma(sums[j], static_cast<float>(group_weights(w, pair, groups, j, nullptr).km[l]), m);
  }
  return std::fma(-m, half_to_f32(last.kdmin[l]), y);
}

#if LMRPC_AVX512
// Tile t's 16 multipliers of a group's sums, as lane_sum_scale makes them.
LMRPC_INLINE __m512 sum_scale_x16(const GroupWeights& gw, int t) {
  if (gw.kd == nullptr) return load_halfx16(gw.scale + 16 * t);
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gw.ksc + 16 * t));
  return _mm512_cvtepi32_ps(gw.ksigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
}

// Tile t of tile pair `pair`, R rows, at the end of the super-block whose last group is g: Y[r] = fma(S[r], d, Y[r]),
// then Y[r] = -(M[r] * dmin) + Y[r] with M[r] over the super-block's groups, as ks_fold_lane (each group's m made
// float once for all rows).
template <int R>
LMRPC_INLINE void ks_fold_x16(__m512 (&Y)[R], const __m512 (&S)[R], const PackedWeight& w, int64_t pair,
                              int64_t groups, int64_t g, int t, const float* const* sums) {
  const GroupWeights last = group_weights(w, pair, groups, g, nullptr);
  const __m512 d = load_halfx16(last.kd + 16 * t);
  for (int r = 0; r < R; ++r) Y[r] = _mm512_fmadd_ps(S[r], d, Y[r]);
  if (last.kdmin == nullptr) return;
  __m512 M[R];
  for (int r = 0; r < R; ++r) M[r] = _mm512_setzero_ps();
  for (int64_t j = g + 1 - (int64_t{1} << w.ks.super_shift); j <= g; ++j) {
    const uint8_t* m = group_weights(w, pair, groups, j, nullptr).km + 16 * t;
    const __m512 mv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m))));
    for (int r = 0; r < R; ++r) M[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r][j]), mv, M[r]);
  }
  const __m512 dmin = load_halfx16(last.kdmin + 16 * t);
  for (int r = 0; r < R; ++r) Y[r] = _mm512_fnmadd_ps(M[r], dmin, Y[r]);
}

// The super-block sums S of a block of R rows over P tile pairs (`pairs`), folded into the block's totals in rb.out
// at the end of the super-block whose last group is g (ks_fold_x16 per tile).
template <int R, int P>
LMRPC_NOINLINE void ks_fold_sums(const __m512 (&S)[R][2 * P], const PackedWeight& w, const int64_t (&pairs)[P],
                                 int64_t groups, int64_t g, const RowBlock& rb) {
  for (int q = 0; q < P; ++q)
    for (int t = 0; t < 2; ++t) {
      const int i = 2 * q + t;
      __m512 T[R], Si[R];
      for (int r = 0; r < R; ++r) {
        T[r] = _mm512_loadu_ps(rb.out[r] + 16 * i);
        Si[r] = S[r][i];
      }
      ks_fold_x16<R>(T, Si, w, pairs[q], groups, g, t, rb.sums);
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(rb.out[r] + 16 * i, T[r]);
    }
}

// A block of R rows over P tile pairs of weight w, after group g that ends a super-block: a K-scaled weight's running
// sums Y (the super-block's S) are folded into the block's totals, kept in rb.out (L1: R x 2P more registers would
// spill), and restart at 0. Other weights: nothing. (The kernels loop over a super-block's groups inside a loop over
// super-blocks, not testing g in their group loop.)
template <int R, int P, bool KS>
LMRPC_INLINE void ks_fold_block(__m512 (&Y)[R][2 * P], const PackedWeight& w, const int64_t (&pairs)[P],
                                int64_t groups, int64_t g, const RowBlock& rb) {
  if constexpr (KS) {
    // The fold out of line, over a copy: inlined, its temporaries spilled the group loop's sums (Q4_K and Q6_K
    // blocks of 6 rows in cache 5-12% slower).
    __m512 S[R][2 * P];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 2 * P; ++i) {
        S[r][i] = Y[r][i];
        Y[r][i] = _mm512_setzero_ps();
      }
    ks_fold_sums<R, P>(S, w, pairs, groups, g, rb);
  }
}

// A block's results into rb.out: the running sums, or for a K-scaled weight (whose super-blocks were folded into
// rb.out as they ended; it was zeroed by ks_begin) nothing more. KS (a K-scaled weight) is a template argument of
// the kernels, so that other weights' kernels are what they were.
template <int R, int P, bool KS>
LMRPC_INLINE void store_block(const __m512 (&Y)[R][2 * P], const RowBlock& rb) {
  if (KS) return;
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P; ++i) _mm512_storeu_ps(rb.out[r] + 16 * i, Y[r][i]);
}

// A K-scaled weight's block totals start at 0 (in rb.out, as ks_fold_block keeps them).
template <int R, int P, bool KS>
LMRPC_INLINE void ks_begin(const RowBlock& rb) {
  if (!KS) return;
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P; ++i) _mm512_storeu_ps(rb.out[r] + 16 * i, _mm512_setzero_ps());
}
#endif

#if !LMRPC_AVX512 && !LMRPC_AVX2
// A block of R rows over P tile pairs (`pairs`) of weight w, after group g: a K-scaled weight's running sums Y (the
// super-block's S) are folded into the block's totals T when g ends a super-block, and restart at 0.
template <int R, int P>
inline void ks_after_group_scalar(float (&Y)[R][32 * P], float (&T)[R][32 * P], const PackedWeight& w,
                                  const int64_t (&pairs)[P], int64_t groups, int64_t g, const RowBlock& rb) {
  if (!w.k_scaled() || !ks_super_end(w, g)) return;
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q)
      for (int l = 0; l < 32; ++l) {
        const int i = 32 * q + l;
        T[r][i] = ks_fold_lane(T[r][i], Y[r][i], w, pairs[q], groups, g, l, rb.sums[r]);
        Y[r][i] = 0.0f;
      }
}

// A block's results into rb.out: the running sums, or a K-scaled weight's totals.
template <int R, int P>
inline void store_block_scalar(const float (&Y)[R][32 * P], const float (&T)[R][32 * P], const PackedWeight& w,
                               const RowBlock& rb) {
  for (int r = 0; r < R; ++r) std::memcpy(rb.out[r], w.k_scaled() ? T[r] : Y[r], sizeof(Y[r]));
}
#endif

#if LMRPC_AVX2
LMRPC_INLINE __m256 load_halfx8(const uint16_t* at) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}
LMRPC_INLINE __m256 load_u8x8(const uint8_t* at) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(at))));
}

// Lanes l0 .. l0 + 7 of the multipliers of a group's sums (lane_sum_scale) and of its offsets (lane_offset; only of
// weights that are not K-scaled: theirs enter at a super-block's end).
LMRPC_INLINE __m256 sum_scale_x8(const GroupWeights& gw, int l0) {
  if (gw.kd == nullptr) return load_halfx8(gw.scale + l0);
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(gw.ksc + l0));
  return _mm256_cvtepi32_ps(gw.ksigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// One row's 32 lanes of tile pair `pair` at the end of the super-block whose last group is g, ks_fold_lane's
// operations 8 lanes at a time: T = fma(S, d, T), then T = -(M * dmin) + T; S restarts at 0. S and T 32-aligned.
LMRPC_INLINE void ks_fold_row8(float* S, float* T, const PackedWeight& w, int64_t pair, int64_t groups, int64_t g,
                               const float* sums) {
  const GroupWeights last = group_weights(w, pair, groups, g, nullptr);
  const int64_t first = g + 1 - (int64_t{1} << w.ks.super_shift);
  for (int l0 = 0; l0 < 32; l0 += 8) {
    __m256 t = _mm256_fmadd_ps(_mm256_load_ps(S + l0), load_halfx8(last.kd + l0), _mm256_load_ps(T + l0));
    if (last.kdmin != nullptr) {
      __m256 m = _mm256_setzero_ps();
      for (int64_t j = first; j <= g; ++j) {
        m = _mm256_fmadd_ps(_mm256_set1_ps(sums[j]), load_u8x8(group_weights(w, pair, groups, j, nullptr).km + l0), m);
      }
      t = _mm256_fnmadd_ps(m, load_halfx8(last.kdmin + l0), t);
    }
    _mm256_store_ps(T + l0, t);
    _mm256_store_ps(S + l0, _mm256_setzero_ps());
  }
}

// Rows' running sums Y (a K-scaled weight's super-block sums) after group g: folded into the totals T when g ends a
// super-block (ks_fold_row8). Y and T [rows][32 * P], pairs[q] the tile pair of Y's lanes 32 q .. 32 q + 31.
template <int R, int P>
LMRPC_INLINE void ks_after_group8(float (&Y)[R][32 * P], float (&T)[R][32 * P], const PackedWeight& w,
                                  const int64_t (&pairs)[P], int64_t groups, int64_t g, const float* const* sums) {
  if (!w.k_scaled() || !ks_super_end(w, g)) return;
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q) ks_fold_row8(Y[r] + 32 * q, T[r] + 32 * q, w, pairs[q], groups, g, sums[r]);
}
#endif

}  // namespace lmrpc::linear_detail
