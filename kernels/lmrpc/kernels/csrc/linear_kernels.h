// Micro-kernels of the row-invariant products (run by linear_products.cpp): R rows x P tile pairs over every group
// in AVX512-BF16 registers, AVX2 registers (linear_kernels_avx2.h) or portable loops, and Q4 codes expanded in
// registers for R rows (block_q4) or one (one_row_q4_bf16); Q8, Q6, Q5 and Q3 codes: linear_kernels_codes.h.
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
        if constexpr (Source::kStreams) {  // codes read in place from memory: asked for ahead (16 KiB)
          for (int q = 0; q < P; ++q) {
            prefetch_one_row(static_cast<const uint16_t*>(gw[q].w) + 64 * (j + kBf16AheadKpairs), 128);
          }
        }
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

// R rows x one tile pair over every group, the frame of the kernels that make codes bf16 in registers (block_q4 here,
// block_codes in linear_kernels_codes.h): group_sums(acc, g) adds group g's kpairs to the rows' 2R sums acc [R][2]
// (zeroed here), which are folded into the totals as fold_group does and, for a K-scaled weight, per super-block.
template <int R, bool KS, typename GroupSums>
LMRPC_INLINE void rows_over_groups(const PackedWeight& w, int64_t p, int64_t groups, const RowBlock& rb,
                                   GroupSums&& group_sums) {
  const int64_t pairs[1] = {p};
  ks_begin<R, 1, KS>(rb);
  __m512 Y[R][2];
  for (int r = 0; r < R; ++r) Y[r][0] = Y[r][1] = _mm512_setzero_ps();
  const int64_t span = KS ? int64_t{1} << w.ks.super_shift : groups;  // groups between folds
  for (int64_t g0 = 0; g0 < groups; g0 += span) {
    for (int64_t g = g0; g < g0 + span; ++g) {
      const GroupWeights gw[1] = {group_weights(w, p, groups, g, nullptr)};
      __m512 acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      group_sums(acc, g);
      fold_group<R, 1, true>(Y, acc, gw, rb, g);
    }
    ks_fold_block<R, 1, KS>(Y, w, pairs, groups, g0 + span - 1, rb);
  }
  store_block<R, 1, KS>(Y, rb);
}

// R rows x one tile pair of Q4 weights over every group, the codes expanded in registers from their 4-bit blocks
// (vpermw on the bf16 table): the kpairs of each group in the same order as block_bf16 over expanded codes, so the
// same bits, from a quarter of the bytes.
template <int R, bool KS>
void block_q4_ks(const PackedWeight& w, int64_t p, const Q4Table& table, int64_t groups, const RowBlock& rb) {
  const uint8_t* data = static_cast<const uint8_t*>(w.data);
  const __m512i lut = _mm512_load_si512(table.bf16);
  rows_over_groups<R, KS>(w, p, groups, rb, [&](__m512 (&acc)[R][2], int64_t g) LMRPC_LAMBDA_INLINE {
    const uint8_t* src = data + (p * groups + g) * 512;
    prefetch_q4_ahead(src);
    prefetch_one_row(src + kL2AheadGroups * 512, 512);
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
  });
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
  auto prefetch = [&](int64_t g) LMRPC_LAMBDA_INLINE {  // the group kL2AheadGroups ahead, into L2
    const int64_t at = one_row_ahead((g + kL2AheadGroups) * 512, groups * 512, P);
    for (int q = 0; q < P; ++q) prefetch_one_row(data + (p + q) * groups * 512 + at, 512);
    const int64_t ahead = one_row_ahead(g + 2 * kL2AheadGroups, groups, P);  // (a line: 1-2 groups' scales)
    for (int q = 0; q < P; ++q) prefetch_scales(w, p + q, groups, ahead);
  };
  one_row_grouped<P>(w, p, 8, sums, out, chunk, prefetch);
}
#endif

}  // namespace lmrpc::linear_detail
