// Micro-kernels of the row-invariant products (run by linear_products.cpp): R rows x P tile pairs over every group
// in AVX512-BF16 registers, AVX2 registers (linear_kernels_avx2.h) or portable loops, and Q4 codes expanded in
// registers for R rows (block_q4) or one (one_row_q4_bf16; Q8 and Q6 codes: one_row_q8_bf16, one_row_q6_bf16).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"
#include "linear.h"
#include "linear_impl.h"
#include "linear_kernels_avx2.h"
#include "linear_kscales.h"

namespace lmrpc::linear_detail {

// ---- micro-kernels: R rows x P tile pairs over every group -------------------------------------------------------
// Per row and output: for each group in order, its kpairs summed in order (one running sum a), then
// Y = fma(a, scale, Y) and Y = fma(group sum of x, offset, Y) when quantized; dense weights are one group, Y = a.
// K-scaled weights: the running sums Y are each super-block's S = fma(a, sc, S), folded into the totals at the
// super-block's end (linear_kscales.h). R and P only choose how many sums run side by side in
// registers: they never change a sum's operations.

#if LMRPC_AVX512
template <int R, int P, bool Q>
inline void fold_group(__m512 (&Y)[R][2 * P], const __m512 (&acc)[R][2 * P], const GroupWeights (&gw)[P],
                       const RowBlock& rb, int64_t g) {
  for (int q = 0; q < P; ++q)
    for (int t = 0; t < 2; ++t) {
      const int i = 2 * q + t;
      if constexpr (Q) {
        const __m512 s = sum_scale_x16(gw[q], t);
        for (int r = 0; r < R; ++r) Y[r][i] = _mm512_fmadd_ps(acc[r][i], s, Y[r][i]);
        if (gw[q].offset != nullptr) {  // (a K-scaled weight's offsets enter at its super-blocks' ends)
          const __m512 o = offset_x16(gw[q], t);
          for (int r = 0; r < R; ++r) Y[r][i] = _mm512_fmadd_ps(_mm512_set1_ps(rb.sums[r][g]), o, Y[r][i]);
        }
      } else {
        for (int r = 0; r < R; ++r) Y[r][i] = acc[r][i];
      }
    }
}

template <int R, int P, bool Q, bool KS, typename Source>
void block_bf16_ks(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  const PackedWeight& w = *src[0].at.w;
  int64_t pairs[P];
  for (int q = 0; q < P; ++q) pairs[q] = src[q].at.pair;
  ks_begin<R, P, KS>(rb);
  __m512 Y[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P; ++i) Y[r][i] = _mm512_setzero_ps();
  const int64_t span = KS ? int64_t{1} << w.ks.super_shift : groups;  // groups between folds
  for (int64_t g0 = 0; g0 < groups; g0 += span) {
    for (int64_t g = g0; g < g0 + span; ++g) {
      GroupWeights gw[P];
      for (int q = 0; q < P; ++q) gw[q] = src[q].group(g);
      __m512 acc[R][2 * P];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 2 * P; ++i) acc[r][i] = _mm512_setzero_ps();
      const int64_t k0 = 2 * g * gkp;
      for (int64_t j = 0; j < gkp; ++j) {
        __m512bh wv[2 * P];
        for (int q = 0; q < P; ++q)
          for (int t = 0; t < 2; ++t) {
            wv[2 * q + t] = reinterpret_cast<__m512bh>(
                _mm512_loadu_si512(static_cast<const uint16_t*>(gw[q].w) + 64 * j + 32 * t));
          }
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, static_cast<const uint16_t*>(rb.x[r]) + k0 + 2 * j, 4);
          const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
          for (int i = 0; i < 2 * P; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], wv[i], xb);
        }
      }
      fold_group<R, P, Q>(Y, acc, gw, rb, g);
    }
    ks_fold_block<R, P, KS>(Y, w, pairs, groups, g0 + span - 1, rb);
  }
  store_block<R, P, KS>(Y, rb);
}

// R rows x one tile pair of Q4 weights over every group, the codes expanded in registers from their 4-bit blocks
// (vpermw on the bf16 table): the kpairs of each group in the same order as block_bf16 over expanded codes, so the
// same bits, from a quarter of the bytes.
template <int R, bool KS>
void block_q4_ks(const PackedWeight& w, int64_t p, const Q4Table& table, int64_t groups, const RowBlock& rb) {
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
  const __m512i lut = _mm512_load_si512(table.bf16);
  const int64_t pairs[1] = {p};
  ks_begin<R, 1, KS>(rb);
  __m512 Y[R][2];
  for (int r = 0; r < R; ++r) Y[r][0] = Y[r][1] = _mm512_setzero_ps();
  const int64_t span = KS ? int64_t{1} << w.ks.super_shift : groups;  // groups between folds
  for (int64_t g0 = 0; g0 < groups; g0 += span) {
    for (int64_t g = g0; g < g0 + span; ++g) {
      const GroupWeights gw[1] = {group_weights(w, p, groups, g, nullptr)};
      const uint8_t* src = data + (p * groups + g) * 512;
      prefetch_q4_ahead(src);
      __m512 acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int c = 0; c < 8; ++c) {  // kpairs 2c (low nibbles) and 2c + 1 (high nibbles)
        for (int t = 0; t < 2; ++t) {
          const Q4Chunk chunk = q4_chunk(src, t, c, lut);
          const __m512bh lo = reinterpret_cast<__m512bh>(chunk.lo), hi = reinterpret_cast<__m512bh>(chunk.hi);
          for (int r = 0; r < R; ++r) {
            int32_t p0, p1;
            const uint16_t* x = static_cast<const uint16_t*>(rb.x[r]) + 32 * g + 4 * c;
            std::memcpy(&p0, x, 4);
            std::memcpy(&p1, x + 2, 4);
            acc[r][t] = _mm512_dpbf16_ps(acc[r][t], lo, reinterpret_cast<__m512bh>(_mm512_set1_epi32(p0)));
            acc[r][t] = _mm512_dpbf16_ps(acc[r][t], hi, reinterpret_cast<__m512bh>(_mm512_set1_epi32(p1)));
          }
        }
      }
      fold_group<R, 1, true>(Y, acc, gw, rb, g);
    }
    ks_fold_block<R, 1, KS>(Y, w, pairs, groups, g0 + span - 1, rb);
  }
  store_block<R, 1, KS>(Y, rb);
}

template <int R, int P, bool Q, bool KS, typename Source>
void block_f32_ks(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const PackedWeight& w = *src[0].at.w;
  int64_t pairs[P];
  for (int q = 0; q < P; ++q) pairs[q] = src[q].at.pair;
  ks_begin<R, P, KS>(rb);
  __m512 Y[R][2 * P];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 2 * P; ++i) Y[r][i] = _mm512_setzero_ps();
  const int64_t span = KS ? int64_t{1} << w.ks.super_shift : groups;  // groups between folds
  for (int64_t g0 = 0; g0 < groups; g0 += span) {
    for (int64_t g = g0; g < g0 + span; ++g) {
      GroupWeights gw[P];
      for (int q = 0; q < P; ++q) gw[q] = src[q].group(g);
      // [row][tile][half]: outputs 0-7 or 8-15 of the tile, as (output, even/odd input) lane pairs
      __m512 acc[R][2 * P][2];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 2 * P; ++i) acc[r][i][0] = acc[r][i][1] = _mm512_setzero_ps();
      const int64_t k0 = 2 * g * gkp;
      for (int64_t j = 0; j < gkp; ++j) {
        __m512 wv[2 * P][2];
        for (int q = 0; q < P; ++q)
          for (int t = 0; t < 2; ++t)
            for (int h = 0; h < 2; ++h)
              wv[2 * q + t][h] = _mm512_loadu_ps(static_cast<const float*>(gw[q].w) + 64 * j + 32 * t + 16 * h);
        for (int r = 0; r < R; ++r) {
          double pair;
          std::memcpy(&pair, static_cast<const float*>(rb.x[r]) + k0 + 2 * j, 8);
          const __m512 xb = _mm512_castpd_ps(_mm512_set1_pd(pair));
          for (int i = 0; i < 2 * P; ++i)
            for (int h = 0; h < 2; ++h) acc[r][i][h] = _mm512_fmadd_ps(wv[i][h], xb, acc[r][i][h]);
        }
      }
      __m512 sum[R][2 * P];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < 2 * P; ++i) {
          sum[r][i] = _mm512_add_ps(_mm512_permutex2var_ps(acc[r][i][0], even, acc[r][i][1]),
                                    _mm512_permutex2var_ps(acc[r][i][0], odd, acc[r][i][1]));
        }
      fold_group<R, P, Q>(Y, sum, gw, rb, g);
    }
    ks_fold_block<R, P, KS>(Y, w, pairs, groups, g0 + span - 1, rb);
  }
  store_block<R, P, KS>(Y, rb);
}

// The block kernels as their callers name them: KS (a K-scaled weight) made a template argument here.
template <int R, int P, bool Q, typename Source>
void block_bf16(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  if (Q && src[0].at.w->k_scaled()) block_bf16_ks<R, P, Q, true>(src, groups, gkp, rb);
  else block_bf16_ks<R, P, Q, false>(src, groups, gkp, rb);
}
template <int R, int P, bool Q, typename Source>
void block_f32(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  if (Q && src[0].at.w->k_scaled()) block_f32_ks<R, P, Q, true>(src, groups, gkp, rb);
  else block_f32_ks<R, P, Q, false>(src, groups, gkp, rb);
}
template <int R>
void block_q4(const PackedWeight& w, int64_t p, const Q4Table& table, int64_t groups, const RowBlock& rb) {
  if (w.k_scaled()) block_q4_ks<R, true>(w, p, table, groups, rb);
  else block_q4_ks<R, false>(w, p, table, groups, rb);
}
#elif !LMRPC_AVX2  // (AVX2: linear_kernels_avx2.h)
template <int R, int P, bool Q>
inline void fold_group_scalar(float (&Y)[R][32 * P], const float (&a)[R][32 * P], const GroupWeights (&gw)[P],
                              const RowBlock& rb, int64_t g) {
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q)
      for (int l = 0; l < 32; ++l) {
        float& y = Y[r][32 * q + l];
        if constexpr (Q) {  // (a K-scaled weight: y is the super-block's S, see ks_after_group_scalar)
          y = std::fma(a[r][32 * q + l], lane_sum_scale(gw[q], l), y);
          if (gw[q].offset != nullptr) y = std::fma(rb.sums[r][g], lane_offset(gw[q], l), y);
        } else {
          y = a[r][32 * q + l];
        }
      }
}

template <int R, int P, bool Q, typename Source>
void block_bf16(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  const PackedWeight& w = *src[0].at.w;
  int64_t pairs[P];
  for (int q = 0; q < P; ++q) pairs[q] = src[q].at.pair;
  float Y[R][32 * P] = {}, T[R][32 * P] = {};
  for (int64_t g = 0; g < groups; ++g) {
    GroupWeights gw[P];
    for (int q = 0; q < P; ++q) gw[q] = src[q].group(g);
    float acc[R][32 * P] = {};  // [row][pair, tile, output]
    const int64_t k0 = 2 * g * gkp;
    for (int64_t j = 0; j < gkp; ++j)
      for (int r = 0; r < R; ++r) {
        const uint16_t* x = static_cast<const uint16_t*>(rb.x[r]) + k0 + 2 * j;
        const float x0 = bf16_to_f32(x[0]), x1 = bf16_to_f32(x[1]);
        for (int q = 0; q < P; ++q)
          for (int l = 0; l < 32; ++l) {  // l = 16 * tile + output
            const uint16_t* w = static_cast<const uint16_t*>(gw[q].w) + 64 * j + 32 * (l / 16) + 2 * (l % 16);
            const float v = std::fma(x0, bf16_to_f32(w[0]), acc[r][32 * q + l]);
            acc[r][32 * q + l] = std::fma(x1, bf16_to_f32(w[1]), v);
          }
      }
    fold_group_scalar<R, P, Q>(Y, acc, gw, rb, g);
    ks_after_group_scalar<R, P>(Y, T, w, pairs, groups, g, rb);
  }
  store_block_scalar<R, P>(Y, T, w, rb);
}

template <int R, int P, bool Q, typename Source>
void block_f32(const Source* src, int64_t groups, int64_t gkp, const RowBlock& rb) {
  const PackedWeight& w = *src[0].at.w;
  int64_t pairs[P];
  for (int q = 0; q < P; ++q) pairs[q] = src[q].at.pair;
  float Y[R][32 * P] = {}, T[R][32 * P] = {};
  for (int64_t g = 0; g < groups; ++g) {
    GroupWeights gw[P];
    for (int q = 0; q < P; ++q) gw[q] = src[q].group(g);
    float acc[R][64 * P] = {};  // [row][pair, tile, output, even/odd input]
    const int64_t k0 = 2 * g * gkp;
    for (int64_t j = 0; j < gkp; ++j)
      for (int r = 0; r < R; ++r) {
        const float* x = static_cast<const float*>(rb.x[r]) + k0 + 2 * j;
        for (int q = 0; q < P; ++q) {
          const float* w = static_cast<const float*>(gw[q].w) + 64 * j;
          for (int l = 0; l < 64; ++l) acc[r][64 * q + l] = std::fma(w[l], x[l & 1], acc[r][64 * q + l]);
        }
      }
    float a[R][32 * P];
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < 32 * P; ++l) a[r][l] = acc[r][2 * l] + acc[r][2 * l + 1];
    fold_group_scalar<R, P, Q>(Y, a, gw, rb, g);
    ks_after_group_scalar<R, P>(Y, T, w, pairs, groups, g, rb);
  }
  store_block_scalar<R, P>(Y, T, w, rb);
}
#endif

#if LMRPC_AVX512
// One row of P tile pairs of a grouped quantized weight (Q4 blocks, Q8 or Q6 units), bf16 products with codes
// decoded in registers and used at once (no buffer): two groups' sums run side by side (one sum per group is a chain
// of dependent dot products) and are folded in group order, so per output the operations are those of the expanded
// path, each group's kpairs in order in one sum. piece(acc, g, i) adds the group's i-th of `pieces` runs of kpairs
// to acc [2 * P] (both tiles of every pair); prefetch(g) asks for the codes a few groups ahead.
template <int P, typename Piece, typename Prefetch>
LMRPC_INLINE void one_row_grouped(const PackedWeight& w, int64_t p, int64_t pieces, const float* sums, float* out,
                                  Piece&& piece, Prefetch&& prefetch) {
  const int64_t groups = w.k_pad / w.group;
  const bool ks = w.k_scaled();
  __m512 Y[2 * P], S[2 * P];  // the totals; a K-scaled weight's super-block sums
  for (int i = 0; i < 2 * P; ++i) Y[i] = S[i] = _mm512_setzero_ps();
  auto fold = [&](const __m512 (&acc)[2 * P], int64_t g) LMRPC_LAMBDA_INLINE {
    for (int q = 0; q < P; ++q) {
      const GroupWeights gw = group_weights(w, p + q, groups, g, nullptr);
      for (int t = 0; t < 2; ++t) {
        const int i = 2 * q + t;
        if (ks) {
          S[i] = _mm512_fmadd_ps(acc[i], sum_scale_x16(gw, t), S[i]);
          continue;
        }
        Y[i] = _mm512_fmadd_ps(acc[i], sum_scale_x16(gw, t), Y[i]);
        if (gw.offset != nullptr) Y[i] = _mm512_fmadd_ps(_mm512_set1_ps(sums[g]), offset_x16(gw, t), Y[i]);
      }
    }
    if (!ks || !ks_super_end(w, g)) return;
    const float* const row_sums[1] = {sums};
    for (int q = 0; q < P; ++q)
      for (int t = 0; t < 2; ++t) {
        const int i = 2 * q + t;
        __m512 y[1] = {Y[i]};
        const __m512 sb[1] = {S[i]};
        ks_fold_x16<1>(y, sb, w, p + q, groups, g, t, row_sums);
        Y[i] = y[0];
        S[i] = _mm512_setzero_ps();
      }
  };
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    prefetch(g);
    prefetch(g + 1);
    __m512 a[2 * P], b[2 * P];
    for (int i = 0; i < 2 * P; ++i) a[i] = b[i] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pieces; ++i) {
      piece(a, g, i);
      piece(b, g + 1, i);
    }
    fold(a, g);
    fold(b, g + 1);
  }
  for (; g < groups; ++g) {
    __m512 a[2 * P];
    for (int i = 0; i < 2 * P; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pieces; ++i) piece(a, g, i);
    fold(a, g);
  }
  for (int i = 0; i < 2 * P; ++i) _mm512_storeu_ps(out + 16 * i, Y[i]);
}

// One row, Q4: a group's pieces are its 8 chunks (kpairs 2c, 2c + 1 of both tiles).
template <int P>
void one_row_q4_bf16(const PackedWeight& w, int64_t p, const Q4Table& table, const uint16_t* x, const float* sums,
                     float* out) {
  const int64_t groups = w.k_pad / w.group;
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
  const __m512i lut = _mm512_load_si512(table.bf16);
  auto chunk = [&](__m512 (&acc)[2 * P], int64_t g, int64_t c) LMRPC_LAMBDA_INLINE {
    int32_t p0, p1;
    std::memcpy(&p0, x + 2 * (16 * g + 2 * c), 4);
    std::memcpy(&p1, x + 2 * (16 * g + 2 * c + 1), 4);
    const __m512bh x0 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p0));
    const __m512bh x1 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p1));
    for (int q = 0; q < P; ++q) {
      const uint8_t* group = data + ((p + q) * groups + g) * 512;
      for (int t = 0; t < 2; ++t) {
        const Q4Chunk codes = q4_chunk(group, t, static_cast<int>(c), lut);
        acc[2 * q + t] = _mm512_dpbf16_ps(acc[2 * q + t], reinterpret_cast<__m512bh>(codes.lo), x0);
        acc[2 * q + t] = _mm512_dpbf16_ps(acc[2 * q + t], reinterpret_cast<__m512bh>(codes.hi), x1);
      }
    }
  };
  auto prefetch = [&](int64_t g) LMRPC_LAMBDA_INLINE {  // the group kOneRowPrefetchGroups ahead, into L2
    const int64_t at = one_row_ahead((g + kOneRowPrefetchGroups) * 512, groups * 512, P);
    for (int q = 0; q < P; ++q) prefetch_one_row(data + (p + q) * groups * 512 + at, 512);
    const int64_t ahead = one_row_ahead(g + 2 * kOneRowPrefetchGroups, groups, P);  // (a line: 1-2 groups' scales)
    for (int q = 0; q < P; ++q) prefetch_scales(w, p + q, groups, ahead);
  };
  one_row_grouped<P>(w, p, 8, sums, out, chunk, prefetch);
}
#endif

#if LMRPC_AVX512
// bf16 values of a Q6 weight's 64 stored codes (code - 32), the two 32-entry halves of a vpermi2w table.
struct Q6Table {
  alignas(64) uint16_t bf16[64];
  Q6Table() {
    for (int c = 0; c < 64; ++c) bf16[c] = f32_to_bf16(static_cast<float>(c - 32));
  }
};

// The one table every Q6 kernel reads (built on first use).
inline const Q6Table& q6_table() {
  static const Q6Table table;
  return table;
}

// A Q6 unit's four kpair vectors (linear.h) as bf16, decoded in registers: in each 16-bit lane the code's low
// nibble lands in bits 0-3 and its top two bits in bits 4-5 of a table index (vpermi2w reads only bits 0-5).
LMRPC_INLINE void q6_unit_bf16(const uint8_t* unit, __m512i lut_lo, __m512i lut_hi, __m512i (&v)[4]) {
  const __m512i nibble = _mm512_set1_epi16(0x0f);
  const __m512i a = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit)));
  const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 32)));
  const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 64)));
  // 0xca: the second operand's bits where the first (nibble) has ones, the third's elsewhere
  const auto code = [&](__m512i low, __m512i top) {
    return _mm512_permutex2var_epi16(lut_lo, _mm512_ternarylogic_epi32(nibble, low, top, 0xca), lut_hi);
  };
  v[0] = code(a, _mm512_slli_epi16(h, 4));
  v[1] = code(_mm512_srli_epi16(a, 4), _mm512_slli_epi16(h, 2));
  v[2] = code(b, h);
  v[3] = code(_mm512_srli_epi16(b, 4), _mm512_srli_epi16(h, 2));
}

// 32 8-bit codes (a kpair vector) as bf16, in registers: the values expand_q8 writes.
LMRPC_INLINE __m512i q8_vector_bf16(const int8_t* codes) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  const __m512 hi =
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));
}

// R rows x one tile pair of Q8 or Q6 weights over every group, four kpair vectors at a time (kpairs 2u and 2u + 1,
// both tiles; a Q6 unit) made bf16 in registers and used by all R rows: the operations of block_bf16<R, 1, true>
// over expanded codes, without a copy of 2 bytes a weight.
template <int R, bool kQ6, bool KS>
void block_codes_ks(const PackedWeight& w, int64_t p, const Q6Table& table, int64_t groups, const RowBlock& rb) {
  const int64_t gkp = w.group / 2;
  const PairIndex at{&w, p, groups, gkp, w.k_pad / 2};
  const __m512i lut_lo = _mm512_load_si512(table.bf16), lut_hi = _mm512_load_si512(table.bf16 + 32);
  const int64_t pairs[1] = {p};
  ks_begin<R, 1, KS>(rb);
  __m512 Y[R][2];
  for (int r = 0; r < R; ++r) Y[r][0] = Y[r][1] = _mm512_setzero_ps();
  const int64_t span = KS ? int64_t{1} << w.ks.super_shift : groups;  // groups between folds
  for (int64_t g0 = 0; g0 < groups; g0 += span) {
    for (int64_t g = g0; g < g0 + span; ++g) {
      const GroupWeights gw[1] = {group_weights(w, p, groups, g, nullptr)};
      const int64_t first = at.vectors(g);
      __m512 acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int64_t u = 0; u < gkp / 2; ++u) {
        __m512i v[4];  // kpair 2u tile 0, tile 1; kpair 2u + 1 tile 0, tile 1
        if constexpr (kQ6) {
          q6_unit_bf16(q6_group(w, first) + u * kQ6UnitBytes, lut_lo, lut_hi, v);
        } else {
          const int8_t* codes = static_cast<const int8_t*>(w.data) + (first + 4 * u) * 32;
          for (int i = 0; i < 4; ++i) v[i] = q8_vector_bf16(codes + 32 * i);
        }
        for (int r = 0; r < R; ++r) {
          int32_t p0, p1;
          const uint16_t* x = static_cast<const uint16_t*>(rb.x[r]) + 2 * (g * gkp + 2 * u);
          std::memcpy(&p0, x, 4);
          std::memcpy(&p1, x + 2, 4);
          const __m512bh x0 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p0));
          const __m512bh x1 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p1));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], reinterpret_cast<__m512bh>(v[0]), x0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], reinterpret_cast<__m512bh>(v[1]), x0);
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], reinterpret_cast<__m512bh>(v[2]), x1);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], reinterpret_cast<__m512bh>(v[3]), x1);
        }
      }
      fold_group<R, 1, true>(Y, acc, gw, rb, g);
    }
    ks_fold_block<R, 1, KS>(Y, w, pairs, groups, g0 + span - 1, rb);
  }
  store_block<R, 1, KS>(Y, rb);
}

template <int R, bool kQ6>
void block_codes(const PackedWeight& w, int64_t p, const Q6Table& table, int64_t groups, const RowBlock& rb) {
  if (w.k_scaled()) block_codes_ks<R, kQ6, true>(w, p, table, groups, rb);
  else block_codes_ks<R, kQ6, false>(w, p, table, groups, rb);
}

// One unit (kpairs `at` and `at` + 1, both tiles) of each of P tile pairs, one row: decode(q, v) makes pair q's four
// kpair vectors (kpair `at` tile 0, tile 1; kpair `at` + 1 tile 0, tile 1) bf16, each tile's sum takes them in kpair
// order (one_row_q8_bf16, one_row_q6_bf16).
template <int P, typename Decode>
LMRPC_INLINE void unit_products(__m512 (&acc)[2 * P], const uint16_t* x, int64_t at, Decode&& decode) {
  int32_t p0, p1;
  std::memcpy(&p0, x + 2 * at, 4);
  std::memcpy(&p1, x + 2 * (at + 1), 4);
  const __m512bh x0 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p0));
  const __m512bh x1 = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p1));
  for (int q = 0; q < P; ++q) {
    __m512i v[4];
    decode(q, v);
    acc[2 * q] = _mm512_dpbf16_ps(acc[2 * q], reinterpret_cast<__m512bh>(v[0]), x0);
    acc[2 * q + 1] = _mm512_dpbf16_ps(acc[2 * q + 1], reinterpret_cast<__m512bh>(v[1]), x0);
    acc[2 * q] = _mm512_dpbf16_ps(acc[2 * q], reinterpret_cast<__m512bh>(v[2]), x1);
    acc[2 * q + 1] = _mm512_dpbf16_ps(acc[2 * q + 1], reinterpret_cast<__m512bh>(v[3]), x1);
  }
}

// One row, Q8 (the bundled model's Q8_0 output head; a Q8_0 file's layers): a group's pieces are its units of four
// kpair vectors (kpairs 2u and 2u + 1, both tiles), made bf16 in registers from the 8-bit codes. Read as stored, half
// the bytes of the expanded copy, which products of many rows read instead.
template <int P>
void one_row_q8_bf16(const PackedWeight& w, int64_t p, const uint16_t* x, const float* sums, float* out) {
  const int64_t groups = w.k_pad / w.group, gkp = w.group / 2, kp = w.k_pad / 2;
  const int8_t* pairs[P];  // each pair's first group
  for (int q = 0; q < P; ++q) {
    pairs[q] = static_cast<const int8_t*>(w.data) + PairIndex{&w, p + q, groups, gkp, kp}.vectors(0) * 32;
  }
  auto unit = [&](__m512 (&acc)[2 * P], int64_t g, int64_t u) LMRPC_LAMBDA_INLINE {
    const int64_t offset = (g * gkp + 2 * u) * 64;
    // The unit kQ8PrefetchBytes ahead, by bytes rather than groups (an int8 weight of ours is one group of all its
    // inputs), into L2 (see kOneRowHint).
    const int64_t ahead = one_row_ahead(offset + kQ8PrefetchBytes, kp * 64, P);
    unit_products<P>(acc, x, g * gkp + 2 * u, [&](int q, __m512i (&v)[4]) LMRPC_LAMBDA_INLINE {
      prefetch_one_row(pairs[q] + ahead, 128);
      for (int i = 0; i < 4; ++i) v[i] = q8_vector_bf16(pairs[q] + offset + 32 * i);
    });
  };
  auto no_prefetch = [](int64_t) LMRPC_LAMBDA_INLINE {};  // the units ask for theirs
  one_row_grouped<P>(w, p, gkp / 2, sums, out, unit, no_prefetch);
}

// One row, Q6 (1.7B Q4_K_M's Q6_K output head and down projections): a group's pieces are its units (kpairs 2u and
// 2u + 1 of both tiles), each decoded in registers (against a group decoded to 8-bit codes, then to bf16 in a buffer).
template <int P>
void one_row_q6_bf16(const PackedWeight& w, int64_t p, const Q6Table& table, const uint16_t* x, const float* sums,
                     float* out) {
  const int64_t groups = w.k_pad / w.group, gkp = w.group / 2, kp = w.k_pad / 2;
  const int64_t units = gkp / 2, group_bytes = units * kQ6UnitBytes;
  const __m512i lut_lo = _mm512_load_si512(table.bf16), lut_hi = _mm512_load_si512(table.bf16 + 32);
  const uint8_t* pairs[P];  // each pair's first group
  for (int q = 0; q < P; ++q) pairs[q] = q6_group(w, PairIndex{&w, p + q, groups, gkp, kp}.vectors(0));
  auto unit = [&](__m512 (&acc)[2 * P], int64_t g, int64_t u) LMRPC_LAMBDA_INLINE {
    unit_products<P>(acc, x, g * gkp + 2 * u, [&](int q, __m512i (&v)[4]) LMRPC_LAMBDA_INLINE {
      q6_unit_bf16(pairs[q] + g * group_bytes + u * kQ6UnitBytes, lut_lo, lut_hi, v);
    });
  };
  auto prefetch = [&](int64_t g) LMRPC_LAMBDA_INLINE {  // kOneRowPrefetchGroups ahead, into L2 (kOneRowHint)
    const int64_t at = one_row_ahead((g + kOneRowPrefetchGroups) * group_bytes, groups * group_bytes, P);
    for (int q = 0; q < P; ++q) prefetch_one_row(pairs[q] + at, group_bytes);
    const int64_t ahead = one_row_ahead(g + 2 * kOneRowPrefetchGroups, groups, P);
    for (int q = 0; q < P; ++q) prefetch_scales(w, p + q, groups, ahead);
  };
  one_row_grouped<P>(w, p, units, sums, out, unit, prefetch);
}
#endif

}  // namespace lmrpc::linear_detail
